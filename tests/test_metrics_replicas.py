"""Two `vgpuctl serve` replicas on one store (SQLite and PostgreSQL): the utilization a sampling round kept in the
store is what both replicas' /metrics export, the leader's and the other's alike, with the same values."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_replicas import Store, _servers_killed_after, _setup, _wait_leader

from vgpu_ctl.hosts.utilization import GpuSample, HostSample, VgpuSample

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, state_dir: Path, tmp_path: Path) -> Iterator[Store]:
    """A store ready for servers (SQLite file, or a fresh PostgreSQL schema); its servers killed at the end."""
    url = str(request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url"))
    yield from _servers_killed_after(_setup(url, state_dir, tmp_path))


def _utilization(store: Store, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", headers=store.auth(), timeout=30)
    assert r.status_code == 200, r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(r.text)
            if f.name.startswith(("vgpuctl_gpu_", "vgpuctl_vgpu_", "vgpuctl_utilization_host_up"))
            for s in f.samples}


def _keep_a_round(store: Store) -> dict[str, Any]:
    """One sampling round kept in the store, as the leader's sampler keeps it: the first inference GPU with a vGPU
    of a VM made for it (the demo's hosts are simulated: the servers' own rounds have nothing to read)."""
    from vgpu_ctl.service.utilization_samples import sample_round
    with store.controller() as c:
        vm = c.request_vm("acme", "sampled", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference",
                          provision=False)
        host, pci = vm.devices[0].gpu.split("/")
        uuid = vm.devices[0].uuid

        def sampler(row: Any) -> HostSample | None:
            if row.name != host:
                return None
            return HostSample(time.time(), [GpuSample(pci, "GPU-x", 3, "NVIDIA A100 80GB PCIe", utilization=0.25,
                                                      power_watts=180.0, temperature_c=50.0)],
                              [VgpuSample(pci, "GPU-x", 1, mdev_uuid=uuid, sm=0.42, fb_used_bytes=2**30)])

        sample_round(c, sampler, interval_s=600)
    return {"host": host, "vm": vm.name, "device": vm.devices[0].id}


def test_both_replicas_export_what_the_round_kept(store: Store) -> None:
    first = store.start("--reconcile-interval", "0")
    second = store.start("--reconcile-interval", "0")
    leader = _wait_leader(store, [first, second])
    other = second if leader is first else first
    kept = _keep_a_round(store)
    seen_leader, seen_other = _utilization(store, leader.url), _utilization(store, other.url)
    assert seen_leader == seen_other
    sm = [v for (name, labels), v in seen_other.items() if name == "vgpuctl_vgpu_utilization_ratio"
          and ("engine", "sm") in labels]
    assert sm == [0.42]
    (labels,) = [dict(lab) for (name, lab) in seen_other if name == "vgpuctl_vgpu_utilization_ratio"]
    assert (labels["tenant"], labels["vm"], labels["device"], labels["Hostname"], labels["gpu"]) == \
        ("acme", kept["vm"], kept["device"], kept["host"], "3")
    up = {dict(lab)["Hostname"]: v for (name, lab), v in seen_other.items() if name == "vgpuctl_utilization_host_up"}
    assert up == {kept["host"]: 1.0}
