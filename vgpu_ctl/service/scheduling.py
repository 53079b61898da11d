"""Scheduling in the service: priority classes, tenants' classes and shares, the fair-share report, preemption
(victims chosen by `core.preemption`, freed by requeue or cancel with a grace period, audited) and the queue of
requests waiting for capacity (pending operations, admitted by priority, fair share, age when capacity frees).

The rules are in `core.priority`, `core.fairshare` and `core.preemption`; this module reads and writes the store
and drives the hosts. See docs/design-scheduling.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from vgpu_ctl.core.fairshare import (
    Interval,
    Member,
    ShareRow,
    Usage,
    check_half_life,
    decayed_usage,
    dominant,
    fair_tree,
    fold,
)
from vgpu_ctl.core.placement import PlacementPlan, PlacementRequest, get_policy
from vgpu_ctl.core.preemption import (
    Holder,
    Preemption,
    borrowed_now,
    borrowed_share,
    choose_victims,
    keeps_floor,
    reclaimable,
    strictly_improves,
)
from vgpu_ctl.core.priority import (
    FREES_DEVICES,
    NO_CLASS,
    PreemptionMode,
    PreemptionPolicy,
    PriorityClass,
    check_mode,
    check_policy,
    check_value,
    resolve_class,
    victim_mode,
)
from vgpu_ctl.core.vm_state import HOLDS_CLAIM, LIVE, VmState
from vgpu_ctl.errors import Conflict, InvalidInput, NoCapacity, NotFound, Refused, VgpuCtlError
from vgpu_ctl.inventory import check_int, check_name
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service import claim
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.hibernation import hibernate, resume, supported_modes
from vgpu_ctl.service.ports import STORE, Tx, utcnow
from vgpu_ctl.service.principals import Principal
from vgpu_ctl.service.scheduling_types import PreemptionPlan, Victim  # their home, re-exported
from vgpu_ctl.store.operations import OperationRow
from vgpu_ctl.store.scheduling import (
    AccountRow,
    ClassRow,
    Guarantee,
    HolderRow,
    LedgerRow,
    TenantSchedRow,
)
from vgpu_ctl.store.vm_sched import VmSchedRow
from vgpu_ctl.store.vms import VmRow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller
    from vgpu_ctl.service.requests import VmRequest

QUEUE_HOLDER = "queue"
"""The lease holder of a queued (pending) operation: never expires, never taken over by the recovery loop."""
ADMITTER = "admit-"
"""How the lease holder of a queued operation being tried (`admit_queued`) begins: it is still in the queue."""

SETTINGS: dict[str, float] = {"half_life_s": 7 * 86400.0, "grace_s": 30.0, "cooldown_s": 600.0}
"""Scheduling settings and their defaults: usage half-life, the grace period of a preempted VM's shutdown, and
the cool-down during which a re-admitted victim is not preempted again by a request no higher than the one that
preempted it."""

log = logging.getLogger(__name__)

PREEMPTION_SLACK_S = 300.0
"""How long past the grace period a requeued victim that still holds its devices is waited for (its preemption
is still running) before its queued request is dropped as a preemption that never happened."""

ACCOUNT_KEY = "@account"
"""The suffix of accounts' nodes in the share tree (a tenant and an account may have the same name; names hold no
'@'; ties between siblings still go by the plain name)."""

COMPACT_AT = 256
"""Closed usage intervals are folded into the tenants' ledgers once there are this many."""

DEFAULT_COMPUTE_SLICES = 7
"""The compute slices of a whole GPU whose model has no MIG mode (so a whole GPU counts as on a MIG GPU)."""


# -- settings ---------------------------------------------------------------------------------------------------

def settings(conn: Tx) -> dict[str, float]:
    """The scheduling settings, stored or default."""
    stored = STORE.scheduling.stored_settings(conn)
    return {name: stored.get(name, default) for name, default in SETTINGS.items()}


def set_settings(conn: Tx, actor: str, values: Mapping[str, float | None]) -> dict[str, float]:
    """Set scheduling settings (None: back to the default); all settings after. InvalidInput naming the field for
    an unknown name or a value that is not a positive number (grace and cool-down may be 0)."""
    for name, value in values.items():
        if name not in SETTINGS:
            raise InvalidInput(f"unknown scheduling setting {name!r}; known: {', '.join(SETTINGS)}",
                               reasons=[{"field": name, "value": value}])
        if value is None:
            continue
        if name == "half_life_s":
            check_half_life(value)
        elif isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10 ** 9:
            raise InvalidInput(f"{name} must be a number of seconds from 0 to 1e9 (field {name}, value {value!r})",
                               reasons=[{"field": name, "value": value}])
    for name, value in values.items():
        STORE.scheduling.put_setting(conn, name, value)
    record(conn, actor, "scheduling.set", "scheduling", params={k: v for k, v in values.items()})
    return settings(conn)


# -- priority classes -------------------------------------------------------------------------------------------

def _class_of(row: ClassRow) -> PriorityClass:
    return PriorityClass(row.name, row.value, row.preemptible, PreemptionPolicy(row.preemption_policy),
                         PreemptionMode(row.preemption_mode), row.is_default, row.description)


def classes(conn: Tx) -> dict[str, PriorityClass]:
    """Every priority class by name."""
    return {r.name: _class_of(r) for r in STORE.scheduling.class_rows(conn)}


def class_dict(c: PriorityClass, vms: int = 0) -> dict[str, Any]:
    """A class as JSON."""
    return {"name": c.name, "value": c.value, "preemptible": c.preemptible,
            "preemption_policy": c.preemption_policy.value, "preemption_mode": c.preemption_mode.value,
            "default": c.default, "description": c.description, "vms": vms}


def create_class(conn: Tx, actor: str, name: str, value: int, *, preemptible: bool = False,
                 preemption_policy: str = "lower-priority", preemption_mode: str = "requeue", default: bool = False,
                 description: str = "") -> dict[str, Any]:
    """Add a priority class (with `default`, it becomes the global default in place of the previous one).
    InvalidInput naming the field for a bad name, value, policy or mode; Conflict if the name is taken."""
    check_name("priority class", name)
    cls = PriorityClass(name, check_value(value), bool(preemptible), check_policy(preemption_policy),
                        check_mode(preemption_mode), bool(default), description)
    if STORE.scheduling.has_class(conn, name):
        raise Conflict(f"priority class {name!r} already exists", reasons=[{"field": "name", "value": name}])
    STORE.scheduling.add_class(conn, ClassRow(name, cls.value, cls.preemptible, cls.preemption_policy.value,
                                              cls.preemption_mode.value, cls.default, description), utcnow())
    out = class_dict(cls)
    record(conn, actor, "priority.create", f"priority:{name}", params=out)
    return out


def list_classes(conn: Tx) -> list[dict[str, Any]]:
    """Every class, highest value first, with how many VMs hold it."""
    counts = STORE.vm_sched.class_vm_counts(conn)
    return [class_dict(c, int(counts.get(c.name, 0))) for c in classes(conn).values()]


def delete_class(conn: Tx, actor: str, name: str) -> None:
    """Remove a class no VM, tenant default or tenant limit uses (Conflict naming them otherwise)."""
    if not STORE.scheduling.has_class(conn, name):
        raise NotFound(f"priority class {name!r} not found", reasons=[{"field": "priority", "value": name}])
    use = STORE.scheduling.class_use(conn, name)
    users = {
        "VMs": use.vms,
        "tenant defaults": use.tenant_defaults,
        "tenant limits": use.tenant_limits,
        "queued requests": sum(1 for r in _queued_rows(conn) if r.request.get("priority") == name),
    }
    used = {k: v for k, v in users.items() if v}
    if used:
        raise Conflict(f"priority class {name!r} is in use ({', '.join(f'{n} {k}' for k, n in used.items())})",
                       reasons=[{"field": "priority", "value": name, **used}])
    STORE.scheduling.remove_class(conn, name)
    record(conn, actor, "priority.delete", f"priority:{name}")


