"""Real utilization: NVML sampled on the host (fake NVML), through the agent, joined with the demo store to
devices, VMs, tenants and pools and kept there by a sampling round; the metrics (with dcgm-exporter's labels) and
idle-vGPU detection read from the kept samples, never from a host; measured load steering spread-load."""

from __future__ import annotations

import json
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from fake_pynvml import A100_80GB, H100_80GB, L40S, FakeGpu, FakeNvml, FakeVgpu
from opsfixtures import Store, clone, snapshot, template_store
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vgpu_ctl.errors import HostError, InvalidInput, PermissionDenied
from vgpu_ctl.hosts.agent import AgentHostSide, InProcessTransport, handle
from vgpu_ctl.hosts.hostside import LocalHostSide
from vgpu_ctl.hosts.nvml_mig import NvmlMig
from vgpu_ctl.hosts.utilization import HostSample, read_xids, sample, sample_side
from vgpu_ctl.ops.status import fleet_status
from vgpu_ctl.ops.utilization import UtilizationCollector, idle_vgpus, rule_from_env
from vgpu_ctl.service.utilization import IdleRule, add_mark, below_since, collect_usage, load_by_gpu, spread_load_policy
from vgpu_ctl.service.utilization_samples import sample_round, stored_usage

MIB = 2**20


def one_host() -> FakeNvml:
    """An A100 with two active vGPUs, an H100 in MIG mode with a 3g.40gb instance, an L40S without power."""
    nvml = FakeNvml([
        FakeGpu(A100_80GB, "00000000:41:00.0", "GPU-a", 0, 0, util_gpu=37, util_mem=12, mem_used_mib=20480,
                power_mw=215000, temperature=61, vgpus=[
                    FakeVgpu(11, mdev_uuid="AAAAAAAA-0000-4000-8000-000000000001", vm_id="vm-1", fb_usage=3 * 2**30,
                             sm=40, mem=10, enc=1, dec=2, jpg=3, ofa=4),
                    FakeVgpu(12, mdev_uuid="aaaaaaaa-0000-4000-8000-000000000002", vm_id="vm-2", fb_usage=0)]),
        FakeGpu(H100_80GB, "00000000:42:00.0", "GPU-b"),
        FakeGpu(L40S, "00000000:43:00.0", "GPU-c", unsupported={"nvmlDeviceGetPowerUsage"}),
    ])
    mig = NvmlMig(nvml)
    mig.create(_mig_spec("0000:42:00.0", 9, 4))
    next(iter(nvml.gpus[1].gis.values())).fb_used_mib = 1024
    return nvml


def _mig_spec(pci: str, profile_id: int, start: int) -> Any:
    from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceSpec
    return DeviceSpec(device_id="d", uuid="u", gpu_pci=pci, profile="3g.40gb", backing=DeviceBacking.MIG,
                      start=start, size=4, mig_profile_id=profile_id)


# --- the host's end -------------------------------------------------------------------------------------------

