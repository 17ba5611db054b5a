"""contrib/: the Prometheus alerting rules are valid and every sparkd metric they use exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
from sparkdproc import free_port, sparkd_run, wait_for

from tests.conftest import REPO, need

RULES = REPO / "contrib" / "prometheus-rules.yml"
DASHBOARD = REPO / "contrib" / "grafana-dashboard.json"


def _real_metric_names(tmp_path: Path) -> set[str]:
    port = free_port()
    with sparkd_run(tmp_path, config=f'kernlog_source = "off"\n[api]\nport = {port}\n', args=()) as p:

        def scrape() -> str | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            except httpx.HTTPError:
                return None
            return r.text if r.status_code == 200 and "sparkd_samples_total" in r.text else None

        text = wait_for(scrape, 30)
        assert text, p.stdout.read() if p.stdout and p.poll() is not None else "no /metrics"
    return {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    need(promtool is not None, "promtool (Debian package prometheus)")
    assert promtool is not None
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_metric_the_rules_and_dashboard_use_is_exported(tmp_path: Path) -> None:
    exported = _real_metric_names(tmp_path)
    used = set(re.findall(r"\bsparkd_[A-Za-z0-9_]+", RULES.read_text()))
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used |= {m for e in exprs for m in re.findall(r"\bsparkd_[A-Za-z0-9_]+", e)}
    used -= {"sparkd_action", "sparkd_node"}  # labels that address sparkd, not metrics
    assert len(used) >= 8
    assert used <= exported, sorted(used - exported)


def test_the_cluster_stop_rule_carries_the_stop_label() -> None:
    text = RULES.read_text()
    block = text[text.index("alert: SparkdClusterNodeLow") :]
    assert "sparkd_action: stop" in block