# -- tenants and accounts ---------------------------------------------------------------------------------------

def tenant_settings(conn: Tx, tenant_id: int) -> dict[str, Any]:
    """A tenant's shares, account, default class and allowed classes (None: any)."""
    row = STORE.scheduling.tenant_sched(conn, tenant_id)
    allowed = STORE.scheduling.tenant_classes(conn, tenant_id)
    return {"shares": row.shares if row else 1, "account": row.account if row else None,
            "default_priority": row.default_class if row else None, "priority_classes": allowed or None}


_UNSET: Any = object()


def set_tenant(conn: Tx, actor: str, tenant_id: int, tenant: str, *, shares: int | None = None,
               account: str | None = _UNSET, default_priority: str | None = _UNSET,
               priority_classes: Collection[str] | None = _UNSET) -> dict[str, Any]:
    """Change a tenant's scheduling settings (what is not given stays; None clears account, default or the class
    limit); the settings after. InvalidInput naming the field for unknown classes or accounts, shares below 1,
    or a default outside the allowed classes."""
    cur = tenant_settings(conn, tenant_id)
    known = classes(conn)
    if shares is not None:
        check_int("shares", shares, 1, 10 ** 9)
        cur["shares"] = shares
    if account is not _UNSET:
        if account is not None and not STORE.scheduling.has_account(conn, account):
            raise InvalidInput(f"unknown account {account!r} (field account)",
                               reasons=[{"field": "account", "value": account}])
        cur["account"] = account
    if priority_classes is not _UNSET:
        wanted = sorted(set(priority_classes)) if priority_classes is not None else None
        for c in wanted or ():
            if c not in known:
                raise InvalidInput(f"unknown priority class {c!r} (field priority_classes; known: "
                                   f"{', '.join(sorted(known)) or 'none'})",
                                   reasons=[{"field": "priority_classes", "value": c}])
        cur["priority_classes"] = wanted or None
    if default_priority is not _UNSET:
        if default_priority is not None and default_priority not in known:
            raise InvalidInput(f"unknown priority class {default_priority!r} (field default_priority; known: "
                               f"{', '.join(sorted(known)) or 'none'})",
                               reasons=[{"field": "default_priority", "value": default_priority}])
        cur["default_priority"] = default_priority
    allowed = cur["priority_classes"]
    if cur["default_priority"] is not None and allowed is not None and cur["default_priority"] not in allowed:
        raise InvalidInput(f"default priority {cur['default_priority']!r} is not among the tenant's classes "
                           f"({', '.join(allowed)}) (field default_priority)",
                           reasons=[{"field": "default_priority", "value": cur["default_priority"]}])
    STORE.scheduling.put_tenant_sched(conn, tenant_id, TenantSchedRow(cur["shares"], cur["account"],
                                                                      cur["default_priority"]), allowed or ())
    record(conn, actor, "tenant.scheduling", tenant, tenant=tenant, params=dict(cur))
    return cur


def set_account(conn: Tx, actor: str, name: str, shares: int, parent: str | None) -> dict[str, Any]:
    """Add or change an account of the share tree; InvalidInput naming the field for bad shares, an unknown
    parent or a parent that would make a cycle."""
    check_name("account", name)
    check_int("shares", shares, 1, 10 ** 9)
    accounts = {r.name: r.parent for r in STORE.scheduling.account_rows(conn)}
    if parent is not None:
        if parent not in accounts:
            raise InvalidInput(f"unknown parent account {parent!r} (field parent)",
                               reasons=[{"field": "parent", "value": parent}])
        up: str | None = parent
        while up is not None:
            if up == name:
                raise InvalidInput(f"account {name!r} can't be under {parent!r}: that makes a cycle (field parent)",
                                   reasons=[{"field": "parent", "value": parent}])
            up = accounts.get(up)
    STORE.scheduling.put_account(conn, AccountRow(name, shares, parent))
    out = {"name": name, "shares": shares, "parent": parent}
    record(conn, actor, "account.set", f"account:{name}", params=out)
    return out


def delete_account(conn: Tx, actor: str, name: str) -> None:
    """Remove an account without members (Conflict naming them otherwise)."""
    if not STORE.scheduling.has_account(conn, name):
        raise NotFound(f"account {name!r} not found", reasons=[{"field": "account", "value": name}])
    members = STORE.scheduling.account_members(conn, name)
    if members:
        raise Conflict(f"account {name!r} still has members: {', '.join(sorted(members))}",
                       reasons=[{"field": "account", "value": name, "members": sorted(members)}])
    STORE.scheduling.remove_account(conn, name)
    record(conn, actor, "account.delete", f"account:{name}")


# -- admission: a VM's priority and charge ----------------------------------------------------------------------

def resolve(conn: Tx, tenant_id: int, tenant: str, requested: str | None,
            any_class: bool | None = None) -> PriorityClass:
    """The class a request of the tenant gets (see `core.priority.resolve_class`); InvalidInput naming the field
    priority for an unknown or disallowed class. `any_class`: whether the store holds a class, if the caller
    has read it (else it is read here)."""
    if requested is None and any_class is None:
        any_class = STORE.scheduling.any_class(conn)
    known = classes(conn) if requested is not None or any_class else {}
    if not known and requested is None:
        return NO_CLASS
    ts = tenant_settings(conn, tenant_id)
    return resolve_class(requested, known, ts["priority_classes"], ts["default_priority"], tenant)


def charge_of(catalog: Any, chosen: PlacementPlan) -> tuple[float, float]:
    """What a placement is charged for fair share: framebuffer GiB and compute slices (a MIG instance's own; a
    whole GPU or a time-sliced vGPU its share of the GPU's slices)."""
    fb = compute = 0.0
    for d in chosen.devices:
        geom = chosen.occupancies[d.gpu_id].geometry
        shape = geom.shapes[d.profile]
        fb += shape.framebuffer_mib / 1024
        if shape.compute:
            compute += shape.compute
        else:
            spec = catalog.model(geom.model)
            slices = spec.mig.compute_slices if spec.mig is not None else DEFAULT_COMPUTE_SLICES
            compute += slices * shape.size / geom.axis
    return fb, compute


def sched_row(catalog: Any, vm_id: str, tenant_id: int, cls: PriorityClass, chosen: PlacementPlan,
              history: Mapping[str, Any] | None = None) -> VmSchedRow:
    """A just-claimed VM's scheduling row (written in the claim's transaction): its priority, charge and
    preemption history; a re-admitted victim's cool-down starts now. Whether it is borrowed is not recorded: it
    follows its tenant's usage as it stands (`borrowed_vms`)."""
    fb, compute = charge_of(catalog, chosen)
    h = history or {}
    now = time.time()
    protected = h.get("protected_below")  # a requeued victim: its cool-down runs from this admission
    return VmSchedRow(vm_id, tenant_id, cls.name or None, cls.value, cls.preemptible, now, fb, compute,
                      int(h.get("preemptions", 0)), protected,
                      now + float(h.get("cooldown_s", 0.0)) if protected is not None else None)


# -- fair share -------------------------------------------------------------------------------------------------

def fleet_capacity(conn: Tx, catalog: Any) -> tuple[float, float]:
    """The fleet's framebuffer GiB and compute slices (managed GPUs)."""
    fb = compute = 0.0
    for model, n in STORE.scheduling.gpu_model_counts(conn):
        spec = catalog.model(model)
        fb += n * spec.memory_mib / 1024
        compute += n * (spec.mig.compute_slices if spec.mig is not None else DEFAULT_COMPUTE_SLICES)
    return fb, compute


