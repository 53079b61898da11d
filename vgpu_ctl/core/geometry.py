"""One geometry for every way of sharing a GPU: intervals on one axis, each profile with allowed starts.

MIG: the axis is the memory slices; vGPU (equal or mixed size): framebuffer in GB; passthrough: one interval
covering the axis. Fitting, freeing and "what still fits" are the same code for all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache, lru_cache

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.errors import InvalidInput


class Mode(StrEnum):
    """How a GPU is shared."""

    VGPU_EQUAL = "vgpu-equal"
    VGPU_MIXED = "vgpu-mixed"
    MIG = "mig"
    PASSTHROUGH = "passthrough"
    UNMANAGED = "unmanaged"


class Misfit(StrEnum):
    """Why a profile does not fit on a GPU right now."""

    OTHER_MODE = "other-mode"  # the GPU's mode (or model) does not offer the profile
    OTHER_TYPE = "other-type"  # equal-size GPU holds (or is pinned to) another type
    NO_SPACE = "no-space"  # no allowed start is free
    MAX_COUNT = "max-count"  # the profile's (or the GPU's) instance limit is reached
    COMPUTE = "compute"  # MIG compute slices exhausted
    MEDIA = "media-extension"  # a second "+me" instance
    LAYOUT = "not-in-layout"  # the GPU has a fixed MIG layout without a free slot of this profile


@dataclass(frozen=True, slots=True)
class Shape:
    """How one profile sits on a GPU in one mode."""

    profile: str
    kind: ProfileKind
    size: int
    starts: tuple[int, ...]
    max_count: int
    group: str  # instances of one group count together (a MIG GI profile and its MIG-backed vGPU types)
    compute: int = 0
    media: bool = False
    framebuffer_mib: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class Geometry:
    """The shapes a GPU model offers in one mode, on its axis (compared by identity: geometries are cached)."""

    model: str
    mode: Mode
    axis: int
    shapes: Mapping[str, Shape]
    homogeneous: bool = False
    compute_capacity: int | None = None
    max_instances: int | None = None

    def shape(self, profile: str) -> Shape | None:
        """The shape of `profile` in this geometry, or None if not offered."""
        return self.shapes.get(profile)


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    """One occupied position: a profile at a start, `size` units long."""

    start: int
    size: int
    profile: str

    def encode(self) -> str:
        """Compact text form `profile@start+size`."""
        return f"{self.profile}@{self.start}+{self.size}"


def decode_layout(text: str) -> tuple[Slot, ...]:
    """Parse the `;`-joined compact form written by `encode_layout`."""
    if not text:
        return ()
    out = []
    for part in text.split(";"):
        profile, _, rest = part.rpartition("@")
        start, _, size = rest.partition("+")
        out.append(Slot(int(start), int(size), profile))
    return tuple(sorted(out))


def encode_layout(slots: Iterable[Slot]) -> str:
    """The compact text form of a set of slots (sorted by start)."""
    return ";".join(s.encode() for s in sorted(slots))


def _mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


@dataclass(frozen=True, slots=True)
class Occupancy:
    """What occupies one GPU: its geometry, its slots, and optionally a type pin or a fixed MIG layout."""

    geometry: Geometry
    slots: tuple[Slot, ...] = ()
    pinned_type: str | None = None
    fixed_layout: frozenset[tuple[str, int]] | None = None  # (group, start) pairs the admin carved
    mask: int = field(init=False, compare=False)
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        m = 0
        for s in self.slots:
            m |= _mask(s.start, s.size)
        object.__setattr__(self, "mask", m)
        object.__setattr__(self, "_hash", hash((id(self.geometry), self.slots, self.pinned_type,
                                                self.fixed_layout)))

    def __hash__(self) -> int:
        # Occupancies key the policies' caches: hashing the slots once, not on every lookup.
        return self._hash

    @property
    def free_units(self) -> int:
        """Units of the axis no slot covers."""
        return self.geometry.axis - self.mask.bit_count()

    @property
    def active_type(self) -> str | None:
        """The type an equal-size GPU is locked to: its pin, or the type of its devices."""
        if not self.geometry.homogeneous:
            return None
        return self.pinned_type or (self.slots[0].profile if self.slots else None)

    def _group_count(self, group: str) -> int:
        shapes = self.geometry.shapes
        return sum(1 for s in self.slots if (sh := shapes.get(s.profile)) is not None and sh.group == group)

    def _compute_used(self) -> int:
        shapes = self.geometry.shapes
        return sum(sh.compute for s in self.slots if (sh := shapes.get(s.profile)) is not None)

    def misfit(self, profile: str) -> Misfit | None:
        """Why `profile` can't be added anywhere on this GPU, or None if it can."""
        return _misfit(self, profile)

    def fit_starts(self, profile: str) -> tuple[int, ...]:
        """The starts at which one more `profile` can be placed now (empty if none)."""
        return _fit_starts(self, profile)

    def placements(self, profile: str) -> tuple[int, ...]:
        """The starts worth comparing for one more `profile`: on an equal-size GPU every free slot is alike (one
        type, one size, the driver does not care which), so only the first; otherwise every start that fits."""
        starts = _fit_starts(self, profile)
        return starts[:1] if self.geometry.homogeneous else starts

    def check(self, profile: str, start: int) -> Misfit | None:
        """Why `profile` can't be placed at `start`, or None if it can."""
        why = self.misfit(profile)
        if why is not None:
            return why
        return None if start in self.fit_starts(profile) else Misfit.NO_SPACE

    def add(self, profile: str, start: int) -> Occupancy:
        """A new occupancy with `profile` at `start`; InvalidInput naming the reason if it doesn't fit."""
        why = self.check(profile, start)
        if why is not None:
            raise InvalidInput(
                f"profile {profile!r} does not fit at start {start} on a {self.geometry.model} "
                f"in {self.geometry.mode} mode: {why}",
                reasons=[{"profile": profile, "start": start, "reason": str(why)}],
            )
        return self.placed(profile, start)

    def placed(self, profile: str, start: int) -> Occupancy:
        """A new occupancy with `profile` at `start`, for a start `fit_starts` just gave (not checked again)."""
        return _placed(self, profile, start)

    def remove(self, start: int) -> Occupancy:
        """A new occupancy without the slot at `start`; InvalidInput if none starts there."""
        rest = tuple(s for s in self.slots if s.start != start)
        if len(rest) == len(self.slots):
            raise InvalidInput(f"no device starts at {start} on this GPU")
        return Occupancy(self.geometry, rest, self.pinned_type, self.fixed_layout)

    def capacity(self, profile: str) -> int:
        """How many more instances of `profile` alone could still be added."""
        return _capacity(self, profile)


