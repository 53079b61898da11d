"""Prometheus metrics read from the store: names, types, values; served on loopback; admin only."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from opsfixtures import Store, cli, clone, template_store
from prometheus_client.parser import text_string_to_metric_families

from vgpu_ctl import QuotaExceeded
from vgpu_ctl.ops.metrics import dump, serve
from vgpu_ctl.ops.status import fleet_status


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fam: Any, suffix: str = "") -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples if s.name == fam.name + suffix}


def test_dump_parses_with_conventional_names_and_types(store: Store) -> None:
    res = cli(store, "metrics", "dump")
    assert res.exit_code == 0, res.output
    fams = families(res.stdout)
    types = {n: f.type for n, f in fams.items()}
    assert types["vgpuctl_gpus"] == "gauge" and types["vgpuctl_devices"] == "gauge"
    assert types["vgpuctl_pool_profile_fits"] == "gauge"
    assert types["vgpuctl_tenant_usage"] == "gauge" and types["vgpuctl_tenant_limit"] == "gauge"
    assert types["vgpuctl_tenant_framebuffer_bytes"] == "gauge"
    assert types["vgpuctl_refusals"] == "counter"  # exposed as vgpuctl_refusals_total
    assert "vgpuctl_refusals_total" in res.stdout
    assert types["vgpuctl_vm_provision_duration_seconds"] == "histogram"
    assert all(n.startswith("vgpuctl_") for n in fams)


def test_inventory_and_device_gauges(store: Store) -> None:
    fams = families(cli(store, "metrics", "dump").stdout)
    gpus = samples(fams["vgpuctl_gpus"])
    assert sum(gpus.values()) == 9
    assert gpus[(("mode", "mig"), ("model", "H100-80GB"), ("pool", "inference"))] == 2
    devs = samples(fams["vgpuctl_devices"])
    assert devs[(("profile", "A100D-10C"), ("state", "ready"))] == 1
    assert devs[(("profile", "L40S-12C"), ("state", "ready"))] == 1


def test_pool_fits_match_status(store: Store) -> None:
    ctl = store.ctl()
    try:
        status = fleet_status(ctl)
        fams = families(dump(ctl))
    finally:
        ctl.close()
    fits = samples(fams["vgpuctl_pool_profile_fits"])
    for p in status["pools"]:
        for profile, n in p["fits"].items():
            assert fits[(("pool", p["name"]), ("profile", profile))] == n


def test_tenant_usage_limits_and_bytes(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("acme", {"vms": 5, "framebuffer_mib": 102400})
        ctl.set_quota("acme", {"vgpus": 3}, pool="inference")
        fams = families(dump(ctl))
    finally:
        ctl.close()
    usage = samples(fams["vgpuctl_tenant_usage"])
    limit = samples(fams["vgpuctl_tenant_limit"])
    assert usage[(("resource", "vms"), ("scope", "all"), ("tenant", "acme"))] == 2
    assert limit[(("resource", "vms"), ("scope", "all"), ("tenant", "acme"))] == 5
    assert limit[(("resource", "vgpus"), ("scope", "inference"), ("tenant", "acme"))] == 3
    assert (("resource", "vms"), ("scope", "all"), ("tenant", "globex")) not in limit  # unlimited: absent
    fb = samples(fams["vgpuctl_tenant_framebuffer_bytes"])
    assert fb[(("scope", "all"), ("tenant", "acme"))] == (10 + 40) * 1024**3
    assert samples(fams["vgpuctl_tenant_framebuffer_limit_bytes"])[(("scope", "all"), ("tenant", "acme"))] == \
        100 * 1024**3
    assert samples(fams["vgpuctl_tenant_memory_bytes"])[(("scope", "all"), ("tenant", "globex"))] == 4 * 1024**3


def test_refusals_are_counted_by_reason_from_the_store(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("globex", {"vms": 1})
        for i in range(2):
            with pytest.raises(QuotaExceeded):
                ctl.request_vm("globex", f"r{i}", "L40S-4C", vcpus=1, memory_mib=1024)
    finally:
        ctl.close()
    other = store.ctl()  # a fresh controller, as another process would scrape
    try:
        fams = families(dump(other))
    finally:
        other.close()
    assert samples(fams["vgpuctl_refusals"], "_total") == {(("reason", "quota_exceeded"),): 2}


def test_provision_histogram_is_derived_from_persisted_events(store: Store) -> None:
    ctl = store.ctl()
    try:
        fams = families(dump(ctl))
    finally:
        ctl.close()
    hist = fams["vgpuctl_vm_provision_duration_seconds"]
    count = next(s.value for s in hist.samples if s.name.endswith("_count"))
    assert count == 3  # the three VMs of the template store, created by another controller
    inf = next(s.value for s in hist.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf")
    assert inf == 3 and next(s.value for s in hist.samples if s.name.endswith("_sum")) > 0


def test_serve_on_loopback_scrapes_fresh_values(store: Store) -> None:
    ctl = store.ctl()
    server, thread = serve(ctl, 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        first = families(urllib.request.urlopen(url, timeout=10).read().decode())
        writer = store.ctl()
        try:
            writer.request_vm("globex", "g2", "L40S-4C", vcpus=1, memory_mib=1024)
        finally:
            writer.close()
        second = families(urllib.request.urlopen(url, timeout=10).read().decode())
        key = (("resource", "vms"), ("scope", "all"), ("tenant", "globex"))
        assert samples(first["vgpuctl_tenant_usage"])[key] == 1
        assert samples(second["vgpuctl_tenant_usage"])[key] == 2
    finally:
        server.shutdown()
        thread.join(5)
        ctl.close()


def test_metrics_are_admin_only(store: Store) -> None:
    assert cli(store, "metrics", "dump", token=store.tokens["acme"]).exit_code == 7
    assert cli(store, "metrics", "serve", "--port", "0", token=store.tokens["acme"]).exit_code == 7


def test_fair_share_per_tenant_follows_what_it_used(store: Store) -> None:
    from vgpu_ctl.service.scheduling import share_report
    fams = families(cli(store, "metrics", "dump").stdout)
    factor = {s.labels["tenant"]: s.value for s in fams["vgpuctl_tenant_fairshare"].samples}
    used = {(s.labels["tenant"], s.labels["resource"]): s.value for s in fams["vgpuctl_tenant_decayed_usage"].samples}
    ctl = store.ctl()
    try:
        with ctl.engine.connect() as conn:
            rows = {r["name"]: r for r in share_report(conn, ctl.catalog, ctl.principal) if r["kind"] == "tenant"}
    finally:
        ctl.close()
    assert set(factor) == set(rows) and {"acme", "globex"} <= set(factor)
    for name, r in rows.items():  # usage decays and grows by the second: only the factor is compared exactly
        assert factor[name] == pytest.approx(r["fairshare"])
        assert (used[(name, "fb_gib_hours")] > 0) == (r["fb_gib_hours"] > 0)
    assert all(0.0 <= f <= 1.0 for f in factor.values()) and fams["vgpuctl_tenant_fairshare"].type == "gauge"
    # equal shares: the tenant that used more (acme's two VMs, globex's one L40S slice) is served later
    assert used[("acme", "compute_slice_hours")] > used[("globex", "compute_slice_hours")]
    assert factor["acme"] < factor["globex"]
