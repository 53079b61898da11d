"""A VM's provisioning states and the moves allowed between them (design.md's state machine).

placed -> devices-ready -> defined -> running <-> stopped is the way up; any provisioning state or running can
fail (its claim undone); every state that holds a claim can go to releasing, after which the VM row is deleted.
Reconcile may send a defined, running or stopped VM whose devices or domain vanished back to placed, to build it
again, and a VM rebuilt that way that was stopped goes from defined back to stopped, not started. A failed VM
holds nothing and can only be deleted.

A running VM may be hibernated (libvirt managed save, a preemption's `hibernate` mode): its memory goes to the
host's disk and QEMU ends, so it gives back its host's vCPUs and memory, but it keeps its devices and quota (a
vGPU's saved state restores only onto the device it was saved from); resumed, it is running again, and it may be
deleted while hibernated.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum


class VmState(StrEnum):
    """Where a VM is in its lifecycle. Stored as its value in the store's `vm.state` column."""

    PLACED = "placed"
    DEVICES_READY = "devices-ready"
    DEFINED = "defined"
    RUNNING = "running"
    STOPPED = "stopped"
    HIBERNATED = "hibernated"
    RELEASING = "releasing"
    FAILED = "failed"


PROVISIONING = (VmState.PLACED, VmState.DEVICES_READY, VmState.DEFINED)
"""States a VM passes through on its way to running."""

BEFORE_DOMAIN = (VmState.PLACED, VmState.DEVICES_READY)
"""Provisioning states in which the VM has no domain yet."""

LIVE = (VmState.RUNNING, VmState.STOPPED)
"""States of a VM that was provisioned and is the tenant's to start and stop."""

IN_FLIGHT = (*PROVISIONING, VmState.RELEASING)
"""States in which a process is (or was, before a crash) in the middle of an operation on the VM."""

HOLDS_CLAIM = (*PROVISIONING, *LIVE, VmState.HIBERNATED, VmState.RELEASING)
"""States in which the VM holds devices and quota."""

HOLDS_HOST = tuple(s for s in HOLDS_CLAIM if s is not VmState.HIBERNATED)
"""States in which the VM holds its host's vCPUs and memory (a hibernated VM gave them back)."""

TRANSITIONS: dict[VmState, frozenset[VmState]] = {
    VmState.PLACED: frozenset({VmState.DEVICES_READY, VmState.FAILED, VmState.RELEASING}),
    VmState.DEVICES_READY: frozenset({VmState.DEFINED, VmState.FAILED, VmState.RELEASING}),
    VmState.DEFINED: frozenset({VmState.RUNNING, VmState.STOPPED, VmState.FAILED, VmState.RELEASING,
                                VmState.PLACED}),
    VmState.RUNNING: frozenset({VmState.STOPPED, VmState.FAILED, VmState.RELEASING, VmState.PLACED,
                                VmState.HIBERNATED}),
    VmState.STOPPED: frozenset({VmState.RUNNING, VmState.RELEASING, VmState.PLACED}),
    VmState.HIBERNATED: frozenset({VmState.RUNNING, VmState.RELEASING}),
    VmState.RELEASING: frozenset(),  # the row is deleted when the release finishes
    VmState.FAILED: frozenset(),  # deleted by vm delete
}
"""The moves allowed from each state. A state may also stay as it is (an idempotent step retried)."""


def check_move(from_states: Collection[str], to_state: str) -> None:
    """ValueError naming the move unless every one of `from_states` may move to `to_state`: a guard against a
    code path that would write a move the state machine does not have."""
    to = VmState(to_state)
    bad = sorted(s for s in from_states if s != to and to not in TRANSITIONS[VmState(s)])
    if bad:
        raise ValueError(f"a VM may not move from {', '.join(bad)} to {to}")