# Occupancies are immutable values and a fleet holds few distinct ones (GPUs in the same state share one), so
# what fits, where, and the state after a placement are memoized: placement asks them of the same states
# over and over.
_MEMO = 1 << 17


@lru_cache(maxsize=_MEMO)
def _placed(occ: Occupancy, profile: str, start: int) -> Occupancy:
    shape = occ.geometry.shapes[profile]
    return Occupancy(occ.geometry, tuple(sorted((*occ.slots, Slot(start, shape.size, profile)))),
                     occ.pinned_type, occ.fixed_layout)


@lru_cache(maxsize=_MEMO)
def _misfit(occ: Occupancy, profile: str) -> Misfit | None:
    g = occ.geometry
    shape = g.shapes.get(profile)
    if shape is None:
        return Misfit.OTHER_MODE
    if g.homogeneous and occ.active_type not in (None, profile):
        return Misfit.OTHER_TYPE
    if g.max_instances is not None and len(occ.slots) >= g.max_instances:
        return Misfit.MAX_COUNT
    if occ._group_count(shape.group) >= shape.max_count:
        return Misfit.MAX_COUNT
    if g.compute_capacity is not None and occ._compute_used() + shape.compute > g.compute_capacity:
        return Misfit.COMPUTE
    if shape.media and any(g.shapes[s.profile].media for s in occ.slots if s.profile in g.shapes):
        return Misfit.MEDIA
    if not _fit_starts(occ, profile):
        if occ.fixed_layout is not None and not any(grp == shape.group for grp, _ in occ.fixed_layout):
            return Misfit.LAYOUT
        return Misfit.NO_SPACE
    return None


@lru_cache(maxsize=_MEMO)
def _fit_starts(occ: Occupancy, profile: str) -> tuple[int, ...]:
    shape = occ.geometry.shapes.get(profile)
    if shape is None:
        return ()
    mask = occ.mask
    starts = tuple(s for s in shape.starts if not mask & _mask(s, shape.size))
    if occ.fixed_layout is not None:
        starts = tuple(s for s in starts if (shape.group, s) in occ.fixed_layout)
    return starts