def usages(conn: Tx, now: float, half_life_s: float) -> dict[int, Usage]:
    """Each tenant's decayed usage as of `now`: its folded ledger, its closed intervals, its VMs holding now."""
    out: dict[int, Usage] = {}
    for r in STORE.scheduling.ledger_rows(conn):
        out[r.tenant_id] = fold(Usage(r.fb_gib_h, r.compute_h), r.as_of, now, half_life_s)
    per: dict[int, list[Interval]] = {}
    for iv in STORE.scheduling.interval_rows(conn):
        per.setdefault(iv.tenant_id, []).append(Interval(iv.started, iv.ended, iv.fb_gib, iv.compute_slices))
    for h in STORE.vm_sched.holdings(conn):
        per.setdefault(h.tenant_id, []).append(Interval(h.admitted_at, None, h.fb_gib, h.compute_slices))
    for t, ivs in per.items():
        out[t] = out.get(t, Usage()) + decayed_usage(ivs, now, half_life_s)
    return out


def compact(conn: Tx, now: float, half_life_s: float) -> int:
    """Fold every closed interval into its tenant's ledger as of `now` (exact: decay is multiplicative); how many
    were folded."""
    rows = STORE.scheduling.interval_rows(conn)
    if not rows:
        return 0
    per: dict[int, list[Interval]] = {}
    for r in rows:
        per.setdefault(r.tenant_id, []).append(Interval(r.started, r.ended, r.fb_gib, r.compute_slices))
    ledgers = {r.tenant_id: r for r in STORE.scheduling.ledger_rows(conn)}
    for t, ivs in per.items():
        old = ledgers.get(t)
        total = decayed_usage(ivs, now, half_life_s)
        if old is not None:
            total = total + fold(Usage(old.fb_gib_h, old.compute_h), old.as_of, now, half_life_s)
        STORE.scheduling.put_ledger(conn, LedgerRow(t, total.fb_gib_h, total.compute_h, now))
    STORE.scheduling.drop_intervals(conn, [r.id for r in rows])
    return len(rows)


def share_tree(conn: Tx, catalog: Any, now: float | None = None) -> tuple[list[ShareRow], dict[int, Usage]]:
    """The Fair Tree rows of every tenant and account, and each tenant's raw decayed usage by id."""
    now = time.time() if now is None else now
    half_life = settings(conn)["half_life_s"]
    raw = usages(conn, now, half_life)
    fleet_fb, fleet_compute = fleet_capacity(conn, catalog)
    # Accounts and tenants are separate namespaces: accounts' nodes are keyed name + ACCOUNT_KEY in the tree.
    members = [Member(r.name + ACCOUNT_KEY, r.parent + ACCOUNT_KEY if r.parent else None, int(r.shares),
                      account=True) for r in STORE.scheduling.account_rows(conn)]
    names = {}
    for t in STORE.scheduling.tenant_shares(conn):
        names[t.id] = t.name
        members.append(Member(t.name, t.account + ACCOUNT_KEY if t.account else None, int(t.shares or 1),
                              dominant(raw.get(t.id, Usage()), fleet_fb, fleet_compute)))
    return fair_tree(members), {tid: raw[tid] for tid in raw if tid in names}


def _plain(key: str | None) -> str | None:
    return key.removesuffix(ACCOUNT_KEY) if key is not None else None


def share_report(conn: Tx, catalog: Any, principal: Principal,
                 now: float | None = None) -> list[dict[str, Any]]:
    """`sshare -l`: per account and tenant the shares (raw and among siblings), the decayed usage (raw GiB-hours
    and slice-hours, and as the dominant share among siblings), the level fairshare, and for tenants the rank and
    fair-share factor. A tenant caller sees only its own row."""
    rows, raw = share_tree(conn, catalog, now)
    ids = {name: tenant_id for tenant_id, name in STORE.quotas.tenant_refs(conn)}
    out = []
    for r in rows:
        if principal.tenant is not None and (r.account or r.name != principal.tenant):
            continue
        u = raw.get(ids.get(r.name, -1), Usage()) if not r.account else None
        out.append({"name": _plain(r.name), "kind": "account" if r.account else "tenant", "parent": _plain(r.parent),
                    "depth": r.depth, "shares": r.shares, "norm_shares": round(r.norm_shares, 6),
                    "usage": round(r.usage, 6), "norm_usage": round(r.norm_usage, 6),
                    "fb_gib_hours": round(u.fb_gib_h, 6) if u else None,
                    "compute_slice_hours": round(u.compute_h, 6) if u else None,
                    "level_fairshare": None if r.level_fs == float("inf") else round(r.level_fs, 6),
                    "rank": r.rank, "fairshare": None if r.factor is None else round(r.factor, 6)})
    return out


# -- preemption -------------------------------------------------------------------------------------------------

class Candidates(NamedTuple):
    """The VMs on some hosts that a preemption could free: as Holders, their rows and the mode each would be
    freed by (by id), and why the others that are live there cannot be freed (their host supports no mode their
    class allows)."""

    holders: list[Holder]
    rows: dict[str, HolderRow]
    modes: dict[str, str]
    unfreeable: list[str]


class Found(NamedTuple):
    """A preemption plan: the victims and the plan once they are gone, the pool, and the candidates it was
    chosen from."""

    pre: Preemption
    pool: Any
    cands: Candidates


def _holders(conn: Tx, host_ids: Sequence[int], now: float) -> Candidates:
    """The VMs on these hosts that could be preempted (live: running or stopped, nobody working on them), each
    with the mode it would be freed by (its class's, or one keeping more of it, that its host supports for its
    profiles: `core.priority.victim_mode`), borrowed as its tenant's usage stands now (`borrowed_vms`)."""
    if not host_ids:
        return Candidates([], {}, {}, [])
    rows = STORE.scheduling.free_vms_on(conn, host_ids, LIVE)
    devs: dict[str, list[tuple[int, int]]] = {}
    kinds: dict[str, tuple[set[str], set[str]]] = {}
    if rows:
        for d in STORE.scheduling.device_kinds(conn, [r.id for r in rows]):
            devs.setdefault(d.vm_id, []).append((d.gpu_id, d.start))
            profiles, backings = kinds.setdefault(d.vm_id, (set(), set()))
            profiles.add(d.profile)
            backings.add(d.backing)
    borrowed = borrowed_vms(conn, {r.tenant_id for r in rows})
    known = classes(conn)
    out: list[Holder] = []
    modes: dict[str, str] = {}
    unfreeable: list[str] = []
    for r in rows:
        profiles, backings = kinds.get(r.id, (set(), set()))
        supported, notes = supported_modes(r.victim_modes, profiles, backings, r.state == VmState.RUNNING)
        wanted = known[r.class_name].preemption_mode if r.class_name in known else PreemptionMode.REQUEUE
        mode = victim_mode(wanted, supported)
        if mode is None:
            if r.preemptible:
                unfreeable.append(f"VM {r.name} on host {r.host_name} ({wanted} or what keeps more: the host "
                                  f"supports {'; '.join(notes) or ', '.join(sorted(supported))})")
            continue
        modes[r.id] = mode.value
        protected = r.protected_below if r.protected_until is not None and r.protected_until > now else None
        out.append(Holder(r.id, r.host_id, int(r.priority), bool(r.preemptible), tuple(sorted(devs.get(r.id, []))),
                          int(r.vcpus), int(r.memory_mib), float(r.admitted_at), r.id in borrowed, protected,
                          keeps_devices=mode not in FREES_DEVICES))
    return Candidates(out, {r.id: r for r in rows}, modes, unfreeable)