def test_sample_reads_gpus_vgpus_and_mig_instances() -> None:
    nvml = one_host()
    before = list(nvml.calls)
    s = sample(nvml, kmsg=None, clock=lambda: 1000.0)
    assert nvml.calls == before and nvml.init_count == 0  # read-only, NVML closed again
    a, h, lx = s.gpus
    assert (a.pci, a.utilization, a.memory_utilization, a.fb_used_bytes, a.power_watts, a.temperature_c) == \
        ("0000:41:00.0", 0.37, 0.12, 20480 * MIB, 215.0, 61.0)
    assert h.mig and h.utilization is None  # NVML: not supported on a MIG-enabled GPU: missing, not 0
    assert lx.power_watts is None and lx.temperature_c == 40.0  # NOT_SUPPORTED on one call only
    v1, v2 = s.vgpus
    assert v2.fb_used_bytes == 0 and v2.vm_id == "vm-2"
    assert v1.mdev_uuid == "aaaaaaaa-0000-4000-8000-000000000001" and v1.vm_id == "vm-1" and v1.vm_id_type == "uuid"
    assert (v1.sm, v1.memory, v1.encoder, v1.decoder, v1.jpeg, v1.ofa) == (0.4, 0.1, 0.01, 0.02, 0.03, 0.04)
    assert v1.fb_used_bytes == 3 * 2**30 and v1.gpu_instance_id is None and v1.vgpu_type == "NVIDIA A100D-10C"
    (m,) = s.migs
    assert (m.gpu_pci, m.profile, m.fb_used_bytes, m.fb_total_bytes, m.utilization) == \
        ("0000:42:00.0", "3g.40gb", 1024 * MIB, 40448 * MIB, None)
    assert HostSample.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_unsupported_vgpu_calls_fall_back_or_leave_the_value_out() -> None:
    nvml = one_host()
    nvml.gpus[0].unsupported |= {"nvmlDeviceGetVgpuInstancesUtilizationInfo", "nvmlVgpuInstanceGetFbUsage",
                                 "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature"}
    s = sample(nvml, kmsg=None)
    v1 = s.vgpus[0]
    assert (v1.sm, v1.memory, v1.encoder, v1.decoder) == (0.4, 0.1, 0.01, 0.02)  # nvmlDeviceGetVgpuUtilization
    assert v1.jpeg is None and v1.ofa is None and v1.fb_used_bytes is None
    assert s.gpus[0].utilization is None and s.gpus[0].temperature_c is None and s.gpus[0].power_watts == 215.0
    nvml.gpus[0].unsupported.add("nvmlDeviceGetVgpuUtilization")
    v1 = sample(nvml, kmsg=None).vgpus[0]
    assert v1.sm is None and v1.mdev_uuid is not None  # still listed, with no utilization


def test_nvml_missing_is_a_host_error() -> None:
    nvml = one_host()
    nvml.driver_loaded = False
    with pytest.raises(HostError, match="NVML: cannot initialise"):
        sample(nvml, kmsg=None)


def test_xid_errors_come_from_the_kernel_log(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,100,5,-;nvidia: loading\n"
                   "4,101,6,-;NVRM: Xid (PCI:0000:41:00): 13, pid=1, Graphics Exception\n"
                   "4,102,7,-;NVRM: Xid (PCI:0000:41:00): 79, pid=1, GPU has fallen off the bus.\n")
    assert read_xids(log) == {"0000:41:00.0": [13, 79]}
    assert read_xids(tmp_path / "absent") is None
    s = sample(one_host(), kmsg=log)
    assert [(g.xid_errors, g.last_xid) for g in s.gpus] == [(2, 79), (0, 0), (0, 0)]
    s = sample(one_host(), kmsg=tmp_path / "absent")
    assert s.gpus[0].xid_errors is None and any("XID" in n for n in s.notes)


def test_through_the_agent_protocol(tmp_path: Path) -> None:
    nvml = one_host()
    local = LocalHostSide(tmp_path, nvml=nvml, dev_root=tmp_path)
    direct = sample_side(local)
    over = AgentHostSide("kvm1", InProcessTransport(local)).utilization()
    assert over.gpus == direct.gpus and over.vgpus == direct.vgpus and over.migs == direct.migs
    answer = json.loads(handle(local, json.dumps({"protocol": 1, "op": "utilization"})))
    assert answer["result"]["vgpus"][0]["mdev_uuid"] == "aaaaaaaa-0000-4000-8000-000000000001"
    nvml.driver_loaded = False
    with pytest.raises(HostError, match="cannot initialise"):
        AgentHostSide("kvm1", InProcessTransport(local)).utilization()


# --- joined with the store ------------------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def devices(store: Store) -> dict[str, tuple[str, str, str]]:
    """VM name -> (device id, host, GPU PCI) of the demo's VMs."""
    rows = store.sql("SELECT v.name, d.id, h.name, g.pci_address FROM device d JOIN vm v ON v.id = d.vm_id "
                     "JOIN gpu g ON g.id = d.gpu_id JOIN host h ON h.id = g.host_id")
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def bus(pci: str) -> str:
    return "0000" + pci