def _capacity(occ: Occupancy, profile: str) -> int:
    if _misfit(occ, profile) is not None:
        return 0
    g = occ.geometry
    shape = g.shapes[profile]
    limit = shape.max_count - occ._group_count(shape.group)
    if g.max_instances is not None:
        limit = min(limit, g.max_instances - len(occ.slots))
    if g.compute_capacity is not None and shape.compute:
        limit = min(limit, (g.compute_capacity - occ._compute_used()) // shape.compute)
    if shape.media:
        limit = min(limit, 1)
    # Greedy by earliest start is optimal for equal-length intervals.
    mask, count = occ.mask, 0
    for s in _fit_starts(occ, profile):
        if count >= limit:
            break
        m = _mask(s, shape.size)
        if not mask & m:
            mask |= m
            count += 1
    return count


FIT_BITS = 63  # a fit mask fits a signed 64-bit column


@lru_cache(maxsize=4096)
def profile_bit(geometry: Geometry, profile: str) -> int:
    """The bit standing for `profile` in the fit masks of GPUs of this geometry: its place among the geometry's
    profiles (modulo FIT_BITS, so a mask only ever over-approximates what fits). 0 if the geometry lacks it."""
    names = tuple(geometry.shapes)
    return 1 << (names.index(profile) % FIT_BITS) if profile in geometry.shapes else 0


@lru_cache(maxsize=65536)
def fit_mask(occ: Occupancy) -> int:
    """The OR of `profile_bit` over the profiles that could be added to this GPU now: what a store keeps beside
    a GPU's layout so that a query can skip GPUs where a profile cannot go. Bits depend on the catalog, so a
    store recomputes its masks when the catalog changes."""
    bits = 0
    for name in occ.geometry.shapes:
        if _misfit(occ, name) is None:
            bits |= profile_bit(occ.geometry, name)
    return bits


def supported_modes(catalog: Catalog, model: str) -> frozenset[Mode]:
    """The sharing modes a GPU of `model` can run in (those `build_geometry` builds), unmanaged aside."""
    spec = catalog.model(model)
    modes = {Mode.VGPU_EQUAL}
    if spec.mixed_size:
        modes.add(Mode.VGPU_MIXED)
    if spec.mig is not None:
        modes.add(Mode.MIG)
    if spec.passthrough:
        modes.add(Mode.PASSTHROUGH)
    return frozenset(modes)


def build_geometry(catalog: Catalog, model: str, mode: Mode) -> Geometry:
    """The geometry of `model` in `mode`, from the catalog."""
    spec = catalog.model(model)
    shapes: dict[str, Shape] = {}
    if mode is Mode.VGPU_EQUAL:
        for p in catalog.profiles(model):
            if p.kind is ProfileKind.VGPU and p.size and p.placements:
                shapes[p.name] = Shape(p.name, p.kind, p.size, p.placements, p.max_instances, p.name,
                                       framebuffer_mib=p.framebuffer_mib)
        return Geometry(model, mode, spec.axis_gb, shapes, homogeneous=True)
    if mode is Mode.VGPU_MIXED:
        if not spec.mixed_size:
            raise InvalidInput(f"GPU model {model} does not support mixed-size vGPU mode (field mode, "
                               f"value {mode.value!r}); use vgpu-equal")
        for p in catalog.profiles(model):
            if p.kind is ProfileKind.VGPU and p.mixed_placement_ids and p.mixed_size:
                shapes[p.name] = Shape(p.name, p.kind, p.mixed_size, p.mixed_placement_ids,
                                       len(p.mixed_placement_ids), p.name, framebuffer_mib=p.framebuffer_mib)
        return Geometry(model, mode, spec.axis_gb, shapes)
    if mode is Mode.MIG:
        if spec.mig is None:
            raise InvalidInput(f"GPU model {model} does not support MIG (field mode, value {mode.value!r})")
        for p in catalog.profiles(model):
            if p.kind in (ProfileKind.MIG, ProfileKind.MIG_VGPU) and p.size and p.placements:
                group = p.mig_profile or p.name
                shapes[p.name] = Shape(p.name, p.kind, p.size, p.placements, p.max_instances, group,
                                       compute=p.compute_slices or 0, media=group.endswith("+me"),
                                       framebuffer_mib=p.framebuffer_mib)
        return Geometry(model, mode, spec.mig.memory_slices, shapes,
                        compute_capacity=spec.mig.compute_slices, max_instances=spec.mig.max_instances)
    if mode is Mode.PASSTHROUGH:
        if not spec.passthrough:
            raise InvalidInput(f"GPU model {model} does not support passthrough (field mode)")
        shapes[model] = Shape(model, ProfileKind.PASSTHROUGH, spec.axis_gb, (0,), 1, model,
                              framebuffer_mib=spec.memory_mib)
        return Geometry(model, mode, spec.axis_gb, shapes)
    return Geometry(model, mode, spec.axis_gb, {})


@cache
def _cached_geometry(catalog_id: int, catalog: Catalog, model: str, mode: Mode) -> Geometry:
    return build_geometry(catalog, model, mode)


def geometry_for(catalog: Catalog, model: str, mode: Mode | str) -> Geometry:
    """The (cached) geometry of `model` in `mode`."""
    return _cached_geometry(id(catalog), catalog, model, Mode(mode))


def parse_mig_layout(geometry: Geometry, entries: Iterable[str]) -> tuple[Slot, ...]:
    """Parse `["3g.40gb@0", ...]` and check that the layout is one NVIDIA allows; InvalidInput if not."""
    occ = Occupancy(geometry)
    for entry in entries:
        profile, sep, start = entry.rpartition("@")
        if not sep or not start.isdigit():
            raise InvalidInput(f"MIG layout entry {entry!r} is not 'profile@start' (e.g. '3g.40gb@4')")
        shape = geometry.shapes.get(profile)
        if shape is None or shape.kind is not ProfileKind.MIG:
            known = ", ".join(sorted(s for s, sh in geometry.shapes.items() if sh.kind is ProfileKind.MIG))
            raise InvalidInput(f"MIG layout entry {entry!r}: {geometry.model} has no MIG profile {profile!r} "
                               f"(known: {known})")
        occ = occ.add(profile, int(start))
    return occ.slots