def plan_preemption(ctl: Controller, conn: Tx, req: VmRequest, cls: PriorityClass,
                    pools: Sequence[Any], reclaim: bool = False) -> Found | None:
    """The fewest victims over the request's pools (first pool with a set wins, as the claim tries pools in
    order), with the pool and the candidates; None when no allowed set makes room. With `reclaim`, only pools
    where the request stays within its tenant's guarantee, only other tenants' VMs borrowed now, only a set that
    leaves every lender at or above its guarantee (`lender_floor`), and only one that makes the borrowed shares
    strictly fairer (`reclaim_check`). None for a VM without vGPUs: preemption frees GPU space by geometry, not
    vCPUs or memory, so such a VM waits in the queue or is refused."""
    if not req.vgpus:
        return None
    preq = PlacementRequest(req.profiles(), req.vcpus, req.memory_mib, req.labels, req.anti_affinity)
    names = {p.id: p.name for p in pools}
    now = time.time()
    t_id = ctl._tenant_id(conn, req.tenant)
    delta = _delta(ctl, req)
    for pool in pools:
        if reclaim and not within_guarantee(conn, t_id, delta, pool.name):
            continue
        found = alloc.all_candidates(conn, ctl.catalog, [pool.id], preq.profiles, req.anti_affinity, names)
        hosts = list(found.hosts)
        cands = _holders(conn, [h.host_id for h in hosts], now)
        holders = cands.holders
        keep = None
        if reclaim:
            holders = [h for h in holders if cands.rows[h.vm_id].tenant_id != t_id]
            keep = lender_floor(conn, cands.rows)
        pre = choose_victims(preq, cls.value, hosts, holders, get_policy("first-fit"),
                             reclaimable if reclaim else None, keep)
        if pre is not None and reclaim and pre.victims and not reclaim_check(conn, t_id, delta, pool.name,
                                                                              pre.victims):
            continue
        if pre is not None:
            return Found(pre, pool, cands)
    return None


# -- borrowing and reclaim --------------------------------------------------------------------------------------

def _delta(ctl: Controller, req: VmRequest) -> dict[str, int]:
    """What a request charges its tenant's base resources."""
    return claim.charge_of(ctl.catalog, req.profiles(), req.vcpus, req.memory_mib)


def _key(g: Guarantee) -> str:
    """A guarantee's key: `RESOURCE` (global) or `RESOURCE@POOL` (a pool's)."""
    return g.resource if g.scope is None else f"{g.resource}@{g.scope}"


def guarantees_of(conn: Tx, tenant_id: int, pool: str) -> dict[str, tuple[int, int]]:
    """A tenant's guarantees that apply in a pool, by `RESOURCE` (global) and `RESOURCE@POOL` (the pool's own):
    (used, guarantee) each."""
    return {_key(g): (g.used, g.guarantee) for g in STORE.scheduling.guarantees(conn, [tenant_id], alloc.GUARANTEED,
                                                                                 pool)}


def within_guarantee(conn: Tx, tenant_id: int, delta: Mapping[str, int], pool: str) -> bool:
    """Whether a request charging `delta` in `pool` keeps its tenant within every guarantee that applies there
    (and the tenant has one): such a request may reclaim what others borrow."""
    g = guarantees_of(conn, tenant_id, pool)
    return bool(g) and all(used + delta.get(key.partition("@")[0], 0) <= guarantee
                           for key, (used, guarantee) in g.items())


def _guarantees(conn: Tx, tenant_ids: Collection[int]) -> dict[int, tuple[dict[str, int], dict[str, int]]]:
    """Per tenant with a guarantee: (used, guarantee) by `RESOURCE` (global) and `RESOURCE@POOL` (a pool's)."""
    out: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
    for g in STORE.scheduling.guarantees(conn, tenant_ids, alloc.GUARANTEED):
        used, guarantee = out.setdefault(g.tenant_id, ({}, {}))
        used[_key(g)], guarantee[_key(g)] = g.used, g.guarantee
    return out


def _charge(spec: Any, pool: str | None) -> dict[str, int]:
    """What a VM charges its tenant, by `RESOURCE` and `RESOURCE@POOL` (its pool's)."""
    delta = dict((spec if isinstance(spec, dict) else {}).get("delta") or {})
    out = {r: int(n) for r, n in delta.items()}
    if pool is not None:
        out.update({f"{r}@{pool}": int(n) for r, n in delta.items()})
    return out


def borrowed_vms(conn: Tx, tenant_ids: Collection[int]) -> set[str]:
    """The VMs of these tenants that are borrowed now (`core.preemption.borrowed_now`): each tenant's VMs that
    hold quota, oldest admission first, past a guarantee with their elders' charges; so when a tenant's older VM
    goes, newer work it holds within the guarantee is guaranteed again."""
    g = _guarantees(conn, tenant_ids)
    if not g:
        return set()
    per: dict[int, list[tuple[str, dict[str, int]]]] = {}
    for r in STORE.scheduling.claim_charges(conn, list(g), HOLDS_CLAIM):
        per.setdefault(r.tenant_id, []).append((r.id, _charge(r.spec, r.pool)))
    out: set[str] = set()
    for t, charges in per.items():
        out |= borrowed_now(charges, g[t][1])
    return out


def lender_floor(conn: Tx, rows: Mapping[str, HolderRow]) -> Callable[[Sequence[Holder]], bool]:
    """The set-wide rule of a reclaim: the victims (of `rows`) leave each lender at or above every guarantee it
    has (`core.preemption.keeps_floor`), counting what they charge globally and in their pools."""
    g = _guarantees(conn, {r.tenant_id for r in rows.values()})

    def keep(victims: Sequence[Holder]) -> bool:
        freed: dict[int, dict[str, int]] = {}
        for v in victims:
            r = rows[v.vm_id]
            acc = freed.setdefault(r.tenant_id, {})
            for k, n in _charge(r.spec, r.pool).items():
                acc[k] = acc.get(k, 0) + n
        return all(keeps_floor(*g[t], f) for t, f in freed.items() if t in g)
    return keep


def reclaim_check(conn: Tx, tenant_id: int, delta: Mapping[str, int], pool: str,
                  victims: Sequence[Holder]) -> bool:
    """Whether reclaiming `victims` for a request of the tenant (charging `delta` in `pool`) makes sharing
    strictly fairer: the borrowed shares of the reclaimer and of the victims' tenants, largest first, go down
    (`core.preemption.strictly_improves`); so a reclaim can never be undone by a reclaim back."""
    vm_rows = {r.id: r for r in STORE.scheduling.vm_charges(conn, [v.vm_id for v in victims])}
    before: dict[str, float] = {}
    after: dict[str, float] = {}

    def shares(t: int, where: str, minus: Mapping[str, int]) -> tuple[float, float]:
        g = guarantees_of(conn, t, where)
        used = {k: float(u) for k, (u, _) in g.items()}
        guarantee = {k: float(x) for k, x in ((k, gg) for k, (_, gg) in g.items())}
        changed = {k: used[k] + minus.get(k.partition("@")[0], 0) for k in used}
        return borrowed_share(used, guarantee), borrowed_share(changed, guarantee)

    b, a = shares(tenant_id, pool, delta)
    before[f"t{tenant_id}@{pool}"], after[f"t{tenant_id}@{pool}"] = b, a
    freed: dict[tuple[int, str], dict[str, int]] = {}
    for v in victims:
        r = vm_rows.get(v.vm_id)
        if r is None:
            continue
        spec = r.spec if isinstance(r.spec, dict) else {}
        key = (int(r.tenant_id), r.pool or "")
        acc = freed.setdefault(key, {})
        for res, n in dict(spec.get("delta") or {}).items():
            acc[res] = acc.get(res, 0) - int(n)
    for (t, where), minus in freed.items():
        b, a = shares(t, where, minus)
        before[f"t{t}@{where}"], after[f"t{t}@{where}"] = b, a
    return strictly_improves(before, after)


def _victims(conn: Tx, found: Found) -> tuple[Victim, ...]:
    out = []
    for h in found.pre.victims:
        r = found.cands.rows[h.vm_id]
        tenant = STORE.tenants.tenant_name(conn, r.tenant_id)
        devices = tuple(f"{d.profile}@{d.pci_address}+{d.start}" for d in
                        STORE.scheduling.device_places(conn, h.vm_id))
        out.append(Victim(h.vm_id, str(tenant), r.name, str(r.host_name), r.class_name, h.priority,
                          found.cands.modes[h.vm_id], devices))
    return tuple(out)


def _host_name(conn: Tx, found: Found) -> str | None:
    """The name of the host a preemption plan places its request on."""
    ref = STORE.vms.host_of(conn, found.pre.plan.host_id)
    return ref[0] if ref is not None else None


