"""The geometry engine against NVIDIA's published placements and impossible combinations (nvidia.md §1.5,
§3.4), plus property tests over random add/remove sequences."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpu_ctl import InvalidInput, load_catalog
from vgpu_ctl.core.geometry import Geometry, Misfit, Mode, Occupancy, geometry_for, parse_mig_layout

CATALOG = load_catalog()


def geom(model: str, mode: str) -> Geometry:
    return geometry_for(CATALOG, model, mode)


def build(g: Geometry, *placements: tuple[str, int], pinned: str | None = None) -> Occupancy:
    occ = Occupancy(g, pinned_type=pinned)
    for profile, start in placements:
        occ = occ.add(profile, start)
    return occ


# -- MIG: valid layouts ----------------------------------------------------------------------------------

A100_MIG = ("A100-80GB", "mig")
H100_MIG = ("H100-80GB", "mig")


@pytest.mark.parametrize("model", ["A100-80GB", "H100-80GB"])
@pytest.mark.parametrize("layout", [
    pytest.param([("3g.40gb", 0), ("3g.40gb", 4)], id="3g+3g"),
    pytest.param([("3g.40gb", 4), ("2g.20gb", 2), ("1g.10gb", 0), ("1g.10gb", 1)], id="3-2-1-1"),
    pytest.param([("2g.20gb", 4), ("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3),
                  ("1g.10gb", 6)], id="2-1-1-1-1-1"),
    pytest.param([("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)], id="4g+2g+1g"),
    pytest.param([("4g.40gb", 0), ("3g.40gb", 4)], id="4g+3g"),
    pytest.param([("7g.80gb", 0)], id="7g"),
    pytest.param([("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4)], id="all-balanced"),
    pytest.param([("1g.20gb", 6), ("3g.40gb", 0), ("2g.20gb", 4)], id="1g-reaches-slot-7"),
])
def test_valid_mig_layouts(model: str, layout: list[tuple[str, int]]) -> None:
    g = geom(model, "mig")
    occ = build(g, *layout)
    assert occ.mask.bit_count() == sum(g.shapes[p].size for p, _ in layout)
    assert sum(g.shapes[p].compute for p, _ in layout) <= 7
    # the same layout through the inventory parser
    assert parse_mig_layout(g, [f"{p}@{s}" for p, s in layout]) == occ.slots


def test_3g_takes_four_memory_slices_and_three_compute() -> None:
    shape = geom(*A100_MIG).shapes["3g.40gb"]
    assert (shape.size, shape.compute, shape.starts) == (4, 3, (0, 4))


def test_a30_layouts() -> None:
    g = geom("A30", "mig")
    assert g.axis == 4 and g.compute_capacity == 4 and g.max_instances == 4
    build(g, ("2g.12gb", 0), ("2g.12gb", 2))
    build(g, ("2g.12gb", 2), ("1g.6gb", 0), ("1g.6gb", 1))
    build(g, ("4g.24gb", 0))
    occ = build(g, ("1g.6gb", 0), ("1g.6gb", 1), ("1g.6gb", 2), ("1g.6gb", 3))
    assert occ.misfit("1g.6gb") == Misfit.MAX_COUNT
    assert build(g, ("2g.12gb", 0)).check("2g.12gb", 1) == Misfit.NO_SPACE


# -- MIG: impossible layouts -----------------------------------------------------------------------------


def test_3g_3g_1g_impossible() -> None:
    occ = build(geom(*A100_MIG), ("3g.40gb", 0), ("3g.40gb", 4))
    assert occ.misfit("1g.10gb") == Misfit.NO_SPACE
    assert occ.capacity("1g.10gb") == 0 and occ.fit_starts("1g.10gb") == ()
    for start in range(7):
        with pytest.raises(InvalidInput, match="does not fit"):
            occ.add("1g.10gb", start)


def test_4g_at_start_4_impossible() -> None:
    occ = Occupancy(geom(*A100_MIG))
    assert occ.check("4g.40gb", 4) == Misfit.NO_SPACE
    with pytest.raises(InvalidInput, match="start 4"):
        occ.add("4g.40gb", 4)
    with pytest.raises(InvalidInput):
        parse_mig_layout(geom(*A100_MIG), ["4g.40gb@4"])


def test_4g_3g_plus_anything_and_7g_plus_anything_impossible() -> None:
    g = geom(*A100_MIG)
    for occ in (build(g, ("4g.40gb", 0), ("3g.40gb", 4)), build(g, ("7g.80gb", 0))):
        for p in g.shapes:
            assert occ.misfit(p) is not None, p
            assert occ.capacity(p) == 0


def test_four_1g20gb_strand_compute() -> None:
    g = geom(*A100_MIG)
    occ = build(g, ("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6))
    assert occ.free_units == 0
    assert occ.misfit("1g.10gb") in (Misfit.NO_SPACE, Misfit.MAX_COUNT)


@pytest.mark.parametrize("first,second", [
    ("1g.10gb+me", "1g.10gb+me"),
    ("1g.10gb+me", "A100D-1-10CME"),
    ("A100D-1-10CME", "1g.10gb+me"),
])
def test_second_media_extension_impossible(first: str, second: str) -> None:
    occ = build(geom(*A100_MIG), (first, 0))
    assert occ.misfit(second) in (Misfit.MEDIA, Misfit.MAX_COUNT)
    assert occ.capacity(second) == 0
    with pytest.raises(InvalidInput):
        occ.add(second, 1)
    occ.add("1g.10gb", 1)  # a plain 1g is still fine


def test_a30_second_media_extension_across_sizes() -> None:
    occ = build(geom("A30", "mig"), ("1g.6gb+me", 0))
    assert occ.misfit("2g.12gb+me") == Misfit.MEDIA


def test_mig_instance_limit_and_compute() -> None:
    g = geom(*A100_MIG)
    occ = build(g, *[("1g.10gb", s) for s in range(7)])
    assert len(occ.slots) == 7
    assert occ.misfit("1g.10gb") == Misfit.MAX_COUNT
    assert occ.misfit("1g.10gb+me") == Misfit.MAX_COUNT  # at most 7 GPU instances, whatever the profile
    # 4g + 3 x 1g uses all 7 compute slices; memory slice 7 stays free but nothing can start there
    occ = build(g, ("4g.40gb", 0), ("1g.10gb", 4), ("1g.10gb", 5), ("1g.10gb", 6))
    assert occ.free_units == 1
    assert all(occ.capacity(p) == 0 for p in g.shapes)


def test_mig_backed_vgpu_shares_group_with_gi_profile() -> None:
    g = geom(*A100_MIG)
    occ = build(g, ("3g.40gb", 0))
    assert occ.fit_starts("A100D-3-40C") == (4,)
    occ = occ.add("A100D-3-40C", 4)
    assert occ.misfit("3g.40gb") is not None and occ.misfit("A100D-3-40C") is not None


def test_fixed_layout_limits_starts() -> None:
    g = geom(*H100_MIG)
    fixed = frozenset((g.shapes[s.profile].group, s.start)
                      for s in parse_mig_layout(g, ["4g.40gb@0", "2g.20gb@4", "1g.10gb@6"]))
    occ = Occupancy(g, fixed_layout=fixed)
    assert occ.fit_starts("1g.10gb") == (6,)
    assert occ.fit_starts("2g.20gb") == (4,)
    assert occ.misfit("3g.40gb") == Misfit.LAYOUT
    assert occ.check("1g.10gb", 0) == Misfit.NO_SPACE
    occ = occ.add("H100-1-10C", 6)
    assert occ.misfit("1g.10gb") is not None


def _maximal_full_compute_layouts(g: Geometry) -> set[tuple[tuple[str, int], ...]]:
    """Multisets of GI profiles (no +me) whose placements don't overlap, use all 7 compute slices, and to
    which no further GI fits."""
    profiles = [p for p, sh in g.shapes.items() if sh.kind.value == "mig" and not sh.media]
    found: set[tuple[tuple[str, int], ...]] = set()
    seen: set[tuple[tuple[int, int, str], ...]] = set()

    def walk(occ: Occupancy) -> None:
        key = tuple((s.start, s.size, s.profile) for s in occ.slots)
        if key in seen:
            return
        seen.add(key)
        extended = False
        for p in profiles:
            for s in occ.fit_starts(p):
                if occ.check(p, s) is None:
                    extended = True
                    walk(occ.add(p, s))
        compute = sum(g.shapes[s.profile].compute for s in occ.slots)
        if not extended and compute == 7:
            found.add(tuple(sorted(Counter(s.profile for s in occ.slots).items())))

    walk(Occupancy(g))
    return found


def test_seventeen_maximal_layouts() -> None:
    layouts = _maximal_full_compute_layouts(geom("A100-40GB", "mig"))
    assert len(layouts) == 17, sorted(layouts)
    assert (("3g.20gb", 1), ("4g.20gb", 1)) in layouts
    assert (("7g.40gb", 1),) in layouts
    assert (("1g.5gb", 7),) in layouts
    assert (("1g.10gb", 1), ("1g.5gb", 6)) in layouts


# -- time-sliced vGPU ------------------------------------------------------------------------------------


def test_equal_size_gpu_holds_one_type() -> None:
    g = geom("A100-80GB", "vgpu-equal")
    occ = build(g, ("A100D-10C", 0))
    assert occ.active_type == "A100D-10C"
    assert occ.misfit("A100D-20C") == Misfit.OTHER_TYPE
    with pytest.raises(InvalidInput, match="other-type"):
        occ.add("A100D-20C", 20)
    assert occ.capacity("A100D-10C") == 7
    empty = occ.remove(0)
    assert empty.active_type is None and empty.misfit("A100D-20C") is None


def test_pinned_type_mismatch() -> None:
    g = geom("A100-80GB", "vgpu-equal")
    occ = Occupancy(g, pinned_type="A100D-10C")
    assert occ.active_type == "A100D-10C"
    assert occ.misfit("A100D-20C") == Misfit.OTHER_TYPE
    assert occ.capacity("A100D-20C") == 0
    assert occ.capacity("A100D-10C") == 8


def test_equal_size_starts_are_multiples_of_size() -> None:
    g = geom("A100-80GB", "vgpu-equal")
    assert g.shapes["A100D-16C"].starts == (0, 16, 32, 48, 64)
    assert Occupancy(g).capacity("A100D-16C") == 5
    assert Occupancy(g).check("A100D-10C", 5) == Misfit.NO_SPACE


def test_mixed_size_published_placements() -> None:
    g = geom("A100-80GB", "vgpu-mixed")
    assert g.shapes["A100D-16C"].starts == (0, 24, 40, 64)
    assert g.shapes["A100D-8C"].starts == (0, 12, 20, 32, 40, 52, 60, 72)
    occ = Occupancy(g)
    assert occ.check("A100D-16C", 16) == Misfit.NO_SPACE
    with pytest.raises(InvalidInput):
        occ.add("A100D-16C", 16)
    occ = build(g, ("A100D-40C", 0), ("A100D-20C", 40), ("A100D-10C", 60), ("A100D-4C", 76))
    assert occ.free_units == 80 - 40 - 20 - 10 - 4
    assert occ.fit_starts("A100D-10C") == ()  # 70 would overlap the 4C at 76
    assert occ.fit_starts("A100D-4C") == (70,)
    assert occ.capacity("A100D-20C") == 0


def test_mixed_not_offered_on_t4() -> None:
    with pytest.raises(InvalidInput, match="mixed-size"):
        geom("T4", "vgpu-mixed")
    with pytest.raises(InvalidInput, match="MIG"):
        geom("T4", "mig")


def test_passthrough_twice() -> None:
    g = geom("A100-80GB", "passthrough")
    occ = build(g, ("A100-80GB", 0))
    assert occ.free_units == 0
    assert occ.misfit("A100-80GB") is not None
    with pytest.raises(InvalidInput):
        occ.add("A100-80GB", 0)


def test_profile_of_other_mode() -> None:
    assert Occupancy(geom("A100-80GB", "vgpu-equal")).misfit("3g.40gb") == Misfit.OTHER_MODE
    assert Occupancy(geom(*A100_MIG)).misfit("A100D-10C") == Misfit.OTHER_MODE


def test_remove_unknown_start() -> None:
    with pytest.raises(InvalidInput):
        Occupancy(geom(*A100_MIG)).remove(3)


# -- properties ------------------------------------------------------------------------------------------

CASES = [
    ("A100-80GB", "mig"), ("A100-80GB", "vgpu-equal"), ("A100-80GB", "vgpu-mixed"),
    ("A100-80GB", "passthrough"), ("A30", "mig"), ("H100-NVL", "vgpu-mixed"), ("L40S", "vgpu-mixed"),
    ("T4", "vgpu-equal"), ("H100-80GB", "mig"),
]


def check_invariants(occ: Occupancy) -> None:
    g = occ.geometry
    shapes = g.shapes
    assert occ.mask.bit_count() == sum(s.size for s in occ.slots), "slots overlap"
    for a, b in pairwise(occ.slots):
        assert a.start + a.size <= b.start
    for s in occ.slots:
        assert s.start in shapes[s.profile].starts
        assert s.start + s.size <= g.axis
    groups = Counter(shapes[s.profile].group for s in occ.slots)
    for s in occ.slots:
        assert groups[shapes[s.profile].group] <= shapes[s.profile].max_count
    if g.max_instances is not None:
        assert len(occ.slots) <= g.max_instances
    if g.compute_capacity is not None:
        assert sum(shapes[s.profile].compute for s in occ.slots) <= g.compute_capacity
    assert sum(1 for s in occ.slots if shapes[s.profile].media) <= 1
    if g.homogeneous:
        types = {s.profile for s in occ.slots} | ({occ.pinned_type} if occ.pinned_type else set())
        assert len(types) <= 1
    assert occ.free_units == g.axis - sum(s.size for s in occ.slots)


def greedy_count(occ: Occupancy, profile: str) -> int:
    n = 0
    while occ.misfit(profile) is None:
        occ = occ.add(profile, occ.fit_starts(profile)[0])
        n += 1
    return n


def check_capacity(occ: Occupancy) -> None:
    for p in occ.geometry.shapes:
        cap = occ.capacity(p)
        assert (cap > 0) == (bool(occ.fit_starts(p)) and occ.misfit(p) is None), p
        assert cap == greedy_count(occ, p), p


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), data=st.data())
def test_random_add_remove_sequences(case: tuple[str, str], data: st.DataObject) -> None:
    g = geom(*case)
    names = sorted(g.shapes)
    pinned = None
    if g.homogeneous and data.draw(st.booleans(), label="pin"):
        pinned = data.draw(st.sampled_from(names), label="pinned")
    occ = Occupancy(g, pinned_type=pinned)
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        if occ.slots and data.draw(st.integers(0, 3), label="op") == 0:
            slot = data.draw(st.sampled_from(occ.slots), label="remove")
            after = occ.remove(slot.start)
            assert slot not in after.slots and len(after.slots) == len(occ.slots) - 1
            assert after.add(slot.profile, slot.start).slots == occ.slots  # adding back restores
            occ = after
        else:
            profile = data.draw(st.sampled_from(names), label="profile")
            start = data.draw(st.sampled_from(g.shapes[profile].starts), label="start")
            why = occ.check(profile, start)
            if why is None:
                after = occ.add(profile, start)
                assert after.remove(start).slots == occ.slots  # removing restores the previous occupancy
                assert after.remove(start) == occ
                occ = after
            else:
                assert isinstance(why, Misfit)
                with pytest.raises(InvalidInput):
                    occ.add(profile, start)
        check_invariants(occ)
    check_capacity(occ)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_capacity_of_empty_gpu(case: tuple[str, str]) -> None:
    g = geom(*case)
    occ = Occupancy(g)
    check_capacity(occ)
    for p, shape in g.shapes.items():
        assert occ.capacity(p) <= shape.max_count
    assert Mode(g.mode) is g.mode
