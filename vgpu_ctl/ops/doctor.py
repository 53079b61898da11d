"""The doctor: checks the store's invariants and says what is wrong and how to fix it. Reads only."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from vgpu_ctl.core.geometry import Slot, decode_layout, encode_layout, fit_mask, geometry_for
from vgpu_ctl.core.vm_state import HOLDS_HOST, IN_FLIGHT, VmState
from vgpu_ctl.errors import VgpuCtlError
from vgpu_ctl.ops import require_admin
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.fit_masks import summary_drift
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.quotas import allocated
from vgpu_ctl.service.requests import BASE_RESOURCES
from vgpu_ctl.store.reports import ReportDevice, ReportGpu

if TYPE_CHECKING:
    from vgpu_ctl.catalog import Catalog
    from vgpu_ctl.service.controller import Controller

RECONCILE = "run `vgpuctl reconcile --fix`"
REPAIR_USAGE = "run `vgpuctl db repair-usage` to see the changes, then `vgpuctl db repair-usage --apply`"


@dataclass
class Problem:
    """One broken invariant: what is wrong and how to fix it."""

    object: str
    message: str
    fix: str


@dataclass
class CheckResult:
    """The outcome of one check."""

    name: str
    description: str
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the check found nothing wrong."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"name": self.name, "description": self.description, "ok": self.ok,
                "problems": [asdict(p) for p in self.problems]}


Check = Callable[[Tx, "Catalog", datetime], Iterator[Problem]]


def _tenant_usage(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for tenant_id, _name in STORE.quotas.tenant_refs(conn):
        t = STORE.quotas.tenant_quota(conn, tenant_id)
        actual = allocated(conn, tenant_id)
        for r in BASE_RESOURCES:
            stored = t.used[r]
            if stored != actual[r]:
                yield Problem(f"tenant {t.name}", f"{r} used is {stored} but its VMs hold {actual[r]}",
                              f"{REPAIR_USAGE} (recomputes usage from allocations)")


def _scoped_usage(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for r in STORE.reports.scoped_usages(conn):
        actual = allocated(conn, r.tenant_id, r.scope).get(r.resource, 0)
        if r.used != actual:
            scope = "all pools" if r.scope == "*" else f"pool {r.scope}"
            yield Problem(f"tenant {r.tenant}",
                          f"{r.resource} ({scope}) used is {r.used} but allocations hold {actual}",
                          f"{REPAIR_USAGE} (recomputes usage from allocations)")


def _failed_vms(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for vm_id, name, n in STORE.reports.vms_holding_devices(conn, VmState.FAILED.value):
        yield Problem(f"vm {name} ({vm_id})", f"VM is failed but still holds {n} device(s)",
                      f"{RECONCILE}, or `vgpuctl vm delete {vm_id}`")


def _slots(devs: list[ReportDevice]) -> list[Slot]:
    return sorted(Slot(d.start, d.size, d.profile) for d in devs)


def _overlaps(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for gid, devs in _devices_by_gpu(conn).items():
        slots = _slots(devs)
        for a, b in itertools.pairwise(slots):
            if b.start < a.start + a.size:
                yield Problem(f"gpu {gid}", f"devices overlap: {a.encode()} and {b.encode()}",
                              f"delete one of the VMs holding them, then {RECONCILE}")


def _devices_by_gpu(conn: Tx) -> dict[int, list[ReportDevice]]:
    out: dict[int, list[ReportDevice]] = {}
    for d in STORE.reports.all_devices(conn):
        out.setdefault(d.gpu_id, []).append(d)
    return out


def _gpu_label(conn: Tx, g: ReportGpu, hosts: dict[int, str]) -> str:
    """`gpu HOST/PCI` of a GPU row (`hosts`: host names by id, filled on first use)."""
    if not hosts:
        hosts.update(STORE.quotas.host_refs(conn))
    return f"gpu {hosts.get(g.host_id)}/{g.pci_address}"


def _layout_check(catalog: Catalog, g: ReportGpu) -> tuple[int | None, str | None]:
    """(the fit mask its layout gives, None) for a GPU row whose layout is valid on its model and mode; else
    (None, why not)."""
    try:
        occ = occupancy_of(catalog, {**g._asdict(), "layout": ""})
        for s in decode_layout(g.layout):
            occ = occ.add(s.profile, s.start)
    except (VgpuCtlError, ValueError) as exc:
        return None, str(exc)
    return fit_mask(occ), None


def _gpu_mirror(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    by_gpu = _devices_by_gpu(conn)
    hosts: dict[int, str] = {}
    # A fleet holds few distinct GPU states: what a state's layout gives is worked out once per state.
    checked: dict[tuple[Any, ...], tuple[int | None, str | None]] = {}
    empty: dict[tuple[str, str], dict[str, Any]] = {}
    for g in STORE.reports.all_gpus(conn):
        devs = by_gpu.get(g.id)
        if devs:
            slots = _slots(devs)
            geom = geometry_for(catalog, g.model, g.mode)
            covered = 0
            for s in slots:
                covered |= ((1 << s.size) - 1) << s.start
            want = {"layout": encode_layout(slots), "device_count": len(slots), "axis_units": geom.axis,
                    "free_units": geom.axis - covered.bit_count(),
                    "active_type": slots[0].profile if geom.homogeneous and slots else None}
        else:
            want = empty.get((g.model, g.mode))  # type: ignore[assignment]
            if want is None:
                axis = geometry_for(catalog, g.model, g.mode).axis
                want = empty[(g.model, g.mode)] = {"layout": "", "device_count": 0, "axis_units": axis,
                                                   "free_units": axis, "active_type": None}
        for col, value in want.items():
            if getattr(g, col) != value:
                yield Problem(_gpu_label(conn, g, hosts), f"{col} is {getattr(g, col)!r} but its devices give "
                              f"{value!r}", f"{RECONCILE} (rewrites the GPU's occupancy from its devices)")
        key = (g.model, g.mode, g.mig_layout, g.layout, g.pinned_type)
        found = checked.get(key)
        if found is None:
            found = checked[key] = _layout_check(catalog, g)
        mask, error = found
        if error is not None or mask is None:
            yield Problem(_gpu_label(conn, g, hosts), f"layout {g.layout!r} is not valid on a {g.model} in "
                          f"{g.mode} mode: {error}",
                          f"delete the VMs on this GPU that break the layout, then {RECONCILE}")
            continue
        if g.fits != mask:
            yield Problem(_gpu_label(conn, g, hosts), f"fit mask is {g.fits:#x} but its layout gives {mask:#x} "
                          "(placement may skip this GPU)", "run `vgpuctl init` (recomputes every fit mask)")


def _one_type(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    by_gpu = _devices_by_gpu(conn)
    hosts: dict[int, str] = {}
    for g in STORE.reports.all_gpus(conn, "vgpu-equal"):
        if g.id not in by_gpu:
            continue
        types = sorted({d.profile for d in by_gpu[g.id]})
        if len(types) > 1:
            yield Problem(_gpu_label(conn, g, hosts), f"equal-size GPU holds several types: {', '.join(types)}",
                          "delete the VMs of all but one type on this GPU")
        elif types and g.pinned_type and types[0] != g.pinned_type:
            yield Problem(_gpu_label(conn, g, hosts), f"GPU is pinned to {g.pinned_type} but holds {types[0]}",
                          "delete those VMs, or change the GPU's vgpu_type in the inventory")


def _host_usage(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    taken = STORE.reports.host_vm_usage(conn, HOLDS_HOST)
    for h in STORE.hosts.host_rows(conn):
        vcpus, mem = taken.get(h.id, (0, 0))
        for col, value in (("used_vcpus", vcpus), ("used_memory_mib", mem)):
            if getattr(h, col) != value:
                yield Problem(f"host {h.name}", f"{col} is {getattr(h, col)} but its VMs take {value}",
                              f"{REPAIR_USAGE} (recomputes host usage from its VMs)")


def _orphans(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for dev_id, vm_id, gpu_id in STORE.reports.orphan_devices(conn):
        yield Problem(f"device {dev_id}", f"device on gpu {gpu_id} belongs to VM {vm_id}, which is gone",
                      f"{RECONCILE} (removes devices without a VM)")
    for r in STORE.reports.misplaced_devices(conn):
        yield Problem(f"device {r.id}", f"device of VM {r.vm_name} is on a GPU of another host than the VM",
                      f"delete VM {r.vm_name}, then {RECONCILE}")


def _stuck(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    for r in STORE.reports.vms_since(conn, IN_FLIGHT, cutoff):
        yield Problem(f"vm {r.name} ({r.id})", f"VM has been {r.state} since {r.updated_at.isoformat()}",
                      f"{RECONCILE} (finishes or rolls back interrupted requests)")


def _host_summaries(conn: Tx, catalog: Catalog, cutoff: datetime) -> Iterator[Problem]:
    hosts = dict(STORE.quotas.host_refs(conn))
    for (host_id, pool_id, model, mode, bit), have, want in summary_drift(conn):
        yield Problem(f"host {hosts.get(host_id, host_id)}",
                      f"summary of pool {pool_id}, {model} {mode}, bit {bit:#x} "
                      f"is {have or (0, 0)} (GPUs, free units) but its GPUs give {want or (0, 0)} "
                      "(placement may skip or miscount the host)", "run `vgpuctl init` (recomputes host summaries)")


CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("tenant-usage", "tenant usage equals the sum of its allocations", _tenant_usage),
    ("scoped-quota", "per-pool and per-profile usage equals allocations", _scoped_usage),
    ("failed-vms", "failed VMs hold no devices", _failed_vms),
    ("overlaps", "no two devices overlap on a GPU", _overlaps),
    ("gpu-occupancy", "each GPU's layout, free units, count and type match its devices", _gpu_mirror),
    ("one-type", "equal-size GPUs hold one vGPU type", _one_type),
    ("host-usage", "host vCPU and memory use equals its VMs", _host_usage),
    ("host-summaries", "each host summary adds up its GPUs that can take the profile", _host_summaries),
    ("orphans", "every device belongs to a VM on the same host", _orphans),
    ("stuck", "no VM stays in an intermediate state", _stuck),
)


def diagnose(ctl: Controller, stuck_minutes: float = 10.0) -> list[CheckResult]:
    """Run every check on one snapshot of the store; the results (admin only)."""
    require_admin(ctl, "doctor")
    cutoff = datetime.now(UTC) - timedelta(minutes=stuck_minutes)
    out = []
    with ctl.read() as conn:
        for name, description, check in CHECKS:
            out.append(CheckResult(name, description, list(check(conn, ctl.catalog, cutoff))))
    return out