def _pools_for(ctl: Controller, conn: Tx, req: VmRequest) -> list[Any]:
    ask = claim.read_ask(ctl, conn, req)
    if isinstance(ask, claim.AlreadyMade):
        return []
    return list(ask.pools)


def preview(ctl: Controller, req: VmRequest) -> PreemptionPlan:
    """What preempting for the request would free (nothing happens): its class, the pool and host, the victims,
    and the reason (`reclaim` when the request stays within its tenant's guarantee and taking back borrowed VMs
    makes room, as the request itself would do first; else `capacity`). NoCapacity when no allowed set of
    victims makes room; InvalidInput as the request itself would get."""
    reclaim = may_reclaim(ctl, req, None)
    with ctl.read() as conn:
        t_id = ctl._tenant_id(conn, req.tenant)
        cls = resolve(conn, t_id, req.tenant, req.priority)
        pools = _pools_for(ctl, conn, req)
        found = plan_preemption(ctl, conn, req, cls, pools, reclaim=True) if reclaim else None
        reason = "reclaim"
        if found is None:
            found, reason = plan_preemption(ctl, conn, req, cls, pools), "capacity"
        if found is None:
            raise _no_victims(ctl, conn, req, cls, pools)
        return PreemptionPlan(cls.name or None, cls.value, found.pool.name, _host_name(conn, found),
                              _victims(conn, found),
                              "fits without preemption" if not found.pre.victims else reason)


def _no_reclaim(req: VmRequest) -> NoCapacity:
    return NoCapacity(f"reclaiming does not help: no set of VMs other tenants borrow above their guarantee frees "
                      f"room for VM {req.name!r} by geometry while making sharing fairer",
                      reasons=[{"kind": "reclaim", "tenant": req.tenant}])


def may_reclaim(ctl: Controller, req: VmRequest, preempt: bool | None) -> bool:
    """Whether a request refused for capacity reclaims borrowed capacity before anything else: unless asked not
    to preempt (`preempt` False), when it stays within its tenant's guarantee in one of its pools. Never for a VM
    without vGPUs (reclaiming frees GPU space)."""
    if preempt is False or not req.vgpus:
        return False
    with ctl.read() as conn:
        t_id = ctl._tenant_id(conn, req.tenant)
        delta = _delta(ctl, req)
        return any(within_guarantee(conn, t_id, delta, p.name) for p in _pools_for(ctl, conn, req))


def reclaim_then_claim(ctl: Controller, req: VmRequest, exc: NoCapacity) -> Any:
    """Reclaim borrowed VMs for a request within its tenant's guarantee (`preempt` with reason 'reclaim': the
    victims requeued or cancelled, with the grace period, audited, counted) and claim again; the claim's result.
    NoCapacity (the refusal and why reclaiming did not help) when it still does not fit."""
    with ctl.read() as conn:
        cls = resolve(conn, ctl._tenant_id(conn, req.tenant), req.tenant, req.priority)
    try:
        preempt(ctl, req, cls, "reclaim")
        return claim.claim(ctl, req)
    except NoCapacity as again:
        raise NoCapacity(f"{exc.message}; {again.message}", reasons=[*exc.reasons, *again.reasons]) from None


def _no_victims(ctl: Controller, conn: Tx, req: VmRequest, cls: PriorityClass,
                pools: Sequence[Any]) -> NoCapacity:
    """Why preempting does not help, naming the preemptible VMs of the request's hosts that no mode frees."""
    if not req.vgpus:
        return NoCapacity(f"VM {req.name!r} has no vGPUs: preemption frees GPU space, not vCPUs or memory, so it "
                          "does not preempt; queue it (--queue) to wait for room",
                          reasons=[{"kind": "preemption", "priority": cls.value, "priority_class": cls.name or None,
                                    "vgpus": 0}])
    hosts = [h.host_id for p in pools for h in alloc.all_candidates(conn, ctl.catalog, [p.id], req.profiles(),
                                                                      req.anti_affinity, {p.id: p.name}).hosts]
    unfreeable = _holders(conn, sorted(set(hosts)), time.time()).unfreeable
    why = f"; no victim mode fits: {'; '.join(unfreeable)}" if unfreeable else ""
    return NoCapacity(f"preempting does not help: no set of preemptible VMs of priority below {cls.value} "
                      f"({cls.name or 'no class'}) frees room for VM {req.name!r} by geometry{why}",
                      reasons=[{"kind": "preemption", "priority": cls.value, "priority_class": cls.name or None,
                                "unfreeable": unfreeable}])


def wants_preemption(cls: PriorityClass, preempt: bool | None) -> bool:
    """Whether a refused request of `cls` preempts: as asked (`preempt`), else by its class's policy; never for
    a class whose policy is `never`."""
    if cls.preemption_policy is PreemptionPolicy.NEVER:
        return False
    return cls.value > 0 and (preempt if preempt is not None else cls.name != "")


def grace_stop(ctl: Controller, host: Any, domain: str, grace_s: float) -> bool:
    """Shut a domain down gracefully (ACPI), wait up to `grace_s` for it to stop, then force it off; whether it
    had to be forced."""
    driver = ctl.hosts.get(host)
    with contextlib.suppress(VgpuCtlError):  # a guest that ignores ACPI is forced off below
        driver.stop_domain(domain, force=False)
    deadline = time.monotonic() + grace_s
    while True:
        active = any(d.name == domain and d.active for d in driver.list_domains())
        if not active:
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0.01)))
    driver.stop_domain(domain, force=True)
    return True


def _requeue_request(vm: VmRow, tenant: str, victim: Victim, preemptor: int, cooldown_s: float,
                     history: Mapping[str, Any]) -> dict[str, Any]:
    spec = vm.spec if isinstance(vm.spec, dict) else {}
    return {"tenant": tenant, "name": vm.name, "vgpus": [{"profile": p, "count": n} for p, n in spec.get("vgpus", [])],
            "vcpus": int(vm.vcpus), "memory_mib": int(vm.memory_mib), "pool": spec.get("pool"),
            "labels": spec.get("labels", {}), "anti_affinity": vm.anti_affinity, "template": spec.get("template"),
            "priority": victim.priority_class, "vm_id": vm.id,
            "history": {"preemptions": int(history.get("preemptions", 0)) + 1, "protected_below": preemptor,
                        "cooldown_s": cooldown_s},
            "requeued": True}


def preempt(ctl: Controller, req: VmRequest, cls: PriorityClass, reason: str = "capacity") -> PreemptionPlan:
    """Free the victims that let the request fit: each audited (preemptor, victims, reason, mode), then freed by
    its mode: requeued (shut down with the grace period, released, its request queued again at its priority with
    a cool-down), hibernated (managed save, its devices kept, queued to resume) or cancelled (shut down and
    released); the plan carried out. NoCapacity when no allowed set makes room."""
    with ctl.read() as conn:
        pools = _pools_for(ctl, conn, req)
        found = plan_preemption(ctl, conn, req, cls, pools, reclaim=reason == "reclaim")
        if found is None or not found.pre.victims:
            if found is None:
                raise _no_reclaim(req) if reason == "reclaim" else _no_victims(ctl, conn, req, cls, pools)
            return PreemptionPlan(cls.name or None, cls.value, found.pool.name, _host_name(conn, found), (),
                                  "fits without preemption")
        victims = _victims(conn, found)
        host_name = _host_name(conn, found)
        conf = settings(conn)
    result = PreemptionPlan(cls.name or None, cls.value, found.pool.name, host_name, victims, reason)
    with ctl.tx() as conn:  # the whole story for the admin; each tenant sees only its own side (below)
        record(conn, ctl.principal.actor, "vm.preempt", f"vm:{req.tenant}/{req.name}", tenant=None,
               params={"preemptor": {"tenant": req.tenant, "name": req.name, "priority_class": cls.name or None,
                                     "priority": cls.value},
                       "victims": [v.to_dict() for v in victims], "reason": reason, "pool": found.pool.name,
                       "host": host_name})
    for v in victims:
        _free_victim(ctl, v, cls, reason, conf)
    return result


