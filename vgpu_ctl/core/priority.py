"""Priority classes: what a VM's priority is, which class a request gets, and who may preempt whom (pure).

A class has an integer value (0 to 1e9, higher is more important, as Kubernetes' PriorityClass), whether VMs of it
may be preempted, the policy of its own requests (`lower-priority`: they may preempt preemptible VMs of strictly
lower value; `never`: they wait instead), and how its VMs are freed when preempted (`requeue`: stopped, devices
freed, the request queued again at its priority; `hibernate`: saved to the host's disk (libvirt managed save),
keeping its devices, and resumed when its host has room again; `cancel`: deleted).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum

from vgpu_ctl.errors import InvalidInput

MAX_PRIORITY = 1_000_000_000
"""The largest priority value (Kubernetes' limit for user classes)."""


class PreemptionPolicy(StrEnum):
    """What a request of a class may do when it does not fit."""

    NEVER = "never"
    LOWER_PRIORITY = "lower-priority"


class PreemptionMode(StrEnum):
    """How a preempted VM of a class is freed."""

    HIBERNATE = "hibernate"
    REQUEUE = "requeue"
    CANCEL = "cancel"


KEEPS_MORE: dict[PreemptionMode, tuple[PreemptionMode, ...]] = {
    PreemptionMode.CANCEL: (PreemptionMode.CANCEL, PreemptionMode.REQUEUE, PreemptionMode.HIBERNATE),
    PreemptionMode.REQUEUE: (PreemptionMode.REQUEUE, PreemptionMode.HIBERNATE),
    PreemptionMode.HIBERNATE: (PreemptionMode.HIBERNATE,),
}
"""The modes a VM of a class may be freed by, in order: its class's own, then those that keep more of it
(hibernate keeps its memory, devices and disk; requeue its disk and request; cancel nothing), never a harsher
one."""

FREES_DEVICES = frozenset({PreemptionMode.REQUEUE, PreemptionMode.CANCEL})
"""The modes that free a victim's devices. A hibernated VM keeps them (NVIDIA: a vGPU's framebuffer is its own
until the vGPU is destroyed, and its saved state restores onto that device), so it frees only its host's vCPUs
and memory."""


def victim_mode(class_mode: PreemptionMode, supported: Collection[PreemptionMode]) -> PreemptionMode | None:
    """How a victim of a class whose mode is `class_mode` is freed where `supported` modes are possible: the first
    of `KEEPS_MORE[class_mode]` that is supported; None when none is."""
    return next((m for m in KEEPS_MORE[class_mode] if m in supported), None)


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """A named priority with its preemption rules."""

    name: str
    value: int
    preemptible: bool = False
    preemption_policy: PreemptionPolicy = PreemptionPolicy.LOWER_PRIORITY
    preemption_mode: PreemptionMode = PreemptionMode.REQUEUE
    default: bool = False
    description: str = ""


NO_CLASS = PriorityClass("", 0)
"""What a VM gets when no class is named and none is a default: value 0, not preemptible."""


def check_value(value: object) -> int:
    """The priority value if it is a whole number from 0 to MAX_PRIORITY; InvalidInput naming the field else."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidInput(f"priority value must be a whole number from 0 to {MAX_PRIORITY} (field value, value "
                           f"{value!r})", reasons=[{"field": "value", "value": value}])
    return value


def check_policy(policy: str) -> PreemptionPolicy:
    """The preemption policy named `policy`; InvalidInput naming the field and the known ones else."""
    try:
        return PreemptionPolicy(policy)
    except ValueError:
        raise InvalidInput(f"unknown preemption policy {policy!r} (field preemption_policy); known: "
                           f"{', '.join(p.value for p in PreemptionPolicy)}",
                           reasons=[{"field": "preemption_policy", "value": policy}]) from None


def check_mode(mode: str) -> PreemptionMode:
    """The preemption mode named `mode`; InvalidInput naming the field and the known ones else."""
    try:
        return PreemptionMode(mode)
    except ValueError:
        raise InvalidInput(f"unknown preemption mode {mode!r} (field preemption_mode); known: "
                           f"{', '.join(m.value for m in PreemptionMode)}",
                           reasons=[{"field": "preemption_mode", "value": mode}]) from None


def resolve_class(requested: str | None, classes: Mapping[str, PriorityClass], allowed: Collection[str] | None,
                  tenant_default: str | None, tenant: str = "") -> PriorityClass:
    """The class a request gets: the one it names, else the tenant's default, else the global default, else
    NO_CLASS. InvalidInput naming the field when the named class does not exist or the tenant is limited to other
    classes (`allowed`: None means any class)."""
    if requested is not None:
        cls = classes.get(requested)
        if cls is None:
            known = ", ".join(sorted(classes)) or "none"
            raise InvalidInput(f"unknown priority class {requested!r} (field priority; known: {known})",
                               reasons=[{"field": "priority", "value": requested}])
        if allowed is not None and requested not in allowed:
            raise InvalidInput(f"tenant {tenant!r} may not use priority class {requested!r} (field priority; "
                               f"allowed: {', '.join(sorted(allowed)) or 'none'})",
                               reasons=[{"field": "priority", "value": requested, "allowed": sorted(allowed)}])
        return cls
    if tenant_default is not None and tenant_default in classes:
        return classes[tenant_default]
    default = next((c for c in classes.values() if c.default), None)
    if default is not None and (allowed is None or default.name in allowed):
        return default
    if allowed:  # limited to some classes without a usable default: the lowest of them
        return min((classes[a] for a in allowed if a in classes), key=lambda c: (c.value, c.name), default=NO_CLASS)
    return NO_CLASS


def may_preempt(preemptor: int, victim: int, victim_preemptible: bool, protected_below: int | None = None) -> bool:
    """Whether a request of priority `preemptor` may preempt a VM of priority `victim`: only a preemptible VM,
    only for a strictly higher priority, and not for a request no higher than `protected_below` (the priority of
    the request that last preempted the VM, while its cool-down runs: no loops between equal requests)."""
    if not victim_preemptible or preemptor <= victim:
        return False
    return protected_below is None or preemptor > protected_below
