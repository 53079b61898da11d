"""The operations views' reads (`STORE.reports`, store/reports.py): typed rows that agree with each other and
with the views built on them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from opsfixtures import Store, clone, template_store

from vgpu_ctl.core.vm_state import HOLDS_HOST, IN_FLIGHT
from vgpu_ctl.ops.status import fleet_status
from vgpu_ctl.service.ports import STORE
from vgpu_ctl.store.reports import Count, ModeSummary, PagedGpu, ReportGpu


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def test_rows_are_typed_and_add_up(store: Store) -> None:
    with store.ctl() as ctl, ctl.engine.connect() as tx:
        gpus = STORE.reports.all_gpus(tx)
        assert gpus and all(type(g) is ReportGpu for g in gpus)
        modes = STORE.reports.mode_summaries(tx)
        assert all(type(m) is ModeSummary for m in modes)
        assert sum(m.gpus for m in modes) == len(gpus) == STORE.reports.gpu_total(tx)
        assert sum(m.devices for m in modes) == len(STORE.reports.all_devices(tx)) == 3
        assert {m.mode for m in modes} == {g.mode for g in gpus}
        counts = STORE.reports.gpu_counts(tx)
        assert all(type(c) is Count for c in counts) and sum(c.n for c in counts) == len(gpus)
        page = STORE.reports.gpu_page(tx, None, None, 0, None)
        assert all(type(p) is PagedGpu for p in page) and len(page) == len(gpus)
        assert [(p.host_name, p.gpu.pci_address) for p in page] == sorted((p.host_name, p.gpu.pci_address)
                                                                           for p in page)
        one = page[0].gpu.host_id
        assert STORE.reports.gpu_total(tx, host=one) == sum(g.host_id == one for g in gpus)
        assert STORE.reports.hosts_by_state(tx, host=one) == {page[0].host_state: 1}
        vms = STORE.reports.vm_counts(tx)
        taken = STORE.reports.host_vm_usage(tx, HOLDS_HOST)
        assert sum(c.n for c in vms) == 3 and sum(c for c, _m in taken.values()) == 4 + 2 + 2
        assert STORE.reports.orphan_devices(tx) == [] and STORE.reports.misplaced_devices(tx) == []
        assert STORE.reports.vms_since(tx, IN_FLIGHT, datetime.now(UTC) + timedelta(days=1)) == []


def test_status_filters_match_the_reads(store: Store) -> None:
    with store.ctl() as ctl:
        with ctl.engine.connect() as tx:
            pools = {name: i for i, name in STORE.reports.pool_names(tx).items()}
            states = STORE.reports.pool_gpu_states(tx, [pools["inference"]])
        out = fleet_status(ctl, pool="inference", limit=1000)
    assert out["page"]["total"] == sum(s.n for s in states) == out["pools"][0]["gpus"]
    assert {g["pool"] for g in out["gpus"]} == {"inference"}