def _free_victim(ctl: Controller, v: Victim, cls: PriorityClass, reason: str, conf: Mapping[str, float]) -> None:
    """Free one victim by its mode, its request queued first (to run again, or to resume) so a crash loses no
    victim; audited `vm.preempted` in its tenant, `failed` (and not queued) when it could not be freed."""
    from vgpu_ctl.service.provision import domain_name, release_vm
    with ctl.read() as conn:
        vm = STORE.vms.vm_row(conn, v.vm_id)
        host = STORE.moves.host_row(conn, vm.host_id) if vm and vm.host_id is not None else None
        preemptions = STORE.vm_sched.preemptions(conn, v.vm_id)
    if vm is None or host is None:
        return  # gone meanwhile: it freed its room already
    queued = None
    if v.mode in (PreemptionMode.REQUEUE.value, PreemptionMode.HIBERNATE.value):
        queued = _requeue_request(vm, v.tenant, v, cls.value, conf["cooldown_s"], {"preemptions": preemptions})
        queued["resume"] = v.mode == PreemptionMode.HIBERNATE.value
    op_id = None
    if queued is not None:  # queued first: a crash after it loses no victim (admission waits for the VM to go)
        with ctl.tx() as conn:
            op_id = _enqueue(conn, Principal(ctl.principal.actor), vm.tenant_id, queued, v.vm_id)
    forced = False
    try:
        if v.mode == PreemptionMode.HIBERNATE.value:
            hibernate(ctl, v.vm_id)
        else:
            forced = grace_stop(ctl, host, domain_name(vm), conf["grace_s"]) if vm.state == "running" else False
            release_vm(ctl.acting_as(Principal(f"{ctl.principal.actor} (preemption)")), v.vm_id)
    except VgpuCtlError as exc:  # changed meanwhile, or its host failed: it stays, and is not queued
        with ctl.tx() as conn:
            if op_id is not None:
                _drop_queued(conn, op_id, f"the preemption of VM {v.name!r} failed: {exc.message}")
            record(conn, ctl.principal.actor, "vm.preempted", f"vm:{v.vm_id}", tenant=v.tenant,
                   params={"name": v.name, "mode": v.mode, "reason": reason,
                           "preemptor_class": cls.name or None, "preemptor_priority": cls.value},
                   result="failed", error=exc.message)
        return
    with ctl.tx() as conn:
        record(conn, ctl.principal.actor, "vm.preempted", f"vm:{v.vm_id}", tenant=v.tenant,
               params={"name": v.name, "mode": v.mode, "reason": reason, "forced": forced,
                       "preemptor_class": cls.name or None, "preemptor_priority": cls.value})


# -- the queue --------------------------------------------------------------------------------------------------

def _enqueue(conn: Tx, principal: Principal, tenant_id: int, request: Mapping[str, Any],
             vm_id: str | None, reason: dict[str, Any] | None = None) -> str:
    now = utcnow()
    op_id = str(uuid.uuid4())
    STORE.operations.add_operation(conn, OperationRow(
        op_id, "vm.create", "pending", principal.actor, principal.role, tenant_id, vm_id, dict(request), None,
        reason, QUEUE_HOLDER, None, 0, now, now, None))
    return op_id


def _drop_queued(conn: Tx, op_id: str, why: str, code: str = "cancelled") -> None:
    """End a queued operation as failed with `why` (error code `code`)."""
    STORE.scheduling.drop_queued(conn, op_id, {"code": code, "message": why, "reasons": []}, utcnow())


def enqueue(ctl: Controller, req: VmRequest, exc: Refused, preempt: bool | None = None,
            deadline: float | None = None) -> str:
    """Queue a refused request as a pending operation with the reason it waits (whether it may preempt when
    tried again: `preempt` as `request_vm` takes it; until when it may wait: `deadline`, epoch seconds); its id."""
    request = {"preempt": preempt, "deadline": deadline, "tenant": req.tenant, "name": req.name,
               "vgpus": [{"profile": v.profile, "count": v.count} for v in req.vgpus], "vcpus": req.vcpus,
               "memory_mib": req.memory_mib, "pool": req.pool, "labels": dict(req.labels),
               "anti_affinity": req.anti_affinity, "template": req.template, "priority": req.priority}
    with ctl.tx() as conn:
        t_id = ctl._tenant_id(conn, req.tenant)
        op_id = _enqueue(conn, ctl.principal, t_id, request, None, exc.to_dict())
        record(conn, ctl.principal.actor, "vm.queue", f"vm:{req.tenant}/{req.name}", tenant=req.tenant,
               params={"operation": op_id, "reason": exc.message})
    return op_id


def _queued_rows(conn: Tx) -> list[OperationRow]:
    # with those being tried: `vgpuctl queue` during the server's periodic try still lists them, in place
    return STORE.scheduling.queued(conn, QUEUE_HOLDER, trying=ADMITTER)


def queue_order(conn: Tx, catalog: Any) -> list[tuple[OperationRow, PriorityClass, float]]:
    """The queued requests in admission order: priority (highest first), then fair share (highest factor
    first), then age; each with its class and its tenant's factor."""
    rows = _queued_rows(conn)
    if not rows:
        return []
    known = classes(conn)
    tree, _ = share_tree(conn, catalog)
    factor = {r.name: r.factor or 0.0 for r in tree if not r.account}
    names: dict[int | None, str] = dict(STORE.quotas.tenant_refs(conn))
    out = []
    for r in rows:
        asked = r.request.get("priority")
        cls = known.get(asked, NO_CLASS) if asked else _default_for(conn, r.tenant_id, known)
        out.append((r, cls, factor.get(names.get(r.tenant_id, ""), 0.0)))
    out.sort(key=lambda x: (-x[1].value, -x[2], x[0].created_at, x[0].id))
    return out


def _default_for(conn: Tx, tenant_id: int | None, known: Mapping[str, PriorityClass]) -> PriorityClass:
    ts = tenant_settings(conn, tenant_id) if tenant_id is not None else {}
    try:
        return resolve_class(None, known, ts.get("priority_classes"), ts.get("default_priority"))
    except InvalidInput:
        return NO_CLASS


def queue_report(conn: Tx, catalog: Any, principal: Principal) -> list[dict[str, Any]]:
    """What waits, in admission order: position, tenant, name, class and value, fair-share factor, since when,
    whether it is a preempted VM requeued (and hibernated: it resumes on its host), and why it waits."""
    names: dict[int | None, str] = dict(STORE.quotas.tenant_refs(conn))
    out = []
    for pos, (r, cls, factor) in enumerate(queue_order(conn, catalog), start=1):
        if principal.tenant_id is not None and r.tenant_id != principal.tenant_id:
            continue
        why = (r.error or {}).get("message") if isinstance(r.error, dict) else None
        out.append({"position": pos, "operation": r.id, "tenant": names.get(r.tenant_id), "name": r.request["name"],
                    "priority_class": cls.name or None, "priority": cls.value, "fairshare": round(factor, 6),
                    "since": r.created_at.isoformat(), "requeued": bool(r.request.get("requeued")),
                    "hibernated": bool(r.request.get("resume")),
                    "deadline": r.request.get("deadline"),
                    "vm_id": r.vm_id, "reason": why})
    return out


