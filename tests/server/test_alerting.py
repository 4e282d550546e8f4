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


def test_every_runbook_section_belongs_to_an_alert():
    assert set(_sections()) == {_anchor(rule["alert"]) for rule in RULES}


def test_open_breakers_and_failing_fleet_sweeps_alert():
    exprs = {rule["alert"]: rule["expr"] for rule in RULES}
    assert "kvtier_breaker_open" in exprs["KVTierBreakerOpen"]
    assert 'kvtier_fleet_gc_runs_total{result="error"}' in exprs["KVTierFleetGCFailing"]
    for rule in RULES:
        assert rule["labels"]["severity"] in ("critical", "warning")  # alertmanager.yml routes
