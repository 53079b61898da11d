"""Which GPUs can hold a profile: per (model, mode) that offers it, the profile's size on that axis and its bit in
the GPUs' fit masks. The store's candidate queries filter GPUs by these; the service plans over what they find."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import Mode, geometry_for, profile_bit, supported_modes


def modes_for(kind: ProfileKind) -> tuple[str, ...]:
    """The GPU modes in which a profile of this kind can be placed."""
    return {
        ProfileKind.VGPU: (Mode.VGPU_EQUAL.value, Mode.VGPU_MIXED.value),
        ProfileKind.MIG: (Mode.MIG.value,),
        ProfileKind.MIG_VGPU: (Mode.MIG.value,),
        ProfileKind.PASSTHROUGH: (Mode.PASSTHROUGH.value,),
    }[kind]


@dataclass(frozen=True, slots=True)
class Placeable:
    """GPUs that can hold a profile: their model and mode, the profile's size on that axis, and its bit in
    the GPUs' fit masks."""

    model: str
    mode: str
    size: int
    bit: int


@lru_cache(maxsize=1024)
def placeables(catalog: Catalog, profiles: frozenset[str]) -> tuple[Placeable, ...]:
    """One entry per (model, mode) that offers one of the profiles, with that profile's size and bit."""
    out = []
    for name in sorted(profiles):
        for model in catalog.models_offering(name):
            p = catalog.profile(model, name)
            assert p is not None
            for mode in modes_for(p.kind):
                if mode not in supported_modes(catalog, model):
                    continue  # e.g. T4 and V100 have no mixed-size mode
                geom = geometry_for(catalog, model, mode)
                shape = geom.shape(name)
                if shape is not None:
                    out.append(Placeable(model, mode, shape.size, profile_bit(geom, name)))
    return tuple(out)


__all__ = ["Placeable", "modes_for", "placeables"]