class Fleet:
    """Fake NVML per demo host: a1's vGPU (A100D-10C), a2's MIG instance (3g.40gb at start 0, GI 1), g1's
    vGPU (L40S-12C), and a vGPU no store device knows."""

    def __init__(self, store: Store) -> None:
        d = devices(store)
        a1, a2, g1 = d["a1"], d["a2"], d["g1"]
        self.ids = {"a1": a1[0], "a2": a2[0], "g1": g1[0]}
        self.a100 = FakeGpu(A100_80GB, bus(a1[2]), "GPU-a100-81", 0, 0, util_gpu=3, vgpus=[
            FakeVgpu(1, mdev_uuid=a1[0], vm_id="x", fb_usage=2 * 2**30, sm=1, mem=2)])
        other = FakeGpu(A100_80GB, "00000000:41:00.0", "GPU-a100-41", 0, 0, util_gpu=90, vgpus=[
            FakeVgpu(2, mdev_uuid="99999999-0000-4000-8000-000000000000", sm=90)])
        h100 = FakeGpu(H100_80GB, bus(a2[2]), "GPU-h100-19")
        self.l40s = FakeGpu(L40S, bus(g1[2]), "GPU-l40s-17", util_gpu=80, vgpus=[
            FakeVgpu(3, type_name="NVIDIA L40S-12C", type_id=900, mdev_uuid=g1[0], fb_usage=2**30, sm=80, mem=30)])
        self.nvml = {a1[1]: FakeNvml([other, self.a100]), a2[1]: FakeNvml([h100]), g1[1]: FakeNvml([self.l40s])}
        NvmlMig(self.nvml[a2[1]]).create(_mig_spec(bus(a2[2])[4:], 9, 0))
        self.broken: set[str] = set()

        self.now = time.time()
        self.calls = 0

    def __call__(self, host: Any) -> HostSample | None:
        self.calls += 1
        if host.name in self.broken:
            raise HostError(f"host {host.name}: the host agent failed")
        nvml = self.nvml.get(host.name)
        return None if nvml is None else sample(nvml, kmsg=None, clock=lambda: self.now)

    def round(self, ctl: Any, interval_s: float = 600.0) -> dict[str, int]:
        """One sampling round at `now`, kept in the store (as the server's leader does it)."""
        return sample_round(ctl, self, interval_s=interval_s, now=self.now)


