"""The alerts reach someone and say what to do: Prometheus sends them to the compose
file's Alertmanager (tests/server/test_compose.py), and every alert of deploy/alerts.yml
carries a runbook_url whose anchor is a section of docs/runbooks.md that says what the
alert means, what to check and what to do."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = [rule for group in yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"]
         for rule in group["rules"]]
RUNBOOKS = (ROOT / "docs" / "runbooks.md").read_text()
PARTS = ("**What it means.**", "**What to check.**", "**What to do.**")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _sections() -> dict[str, str]:
    """Anchor -> the text of its ``##`` section."""
    chunks = re.split(r"^## (.+)$", RUNBOOKS, flags=re.MULTILINE)
    return {_anchor(title): body for title, body in zip(chunks[1::2], chunks[2::2], strict=True)}


def test_every_alert_links_a_runbook_section_that_says_what_to_do():
    homepage = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Homepage"]
    sections = _sections()
    assert len(RULES) >= 8
    for rule in RULES:
        url = urlsplit(rule["annotations"]["runbook_url"])
        assert f"{url.scheme}://{url.netloc}{url.path}" == f"{homepage}/blob/main/docs/runbooks.md"
        assert url.fragment in sections, (rule["alert"], url.fragment)
        assert url.fragment == _anchor(rule["alert"])  # its own section, not a neighbour's
        body = sections[url.fragment]
        assert all(part in body for part in PARTS), (rule["alert"], body[:200])


def test_every_alert_says_what_to_run_first_and_it_needs_no_traffic():
    """``runbook_step``: a command (a kvtier tool, the server's /metrics at the alert's
    instance, the dependency's own client) whose answer does not depend on requests
    arriving, so it works on an idle node."""
    tools = ("kvtier ", "curl ", "redis-cli ", "aws s3 ")
    for rule in RULES:
        step = rule["annotations"].get("runbook_step", "")
        assert any(tool in step for tool in tools), (rule["alert"], step)
        assert "rate(" not in step and "increase(" not in step, rule["alert"]


def test_every_runbook_section_belongs_to_an_alert():
    assert set(_sections()) == {_anchor(rule["alert"]) for rule in RULES}


def test_open_breakers_and_failing_fleet_sweeps_alert():
    exprs = {rule["alert"]: rule["expr"] for rule in RULES}
    assert "kvtier_breaker_open" in exprs["KVTierBreakerOpen"]
    # what the servers export (prometheus.yml scrapes them), not a textfile collector's
    assert "kvtier_fleet_gc_last_run_failed" in exprs["KVTierFleetGCFailing"]
    assert "time() - kvtier_fleet_gc_last_run_timestamp_seconds" in exprs["KVTierFleetGCStale"]
    for rule in RULES:
        assert rule["labels"]["severity"] in ("critical", "warning")  # alertmanager.yml routes


def test_the_service_is_covered():
    """Corrupt copies, loop stalls, a resume-latency SLO, remote error rates, fleet nodes
    down: each has its alert on the metric that measures it."""
    exprs = {rule["alert"]: rule["expr"] for rule in RULES}
    wanted = {"KVTierCorruptCopies": "kvtier_corrupt_copies_total",
              "KVTierEventLoopStalls": "kvtier_event_loop_stalls_total",
              "KVTierResumeLatencySLO": "kvtier_resume_seconds_bucket",
              "KVTierRedisErrorRate": "kvtier_redis_errors_total",
              "KVTierObjectErrorRate": "kvtier_object_errors_total",
              "KVTierFleetNodeDown": "kvtier_fleet_nodes_down"}
    for alert, metric in wanted.items():
        assert metric in exprs.get(alert, ""), alert


def _aggregations(expr: str) -> list[str]:
    """The ``by (...)`` label lists of every aggregation in ``expr``, in order."""
    return re.findall(r"\b(?:sum|max|min|avg|count)\s+by\s*\(([^)]*)\)", expr) + [
        "" for _ in re.findall(r"\b(?:sum|max|min|avg|count)\s*\(", expr)]


def test_every_alert_keeps_the_instance_label_for_the_inhibit_rule():
    """alertmanager.yml inhibits a server's warnings by its critical alerts with
    ``equal: [instance]``: an aggregation that drops ``instance`` defeats it."""
    manager = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text())
    assert manager["inhibit_rules"][0]["equal"] == ["instance"]
    for rule in RULES:
        for labels in _aggregations(rule["expr"]):
            assert "instance" in [label.strip() for label in labels.split(",")], \
                (rule["alert"], rule["expr"])


def test_the_error_ratio_counts_server_faults_only():
    """Quota and auth refusals, and a client's own errors, are not faults: the status
    codes the servers count them under (kvtier_requests_total{code}) stay out."""
    expr = {rule["alert"]: rule["expr"] for rule in RULES}["KVTierErrorRatioHigh"]
    faults = re.search(r'code=~"([^"]+)"', expr).group(1).split("|")
    assert {"INTERNAL", "UNAVAILABLE", "DATA_LOSS"} <= set(faults)
    assert not {"RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND",
                "INVALID_ARGUMENT", "FAILED_PRECONDITION", "CANCELLED"} & set(faults)