def admit_queued(ctl: Controller) -> list[str]:
    """Try the queued requests in admission order (each one that fits now is admitted, provisioned and its
    operation finished; one whose class preempts may preempt lower-priority VMs for it; one that still does not
    fit keeps waiting with its new reason); the ids of those admitted. Runs in process after a release, a new
    host or an uncordon, and when asked (`vgpuctl queue --admit`)."""
    from vgpu_ctl.service.operations import principal_of
    from vgpu_ctl.service.requests import VgpuRequest, VmRequest
    admitted: list[str] = []
    with ctl.read() as conn:
        order = queue_order(conn, ctl.catalog)
        askers = {r.id: principal_of(conn, r) for r, _, _ in order}
        wait_s = settings(conn)["grace_s"] + PREEMPTION_SLACK_S
    for row, cls, _f in order:
        if row.lease_holder != QUEUE_HOLDER:  # another admitter is trying it
            continue
        q = dict(row.request)
        if q.get("deadline") is not None and time.time() > float(q["deadline"]):
            with ctl.tx() as conn:
                _drop_queued(conn, row.id, f"VM {q['name']!r} waited past its queue deadline", "deadline")
                record(conn, ctl.principal.actor, "vm.dequeue", f"operation:{row.id}", tenant=q["tenant"],
                       params={"name": q["name"], "reason": "deadline"})
            continue
        if row.vm_id is not None and q.get("requeued") and not _victim_gone(ctl, row, q, wait_s):
            continue
        claim_holder = f"{ADMITTER}{uuid.uuid4()}"
        with ctl.tx() as conn:  # take it: one admitter per queued request
            if not STORE.scheduling.take_queued(conn, row.id, QUEUE_HOLDER, claim_holder, utcnow()):
                continue
        req = VmRequest(q["tenant"], q["name"], tuple(VgpuRequest(v["profile"], v["count"]) for v in q["vgpus"]),
                        q["vcpus"], q["memory_mib"], q.get("pool"), dict(q.get("labels") or {}),
                        q.get("anti_affinity"), f"op-{row.id}", q.get("template"), priority=q.get("priority"),
                        vm_id=q.get("vm_id"), history=q.get("history"))
        actor = ctl.acting_as(askers[row.id])
        state, result, error = "pending", None, None
        try:
            vm = _admit_one(actor, req, cls, q)
            state, result = "succeeded", vm.to_dict()
            admitted.append(vm.id)
        except Refused as exc:
            error = exc.to_dict()
        except VgpuCtlError as exc:
            state, error = "failed", exc.to_dict()
        now = utcnow()
        with ctl.tx() as conn:
            done = state != "pending"
            STORE.scheduling.end_admission(conn, row.id, claim_holder, state,
                                           holder_after=None if done else QUEUE_HOLDER,
                                           vm_id=result["id"] if result else row.vm_id, result=result, error=error,
                                           now=now)
            if state == "succeeded":
                record(conn, ctl.principal.actor, "vm.admit", f"vm:{result['id'] if result else ''}",
                       tenant=q["tenant"], params={"operation": row.id, "name": q["name"],
                                                   "requeued": bool(q.get("requeued"))})
    return admitted


def _victim_gone(ctl: Controller, row: OperationRow, q: Mapping[str, Any], wait_s: float) -> bool:
    """Whether a preempted victim's queued request may be tried now: a requeued VM must be gone (released), a
    hibernated one hibernated. While its preemption may still run (releasing, or younger than `wait_s`) it
    waits; past that, a victim the preemption never freed (a crash, a failed save) or a hibernated VM deleted
    meanwhile drops its request."""
    with ctl.read() as conn:
        still = STORE.vms.vm_row(conn, row.vm_id or "")
    if q.get("resume") and still is not None and still.state == VmState.HIBERNATED:
        return True
    if not q.get("resume") and still is None:
        return True
    if still is not None and (still.state == VmState.RELEASING or
                              time.time() - row.created_at.timestamp() < wait_s):
        return False  # the victim is still being stopped, released or saved: it waits for that
    why = (f"VM {q['name']!r} was deleted while hibernated" if still is None else
           f"VM {q['name']!r} was not preempted after all; it still holds its devices" if not q.get("resume") else
           f"VM {q['name']!r} was not hibernated after all; it is {still.state}")
    with ctl.tx() as conn:
        _drop_queued(conn, row.id, why)
    return False


def _admit_one(ctl: Controller, req: VmRequest, cls: PriorityClass, q: Mapping[str, Any]) -> Any:
    """Admit one queued request now, its VmInfo: a hibernated victim resumes on its host; any other is claimed
    and provisioned, reclaiming what others borrow when it stays within its tenant's guarantee, else preempting
    when its class preempts. Refused when it still does not fit."""
    if q.get("resume"):
        resume(ctl, req.vm_id or "", q.get("history"))
        return ctl.get_vm(req.vm_id or "")
    try:
        return admit(ctl, req)
    except NoCapacity as refused:
        if may_reclaim(ctl, req, q.get("preempt")):
            with contextlib.suppress(NoCapacity):  # within its guarantee: what others borrow comes back
                preempt(ctl, req, cls, "reclaim")
                return admit(ctl, req)
        if not wants_preemption(cls, q.get("preempt")):
            raise refused from None
        # a waiting request whose class preempts does not wait while lower preemptible VMs hold its room
        preempt(ctl, req, cls, "capacity")
        return admit(ctl, req)


def capacity_freed(ctl: Controller) -> list[str]:
    """What a release (a new host, an uncordon) calls: fold old usage intervals when many, then admit what
    waits; the VMs admitted. Best effort: the change that freed capacity is done, so a failure here is logged and
    left to the next trigger (or `vgpuctl queue --admit`)."""
    try:
        return _capacity_freed(ctl)
    except Exception:
        log.exception("admitting queued requests failed; they stay queued")
        return []


def _capacity_freed(ctl: Controller) -> list[str]:
    with ctl.read() as conn:
        waiting = STORE.scheduling.queued_count(conn, QUEUE_HOLDER)
        closed = STORE.scheduling.interval_count(conn)
    if closed >= COMPACT_AT:
        with ctl.tx() as conn:
            compact(conn, time.time(), settings(conn)["half_life_s"])
    return admit_queued(ctl) if waiting else []


def cancel_queued(ctl: Controller, op_id: str) -> None:
    """Take a queued request out of the queue (its operation fails as cancelled); NotFound if it is not
    queued or not the caller's."""
    with ctl.tx() as conn:
        row = STORE.operations.operation(conn, op_id)
        holder = (row.lease_holder or "") if row is not None else ""
        if row is None or row.state != "pending" or not (holder == QUEUE_HOLDER or holder.startswith(ADMITTER)) or (
                ctl.principal.tenant_id is not None and row.tenant_id != ctl.principal.tenant_id):
            raise NotFound(f"queued request {op_id!r} not found", reasons=[{"field": "operation", "value": op_id}])
        if holder != QUEUE_HOLDER:
            raise Conflict(f"queued request {op_id!r} is being tried for admission right now; cancel it again "
                           "in a moment (if it was admitted, delete its VM instead)",
                           reasons=[{"field": "operation", "value": op_id}])
        _drop_queued(conn, op_id, "taken out of the queue")
        record(conn, ctl.principal.actor, "vm.dequeue", f"operation:{op_id}",
               params={"name": row.request.get("name")})


# -- metrics ----------------------------------------------------------------------------------------------------

def preemption_counts(conn: Tx) -> dict[tuple[str, str], int]:
    """Preemptions done so far by (reason, mode), counted from the audit trail (every replica's)."""
    out: dict[tuple[str, str], int] = {}
    for params in STORE.scheduling.event_params(conn, "vm.preempted", "ok"):
        p = params if isinstance(params, dict) else {}
        key = (str(p.get("reason", "unknown")), str(p.get("mode", "unknown")))
        out[key] = out.get(key, 0) + 1
    return out



# -- the request path -------------------------------------------------------------------------------------------