def scrape(ctl: Any, rule: IdleRule | None = None) -> dict[str, Any]:
    """The utilization families of one scrape, by name."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(UtilizationCollector(ctl, rule))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


def test_each_vgpu_is_attributed_to_its_device_vm_tenant_and_pool(store: Store) -> None:
    fleet = Fleet(store)
    ctl = store.ctl()
    try:
        usage = collect_usage(ctl, fleet)
    finally:
        ctl.close()
    by_vm = {v.vm: v for v in usage.vgpus}
    a1, a2, g1 = by_vm["a1"], by_vm["a2"], by_vm["g1"]
    assert (a1.device, a1.tenant, a1.pool, a1.profile, a1.kind, a1.sm, a1.fb_used_bytes, a1.fb_total_bytes) == \
        (fleet.ids["a1"], "acme", "inference", "A100D-10C", "vgpu", 0.01, 2 * 2**30, 10240 * MIB)
    assert (a2.device, a2.tenant, a2.kind, a2.gpu_instance_id, a2.gpu_instance_profile) == \
        (fleet.ids["a2"], "acme", "mig", 1, "3g.40gb")
    assert (g1.tenant, g1.profile, g1.sm) == ("globex", "L40S-12C", 0.8)
    stranger = by_vm[None]
    assert stranger.device is None and stranger.tenant is None and stranger.sm == 0.9
    pools = {g.uuid: g.pool for g in usage.gpus}
    assert pools["GPU-a100-81"] == "inference" and pools["GPU-a100-41"] == "training"
    assert all(why is None for why in usage.hosts.values())


def test_vfio_vgpus_are_joined_by_the_domain_uuid(store: Store) -> None:
    fleet = Fleet(store)
    domain = store.sql("SELECT domain_uuid FROM vm WHERE name = 'a1'")[0][0]
    fleet.a100.vgpus[0].mdev_uuid, fleet.a100.vgpus[0].vm_id = "", domain
    ctl = store.ctl()
    try:
        usage = collect_usage(ctl, fleet)
    finally:
        ctl.close()
    (a1,) = [v for v in usage.vgpus if v.vm == "a1"]
    assert a1.device == fleet.ids["a1"] and a1.uuid is None


def test_metrics_carry_dcgm_labels_and_per_tenant_utilization(store: Store) -> None:
    fleet = Fleet(store)
    ctl = store.ctl()
    try:
        assert fleet.round(ctl) == {"hosts": 3, "gpu_loads": 4}
        fams = scrape(ctl, IdleRule(0.05, 0))
    finally:
        ctl.close()
    util = [s for s in fams["vgpuctl_vgpu_utilization_ratio"].samples if s.labels["engine"] == "sm"]
    g1 = next(s for s in util if s.labels["vm"] == "g1")
    assert g1.value == 0.8 and g1.labels["tenant"] == "globex" and g1.labels["UUID"] == "GPU-l40s-17"
    assert g1.labels["gpu"] == "0" and g1.labels["Hostname"] == "kvm-l40s-01" and g1.labels["device"] == fleet.ids["g1"]
    mig = next(s for s in fams["vgpuctl_vgpu_framebuffer_bytes"].samples if s.labels["vm"] == "a2")
    assert (mig.labels["GPU_I_PROFILE"], mig.labels["GPU_I_ID"], mig.labels["kind"]) == ("3g.40gb", "1", "mig")
    gpu = {s.labels["UUID"]: s.value for s in fams["vgpuctl_gpu_utilization_ratio"].samples}
    assert gpu["GPU-a100-81"] == 0.03 and "GPU-h100-19" not in gpu  # MIG mode: not supported, left out
    idle = {s.labels["vm"]: s.value for s in fams["vgpuctl_vgpu_idle"].samples}
    assert idle == {"a1": 1.0}  # 1 %, threshold 5 %, idle_for 0; g1 busy; a2 has no utilization (MIG)
    up = {s.labels["Hostname"]: s.value for s in fams["vgpuctl_utilization_host_up"].samples}
    assert up == {"kvm-a100-01": 1.0, "kvm-h100-01": 1.0, "kvm-l40s-01": 1.0}
    ages = {s.labels["Hostname"]: s.value for s in fams["vgpuctl_utilization_sample_age_seconds"].samples}
    assert set(ages) == set(up) and all(0 <= a < 60 for a in ages.values())


def test_a_scrape_calls_no_host_and_every_reader_sees_the_same_numbers(store: Store,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl.ops.metrics import dump
    fleet = Fleet(store)
    leader = store.ctl()
    try:
        fleet.round(leader)
    finally:
        leader.close()
    sampled = fleet.calls

    def no_host(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a scrape called a host")

    import vgpu_ctl.service.utilization as utilization
    monkeypatch.setattr(utilization, "sample_side", no_host)
    monkeypatch.setattr(utilization, "sample_hosts", no_host)

    def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
                if f.name.startswith(("vgpuctl_gpu_", "vgpuctl_vgpu_", "vgpuctl_utilization_host_up"))
                for s in f.samples}

    first, other = store.ctl(), store.ctl()  # two processes' controllers, neither of them the sampler
    try:
        a, b = values(dump(first)), values(dump(other))
    finally:
        first.close()
        other.close()
    assert fleet.calls == sampled  # the scrapes sampled nothing
    assert a == b and a[("vgpuctl_vgpu_framebuffer_used_bytes", tuple(sorted({
        "Hostname": "kvm-l40s-01", "gpu": "0", "UUID": "GPU-l40s-17", "GPU_I_PROFILE": "", "GPU_I_ID": "",
        "kind": "vgpu", "device": fleet.ids["g1"], "mdev": fleet.ids["g1"], "profile": "L40S-12C", "vm": "g1",
        "tenant": "globex", "pool": "workstations"}.items())))] == 2**30


def test_a_stale_sample_shows_its_age_not_its_values(store: Store) -> None:
    fleet = Fleet(store)
    fleet.now = time.time() - 400  # three intervals of 120 s ago, and some
    ctl = store.ctl()
    try:
        fleet.round(ctl, interval_s=120)
        fams = scrape(ctl, IdleRule(0.05, 0))
        out = idle_vgpus(ctl, IdleRule(0.05, 0))
        fleet.now = time.time() - 300  # within three intervals: current again
        fleet.round(ctl, interval_s=120)
        fresh = scrape(ctl, IdleRule(0.05, 0))
    finally:
        ctl.close()
    for name in ("vgpuctl_gpu_utilization_ratio", "vgpuctl_vgpu_utilization_ratio", "vgpuctl_vgpu_idle"):
        assert fams[name].samples == [], name
        assert fresh[name].samples != [], name
    up = {s.labels["Hostname"]: s.value for s in fams["vgpuctl_utilization_host_up"].samples}
    ages = {s.labels["Hostname"]: s.value for s in fams["vgpuctl_utilization_sample_age_seconds"].samples}
    assert set(up.values()) == {0.0} and all(400 <= a < 460 for a in ages.values())
    assert out["vgpus"] == [] and all("stale" in why for why in out["hosts"].values())


def test_a_host_that_fails_keeps_its_last_sample_and_says_so(store: Store) -> None:
    fleet = Fleet(store)
    ctl = store.ctl()
    try:
        fleet.round(ctl)
        fleet.broken.add("kvm-l40s-01")
        fleet.now += 60
        fleet.round(ctl)
        fams = scrape(ctl)
        hosts = stored_usage(ctl).usage.hosts
    finally:
        ctl.close()
    up = {s.labels["Hostname"]: s.value for s in fams["vgpuctl_utilization_host_up"].samples}
    assert up == {"kvm-a100-01": 1.0, "kvm-h100-01": 1.0, "kvm-l40s-01": 0.0}
    assert hosts["kvm-l40s-01"] == "host kvm-l40s-01: the host agent failed"
    kept = {s.labels["vm"] for s in fams["vgpuctl_vgpu_utilization_ratio"].samples}
    assert "g1" in kept  # its sample of a minute before is still current


def test_the_registry_of_metrics_dump_has_the_utilization_families(store: Store) -> None:
    from vgpu_ctl.ops.metrics import dump
    ctl = store.ctl()
    try:
        text = dump(ctl)  # the demo's hosts are simulated: nothing sampled, the families are there, empty
    finally:
        ctl.close()
    assert "# TYPE vgpuctl_vgpu_idle gauge" in text and "# TYPE vgpuctl_gpu_utilization_ratio gauge" in text
    assert "vgpuctl_utilization_host_up{" not in text


def test_idle_needs_the_configured_time_below_the_threshold(store: Store) -> None:
    fleet = Fleet(store)
    rule = IdleRule(0.05, 600)
    ctl = store.ctl()

    def below() -> dict[str | None, Any]:
        fleet.round(ctl)
        return {i.vm: i for i in stored_usage(ctl, now=fleet.now).idle_vgpus(rule)}

    try:
        first = below()
        assert set(first) == {"a1"} and not first["a1"].idle and first["a1"].why == "utilization"
        fleet.now += 601
        later = below()
        assert later["a1"].idle and later["a1"].below_since == first["a1"].below_since
        fleet.broken.add("kvm-a100-01")  # a host not sampled keeps its vGPUs' clocks
        fleet.now += 10
        assert below()["a1"].below_since == first["a1"].below_since
        fleet.broken.clear()
        kept = below()
        assert kept["a1"].idle and kept["a1"].below_since == first["a1"].below_since
        fleet.a100.vgpus[0].sm = 50  # busy again: not below 5 % now, and the clock starts again after it
        assert below() == {}
        busy_at = fleet.now
        fleet.a100.vgpus[0].sm = 0
        fleet.now += 5
        again = below()
        assert not again["a1"].idle and again["a1"].below_since == fleet.now
        assert busy_at < again["a1"].below_since
        # a higher threshold, read from the same samples: 50 % was not below 60 %, so below since the start
        loose = {i.vm: i for i in stored_usage(ctl, now=fleet.now).idle_vgpus(IdleRule(0.6, 600))}
        assert loose["a1"].below_since == first["a1"].below_since and loose["a1"].idle
    finally:
        ctl.close()


def test_a_stopped_vm_holding_its_vgpu_counts_as_unused(store: Store) -> None:
    fleet = Fleet(store)
    store.sql("UPDATE vm SET state = 'stopped' WHERE name = 'g1'")
    fleet.l40s.vgpus.clear()  # NVML lists only running vGPUs
    ctl = store.ctl()
    try:
        fleet.round(ctl)
        got = {i.vm: i for i in stored_usage(ctl).idle_vgpus(IdleRule(0.05, 0))}
    finally:
        ctl.close()
    assert got["g1"].why == "vm stopped" and got["g1"].utilization == 0.0 and got["g1"].idle


def _brute_below_since(history: list[tuple[float, float]], threshold: float) -> float | None:
    """Since when every sample of `history` ((time, busy), oldest first) has been below threshold."""
    if history[-1][1] >= threshold:
        return None
    since = history[0][0]
    for (_t, b), (t_next, _b) in pairwise(history):
        if b >= threshold:
            since = t_next
    return since


def test_marks_give_every_threshold_what_the_whole_history_gives() -> None:
    from hypothesis import given
    from hypothesis import strategies as st

    @given(st.lists(st.integers(0, 100), min_size=1, max_size=60), st.integers(0, 101))
    def check(percents: list[int], threshold: int) -> None:
        marks: list[tuple[float, float | None]] = []
        history = []
        for n, p in enumerate(percents):
            marks = add_mark(marks, p / 100, 10.0 * n)
            history.append((10.0 * n, p / 100))
        assert len(marks) <= 101
        assert below_since(marks, 0.0, threshold / 100) == _brute_below_since(history, threshold / 100)

    check()


@pytest.mark.parametrize(("threshold", "idle_for", "field"), [
    (1.5, 0, "idle_threshold"), (-0.1, 0, "idle_threshold"), (float("nan"), 0, "idle_threshold"),
    (0.1, -1, "idle_for"), (0.1, float("inf"), "idle_for")])
def test_a_bad_idle_setting_names_the_field(threshold: float, idle_for: float, field: str) -> None:
    with pytest.raises(InvalidInput, match=field) as err:
        IdleRule(threshold, idle_for)
    assert err.value.reasons[0]["field"] == field and err.value.exit_code == 2


def test_bad_idle_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_IDLE_THRESHOLD", "lots")
    with pytest.raises(InvalidInput, match="VGPU_CTL_IDLE_THRESHOLD"):
        rule_from_env()
    monkeypatch.setenv("VGPU_CTL_IDLE_THRESHOLD", "0.2")
    monkeypatch.setenv("VGPU_CTL_IDLE_FOR", "-5")
    with pytest.raises(InvalidInput, match="VGPU_CTL_IDLE_FOR"):
        rule_from_env()
    monkeypatch.setenv("VGPU_CTL_IDLE_FOR", "60")
    t = rule_from_env()
    assert (t.threshold, t.idle_for_s) == (0.2, 60.0)


def test_status_lists_idle_vgpus(store: Store) -> None:
    fleet = Fleet(store)
    ctl = store.ctl()
    try:
        plain = fleet_status(ctl, idle=IdleRule(0.05, 0))  # nothing sampled yet
        assert plain["idle"]["vgpus"] == [] and plain["idle"]["hosts"] == {}
        fleet.round(ctl)
        out = idle_vgpus(ctl, IdleRule(0.05, 0))
        assert [(v["vm"], v["tenant"], v["idle"]) for v in out["vgpus"]] == [("a1", "acme", True)]
        assert out["threshold"] == 0.05 and out["hosts"] == dict.fromkeys(("kvm-a100-01", "kvm-h100-01",
                                                                           "kvm-l40s-01"))
        assert idle_vgpus(ctl, IdleRule(0.05, 0), pool="training")["vgpus"] == []  # a1 is in inference
        assert [v["vm"] for v in fleet_status(ctl, idle=IdleRule(0.05, 0))["idle"]["vgpus"]] == ["a1"]
        assert "idle" not in fleet_status(ctl)
    finally:
        ctl.close()
    tenant = store.as_tenant("acme")
    try:
        with pytest.raises(PermissionDenied):
            fleet_status(tenant, idle=IdleRule())
    finally:
        tenant.close()


def test_status_cli_idle_and_a_bad_threshold(store: Store) -> None:
    from opsfixtures import cli
    before = snapshot(store)
    res = cli(store, "status", "--idle", "--idle-threshold", "1.5")
    assert res.exit_code == 2 and "idle_threshold" in res.output, res.output
    res = cli(store, "status", "--idle", "--idle-for", "-3")
    assert res.exit_code == 2 and "idle_for" in res.output, res.output
    assert snapshot(store) == before
    res = cli(store, "status", "--idle", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["idle"]["vgpus"] == []
    res = cli(store, "status", "--idle")
    assert res.exit_code == 0 and "Idle vGPUs" in res.stdout, res.output


def test_metrics_sample_cli_keeps_a_round_and_refuses_a_bad_interval(store: Store) -> None:
    from opsfixtures import cli
    before = snapshot(store)
    for bad in ("0", "-5", "nan"):
        res = cli(store, "metrics", "sample", "--interval", bad)
        assert res.exit_code == 2 and "interval" in res.output, res.output
    assert snapshot(store) == before
    res = cli(store, "metrics", "sample", "--json")  # the demo's hosts are simulated: nothing to keep
    assert res.exit_code == 0 and json.loads(res.stdout) == {"hosts": 0, "gpu_loads": 0}, res.output
    tenant = store.as_tenant("acme")
    try:
        with pytest.raises(PermissionDenied):
            sample_round(tenant)
    finally:
        tenant.close()


def test_measured_load_steers_spread_load_to_the_idle_gpu(store: Store) -> None:
    from vgpu_ctl.core.placement import GpuView, HostView, PlacementRequest, get_policy, plan
    from vgpu_ctl.service.allocation import occupancy_of
    fleet = Fleet(store)
    ctl = store.ctl()
    try:
        usage = collect_usage(ctl, fleet)
        load = load_by_gpu(usage)
        rows = store.sql("SELECT g.id, g.pci_address FROM gpu g JOIN host h ON h.id = g.host_id "
                         "WHERE h.name = 'kvm-a100-01' AND g.mode = 'vgpu-equal'")
        ids = {pci: gid for gid, pci in rows}
        assert load[ids["0000:41:00.0"]] == 0.9 and load[ids["0000:81:00.0"]] == 0.03
        from sqlalchemy import select

        from vgpu_ctl.store.tables import GPU
        with ctl.engine.connect() as conn:
            gpus = {r.id: r for r in conn.execute(select(GPU).where(GPU.c.id.in_(list(ids.values()))))}
        # 41:00.0 is empty (spread's choice) but 90 % busy with a vGPU made outside the controller;
        # 81:00.0 holds a1's vGPU and idles
        views = tuple(GpuView(gid, f"kvm-a100-01/{gpus[gid].pci_address}",
                              occupancy_of(ctl.catalog, gpus[gid]._mapping))
                      for gid in (ids["0000:41:00.0"], ids["0000:81:00.0"]))
        hosts = [HostView(1, "kvm-a100-01", 64, 512 * 1024, views)]
        req = PlacementRequest(("A100D-10C",), vcpus=2, memory_mib=4096)
        spread = plan(req, hosts, get_policy("spread"))
        loaded = plan(req, hosts, spread_load_policy(usage))
        assert spread is not None and loaded is not None
        assert spread.devices[0].gpu_id == ids["0000:41:00.0"]
        assert loaded.devices[0].gpu_id == ids["0000:81:00.0"]
    finally:
        ctl.close()


def test_a_driver_without_the_v1_utilization_struct_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import pynvml
    nvml = one_host()

    def mismatch(handle: Any, ts: int) -> list[Any]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)

    monkeypatch.setattr(nvml, "nvmlDeviceGetVgpuInstancesUtilizationInfo", mismatch)
    v1 = sample(nvml, kmsg=None).vgpus[0]
    assert v1.sm == 0.4 and v1.jpeg is None
