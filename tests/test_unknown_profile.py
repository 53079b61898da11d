"""Every way in that prices a request refuses an unknown profile as bad input naming it (schemathesis found
the preemption preview failing with an IndexError on an empty profile name), and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import store_snapshot

from vgpu_ctl import Controller, InvalidInput

DEMO = Path(__file__).resolve().parent.parent / "inventory" / "demo.yaml"
WAYS: dict[str, Callable[[Controller, str], Any]] = {
    "request_vm": lambda c, p: c.request_vm("acme", "x", [(p, 1)], vcpus=1, memory_mib=1),
    "dry run": lambda c, p: c.request_vm("acme", "x", [(p, 1)], vcpus=1, memory_mib=1, dry_run=True),
    "preemption preview": lambda c, p: c.scheduling.preview("acme", "x", [(p, 1)], vcpus=1, memory_mib=1),
    "candidates": lambda c, p: c.placement_candidates("acme", [(p, 1)], vcpus=1, memory_mib=1),
    "queued": lambda c, p: c.request_vm("acme", "x", [(p, 1)], vcpus=1, memory_mib=1, queue=True),
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("profile", ["", "1g.10gbx"])
def test_an_unknown_profile_is_bad_input_naming_it(ctl: Controller, way: str, profile: str) -> None:
    ctl.apply_inventory(DEMO)
    ctl.create_tenant("acme")
    before = store_snapshot(ctl)
    with pytest.raises(InvalidInput, match="unknown profile") as err:
        WAYS[way](ctl, profile)
    assert err.value.reasons == [{"field": "profile", "value": profile}]
    assert store_snapshot(ctl) == before
