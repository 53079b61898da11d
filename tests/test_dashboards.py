"""The shipped Grafana dashboard and Prometheus rules use only metric names (and selector labels) the code
exports: the store and utilization collectors run on the demo store (with the fake NVML behind a sampler, one
sampling round kept in the store) and the server's metrics function on the same store. The rules pass
`promtool check rules` and their unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from fake_pynvml import A100_80GB, L40S, FakeGpu, FakeNvml, FakeVgpu
from opsfixtures import ROOT, Store, clone, template_store
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vgpu_ctl.hosts.utilization import HostSample, sample
from vgpu_ctl.ops.metrics import StoreCollector
from vgpu_ctl.ops.utilization import UtilizationCollector
from vgpu_ctl.server.metrics import server_metrics
from vgpu_ctl.server.runtime import LoopStats
from vgpu_ctl.service.utilization import IdleRule
from vgpu_ctl.service.utilization_samples import sample_round

DASHBOARD = ROOT / "contrib" / "grafana" / "vgpu-ctl.json"
RULES = ROOT / "contrib" / "prometheus" / "vgpu-ctl-rules.yml"
RULES_TEST = ROOT / "contrib" / "prometheus" / "vgpu-ctl-rules.test.yml"
OURS = re.compile(r"\b(vgpu(?:ctl)?_[a-zA-Z0-9_]+)\b")
SELECTOR = re.compile(r"\b(vgpu(?:ctl)?_[a-zA-Z0-9_]+)\{([^}]*)\}")
LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template-variable queries."""
    data = json.loads(DASHBOARD.read_text())
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    out.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(data)
    return out


def rule_queries() -> list[str]:
    """Every rule's expression."""
    data = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in data["groups"] for r in g["rules"]]


def exported(store: Store) -> dict[str, set[str] | None]:
    """Sample names the code exports on the demo store -> their label names (None: no sample to tell)."""
    rows = store.sql("SELECT d.uuid, h.name, g.pci_address, v.name FROM device d JOIN gpu g ON g.id = d.gpu_id "
                     "JOIN host h ON h.id = g.host_id JOIN vm v ON v.id = d.vm_id WHERE d.backing = 'mdev'")
    fakes: dict[str, FakeNvml] = {}
    for i, (uuid, host, pci, _vm) in enumerate(rows):
        model = L40S if "l40s" in host else A100_80GB
        fakes[host] = FakeNvml([FakeGpu(model, "0000" + pci, f"GPU-{i}", 0, 0, util_gpu=5, vgpus=[
            FakeVgpu(i + 1, mdev_uuid=uuid, fb_usage=2**30, sm=1)])])

    def sampler(host: Any) -> HostSample | None:
        return sample(fakes[host.name], kmsg=None) if host.name in fakes else None

    ctl = store.ctl()
    try:
        ctl.set_quota("acme", {"vms": 5, "framebuffer_mib": 102400})
        sample_round(ctl, sampler)
        reg = CollectorRegistry(auto_describe=False)
        reg.register(StoreCollector(ctl))
        reg.register(UtilizationCollector(ctl, IdleRule(0.05, 0)))
        text = generate_latest(reg).decode()
        rt = SimpleNamespace(ctx=ctl.ctx, stats=LoopStats(), leading=True,
                             accepting=True, in_flight=0)
        text += server_metrics(rt)  # type: ignore[arg-type]
    finally:
        ctl.close()
    out: dict[str, set[str] | None] = {}
    for fam in text_string_to_metric_families(text):
        names = {"counter": [f"{fam.name}_total"], "histogram": [f"{fam.name}_{s}" for s in ("bucket", "sum", "count")]
                 }.get(fam.type, [fam.name])
        for n in names:
            out.setdefault(n, None)
        for s in fam.samples:
            known = out.get(s.name) or set()
            out[s.name] = known | set(s.labels)
    return out


def test_every_metric_the_dashboard_and_rules_query_is_exported(store: Store) -> None:
    names = exported(store)
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 30
    used = {m for q in queries for m in OURS.findall(q)}
    assert used and not used - set(names), f"not exported: {sorted(used - set(names))}"
    for q in queries:  # labels in selectors are labels the series have
        for metric, body in SELECTOR.findall(q):
            labels = names.get(metric)
            if labels is None:
                continue  # no sample on the demo store to tell its labels
            wrong = {lab for lab in LABEL.findall(body) if lab not in labels and lab != "__name__"}
            assert not wrong, f"{metric} has no label {sorted(wrong)} (has {sorted(labels)}): {q}"


def test_the_dashboard_covers_what_it_promises() -> None:
    data = json.loads(DASHBOARD.read_text())
    panels = [p for p in data["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in data["panels"]}) == len(data["panels"])
    text = " ".join(dashboard_queries())
    for metric in ("vgpuctl_gpus", "vgpuctl_pool_profile_fits", "vgpuctl_tenant_usage", "vgpuctl_tenant_limit",
                   "vgpuctl_refusals_total", "vgpuctl_vm_provision_duration_seconds_bucket",
                   "vgpuctl_vgpu_utilization_ratio", "vgpuctl_vgpu_idle", "vgpu_operations", "vgpu_server_leader",
                   "vgpuctl_queue_length", "vgpuctl_preemptions_total", "vgpuctl_tenant_fairshare"):
        assert metric in text
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and p["targets"] and p["datasource"]["uid"] == "${datasource}"


def test_the_rules_cover_what_they_promise() -> None:
    alerts = {r["alert"]: r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert "vgpu_reconcile_unfixed" in alerts["VgpuReconcileDriftUnfixed"]
    assert "vgpu_operations" in alerts["VgpuOperationsStuck"]
    assert "vgpuctl_pool_profile_fits" in alerts["VgpuPoolCannotPlaceTypicalRequest"]
    assert "vgpuctl_tenant_limit" in alerts["VgpuTenantAtLimit"]
    assert "vgpuctl_vgpu_idle" in alerts["VgpuIdle"]


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_checks_and_unit_tests_the_rules() -> None:
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120,
                           check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([PROMTOOL, "test", "rules", RULES_TEST.name], capture_output=True, text=True,
                         timeout=120, cwd=RULES_TEST.parent, check=False)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
