"""The result types of scheduling that callers get back (a preemption's victims and plan): plain dataclasses,
free of the store, so that the HTTP client returns the very same types as the Controller."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Victim:
    """A VM a preemption frees, as reported (dry run) and audited."""

    vm_id: str
    tenant: str
    name: str
    host: str
    priority_class: str | None
    priority: int
    mode: str
    devices: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = dict(self.__dict__)
        d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Victim:
        """A Victim from its `to_dict()` form."""
        return cls(str(d["vm_id"]), str(d["tenant"]), str(d["name"]), str(d["host"]), d.get("priority_class"),
                   int(d["priority"]), str(d["mode"]), tuple(d.get("devices") or ()))


@dataclass(frozen=True)
class PreemptionPlan:
    """What a preemption would do: the request's class and value, the pool and host it would go to, the victims."""

    priority_class: str | None
    priority: int
    pool: str | None
    host: str | None
    victims: tuple[Victim, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"priority_class": self.priority_class, "priority": self.priority, "pool": self.pool,
                "host": self.host, "victims": [v.to_dict() for v in self.victims], "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PreemptionPlan:
        """A PreemptionPlan from its `to_dict()` form."""
        return cls(d.get("priority_class"), int(d["priority"]), d.get("pool"), d.get("host"),
                   tuple(Victim.from_dict(v) for v in d.get("victims") or ()), str(d.get("reason") or ""))


__all__ = ["PreemptionPlan", "Victim"]
