"""The Grafana dashboard (deploy/grafana/dashboards/kvtier.json) is usable on a fleet: a
node selector scopes every kvtier query, and it has the panels an operator looks for
(tenants, spill and resume latency, the event loop, the fleet's GC age and nodes down).
That every metric it names is exported: tests/server/test_metrics_names.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvtier.json").read_text())
SELECTOR = re.compile(r"\b((?:kvtier|process)_[a-z_]+)(\{[^}]*\})?")


def _targets() -> dict[str, str]:
    return {f"{p['title']} {t['refId']}": t["expr"] for p in DASHBOARD["panels"]
            for t in p.get("targets", [])}


def test_a_node_selector_scopes_every_query():
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    node = variables["instance"]
    assert "label_values(kvtier_build_info, instance)" in node["definition"]
    assert node["multi"] and node["includeAll"]
    unscoped = {where: name for where, expr in _targets().items()
                for name, labels in SELECTOR.findall(expr)
                if 'instance=~"$instance"' not in labels}
    assert not unscoped, unscoped


def test_tenant_latency_and_fleet_panels_are_there():
    exprs = _targets()

    def panel(metric: str) -> list[str]:
        return [where for where, expr in exprs.items() if metric in expr]

    assert panel("kvtier_tenant_sessions") and panel("kvtier_tenant_bytes")
    assert panel("kvtier_spill_seconds_bucket") and panel("kvtier_resume_seconds_bucket")
    assert panel("kvtier_event_loop_lag_seconds_bucket")
    assert panel("time() - max(kvtier_fleet_gc_last_run_timestamp_seconds")
    assert panel("kvtier_fleet_nodes_down") and panel("kvtier_corrupt_copies_total")
    assert "tenant" in {v["name"] for v in DASHBOARD["templating"]["list"]}
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
