"""`vgpuctl doctor`: a consistent store passes; each corruption made with direct SQL is reported with a fix."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from opsfixtures import Store, cli, clone, template_store

from vgpu_ctl.ops.doctor import CHECKS, diagnose

DEVICE_COLS = "id, gpu_id, vm_id, profile, kind, start, size, framebuffer_mib, uuid, backing, handle, state"


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _copy_device(store: Store, profile: str, start: int, size: int, new_profile: str | None = None) -> None:
    store.sql("DROP TRIGGER IF EXISTS device_no_overlap")
    store.sql(f"INSERT INTO device ({DEVICE_COLS}) SELECT 'extra', gpu_id, vm_id, :np, kind, :start, :size, "
              f"framebuffer_mib, 'extra', backing, handle, state FROM device WHERE profile = :p",
              p=profile, np=new_profile or profile, start=start, size=size)


def _scoped(store: Store) -> None:
    ctl = store.ctl()
    try:
        ctl.set_quota("acme", {"vgpus": 5}, pool="inference")
    finally:
        ctl.close()
    store.sql("UPDATE scoped_quota SET used = used + 2")


CORRUPTIONS: dict[str, Callable[[Store], object]] = {
    "tenant-usage": lambda s: s.sql("UPDATE tenant SET vms_used = vms_used + 1 WHERE name = 'acme'"),
    "scoped-quota": _scoped,
    "failed-vms": lambda s: s.sql("UPDATE vm SET state = 'failed' WHERE name = 'a2'"),
    "overlaps": lambda s: _copy_device(s, "A100D-10C", 5, 10),
    "gpu-occupancy": lambda s: s.sql("UPDATE gpu SET free_units = free_units - 1 WHERE pci_address = '0000:17:00.0'"),
    "one-type": lambda s: _copy_device(s, "A100D-10C", 20, 20, "A100D-20C"),
    "host-usage": lambda s: s.sql("UPDATE host SET used_vcpus = used_vcpus + 3 WHERE name = 'kvm-l40s-01'"),
    "orphans": lambda s: s.sql("UPDATE device SET vm_id = 'gone' WHERE profile = 'L40S-12C'"),
    "host-summaries": lambda s: s.sql("UPDATE host_fit SET free_units = free_units + 1 WHERE host_id = "
                                      "(SELECT id FROM host WHERE name = 'kvm-l40s-01')"),
    "stuck": lambda s: s.sql("UPDATE vm SET state = 'placed', updated_at = '2020-01-01 00:00:00.000000' "
                             "WHERE name = 'g1'"),
}


def test_every_check_has_a_corruption_test() -> None:
    assert {name for name, _, _ in CHECKS} == set(CORRUPTIONS)


def test_consistent_store_passes(store: Store) -> None:
    res = cli(store, "doctor")
    assert res.exit_code == 0, res.output
    assert "store is consistent" in res.output
    out = json.loads(cli(store, "doctor", "--json").stdout)
    assert out["ok"] is True and all(c["ok"] for c in out["checks"])


@pytest.mark.parametrize("check", sorted(CORRUPTIONS))
def test_corruption_is_reported_with_a_fix(store: Store, check: str) -> None:
    CORRUPTIONS[check](store)
    res = cli(store, "doctor", "--json")
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    failed = {c["name"]: c for c in out["checks"] if not c["ok"]}
    assert check in failed, failed
    for p in failed[check]["problems"]:
        assert p["object"] and p["message"] and p["fix"]
    text = cli(store, "doctor")
    assert text.exit_code == 1 and "FAIL" in text.output and "fix:" in text.output


def test_invalid_mig_layout_is_reported(store: Store) -> None:
    store.sql("UPDATE device SET start = 1 WHERE profile = '3g.40gb'")
    store.sql("UPDATE gpu SET layout = '3g.40gb@1+4' WHERE layout = '3g.40gb@4+4'")
    ctl = store.ctl()
    try:
        results = {r.name: r for r in diagnose(ctl)}
    finally:
        ctl.close()
    problems = results["gpu-occupancy"].problems
    assert len(problems) == 1 and "not valid" in problems[0].message and "kvm-h100-01" in problems[0].object


def test_specific_messages(store: Store) -> None:
    store.sql("UPDATE tenant SET vms_used = vms_used + 1 WHERE name = 'acme'")
    store.sql("UPDATE host SET used_vcpus = used_vcpus + 3 WHERE name = 'kvm-l40s-01'")
    ctl = store.ctl()
    try:
        results = {r.name: r for r in diagnose(ctl)}
    finally:
        ctl.close()
    [p] = results["tenant-usage"].problems
    assert p.object == "tenant acme" and "vms used is 3" in p.message and "vgpuctl db repair-usage" in p.fix
    [p] = results["host-usage"].problems
    assert p.object == "host kvm-l40s-01" and "used_vcpus is 5" in p.message


def test_stuck_threshold_is_an_option(store: Store) -> None:
    store.sql("UPDATE vm SET state = 'placed' WHERE name = 'g1'")
    assert cli(store, "doctor").exit_code == 0
    assert cli(store, "doctor", "--stuck-minutes", "0").exit_code == 1
