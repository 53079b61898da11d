"""Every profile of every catalog model can be placed, through the Controller, on a GPU in each mode it supports.

The modes a profile should be placeable in are read from the catalog entry (its kind and the model's flags), not
from the geometry engine, so a mode the engine or the candidate query leaves out fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import check_store_invariants, write_inventory

from vgpu_ctl import Controller, load_catalog
from vgpu_ctl.catalog import ProfileInfo, ProfileKind
from vgpu_ctl.service.allocation import placeables

CATALOG = load_catalog()
MODELS = sorted(CATALOG.models)
POOL_OF = {"vgpu-equal": "equal", "vgpu-mixed": "mixed", "mig": "mig", "passthrough": "whole"}


def expected_modes(model: str, p: ProfileInfo) -> list[str]:
    """The modes the catalog says `p` can be placed in on `model`."""
    spec = CATALOG.model(model)
    if p.kind is ProfileKind.VGPU:
        out = ["vgpu-equal"] if p.placements else []
        return out + (["vgpu-mixed"] if spec.mixed_size and p.mixed_placement_ids else [])
    if p.kind in (ProfileKind.MIG, ProfileKind.MIG_VGPU):
        return ["mig"] if spec.mig is not None else []
    return ["passthrough"] if spec.passthrough else []


def model_modes(model: str) -> list[str]:
    """The modes in which some profile of `model` should be placeable."""
    return [m for m in POOL_OF if any(m in expected_modes(model, p) for p in CATALOG.profiles(model))]


def inventory(model: str) -> str:
    """One simulated host with one GPU of `model` per mode, each in its own pool."""
    modes = model_modes(model)
    pools = "".join(f"  - {{name: {POOL_OF[m]}}}\n" for m in modes)
    gpus = "".join(f'      - {{pci: "0000:{0x41 + i:02x}:00.0", model: {model}, mode: {m}, pool: {POOL_OF[m]}}}\n'
                   for i, m in enumerate(modes))
    return (f"pools:\n{pools}hosts:\n  - name: sim-{model.lower()}\n    uri: \"simulated:///sim-{model.lower()}\"\n"
            f"    driver: simulated\n    vcpus: 64\n    memory_mib: 262144\n    gpus:\n{gpus}")


def test_every_model_has_profiles_in_the_modes_it_claims() -> None:
    for model in MODELS:
        spec = CATALOG.model(model)
        modes = model_modes(model)
        assert "vgpu-equal" in modes and ("vgpu-mixed" in modes) == spec.mixed_size, model
        assert ("mig" in modes) == (spec.mig is not None) and ("passthrough" in modes) == spec.passthrough, model


@pytest.mark.parametrize("model", MODELS)
def test_every_profile_places_in_each_mode_it_supports(model: str, sqlite_url: str, state_dir: Path,
                                                       tmp_path: Path) -> None:
    ctl = Controller(sqlite_url)
    try:
        ctl.apply_inventory(write_inventory(tmp_path, inventory(model)))
        ctl.create_tenant("t")
        pci = {m: f"sim-{model.lower()}/0000:{0x41 + i:02x}:00.0" for i, m in enumerate(model_modes(model))}
        placed: list[tuple[str, str]] = []
        for p in CATALOG.profiles(model):
            modes = expected_modes(model, p)
            assert modes, f"{model} {p.name}: no mode to place it in"
            # the candidate query offers exactly those modes of this model
            offered = {c.mode for c in placeables(CATALOG, frozenset((p.name,))) if c.model == model}
            assert offered == set(modes), (model, p.name)
            for mode in modes:
                vm = ctl.request_vm("t", f"vm{len(placed)}", [(p.name, 1)], vcpus=1,
                                    memory_mib=1024, pool=POOL_OF[mode], provision=False)
                assert (vm.state, vm.pool) == ("placed", POOL_OF[mode]), (p.name, mode)
                assert [(d.profile, d.gpu) for d in vm.devices] == [(p.name, pci[mode])], (p.name, mode)
                check_store_invariants(ctl.engine)
                ctl.release_vm(vm.id)
                placed.append((p.name, mode))
        assert ctl.list_vms() == []
        assert {m for _, m in placed} == set(model_modes(model))
    finally:
        ctl.close()