def check_deadline(seconds: object) -> float:
    """A queue deadline if it is a positive number of seconds (at most a year); InvalidInput naming the field."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 366 * 86400:
        raise InvalidInput(f"queue_deadline must be a number of seconds from 1 to a year (field queue_deadline, "
                           f"value {seconds!r})", reasons=[{"field": "queue_deadline", "value": seconds}])
    return float(seconds)


def after_refusal(ctl: Controller, req: VmRequest, exc: Refused, preempt: bool | None,
                  queue: bool, deadline_s: float | None = None) -> Any:
    """What `request_vm` does with a refused request: for a lack of capacity, reclaim borrowed VMs when the
    request stays within its tenant's guarantee (`may_reclaim`), else (or if that does not help) preempt (as
    asked, else as the class's policy says) and claim again; if it still does not fit and `queue`, queue it (the
    pending operation is returned). Otherwise the refusal is raised again. Returns what the claim returns."""
    from vgpu_ctl.service.operations import get as get_operation
    if isinstance(exc, NoCapacity) and may_reclaim(ctl, req, preempt):
        try:  # within its guarantee: take back what others borrow first
            return reclaim_then_claim(ctl, req, exc)
        except NoCapacity as again:
            exc = again
        except Refused as again:
            exc = again
    if isinstance(exc, NoCapacity):
        with ctl.read() as conn:
            cls = resolve(conn, ctl._tenant_id(conn, req.tenant), req.tenant, req.priority)
        if preempt and cls.preemption_policy is PreemptionPolicy.NEVER:
            exc = NoCapacity(f"{exc.message}; priority class {cls.name!r} has preemption policy 'never': its "
                             "requests wait, they do not preempt",
                             reasons=[*exc.reasons, {"kind": "preemption", "priority_class": cls.name,
                                                     "preemption_policy": "never"}])
        elif wants_preemption(cls, preempt):
            try:
                preempt_for(ctl, req, cls)
                return claim.claim(ctl, req)
            except NoCapacity as again:  # the refusal as it was, and why preempting did not help
                exc = NoCapacity(f"{exc.message}; {again.message}", reasons=[*exc.reasons, *again.reasons])
            except Refused as again:
                exc = again
    if queue:
        op_id = enqueue(ctl, req, exc, preempt, None if deadline_s is None else time.time() + deadline_s)
        with ctl.read() as conn:
            return get_operation(conn, ctl.principal, op_id)
    raise exc


def preempt_for(ctl: Controller, req: VmRequest, cls: PriorityClass) -> PreemptionPlan:
    """Preempt for a request (see `preempt`); NoCapacity when nothing allowed makes room."""
    return preempt(ctl, req, cls, "capacity")


def admit(ctl: Controller, req: VmRequest) -> Any:
    """Claim and provision a queued request now (no preemption); its VmInfo. Refused when it still does not
    fit."""
    from vgpu_ctl.service.provision import provision_vm
    claimed = claim.claim(ctl, req)
    if isinstance(claimed, claim.AlreadyMade):
        return ctl._made_by_key(req, claimed.vm_id, True)
    assert isinstance(claimed, claim.Claimed)
    provision_vm(ctl, claimed.vm.id)
    return ctl.get_vm(claimed.vm.id)


# -- the facade (Controller.scheduling) -------------------------------------------------------------------------

class Scheduling:
    """Scheduling's API for one Controller (its principal, its store): priority classes, tenants' classes and
    shares, accounts, settings, the fair-share report, the queue and preemption previews."""

    def __init__(self, ctl: Controller) -> None:
        """Act through `ctl` (its principal decides what may be seen and changed)."""
        self.ctl = ctl

    def create_class(self, name: str, value: int, *, preemptible: bool = False,
                     preemption_policy: str = "lower-priority", preemption_mode: str = "requeue",
                     default: bool = False, description: str = "") -> dict[str, Any]:
        """Add a priority class (admin only); see `create_class`."""
        self.ctl.principal.require_admin("priority create")
        with self.ctl.tx() as conn:
            return create_class(conn, self.ctl.principal.actor, name, value, preemptible=preemptible,
                                preemption_policy=preemption_policy, preemption_mode=preemption_mode,
                                default=default, description=description)

    def list_classes(self) -> list[dict[str, Any]]:
        """Every priority class, highest first, with its VMs (anyone may read them)."""
        with self.ctl.read() as conn:
            return list_classes(conn)

    def delete_class(self, name: str) -> None:
        """Remove an unused priority class (admin only)."""
        self.ctl.principal.require_admin("priority delete")
        with self.ctl.tx() as conn:
            delete_class(conn, self.ctl.principal.actor, name)

    def tenant(self, tenant: str) -> dict[str, Any]:
        """A tenant's scheduling settings (a tenant caller sees only its own)."""
        with self.ctl.read() as conn:
            return {"tenant": tenant, **tenant_settings(conn, self.ctl._tenant_id(conn, tenant))}

    def set_tenant(self, tenant: str, *, shares: int | None = None, account: str | None = _UNSET,
                   default_priority: str | None = _UNSET,
                   priority_classes: Collection[str] | None = _UNSET) -> dict[str, Any]:
        """Change a tenant's shares, account, default class or allowed classes (admin only)."""
        self.ctl.principal.require_admin("tenant set")
        with self.ctl.tx() as conn:
            t_id = self.ctl._tenant_id(conn, tenant)
            out = set_tenant(conn, self.ctl.principal.actor, t_id, tenant, shares=shares, account=account,
                             default_priority=default_priority, priority_classes=priority_classes)
            return {"tenant": tenant, **out}

    def set_account(self, name: str, shares: int = 1, parent: str | None = None) -> dict[str, Any]:
        """Add or change an account of the share tree (admin only)."""
        self.ctl.principal.require_admin("share account")
        with self.ctl.tx() as conn:
            return set_account(conn, self.ctl.principal.actor, name, shares, parent)

    def delete_account(self, name: str) -> None:
        """Remove an account without members (admin only)."""
        self.ctl.principal.require_admin("share account delete")
        with self.ctl.tx() as conn:
            delete_account(conn, self.ctl.principal.actor, name)

    def settings(self) -> dict[str, float]:
        """The scheduling settings (half-life, grace, cool-down, in seconds)."""
        with self.ctl.read() as conn:
            return settings(conn)

    def set_settings(self, **values: float | None) -> dict[str, float]:
        """Change scheduling settings (admin only); all of them after."""
        self.ctl.principal.require_admin("scheduling set")
        with self.ctl.tx() as conn:
            return set_settings(conn, self.ctl.principal.actor, values)

    def share(self, now: float | None = None) -> list[dict[str, Any]]:
        """The fair-share report (`sshare -l`); a tenant caller sees only its own row."""
        with self.ctl.read() as conn:
            return share_report(conn, self.ctl.catalog, self.ctl.principal, now)

    def queue(self) -> list[dict[str, Any]]:
        """What waits, in admission order (a tenant caller sees only its own)."""
        with self.ctl.read() as conn:
            return queue_report(conn, self.ctl.catalog, self.ctl.principal)

    def admit(self) -> list[str]:
        """Try to admit what waits now (admin only: it acts for every asker); the VMs admitted."""
        self.ctl.principal.require_admin("queue admit")
        return admit_queued(self.ctl)

    def cancel(self, op_id: str) -> None:
        """Take a queued request out of the queue (the admin, or the tenant that asked)."""
        cancel_queued(self.ctl, op_id)

    def preview(self, tenant: str, name: str, vgpus: Sequence[tuple[str, int]], *, vcpus: int, memory_mib: int,
                pool: str | None = None, labels: Mapping[str, str] | None = None, anti_affinity: str | None = None,
                priority: str | None = None) -> PreemptionPlan:
        """The victims preempting for this request would free (a dry run: nothing changes)."""
        from vgpu_ctl.service.requests import VgpuRequest, VmRequest
        req = VmRequest(tenant, name, tuple(VgpuRequest(p, n) for p, n in vgpus), vcpus, memory_mib, pool,
                        dict(labels or {}), anti_affinity, priority=priority)
        req.validate()
        plan = preview(self.ctl, req)
        me = self.ctl.principal.tenant
        if me is None:
            return plan
        # a tenant learns that other tenants' VMs would go (and at which priority), not which
        hidden = tuple(v if v.tenant == me else Victim("", "(another tenant)", "", "", v.priority_class, v.priority,
                                                       v.mode, ()) for v in plan.victims)
        return PreemptionPlan(plan.priority_class, plan.priority, plan.pool, plan.host, hidden, plan.reason)

    def preemption_counts(self) -> dict[tuple[str, str], int]:
        """Preemptions so far by (reason, mode)."""
        with self.ctl.read() as conn:
            return preemption_counts(conn)
