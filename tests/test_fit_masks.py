"""Fit masks (gpu.fits): the mask never hides a profile that fits (property test over random occupancies);
the store keeps every GPU's mask equal to its occupancy's through inventory changes, claims and releases; the
candidate query skips GPUs that have the units but no valid start; masks are recomputed when the catalog
changes and by `vgpuctl init`, doctor reports a wrong one; migration 0002 adds and fills them on an old
store and drops the four redundant indexes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from conftest import DEMO, check_store_invariants, write_inventory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opsfixtures import Store, cli, clone, template_store
from sqlalchemy import event, func, inspect, select, text, update
from sqlalchemy.engine import Engine
from test_geometry import CATALOG, geom

from vgpu_ctl import Controller, NoCapacity
from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import FIT_BITS, Misfit, Occupancy, fit_mask, parse_mig_layout, profile_bit
from vgpu_ctl.core.placement import PlacementRequest, get_policy
from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.ops.doctor import diagnose
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.fit_masks import ALL_BITS, CATALOG_KEY, MASK_SCHEME, ensure_fit_masks, masks_key
from vgpu_ctl.store import migrate, tables
from vgpu_ctl.store.engine import make_engine
from vgpu_ctl.store.tables import GPU, META, POOL

# -- the mask of an occupancy -------------------------------------------------------------------------------

FIT_CASES = [("A100-80GB", "mig"), ("H100-80GB", "mig"), ("L40S", "vgpu-mixed"), ("A100-80GB", "vgpu-equal")]
FIXED_LAYOUTS = [["4g.40gb@0", "2g.20gb@4", "1g.10gb@6"], ["3g.40gb@0", "3g.40gb@4"],
                 ["2g.20gb@0", "2g.20gb@2", "3g.40gb@4"]]


@st.composite
def occupancies(draw: st.DrawFn) -> Occupancy:
    """A valid occupancy of one of FIT_CASES: profiles added at starts where they fit (some removed again),
    with an optional type pin (equal-size) or fixed layout (MIG)."""
    g = geom(*draw(st.sampled_from(FIT_CASES), label="case"))
    names = sorted(g.shapes)
    pinned = draw(st.sampled_from(names), label="pinned") if g.homogeneous and draw(st.booleans()) else None
    fixed = None
    if g.mode == "mig" and draw(st.booleans(), label="fixed"):
        layout = parse_mig_layout(g, draw(st.sampled_from(FIXED_LAYOUTS), label="layout"))
        fixed = frozenset((g.shapes[s.profile].group, s.start) for s in layout)
    occ = Occupancy(g, pinned_type=pinned, fixed_layout=fixed)
    for _ in range(draw(st.integers(0, 10), label="steps")):
        if occ.slots and draw(st.integers(0, 4), label="op") == 0:
            occ = occ.remove(draw(st.sampled_from(occ.slots), label="remove").start)
            continue
        fitting = [p for p in names if occ.misfit(p) is None]
        if not fitting:
            break
        p = draw(st.sampled_from(fitting), label="profile")
        occ = occ.add(p, draw(st.sampled_from(occ.fit_starts(p)), label="start"))
    return occ


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(occ=occupancies())
def test_mask_never_hides_a_fit(occ: Occupancy) -> None:
    mask = fit_mask(occ)
    fitting = [p for p in occ.geometry.shapes if occ.misfit(p) is None]
    for p in fitting:
        assert mask & profile_bit(occ.geometry, p), f"{p} fits but its bit is not in the mask"
    assert 0 <= mask < 1 << FIT_BITS  # fits a signed 64-bit column
    # only profiles of this geometry set bits (the over-approximation comes only from shared bits)
    offered = 0
    for p in occ.geometry.shapes:
        offered |= profile_bit(occ.geometry, p)
    assert mask & ~offered == 0
    assert (mask == 0) == (not fitting)
    # an equal occupancy built again gives the same mask (the cache is keyed by value, not identity)
    assert fit_mask(Occupancy(occ.geometry, occ.slots, occ.pinned_type, occ.fixed_layout)) == mask


def test_profile_bits_are_distinct_single_bits_per_geometry() -> None:
    for model in CATALOG.models:
        for mode in ("vgpu-equal", "vgpu-mixed", "mig", "passthrough"):
            try:
                g = geom(model, mode)
            except InvalidInput:
                continue  # a mode the model lacks
            bits = [profile_bit(g, p) for p in g.shapes]
            assert all(b.bit_count() == 1 and b < 1 << FIT_BITS for b in bits), (model, mode)
            assert len(set(bits)) == len(bits) or len(bits) > FIT_BITS, (model, mode)  # no shared bits
    assert profile_bit(geom("H100-80GB", "mig"), "A100D-10C") == 0  # not a profile of that geometry


def test_mask_of_a_pinned_and_a_full_gpu() -> None:
    g = geom("A100-80GB", "vgpu-equal")
    assert fit_mask(Occupancy(g, pinned_type="A100D-10C")) == profile_bit(g, "A100D-10C")
    full = Occupancy(g)
    for start in range(0, 80, 10):
        full = full.add("A100D-10C", start)
    assert fit_mask(full) == 0
    mig = geom("H100-80GB", "mig")
    assert fit_mask(Occupancy(mig).add("7g.80gb", 0)) == 0


# -- the store keeps the masks --------------------------------------------------------------------------------


def gpu_rows(engine: Engine) -> list[Any]:
    host = tables.HOST
    with engine.connect() as conn:
        return list(conn.execute(select(GPU, host.c.name.label("host_name")).join(host, host.c.id == GPU.c.host_id)
                                 .order_by(GPU.c.id)).all())


def expected_mask(catalog: Catalog, row: Any) -> int:
    return fit_mask(occupancy_of(catalog, row._mapping))


def assert_masks_match(ctl: Controller) -> list[Any]:
    rows = gpu_rows(ctl.engine)
    assert rows
    for r in rows:
        assert r.fits == expected_mask(ctl.catalog, r), f"{r.host_name}/{r.pci_address} {r.layout!r}"
    return rows


def gpu_id(ctl: Controller, host: str, pci: str) -> int:
    return int(next(r.id for r in gpu_rows(ctl.engine) if r.host_name == host and r.pci_address == pci))


def fits_of(ctl: Controller, gid: int) -> int:
    with ctl.engine.connect() as conn:
        return int(conn.execute(select(GPU.c.fits).where(GPU.c.id == gid)).scalar_one())


def set_fits(engine: Engine, gid: int, value: int) -> None:
    with engine.begin() as conn:
        conn.execute(update(GPU).where(GPU.c.id == gid).values(fits=value))


def req(ctl: Controller, name: str, profile: str, pool: str | None = None, **kw: Any) -> Any:
    return ctl.request_vm("acme", name, [(profile, 1)], vcpus=2, memory_mib=2048, pool=pool, provision=False, **kw)


@pytest.fixture
def acme(ctl: Controller) -> Controller:
    ctl.create_tenant("acme")
    return ctl


def test_inventory_apply_sets_masks(ctl: Controller, tmp_path: Path) -> None:
    rows = assert_masks_match(ctl)
    assert all(r.fits for r in rows)  # every demo GPU is empty: something fits on each
    pinned = gpu_id(ctl, "kvm-a100-01", "0000:81:00.0")
    # a pinned GPU takes only its type
    assert fits_of(ctl, pinned) == profile_bit(geom("A100-80GB", "vgpu-equal"), "A100D-10C")
    # change a pin and a mode: the masks follow
    text_ = DEMO.read_text().replace("pool: inference, vgpu_type: A100D-10C", "pool: inference, vgpu_type: A100D-20C")
    text_ = text_.replace('{pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal',
                          '{pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-mixed')
    text_ = text_.replace('mig_layout: ["4g.40gb@0", "2g.20gb@4", "1g.10gb@6"]',
                          'mig_layout: ["3g.40gb@0", "3g.40gb@4"]')
    changes = ctl.apply_inventory(write_inventory(tmp_path, text_))
    assert {c["name"] for c in changes} == {"kvm-a100-01/0000:81:00.0", "kvm-a100-01/0000:41:00.0",
                                            "kvm-h100-01/0000:4c:00.0"}
    assert_masks_match(ctl)
    carved = gpu_id(ctl, "kvm-h100-01", "0000:4c:00.0")
    assert fits_of(ctl, carved) & profile_bit(geom("H100-80GB", "mig"), "3g.40gb")
    assert fits_of(ctl, pinned) == profile_bit(geom("A100-80GB", "vgpu-equal"), "A100D-20C")
    mixed = gpu_id(ctl, "kvm-a100-01", "0000:41:00.0")
    assert fits_of(ctl, mixed) == fit_mask(Occupancy(geom("A100-80GB", "vgpu-mixed")))
    ctl.apply_inventory(DEMO)
    assert_masks_match(ctl)
    assert fits_of(ctl, pinned) == profile_bit(geom("A100-80GB", "vgpu-equal"), "A100D-10C")


def test_masks_follow_claims_and_releases(acme: Controller) -> None:
    ctl = acme
    asks = [("A100D-10C", "inference"), ("3g.40gb", "inference"), ("1g.10gb", "inference"),
            ("2g.20gb", "inference"), ("A100D-20C", "training"), ("A100-80GB", "training"),
            ("H100-2-20C", "training"), ("L40S-24C", "workstations"), ("L40S-12C", "workstations"),
            ("L40S-8C", "workstations"), ("3g.40gb", "inference")]
    vms = []
    for i, (profile, pool) in enumerate(asks):
        vms.append(req(ctl, f"v{i}", profile, pool))
        assert_masks_match(ctl)
    check_store_invariants(ctl.engine)
    # fill the pinned GPU: its mask empties, and the next request is refused without a candidate
    pinned = gpu_id(ctl, "kvm-a100-01", "0000:81:00.0")
    for i in range(7):
        vms.append(req(ctl, f"p{i}", "A100D-10C", "inference"))
    assert fits_of(ctl, pinned) == 0
    assert_masks_match(ctl)
    with pytest.raises(NoCapacity):
        req(ctl, "p7", "A100D-10C", "inference")
    for vm in vms[::2] + vms[1::2]:
        ctl.release_vm(vm.id)
        assert_masks_match(ctl)
    check_store_invariants(ctl.engine)
    assert fits_of(ctl, pinned) == profile_bit(geom("A100-80GB", "vgpu-equal"), "A100D-10C")


def _candidate_ids(ctl: Controller, pool: str, profile: str) -> list[int]:
    """The GPUs the candidate query gives for one `profile` in `pool`, page after page."""
    with ctl.engine.connect() as conn:
        p = conn.execute(select(POOL).where(POOL.c.name == pool)).one()
        preq = PlacementRequest((profile,), 1, 1024)
        ids = []
        for page in alloc.candidate_pages(conn, ctl.catalog, preq, p.id, get_policy(p.policy).order, {p.id: p.name}):
            ids += [g.gpu_id for h in page.hosts for g in h.gpus]
        return ids


def test_mig_gpu_with_units_but_no_valid_start_is_no_candidate(acme: Controller) -> None:
    ctl = acme
    a = gpu_id(ctl, "kvm-h100-01", "0000:19:00.0")
    b = gpu_id(ctl, "kvm-h100-01", "0000:3b:00.0")
    g = geom("H100-80GB", "mig")
    occ = Occupancy(g).add("3g.40gb", 0).add("1g.10gb", 4)  # slices 5-7 free, but 2g starts at 0, 2 or 4
    assert occ.free_units == 3 >= g.shapes["2g.20gb"].size
    assert occ.misfit("2g.20gb") == Misfit.NO_SPACE and occ.misfit("1g.10gb") is None
    with ctl.tx() as conn:
        version = conn.execute(select(GPU.c.version).where(GPU.c.id == a)).scalar_one()
        alloc.write_gpu(conn, a, version, occ)
    assert fits_of(ctl, a) == fit_mask(occ)
    assert fits_of(ctl, a) & profile_bit(g, "2g.20gb") == 0
    two = _candidate_ids(ctl, "inference", "2g.20gb")
    assert a not in two and b in two
    one = _candidate_ids(ctl, "inference", "1g.10gb")
    assert one[0] == a and b in one  # pack order: the fuller GPU first, when the profile can go there
    vm = req(ctl, "two", "2g.20gb", "inference")
    assert vm.devices[0].gpu == "kvm-h100-01/0000:3b:00.0"
    vm = req(ctl, "one", "1g.10gb", "inference")
    assert vm.devices[0].gpu == "kvm-h100-01/0000:19:00.0"


def test_equal_size_gpu_of_another_type_is_no_candidate(acme: Controller) -> None:
    ctl = acme
    first = req(ctl, "a", "A100D-20C", "training")
    locked = gpu_id(ctl, *first.devices[0].gpu.split("/"))
    with ctl.engine.connect() as conn:
        free = conn.execute(select(GPU.c.free_units).where(GPU.c.id == locked)).scalar_one()
    assert free == 60  # room for a 40C by units, not by type
    forty = _candidate_ids(ctl, "training", "A100D-40C")
    assert locked not in forty and len(forty) == 1
    assert locked in _candidate_ids(ctl, "training", "A100D-20C")
    assert req(ctl, "b", "A100D-40C", "training").devices[0].gpu != first.devices[0].gpu


# -- keeping masks in step with the catalog ------------------------------------------------------------------


def _meta(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(META.c.value).where(META.c.key == CATALOG_KEY)).scalar()


@pytest.fixture
def demo_store(store_url: str, state_dir: Path) -> Iterator[tuple[str, int, int]]:
    """The demo store (closed): its URL, the id of the L40S GPU 0000:17:00.0 and its correct mask."""
    c = Controller(store_url)
    try:
        c.apply_inventory(DEMO)
        gid = gpu_id(c, "kvm-l40s-01", "0000:17:00.0")
        good = fits_of(c, gid)
        assert _meta(c.engine) == masks_key(c.catalog)
    finally:
        c.close()
    assert good != 0
    yield store_url, gid, good


@pytest.mark.parametrize("recorded", ["another catalog", f"{MASK_SCHEME - 1}:{CATALOG.fingerprint}"],
                         ids=["catalog-changed", "bit-scheme-changed"])
def test_masks_recomputed_when_what_they_were_computed_with_differs(demo_store: tuple[str, int, int],
                                                                    recorded: str) -> None:
    """Another catalog, or the same catalog with masks from an older way of assigning bits: recomputed on open."""
    url, gid, good = demo_store
    engine = make_engine(url)
    set_fits(engine, gid, 0)
    with engine.begin() as conn:
        conn.execute(update(META).where(META.c.key == CATALOG_KEY).values(value=recorded))
    engine.dispose()
    c = Controller(url)
    try:
        assert fits_of(c, gid) == good
        assert _meta(c.engine) == masks_key(c.catalog) == f"{MASK_SCHEME}:{c.catalog.fingerprint}"
        assert_masks_match(c)
    finally:
        c.close()


def test_masks_left_alone_when_the_fingerprint_matches(demo_store: tuple[str, int, int]) -> None:
    url, gid, good = demo_store
    engine = make_engine(url)
    set_fits(engine, gid, 0)
    engine.dispose()
    c = Controller(url)
    try:
        assert fits_of(c, gid) == 0  # opening the store only compares the fingerprint
        c.create_tenant("acme")
        vm = req(c, "w", "L40S-48C", "workstations")  # so the corrupted GPU is skipped
        assert vm.devices[0].gpu == "kvm-l40s-01/0000:ca:00.0"
        c.release_vm(vm.id)
        assert ensure_fit_masks(c.engine, c.catalog) == 0
        assert fits_of(c, gid) == 0
        assert c.init(refresh_fit_masks=True) == migrate.head_revision()
        assert fits_of(c, gid) == good
        assert ensure_fit_masks(c.engine, c.catalog, force=True) == 0  # nothing left to change
        set_fits(c.engine, gid, ALL_BITS)
        assert ensure_fit_masks(c.engine, c.catalog, force=True) == 1
        assert_masks_match(c)
    finally:
        c.close()


def test_catalog_without_a_model_keeps_its_gpus_candidates(demo_store: tuple[str, int, int]) -> None:
    url, gid, _ = demo_store
    smaller = Catalog([m for name, m in CATALOG.models.items() if name != "L40S"])
    assert smaller.fingerprint != CATALOG.fingerprint
    engine = make_engine(url)
    try:
        before = {r.id: r.fits for r in gpu_rows(engine)}
        assert ensure_fit_masks(engine, smaller) == 2  # the two L40S GPUs
        after = {r.id: r.fits for r in gpu_rows(engine)}
        assert after[gid] == ALL_BITS
        assert {k: v for k, v in after.items() if v != ALL_BITS} == {k: v for k, v in before.items()
                                                                      if after[k] != ALL_BITS}
        assert _meta(engine) == masks_key(smaller)
        assert ensure_fit_masks(engine, CATALOG) == 2  # and back
        assert {r.id: r.fits for r in gpu_rows(engine)} == before
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_two_controllers_update_the_fingerprint_at_once(pg_url: str, state_dir: Path) -> None:
    c = Controller(pg_url)
    try:
        c.apply_inventory(DEMO)
        catalog = c.catalog
    finally:
        c.close()
    engines = [make_engine(pg_url) for _ in range(3)]
    with engines[0].begin() as conn:  # a catalog change that leaves every mask as it is (a model not in the fleet)
        conn.execute(update(META).where(META.c.key == CATALOG_KEY).values(value="the previous catalog"))
    first_wrote, second_writing = threading.Event(), threading.Event()

    @event.listens_for(engines[1], "after_cursor_execute")
    def _wrote(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO meta"):  # the first commits after the second reached its write
            first_wrote.set()
            second_writing.wait(10)
            time.sleep(0.3)

    @event.listens_for(engines[2], "before_cursor_execute")
    def _writing(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO meta"):
            second_writing.set()

    results: dict[int, Any] = {}

    def open_store(i: int) -> None:
        try:
            results[i] = ensure_fit_masks(engines[i], catalog)
        except Exception as exc:
            results[i] = exc

    try:
        threads = [threading.Thread(target=open_store, args=(i,)) for i in (1, 2)]
        threads[0].start()
        assert first_wrote.wait(10)
        threads[1].start()
        for t in threads:
            t.join(30)
        assert results == {1: 0, 2: 0}
        assert _meta(engines[0]) == masks_key(catalog)
    finally:
        for e in engines:
            e.dispose()


# -- CLI and doctor (SQLite store of the operations tests) ---------------------------------------------------


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


def _store_fits(store: Store, pci: str) -> int:
    return int(store.sql("SELECT fits FROM gpu WHERE pci_address = :pci", pci=pci)[0][0])


def test_cli_init_recomputes_masks(store: Store) -> None:
    pci = "0000:17:00.0"  # holds globex's L40S-12C
    good = _store_fits(store, pci)
    store.sql("UPDATE gpu SET fits = 0 WHERE pci_address = :pci", pci=pci)
    ctl = store.ctl()  # opening with the same catalog does not look at the masks
    ctl.close()
    assert _store_fits(store, pci) == 0
    res = cli(store, "init")
    assert res.exit_code == 0, res.output
    assert _store_fits(store, pci) == good != 0


@pytest.mark.parametrize("corrupt", ["fits = 0", "fits = fits | :extra"], ids=["cleared", "extra-bit"])
def test_doctor_reports_a_wrong_mask(store: Store, corrupt: str) -> None:
    assert cli(store, "doctor").exit_code == 0
    pci = "0000:17:00.0"
    good = _store_fits(store, pci)
    extra = next(1 << k for k in range(FIT_BITS) if not good & (1 << k))
    store.sql(f"UPDATE gpu SET {corrupt} WHERE pci_address = :pci", pci=pci, extra=extra)
    assert _store_fits(store, pci) != good
    ctl = store.ctl()
    try:
        results = {r.name: r for r in diagnose(ctl)}
    finally:
        ctl.close()
    assert [r for name, r in results.items() if name != "gpu-occupancy" and r.problems] == []
    [p] = results["gpu-occupancy"].problems
    assert p.object == f"gpu kvm-l40s-01/{pci}" and "fit mask" in p.message and "vgpuctl init" in p.fix
    assert f"{good:#x}" in p.message
    assert cli(store, "doctor").exit_code == 1
    assert cli(store, "init").exit_code == 0
    res = cli(store, "doctor")
    assert res.exit_code == 0, res.output


# -- migration 0002 -------------------------------------------------------------------------------------------

REDUNDANT = {("vm", "ix_vm_tenant_id"), ("device", "ix_device_gpu_id"), ("gpu", "ix_gpu_host_id"),
             ("scoped_quota", "ix_scoped_quota_tenant_id")}


def _indexes(engine: Engine) -> set[tuple[str, str | None]]:
    insp = inspect(engine)
    return {(t, ix["name"]) for t in ("vm", "device", "gpu", "scoped_quota", "tenant") for ix in insp.get_indexes(t)}


def _revision(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one())


OLD_GPUS = [  # pci, model, mode, pinned_type, mig_layout, axis
    ("0000:01:00.0", "H100-80GB", "mig", None, "", 8),
    ("0000:02:00.0", "A100-80GB", "vgpu-equal", "A100D-20C", "", 80),
    ("0000:03:00.0", "L40S", "vgpu-mixed", None, "", 48),
    ("0000:04:00.0", "H100-80GB", "mig", None, "4g.40gb@0+4;2g.20gb@4+2;1g.10gb@6+1", 8),
]


def test_migration_0002_on_a_store_at_0001(store_url: str, state_dir: Path) -> None:
    engine = make_engine(store_url)
    try:
        command.upgrade(migrate.alembic_config(engine), "0001")
        assert _revision(engine) == "0001"
        assert _indexes(engine) >= REDUNDANT
        assert "fits" not in {c["name"] for c in inspect(engine).get_columns("gpu")}
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO pool (name, policy, description) VALUES ('old', 'pack', '')"))
            conn.execute(text("INSERT INTO host (name, uri, driver, vgpu_backing, labels, vcpus, memory_mib, "
                              "cpu_overcommit, memory_overcommit, used_vcpus, used_memory_mib, state) VALUES "
                              "('kvm-old', 'simulated:///kvm-old', 'simulated', 'mdev', '{}', 64, 262144, 1, 1, "
                              "0, 0, 'active')"))
            for pci, model, mode, pinned, mig_layout, axis in OLD_GPUS:
                conn.execute(text(
                    "INSERT INTO gpu (host_id, pci_address, model, mode, pool_id, pinned_type, mig_layout, "
                    "axis_units, free_units, active_type, layout, device_count, version) VALUES "
                    "((SELECT id FROM host), :pci, :model, :mode, (SELECT id FROM pool), :pinned, :mig, :axis, "
                    ":axis, :pinned, '', 0, 0)"),
                    {"pci": pci, "model": model, "mode": mode, "pinned": pinned, "mig": mig_layout, "axis": axis})
    finally:
        engine.dispose()

    c = Controller(store_url)
    try:
        assert _revision(c.engine) == migrate.head_revision()
        indexes = _indexes(c.engine)
        assert not REDUNDANT & indexes, REDUNDANT & indexes
        assert ("gpu", "gpu_candidates") in indexes and ("vm", "ix_vm_host_id") in indexes
        uniques = {u["name"] for t in ("vm", "device", "gpu", "scoped_quota")
                   for u in inspect(c.engine).get_unique_constraints(t)}
        assert {"vm_tenant_name_unique", "device_position_unique", "gpu_host_pci_unique",
                "scoped_quota_unique"} <= uniques  # what makes the dropped indexes redundant is still there
        rows = assert_masks_match(c)
        assert len(rows) == len(OLD_GPUS) and all(r.fits for r in rows)
        by_pci = {r.pci_address: r.fits for r in rows}
        assert by_pci["0000:02:00.0"] == profile_bit(geom("A100-80GB", "vgpu-equal"), "A100D-20C")
        fixed = next(r for r in rows if r.pci_address == "0000:04:00.0")
        occ = occupancy_of(c.catalog, fixed._mapping)
        outside = [p for p in occ.geometry.shapes if occ.misfit(p) == Misfit.LAYOUT]
        assert "7g.80gb" in outside
        assert all(fixed.fits & profile_bit(occ.geometry, p) == 0 for p in outside)  # not in its fixed layout
        assert _meta(c.engine) == masks_key(c.catalog)
        # and the old fleet takes VMs
        c.create_tenant("acme")
        assert req(c, "m", "3g.40gb").devices[0].gpu == "kvm-old/0000:01:00.0"
        assert req(c, "e", "A100D-20C").devices[0].gpu == "kvm-old/0000:02:00.0"
        assert req(c, "x", "L40S-24C").devices[0].gpu == "kvm-old/0000:03:00.0"
        assert req(c, "f", "H100-2-20C").devices[0].gpu == "kvm-old/0000:04:00.0"
        assert_masks_match(c)
        check_store_invariants(c.engine)
        with c.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(GPU).where(GPU.c.fits == 0)).scalar() == 0
    finally:
        c.close()


def test_migration_0002_downgrades_with_vms_and_upgrades_again(store_url: str, state_dir: Path,
                                                               request: pytest.FixtureRequest) -> None:
    c = Controller(store_url)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        req(c, "a", "3g.40gb", "inference")
        req(c, "b", "L40S-12C", "workstations")
        command.downgrade(migrate.alembic_config(c.engine), "0001")
        assert _revision(c.engine) == "0001"
        assert _indexes(c.engine) >= REDUNDANT
        assert "fits" not in {col["name"] for col in inspect(c.engine).get_columns("gpu")}
    finally:
        c.close()
    c = Controller(store_url)
    try:
        assert _revision(c.engine) == migrate.head_revision()
        assert_masks_match(c)
        check_store_invariants(c.engine)
        req(c, "c", "3g.40gb", "inference")
        assert_masks_match(c)
    finally:
        c.close()


def test_candidate_order_is_declared_by_the_policy(acme: Controller, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The store pages candidates in the order the pool's policy declares, for a plugged-in policy too (the
    inventory accepts any policy in POLICIES; before, an unknown name silently got pack's order)."""
    from vgpu_ctl.core import placement
    ctl = acme
    used = req(ctl, "one", "1g.10gb", "inference").devices[0].gpu_id
    gpus = {gpu_id(ctl, "kvm-h100-01", pci) for pci in ("0000:19:00.0", "0000:3b:00.0")}
    assert used in gpus
    assert _candidate_ids(ctl, "inference", "1g.10gb")[0] == used  # pack: fullest first

    emptiest = placement.Policy("emptiest", placement.get_policy("first-fit").score,
                                placement.CandidateOrder.EMPTIEST_FIRST)
    monkeypatch.setitem(placement.POLICIES, "emptiest",
                        placement.PolicyDef("emptiest", "test", lambda _demand=None, _supply=None: emptiest))
    edited = write_inventory(tmp_path, DEMO.read_text().replace(
        "  - name: inference\n    policy: pack\n", "  - name: inference\n    policy: emptiest\n"), "e.yaml")
    ctl.apply_inventory(edited)
    assert _candidate_ids(ctl, "inference", "1g.10gb")[0] == (gpus - {used}).pop()
