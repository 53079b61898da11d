"""Measured GPU loads feed placement: a pool with policy spread-load places on the GPU its hosts last
measured idle (through the store's claim, not only the policy on its own), stale loads count as none, and a
bad load is refused with nothing written. The server's leader samples them on an interval and keeps the whole
sample, which any other replica's metrics then read without calling a host."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import write_inventory
from sqlalchemy import select

from vgpu_ctl import Controller, InvalidInput, PermissionDenied
from vgpu_ctl.server.config import ServerConfig, load_config
from vgpu_ctl.service import gpu_loads
from vgpu_ctl.store import tables
from vgpu_ctl.store.models import utcnow
from vgpu_ctl.store.tables import GPU_LOAD, POOL

DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"
_INFERENCE = select(POOL.c.id).where(POOL.c.name == "inference").scalar_subquery()


@pytest.fixture
def fleet(ctl: Controller, tmp_path: Path) -> Controller:
    """The demo fleet with its MIG pool (two H100s on one host) placing by measured load."""
    text = DEMO.read_text().replace("  - name: inference\n    policy: pack\n",
                                    "  - name: inference\n    policy: spread-load\n")
    assert "policy: spread-load" in text
    ctl.apply_inventory(write_inventory(tmp_path, text, "spread.yaml"))
    ctl.create_tenant("acme")
    return ctl


def _h100s(ctl: Controller) -> list[Any]:
    with ctl.engine.connect() as conn:
        return conn.execute(select(tables.GPU.c.id, tables.GPU.c.pci_address).where(tables.GPU.c.model == "H100-80GB",
                                                                                  tables.GPU.c.mode == "mig",
                                                                                  tables.GPU.c.pool_id == _INFERENCE)
                            .order_by(tables.GPU.c.pci_address)).all()


def _where(ctl: Controller, name: str) -> str:
    vm = ctl.request_vm("acme", name, [("1g.10gb", 1)], vcpus=2, memory_mib=2048, pool="inference",
                        provision=False)
    return vm.devices[0].gpu.split("/")[1]


def test_the_idle_gpu_is_chosen_and_the_choice_follows_the_measurement(fleet: Controller) -> None:
    (a, pci_a), (b, pci_b) = _h100s(fleet)
    assert fleet.record_gpu_loads({a: 0.9, b: 0.0}) == 2
    assert _where(fleet, "one") == pci_b
    fleet.record_gpu_loads({a: 0.0, b: 0.95})
    assert _where(fleet, "two") == pci_a  # what spread alone would not do: b holds less
    fleet.record_gpu_loads({a: 0.9, b: 0.95})  # both as busy (one load step apart): b's is higher
    assert _where(fleet, "three") == pci_a


def test_a_stale_load_counts_as_none(fleet: Controller) -> None:
    (a, _), (b, pci_b) = _h100s(fleet)
    with fleet.tx() as conn:
        gpu_loads.record(conn, {a: 0.0, b: 0.9}, at=utcnow() - timedelta(seconds=gpu_loads.MAX_AGE_S + 60))
    with fleet.engine.connect() as conn:
        assert gpu_loads.recent(conn, conn.execute(select(tables.GPU.c.pool_id).where(tables.GPU.c.id == a))
                                .scalar_one()) == {}
    fleet.record_gpu_loads({a: 0.9})  # only a fresh one counts: b is taken as idle
    assert _where(fleet, "one") == pci_b


def test_bad_loads_are_refused_with_nothing_written(fleet: Controller) -> None:
    (a, _), _ = _h100s(fleet)
    for loads, field in (({a: 1.5}, "load"), ({a: float("nan")}, "load"), ({10**6: 0.1}, "gpu")):
        with pytest.raises(InvalidInput) as err:
            fleet.record_gpu_loads(loads)
        assert err.value.reasons[0]["field"] == field
    with fleet.engine.connect() as conn:
        assert conn.execute(select(GPU_LOAD)).all() == []
    token = fleet.issue_token("acme")
    with Controller(fleet.engine.url.render_as_string(hide_password=False), token=token,
                    state_path=fleet.state_path) as tenant, pytest.raises(PermissionDenied):
        tenant.record_gpu_loads({a: 0.1})


def test_the_sampling_interval_is_a_setting(tmp_path: Path) -> None:
    assert ServerConfig().utilization_interval_s == 60.0
    cfg = tmp_path / "c.toml"
    cfg.write_text("[server]\nutilization_interval_s = -1\n")
    with pytest.raises(InvalidInput, match="utilization_interval_s"):
        load_config(cfg, {})
    cfg.write_text("[server]\nutilization_interval_s = 0\n")
    assert load_config(cfg, {}).utilization_interval_s == 0


class OneGpu:
    """A sampler: the first H100 of the inference pool as NVML would show it, with one vGPU of `device` (its uuid
    as the mdev), busy `busy`; every other host has nothing to read."""

    def __init__(self, host: str, pci: str, device: str, busy: int = 3) -> None:
        self.host, self.pci, self.device, self.busy = host, pci, device, busy
        self.calls = 0

    def __call__(self, row: Any) -> Any:
        from vgpu_ctl.hosts.utilization import GpuSample, HostSample, VgpuSample
        self.calls += 1
        if row.name != self.host:
            return None
        return HostSample(time.time(), [GpuSample(self.pci, "GPU-h100", 0, "NVIDIA H100 80GB HBM3", utilization=0.5,
                                                  power_watts=301.5, temperature_c=55.0, xid_errors=0, last_xid=0)],
                          [VgpuSample(self.pci, "GPU-h100", 7, mdev_uuid=self.device, sm=self.busy / 100)])


def _one_vm(c: Controller) -> OneGpu:
    vm = c.request_vm("acme", "v1", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference",
                      provision=False)
    host, pci = vm.devices[0].gpu.split("/")
    with c.engine.connect() as conn:
        uuid = conn.execute(select(tables.DEVICE.c.uuid).where(tables.DEVICE.c.vm_id == vm.id)).scalar_one()
    return OneGpu(host, pci, uuid)


def _utilization(text: str) -> dict[str, list[Any]]:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name.startswith(
        ("vgpuctl_gpu_", "vgpuctl_vgpu_", "vgpuctl_utilization_"))}


def test_a_round_is_kept_whole_and_another_replica_reads_it(fleet: Controller) -> None:
    from vgpu_ctl.ops.metrics import dump
    from vgpu_ctl.service.utilization_samples import sample_round
    sampler = _one_vm(fleet)
    assert sample_round(fleet, sampler, interval_s=60) == {"hosts": 1, "gpu_loads": 1}
    calls = sampler.calls
    with Controller(fleet.engine.url.render_as_string(hide_password=False), state_path=fleet.state_path) as other:
        seen = _utilization(dump(other))
    assert sampler.calls == calls
    (power,) = seen["vgpuctl_gpu_power_watts"]
    assert power.value == 301.5 and power.labels["Hostname"] == sampler.host and power.labels["pool"] == "inference"
    (sm,) = [s for s in seen["vgpuctl_vgpu_utilization_ratio"] if s.labels["engine"] == "sm"]
    assert (sm.value, sm.labels["tenant"], sm.labels["vm"], sm.labels["mdev"]) == (0.03, "acme", "v1", sampler.device)
    (age,) = seen["vgpuctl_utilization_sample_age_seconds"]
    assert 0 <= age.value < 30
    assert sample_round(fleet, sampler, interval_s=60)["hosts"] == 1  # replaced, not added
    with fleet.engine.connect() as conn:
        from vgpu_ctl.store.utilization import SAMPLE
        assert len(conn.execute(select(SAMPLE)).all()) == 1


def test_a_bad_interval_is_refused_with_nothing_written(fleet: Controller) -> None:
    from vgpu_ctl.service.utilization_samples import sample_round
    from vgpu_ctl.store.utilization import SAMPLE
    sampler = _one_vm(fleet)
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(InvalidInput, match="interval_s") as err:
            sample_round(fleet, sampler, interval_s=bad)
        assert err.value.reasons[0]["field"] == "interval_s"
    assert sampler.calls == 0
    with fleet.engine.connect() as conn:
        assert conn.execute(select(SAMPLE)).all() == [] and conn.execute(select(GPU_LOAD)).all() == []


def test_the_leader_samples_on_its_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl.ops.metrics import dump
    from vgpu_ctl.server.runtime import Runtime
    from vgpu_ctl.service import utilization
    cfg = ServerConfig(store=f"sqlite:///{tmp_path / 'store.db'}", state_dir=str(tmp_path), reconcile_interval_s=0,
                       recovery_interval_s=0.1, utilization_interval_s=0.2, drain_timeout_s=5).check()
    rt = Runtime(cfg)
    try:
        rt.server.apply_inventory(DEMO)
        deadline = time.monotonic() + 20
        while rt.stats.utilization_samples < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.leading and rt.stats.utilization_samples >= 2 and rt.stats.utilization_errors == 0
        assert rt.stats.gpu_loads_recorded == 0  # simulated hosts have no NVML to sample
        rt.server.create_tenant("acme")
        sampler = _one_vm(rt.server)
        monkeypatch.setattr(utilization, "default_sampler", lambda ctl: sampler)
        while rt.stats.gpu_loads_recorded == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rt.stats.gpu_loads_recorded == 1
        with Controller(cfg.store) as reader:  # not the leader: it reads what the leader kept
            seen = _utilization(dump(reader))
        assert [s.value for s in seen["vgpuctl_gpu_power_watts"]] == [301.5]
    finally:
        rt.close()
