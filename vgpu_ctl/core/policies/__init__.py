"""The placement policies, one module each. A module here that defines `POLICY` (a PolicyDef) is a policy:
adding a policy is adding a file, and the inventory, the CLI and the store's candidate order know it from here."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vgpu_ctl.core.placement_types import Demand, Policy


@dataclass(frozen=True)
class PolicyDef:
    """A policy by name: what it does, and how to make it for a pool's demand mix (and, for policies that use
    it, the number of GPUs per model the pool has)."""

    name: str
    description: str
    make: Callable[[Demand | None, Mapping[str, float] | None], Policy]


def _discover() -> dict[str, PolicyDef]:
    found: dict[str, PolicyDef] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        definition = getattr(module, "POLICY", None)
        if isinstance(definition, PolicyDef):
            if definition.name in found:
                raise RuntimeError(f"two placement policies are called {definition.name!r}")
            found[definition.name] = definition
    return found


POLICIES: dict[str, PolicyDef] = _discover()


def get_policy(name: str, demand: Demand | None = None, supply: Mapping[str, float] | None = None) -> Policy:
    """The policy called `name`, configured with a demand mix (and the GPUs per model) where it uses them."""
    from vgpu_ctl.errors import InvalidInput

    try:
        definition = POLICIES[name]
    except KeyError:
        raise InvalidInput(f"unknown placement policy {name!r} (field policy); known: "
                           f"{', '.join(sorted(POLICIES))}", reasons=[{"field": "policy", "value": name}]) from None
    return definition.make(demand, supply)


__all__ = ["POLICIES", "PolicyDef", "get_policy"]
