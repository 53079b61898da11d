"""The VM state machine: the moves it has, and the guard that refuses the ones it does not."""

from __future__ import annotations

import itertools

import pytest

from vgpu_ctl.core.vm_state import HOLDS_CLAIM, IN_FLIGHT, LIVE, PROVISIONING, TRANSITIONS, VmState, check_move


def test_every_state_has_its_moves() -> None:
    assert set(TRANSITIONS) == set(VmState)
    assert all(to in VmState for moves in TRANSITIONS.values() for to in moves)


def test_the_way_up_and_back() -> None:
    way = [VmState.PLACED, VmState.DEVICES_READY, VmState.DEFINED, VmState.RUNNING, VmState.STOPPED,
           VmState.RUNNING]
    for a, b in itertools.pairwise(way):
        check_move([a], b)
    for s in HOLDS_CLAIM:
        check_move([s], VmState.RELEASING)  # every state that holds a claim can be deleted
    check_move([*PROVISIONING, VmState.RUNNING], VmState.FAILED)  # undo
    check_move([VmState.DEFINED, *LIVE], VmState.PLACED)  # reconcile rebuilds a VM whose devices vanished


@pytest.mark.parametrize("frm,to", [
    (VmState.FAILED, VmState.RUNNING),      # a failed VM holds nothing: it is only deleted
    (VmState.FAILED, VmState.RELEASING),
    (VmState.RELEASING, VmState.RUNNING),   # a release is finished, never undone
    (VmState.STOPPED, VmState.FAILED),      # a provisioned VM is not failed by a later step
    (VmState.PLACED, VmState.RUNNING),      # no skipping devices and domain
    (VmState.RUNNING, VmState.DEVICES_READY),
])
def test_moves_the_machine_lacks_are_refused(frm: VmState, to: VmState) -> None:
    with pytest.raises(ValueError, match=f"from {frm} to {to}"):
        check_move([frm], to)


def test_staying_is_allowed_and_names_are_the_stored_values() -> None:
    check_move([VmState.RELEASING], VmState.RELEASING)  # a release retried
    assert VmState("devices-ready") is VmState.DEVICES_READY and VmState.PLACED == "placed"
    assert set(IN_FLIGHT) == {*PROVISIONING, VmState.RELEASING}
    with pytest.raises(ValueError):
        check_move(["requested"], VmState.PLACED)  # not a state
