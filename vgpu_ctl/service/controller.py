"""The Controller: the typed API every interface uses. It owns transactions and the order of side effects."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from vgpu_ctl.catalog import Catalog, ProfileInfo
from vgpu_ctl.core.placement import (
    DevicePlacement,
    PlacementPlan,
    describe_refusal,
    rank_hosts,
)
from vgpu_ctl.core.vm_state import PROVISIONING, VmState
from vgpu_ctl.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    PermissionDenied,
    Refused,
    did_you_mean,
)
from vgpu_ctl.inventory import MAX_EVENTS, InventoryDecl, check_int, check_name, parse_inventory
from vgpu_ctl.service import allocation as alloc
from vgpu_ctl.service import claim as claims
from vgpu_ctl.service import operations as ops
from vgpu_ctl.service.audit import record
from vgpu_ctl.service.context import ServiceContext
from vgpu_ctl.service.inventory_apply import apply_inventory
from vgpu_ctl.service.leases import check_generation, new_holder
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.principals import (
    Principal,
    authenticate,
    create_api_token,
    hash_token,
    list_api_tokens,
    new_token,
    revoke_api_token,
)
from vgpu_ctl.service.quotas import repair_usage, set_limits, usage_report
from vgpu_ctl.service.requests import (
    BASE_RESOURCES,
    DeviceInfo,
    Placement,
    VgpuRequest,
    VmInfo,
    VmRequest,
)
from vgpu_ctl.store.tenants import TenantRow
from vgpu_ctl.store.unit import StoreEngine
from vgpu_ctl.store.vms import VmRow

if TYPE_CHECKING:
    from vgpu_ctl.hosts.protocol import DomainInfo
    from vgpu_ctl.planning.demand import Demand
    from vgpu_ctl.planning.rebalance import Move, RebalancePlan
    from vgpu_ctl.service.scheduling import Scheduling

TOKEN_ENV = "VGPU_CTL_TOKEN"
_ID_PREFIX = re.compile(r"[0-9a-f][0-9a-f-]{3,35}")  # at least 4 characters of a VM id, no LIKE wildcards


class Controller:
    """vgpu-ctl's service API: inventory, tenants and quotas, VM placement and lifecycle."""

    def __init__(self, url: str | None = None, *, engine: StoreEngine | None = None, catalog: Catalog | None = None,
                 token: str | None = None, actor: str | None = None, host_factory: Any = None,
                 state_path: Path | None = None, init: bool = True, context: ServiceContext | None = None,
                 principal: Principal | None = None) -> None:
        """Open the store (or share `context`, which the caller keeps and closes) and act as `principal`, or as
        whom `token` names (none: the admin). The admin's open upgrades the schema (unless not `init`); a token's
        open needs it at the newest revision."""
        self._owns = context is None
        if context is None:
            schema = "as-is" if not init else ("upgrade" if token is None and principal is None else "require")
            context = ServiceContext(url, engine=engine, catalog=catalog, host_factory=host_factory,
                                     state_path=state_path, schema=schema)
        self.ctx = context
        self.engine, self.catalog, self.hosts, self.state_path = (context.engine, context.catalog, context.hosts,
                                                                  context.state_path)
        try:
            self.principal = principal or self._principal(token, actor)
        except BaseException:
            if self._owns:
                context.close()
            raise

    @property
    def scheduling(self) -> Scheduling:
        """Priority classes, fair share, the queue and preemption."""
        from vgpu_ctl.service.scheduling import Scheduling
        return Scheduling(self)

    def acting_as(self, principal: Principal) -> Controller:
        """A Controller on the same store and hosts acting for `principal` (closing it closes nothing shared)."""
        return Controller(context=self.ctx, principal=principal)

    # -- plumbing ---------------------------------------------------------------------------------------------

    def init(self, refresh_fit_masks: bool = False) -> str:
        """Create or upgrade the store's schema and bring the GPUs' fit masks up to date with the catalog
        (all of them recomputed with `refresh_fit_masks`); the revision it is at. Admin only."""
        self._admin("init")
        return self.ctx.upgrade(refresh_fit_masks)

    def read(self) -> AbstractContextManager[Tx]:
        """A connection for reads (on SQLite its transactions hold no lock, so writers never wait for them)."""
        return self.ctx.read()

    def tx(self) -> AbstractContextManager[Tx]:
        """One transaction (SQLite: taken with BEGIN IMMEDIATE, in turn with this store's other controllers)."""
        return self.ctx.tx()

    def write_turn(self) -> AbstractContextManager[None]:
        """Wait for this process's turn to write (SQLite: the store's writer queue; PostgreSQL: no wait)."""
        return self.ctx.write_turn()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release database and host connections (of a shared context: nothing, its owner closes it)."""
        if self._owns:
            self.ctx.close()

    def _principal(self, token: str | None, actor: str | None) -> Principal:
        if token is None:
            return Principal(actor or "admin")
        with self.read() as conn:
            return authenticate(conn, token, actor)

    def _admin(self, what: str) -> None:
        self.principal.require_admin(what)

    def _writer(self, what: str) -> None:
        """PermissionDenied for a reader token, which may read everything and change nothing."""
        if self.principal.role == "reader":
            raise PermissionDenied(f"{what} changes the store; a reader token ({self.principal.actor}) may only "
                                   "read", reasons=[{"field": "role", "value": "reader"}])

    def _tenant_row(self, conn: Tx, name: str) -> TenantRow:
        row = STORE.tenants.tenant_by_name(conn, name)
        self._visible_tenant(name, row.id if row is not None else None)
        assert row is not None
        return row

    def _tenant_id(self, conn: Tx, name: str) -> int:
        return self._visible_tenant(name, STORE.tenants.tenant_id(conn, name))

    def _visible_tenant(self, name: str, tenant_id: int | None) -> int:
        """The tenant's id if it exists and the caller may see it (the admin, or that tenant); else NotFound."""
        if tenant_id is None or (self.principal.tenant_id is not None and tenant_id != self.principal.tenant_id):
            raise NotFound(f"tenant {name!r} not found", reasons=[{"field": "tenant", "value": name}])
        return int(tenant_id)

    # -- catalog and inventory --------------------------------------------------------------------------------

    def profiles(self, model: str | None = None) -> list[ProfileInfo]:
        """The catalog's profiles, of one model or all."""
        return self.catalog.profiles(model)

    def apply_inventory(self, path: str | Path, dry_run: bool = False,
                        progress: Callable[[int, int, str], None] | None = None, *, prune: bool = False,
                        expected_removals: Collection[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        """Add and update what an inventory file declares (with `prune`, also remove what it leaves out; else
        that is reported as `keep`); the changes (none made with dry_run). See `apply_declaration`."""
        self._admin("inventory apply")
        inv = parse_inventory(Path(path), self.catalog)
        return self.apply_declaration(inv, dry_run=dry_run, source=str(path), progress=progress, prune=prune,
                                      expected_removals=expected_removals)

    def apply_declaration(self, inv: InventoryDecl, dry_run: bool = False, source: str = "api",
                          progress: Callable[[int, int, str], None] | None = None, *, prune: bool = False,
                          expected_removals: Collection[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        """Add and update a parsed inventory's pools, hosts and GPUs (with `prune`, also remove those it leaves
        out); the changes (none made with dry_run). With `expected_removals` (the (kind, name) pairs a preview
        showed), Conflict and nothing changed if the apply would remove anything else."""
        self._admin("inventory apply")
        for pool in inv.pools:  # a pool's template is checked now, not at its first VM's provisioning
            if pool.template is not None:
                try:
                    self.hosts.renderer.check_template(pool.template)
                except InvalidInput as exc:
                    raise InvalidInput(f"pool {pool.name!r}: {exc.message}",
                                       reasons=[{"field": f"pools.{pool.name}.template", "value": pool.template}]
                                       ) from None
        from vgpu_ctl.service.host_types import discover_hosts, record_all
        found = discover_hosts(self, inv.hosts)  # libvirt hosts: what each calls each profile (no lock held)
        with self.engine.connect() as conn, self.write_turn():
            trans = conn.begin()
            try:
                changes = apply_inventory(conn, self.catalog, inv, progress, prune=prune,
                                          expected_removals=expected_removals)
                changes += record_all(conn, self.catalog, found)
                if dry_run:
                    trans.rollback()
                else:
                    if any(c["action"] != "keep" for c in changes):
                        record(conn, self.principal.actor, "inventory.apply", source,
                               params={"changes": sum(c["action"] != "keep" for c in changes)})
                    trans.commit()
            except BaseException:
                trans.rollback()
                raise
        if not dry_run and any(c["action"] != "keep" for c in changes):
            from vgpu_ctl.service.scheduling import capacity_freed
            capacity_freed(self)  # a new host or GPU: queued requests that fit now are admitted
        return changes

    def set_host_state(self, name: str, state: str) -> dict[str, Any]:
        """Set a host's scheduling state: `draining` (cordon: no new VMs, its VMs stay), `active` (uncordon),
        `down`. The host, the state before and after, and the VMs still on it."""
        self._admin("host state")
        from vgpu_ctl.service.hosts import set_host_state
        with self.tx() as conn:
            out = set_host_state(conn, name, state)
            if out["from"] != state:
                record(conn, self.principal.actor, "host.state", name, params={"from": out["from"], "to": state})
        if state == "active" and out["from"] != state:
            from vgpu_ctl.service.scheduling import capacity_freed
            capacity_freed(self)  # an uncordoned host: queued requests that fit now are admitted
        return out

    def inventory(self) -> dict[str, Any]:
        """Pools, hosts and GPUs as the store holds them (the admin and readers)."""
        self.principal.require_reader("inventory show")
        inv = STORE.inventory
        with self.read() as conn:
            by_name = inv.pools_by_name(conn)
            pools = {r["id"]: r["name"] for r in by_name}
            hosts = []
            for h in inv.hosts_by_name(conn):
                gpus = [{"pci": g["pci_address"], "model": g["model"], "mode": g["mode"],
                         "pool": pools.get(g["pool_id"]), "vgpu_type": g["pinned_type"], "layout": g["layout"],
                         "devices": g["device_count"], "free_units": g["free_units"], "axis_units": g["axis_units"]}
                        for g in inv.host_gpus(conn, h["id"])]
                hosts.append({"name": h["name"], "uri": h["uri"], "driver": h["driver"],
                              "simulated": h["driver"] == "simulated", "state": h["state"], "labels": h["labels"],
                              "vcpus": h["vcpus"], "memory_mib": h["memory_mib"], "used_vcpus": h["used_vcpus"],
                              "used_memory_mib": h["used_memory_mib"], "gpus": gpus})
        pool_list = [{"name": r["name"], "policy": r["policy"], "template": r["template"],
                      "description": r["description"]} for r in by_name]
        return {"pools": pool_list, "hosts": hosts}

    def pools(self) -> list[dict[str, Any]]:
        """Each pool with its policy, GPU count, the profiles it offers and its demand (typical requests)."""
        from vgpu_ctl.core.geometry import geometry_for
        with self.read() as conn:
            out = []
            for p in STORE.inventory.pools_by_name(conn):
                gpus = STORE.inventory.pool_gpu_kinds(conn, p["id"])
                offered = sorted({s for m, mode in set(gpus) for s in geometry_for(self.catalog, m, mode).shapes})
                out.append({"name": p["name"], "policy": p["policy"], "gpus": len(gpus), "profiles": offered,
                            "template": p["template"], "description": p["description"], "demand": p["demand"]})
        return out

    # -- tenants and quotas -----------------------------------------------------------------------------------

    def create_tenant(self, name: str) -> dict[str, Any]:
        """Add a tenant (no limits: everything unlimited until quotas are set)."""
        self._admin("tenant create")
        check_name("tenant", name)
        with self.tx() as conn:
            if not STORE.tenants.add_tenant(conn, name):
                raise Conflict(f"tenant {name!r} already exists", reasons=[{"field": "tenant", "value": name}])
            record(conn, self.principal.actor, "tenant.create", name, tenant=name)
        return {"name": name}

    def list_tenants(self) -> list[dict[str, Any]]:
        """Tenants (a tenant caller sees only itself)."""
        with self.read() as conn:
            return [{"name": t.name, "vms": t.vms_used, "vgpus": t.vgpus_used,
                     "framebuffer_mib": t.framebuffer_mib_used, "has_token": t.token_hash is not None,
                     "generation": t.generation}
                    for t in STORE.tenants.tenant_rows(conn, self.principal.tenant_id)]

    def get_tenant(self, name: str) -> dict[str, Any]:
        """One tenant with its generation (its ETag), usage and limits (a tenant caller sees only itself)."""
        with self.read() as conn:
            t = self._tenant_row(conn, name)
            return {"name": t.name, "generation": t.generation, "has_token": t.token_hash is not None,
                    "created_at": t.created_at.isoformat(), "quota": usage_report(conn, t.id)}

    def delete_tenant(self, name: str, if_generation: int | None = None) -> None:
        """Remove a tenant that has no VMs (PreconditionFailed, nothing changed, when `if_generation` is given
        and the tenant has changed since)."""
        self._admin("tenant delete")
        with self.tx() as conn:
            t = self._tenant_row(conn, name)
            check_generation(t, if_generation, "tenant", name)
            vms = STORE.tenants.tenant_vm_names(conn, t.id)
            if vms:
                raise Conflict(f"tenant {name!r} still has VMs: {', '.join(vms)}; delete them first",
                               reasons=[{"tenant": name, "vms": vms}])
            STORE.tenants.remove_tenant(conn, t.id)
            record(conn, self.principal.actor, "tenant.delete", name, tenant=name)

    def issue_token(self, name: str) -> str:
        """A new API token for the tenant (the previous one stops working); only its hash is stored."""
        self._admin("tenant token")
        token = new_token("vgt")
        with self.tx() as conn:
            t = self._tenant_row(conn, name)
            STORE.tenants.set_token_hash(conn, t.id, hash_token(token))
            record(conn, self.principal.actor, "tenant.token", name, tenant=name)
        return token

    def revoke_token(self, name: str) -> None:
        """Revoke the tenant's API token."""
        self._admin("tenant token --revoke")
        with self.tx() as conn:
            t = self._tenant_row(conn, name)
            STORE.tenants.set_token_hash(conn, t.id, None)
            record(conn, self.principal.actor, "tenant.token.revoke", name, tenant=name)

    def create_api_token(self, name: str, role: str) -> str:
        """Issue an API token for `role` (admin or reader) named `name`; the token (only its hash is kept)."""
        self._admin("token create")
        with self.tx() as conn:
            return create_api_token(conn, self.principal.actor, name, role)

    def list_api_tokens(self) -> list[dict[str, Any]]:
        """The API tokens (name, role, created), never the tokens themselves."""
        self._admin("token list")
        with self.read() as conn:
            return list_api_tokens(conn)

    def revoke_api_token(self, name: str) -> None:
        """Revoke an API token."""
        self._admin("token revoke")
        with self.tx() as conn:
            revoke_api_token(conn, self.principal.actor, name)

    def set_quota(self, tenant: str, limits: Mapping[str, int | None], pool: str | None = None,
                  if_generation: int | None = None,
                  guarantees: Mapping[str, int | None] | None = None) -> dict[str, Any]:
        """Set (int) or clear (None) limits of a tenant, globally or within one pool. Keys: vms, vgpus,
        framebuffer_mib, vcpus, memory_mib, profile:NAME. `guarantees` sets or clears the guaranteed part of the
        base resources' limits (usage above it is borrowed, and reclaimable by tenants below their guarantee);
        InvalidInput naming the field, nothing changed, for a guarantee below 0 or above its limit.
        PreconditionFailed, nothing changed, when `if_generation` is given and the tenant (its usage or limits)
        has changed since."""
        self._admin("quota set")
        for key in limits:
            if key.startswith("profile:") and key[8:] not in self.catalog.profile_names():
                raise InvalidInput(f"unknown profile {key[8:]!r} in --profile"
                                   f"{did_you_mean(key[8:], self.catalog.profile_names())}",
                                   reasons=[{"field": "profile", "value": key[8:]}])
        with self.tx() as conn:
            t = self._tenant_row(conn, tenant)
            check_generation(t, if_generation, "tenant", tenant)
            if pool is not None:
                claims.pool_row(conn, pool)
            changes = set_limits(conn, t.id, pool or "*", limits, guarantees)
            record(conn, self.principal.actor, "quota.set", tenant, tenant=tenant,
                   params={"pool": pool, "limits": changes})
        return changes

    def repair_usage(self, dry_run: bool = True) -> list[dict[str, Any]]:
        """Recompute every tenant's and host's usage from what is allocated; the changes (each object,
        resource, stored and allocated value). A dry run (the default) changes nothing; otherwise the changes
        are made in one transaction and audited (admin only)."""
        self._admin("db repair-usage")
        with self.engine.connect() as conn, self.write_turn(), conn.begin() as trans:
            changes = repair_usage(conn)
            if dry_run:
                trans.rollback()
            elif changes:
                record(conn, self.principal.actor, "usage.repair", "usage",
                       params={"changes": len(changes), "repaired": changes})
        return changes

    def tenant_usage(self, tenant: str) -> list[dict[str, Any]]:
        """Each limit of the tenant with its usage."""
        with self.read() as conn:
            t = self._tenant_row(conn, tenant)
            return usage_report(conn, t.id)

    # -- VMs --------------------------------------------------------------------------------------------------

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, provision: bool = True,
                   priority: str | None = None, preempt: bool | None = None, queue: Literal[False] = False,
                   queue_deadline_s: float | None = None) -> VmInfo:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, provision: bool = True,
                   priority: str | None = None, preempt: bool | None = None,
                   queue: Literal[True], queue_deadline_s: float | None = None) -> VmInfo | ops.OperationInfo:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[True], provision: bool = True,
                   priority: str | None = None, preempt: bool | None = None, queue: bool = False,
                   queue_deadline_s: float | None = None) -> Placement:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: bool = False,
                   provision: bool = True, priority: str | None = None, preempt: bool | None = None,
                   queue: bool = False,
                   queue_deadline_s: float | None = None) -> VmInfo | Placement | ops.OperationInfo:
        ...

    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: bool = False,
                   provision: bool = True, priority: str | None = None, preempt: bool | None = None,
                   queue: bool = False,
                   queue_deadline_s: float | None = None) -> VmInfo | Placement | ops.OperationInfo:
        """Place a VM with vGPUs and claim them in one transaction; then (unless dry_run) create its devices
        and domain. Returns VmInfo, or a Placement with dry_run. QuotaExceeded / NoCapacity explain a refusal.
        `priority` names its priority class; when nothing fits, lower-priority preemptible VMs are preempted if
        `preempt` (None: as the class's policy says), and with `queue` the request waits (the pending operation
        is returned) instead of being refused, for at most `queue_deadline_s` seconds if given. See
        service.scheduling."""
        if isinstance(vgpus, str):
            vgpus = [VgpuRequest(vgpus, 1)]
        wants = tuple(v if isinstance(v, VgpuRequest) else VgpuRequest(v[0], v[1]) for v in vgpus)
        req = VmRequest(tenant, name, wants, vcpus, memory_mib, pool, dict(labels or {}), anti_affinity,
                        idempotency_key, template, lease_holder=new_holder() if provision and not dry_run else None,
                        priority=priority)
        if not dry_run:
            self._writer("vm create")
        req.validate()
        if queue_deadline_s is not None:
            from vgpu_ctl.service.scheduling import check_deadline
            check_deadline(queue_deadline_s)
        if template is not None:  # before the claim: a bad name changes nothing
            self.hosts.renderer.check_template(template)
        try:
            claim = self.ctx.allocator.claim if self.ctx.allocator is not None else claims.claim
            claimed = claim(self, req, dry_run)
        except Refused as exc:
            if dry_run:
                raise
            self._record_refusal(req, exc)
            from vgpu_ctl.service.scheduling import after_refusal
            retried = after_refusal(self, req, exc, preempt, queue, queue_deadline_s)
            if isinstance(retried, ops.OperationInfo):
                return retried
            claimed = retried
        if isinstance(claimed, claims.Planned):
            return claimed.placement
        if isinstance(claimed, claims.AlreadyMade):
            return self._made_by_key(req, claimed.vm_id, provision and not dry_run)
        if not provision:
            return claimed.vm  # just claimed: what the claim wrote, without reading it back
        from vgpu_ctl.service.provision import provision_vm
        provisioned = provision_vm(self, claimed.vm.id, req.lease_holder)  # the VM as provisioned, not read back
        return provisioned if provisioned is not None else self.get_vm(claimed.vm.id)

    def placement_candidates(self, tenant: str, vgpus: Sequence[VgpuRequest | tuple[str, int]], *, vcpus: int,
                             memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                             anti_affinity: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """The hosts of the pools that offer the request, ranked as each pool's policy would (rank 1: where it
        goes; pools in the order a request tries them), with the positions each would give, then the hosts it
        does not fit with why not, in an admin's words; at most `limit`. Nothing is claimed and quotas are not
        applied (a dry run of request_vm says whether they allow it)."""
        check_int("limit", limit, 1, 1000)
        wants = tuple(v if isinstance(v, VgpuRequest) else VgpuRequest(v[0], v[1]) for v in vgpus)
        req = VmRequest(tenant, "candidates", wants, vcpus, memory_mib, pool, dict(labels or {}), anti_affinity)
        req.validate()
        fits: list[dict[str, Any]] = []
        others: list[dict[str, Any]] = []
        with self.read() as conn:
            ask = claims.read_ask(self, conn, req)
            assert isinstance(ask, claims.Ask)  # no idempotency key was given
            for p in ask.pools:
                found = alloc.all_candidates(conn, self.catalog, [p.id], ask.profiles, req.anti_affinity,
                                             ask.pool_names)
                for c in rank_hosts(ask.preq, found.hosts, claims.pool_policy(p.policy, p.demand)):
                    row: dict[str, Any] = {
                        "pool": p.name, "host": c.host, "rank": c.rank,
                        "score": [round(x, 6) for x in c.score] if c.score is not None else None,
                        "devices": [{"gpu": f"{c.host}/{found.pcis[d.gpu_id]}", "profile": d.profile,
                                     "start": d.start, "size": d.size} for d in (c.plan.devices if c.plan else ())],
                        "why_not": describe_refusal(c.refusal) if c.plan is None else None,
                        "reasons": dict(c.refusal)}
                    (fits if c.plan is not None else others).append(row)
        return (fits + others)[:limit]

    def record_gpu_loads(self, loads: Mapping[int, float]) -> int:
        """Keep measured GPU loads (store GPU id -> 0..1, from NVML) as what spread-load pools place by; how
        many (admin only: the server's leader records them on an interval)."""
        self._admin("record GPU loads")
        from vgpu_ctl.service import gpu_loads
        with self.tx() as conn:
            return gpu_loads.record(conn, loads)

    def _made_by_key(self, req: VmRequest, vm_id: str, provision: bool) -> VmInfo:
        """The VM an earlier request with the same idempotency key made, as it is now: Conflict naming the key
        when that request asked for something else, or when the VM failed. A VM still being provisioned with
        nobody working on it is finished; one stopped (or being deleted) is left as it is."""
        from vgpu_ctl.service.provision import provision_vm
        with self.read() as conn:
            vm = self._vm_row(conn, vm_id)
            pool = STORE.vms.pool_name(conn, vm.pool_id) if vm.pool_id is not None else None
        spec = vm.spec if isinstance(vm.spec, dict) else {}
        asked = sorted((v.profile, v.count) for v in req.vgpus)
        differs = [f for f, same in (
            ("name", vm.name == req.name), ("vcpus", vm.vcpus == req.vcpus),
            ("memory_mib", vm.memory_mib == req.memory_mib),
            ("profile", sorted((p, n) for p, n in spec.get("vgpus", [])) == asked),
            ("pool", (req.pool is None and spec.get("pool") is None) or pool == req.pool),
            ("labels", spec.get("labels", {}) == req.labels), ("anti_affinity", vm.anti_affinity == req.anti_affinity),
            ("template", spec.get("template", req.template) == req.template),
            ("disk_gib", spec.get("disk_gib", req.disk_gib) == req.disk_gib),
            ("network", spec.get("network", req.network) == req.network)) if not same]
        if differs:
            raise Conflict(f"idempotency key {req.idempotency_key!r} was already used for a different request "
                           f"(VM {vm.name!r}; differs in {', '.join(differs)}); use a new key",
                           reasons=[{"field": "idempotency_key", "value": req.idempotency_key, "vm": vm.name,
                                     "differs": differs}])
        if vm.state == VmState.FAILED:
            raise Conflict(f"idempotency key {req.idempotency_key!r} made VM {vm.name!r}, which failed "
                           f"({vm.error}); delete it to try again",
                           reasons=[{"field": "idempotency_key", "value": req.idempotency_key, "vm": vm.name,
                                     "state": vm.state}])
        if provision and vm.state in PROVISIONING:
            try:
                provision_vm(self, vm_id)
            except Conflict:
                return self.get_vm(vm_id)  # another process is working on it: the VM as it is now
        return self.get_vm(vm_id)

    def _record_refusal(self, req: VmRequest, exc: Refused) -> None:
        """Audit a refused request in its own transaction (the claim's was rolled back)."""
        with self.tx() as conn:
            record(conn, self.principal.actor, "vm.create", f"vm:{req.tenant}/{req.name}", tenant=req.tenant,
                   params={"name": req.name, "profiles": list(req.profiles()), "vcpus": req.vcpus,
                           "memory_mib": req.memory_mib, "pool": req.pool, "message": exc.message},
                   result="refused", error=exc.code)

    def adopt_domain(self, host: str, domain: DomainInfo) -> VmInfo:
        """Claim again, in this store, the VM a vgpu-ctl domain on `host` records (tenant, size and each device's
        GPU and position, as its metadata holds them), as it is on the host (running or stopped): for a domain
        this store lost (restored from an older backup, or made by another store). Admin only, audited, in one
        transaction; refused with nothing changed for a domain without positions in its metadata, a tenant or
        GPU this store lacks, a VM id or name it has, a position now taken, a quota it would pass."""
        self._admin("reconcile --adopt")
        claim = domain.claim
        where = [{"field": "domain", "value": domain.name}]
        if claim is None or not claim.devices:
            raise InvalidInput(f"domain {domain.name!r} records no device positions in its metadata (written by a "
                               "vgpu-ctl before they were kept, or by a template without them): it cannot be "
                               "adopted", reasons=where)
        suffix = f"-{claim.vm_id[:8]}"
        if not domain.name.endswith(suffix) or len(domain.name) == len(suffix):
            raise InvalidInput(f"domain {domain.name!r} is not named NAME{suffix} as its VM id says", reasons=where)
        profiles = tuple(d.profile for d in claim.devices)
        wants = tuple(VgpuRequest(p, n) for p, n in Counter(profiles).items())
        req = VmRequest(claim.tenant, domain.name[:-len(suffix)], wants, claim.vcpus, claim.memory_mib,
                        vm_id=claim.vm_id)
        req.validate()
        with self.tx() as conn:
            t_id = self._tenant_id(conn, claim.tenant)
            if STORE.vms.vm_row(conn, claim.vm_id) is not None:
                raise Conflict(f"VM {claim.vm_id} of domain {domain.name!r} is already in this store", reasons=where)
            gpus = STORE.hosts.gpus_of_host(conn, host)
            missing = sorted({d.gpu_pci for d in claim.devices} - set(gpus))
            pool_ids = {gpus[d.gpu_pci].pool_id for d in claim.devices if d.gpu_pci in gpus}
            if missing or len(pool_ids) != 1 or None in pool_ids:
                raise InvalidInput(f"domain {domain.name!r}: its GPUs ({', '.join(d.gpu_pci for d in claim.devices)}) "
                                   f"are not in one pool of host {host!r} in this store", reasons=where)
            pool = next(p for p in claims.all_pools(conn) if p.id in pool_ids)  # with the columns a claim needs
            names = {pool.id: pool.name}
            page = alloc.all_candidates(conn, self.catalog, [pool.id], profiles, None, names)
            view = next((h for h in page.hosts if h.name == host), None)
            if view is None:
                raise InvalidInput(f"domain {domain.name!r}: host {host!r} has no GPU for {', '.join(profiles)}",
                                   reasons=where)
            occ = {g.gpu_id: g.occupancy for g in view.gpus}
            placed = []
            for d in claim.devices:
                gid = gpus[d.gpu_pci].id
                occ[gid] = occ[gid].add(d.profile, d.start)  # InvalidInput when taken or not offered there
                placed.append(DevicePlacement(gid, d.profile, d.start, d.size))
            chosen = PlacementPlan(view.host_id, host, tuple(placed), {d.gpu_id: occ[d.gpu_id] for d in placed})
            delta = claims.charge_of(self.catalog, profiles, req.vcpus, req.memory_mib)
            charges = claims.scoped_charges(pool.name, delta, profiles)
            failed = claims.charge(conn, t_id, req.tenant, delta, charges)
            if failed:
                raise alloc.quota_refusal(conn, t_id, req.tenant, {}, failed, charges)
            cls = claims.take(conn, t_id, req, chosen, page)
            claims.record_vm(self, conn, t_id, req, pool, chosen, page, delta, charges, cls)
            by_position = {(r.gpu_id, r.start): r.id for r in STORE.vms.vm_devices(conn, claim.vm_id)}
            for d in claim.devices:  # the devices exist on the host: recorded as the domain has them
                mdev = "-" in d.host_ref
                handle = {"backing": d.backing, "uuid": d.host_ref if mdev else None,
                          "pci_address": None if mdev else d.host_ref, "gpu_instance_id": None}
                STORE.vms.adopt_device(conn, by_position[(gpus[d.gpu_pci].id, d.start)], d.device_id,
                                       d.host_ref if mdev else d.device_id, handle)
            STORE.vms.set_adopted(conn, claim.vm_id, (VmState.RUNNING if domain.active else VmState.STOPPED).value,
                                  domain.uuid)
            record(conn, self.principal.actor, "vm.adopt", f"vm:{claim.vm_id}", tenant=claim.tenant,
                   params={"name": req.name, "host": host, "domain": domain.name, "active": domain.active})
        return self.get_vm(claim.vm_id)

    def _vm_row(self, conn: Tx, ref: str) -> VmRow:
        vms = STORE.vms
        if "/" in ref:
            tname, _, vname = ref.partition("/")
            rows = vms.vms_by(conn, tenant=tname, name=vname)
        else:
            rows = vms.vms_by(conn, vm_id=ref) or vms.vms_by(conn, name=ref)
        if self.principal.tenant_id is not None:
            rows = [r for r in rows if r.tenant_id == self.principal.tenant_id]
        if not rows and _ID_PREFIX.fullmatch(ref):  # a unique prefix of the id, as `vm list` shows it
            rows = [r for r in vms.vms_by(conn, id_prefix=ref, limit=50)
                    if self.principal.tenant_id is None or r.tenant_id == self.principal.tenant_id]
            if len(rows) > 1:
                raise InvalidInput(f"VM id prefix {ref!r} matches {len(rows)} VMs "
                                   f"({', '.join(sorted(r.id[:12] for r in rows))}); give more of the id",
                                   reasons=[{"field": "vm", "value": ref}])
        if not rows:
            raise NotFound(f"VM {ref!r} not found", reasons=[{"field": "vm", "value": ref}])
        if len(rows) > 1:
            raise InvalidInput(f"VM name {ref!r} is used by several tenants; use TENANT/NAME or the VM id",
                               reasons=[{"field": "vm", "value": ref}])
        return rows[0]

    def _vm_info(self, conn: Tx, vm: VmRow) -> VmInfo:
        host = STORE.vms.host_of(conn, vm.host_id) if vm.host_id else None
        pool = STORE.vms.pool_name(conn, vm.pool_id) if vm.pool_id else None
        devices = tuple(DeviceInfo(d.id, f"{host[0] if host else '?'}/{d.pci_address}", d.gpu_id, d.profile,
                                   d.kind, d.start, d.size, d.uuid, d.backing, d.state)
                        for d in STORE.vms.vm_devices(conn, vm.id))
        return VmInfo(vm.id, vm.name, str(vm.tenant_name), host[0] if host else None, pool, vm.state, vm.vcpus,
                      vm.memory_mib, vm.framebuffer_mib, devices, vm.error, vm.domain_uuid,
                      bool(host and host[1] == "simulated"), vm.generation)

    def get_vm(self, ref: str) -> VmInfo:
        """One VM by id, name, or TENANT/NAME (a tenant caller sees only its own)."""
        with self.read() as conn:
            return self._vm_info(conn, self._vm_row(conn, ref))

    def list_vms(self, tenant: str | None = None) -> list[VmInfo]:
        """VMs, of one tenant or all (a tenant caller sees only its own)."""
        with self.read() as conn:
            only = self._tenant_row(conn, tenant).id if tenant is not None else self.principal.tenant_id
            return [self._vm_info(conn, vm) for vm in STORE.vms.tenant_vms(conn, only)]

    def release_vm(self, ref: str, if_generation: int | None = None) -> None:
        """Delete a VM: its domain, then its devices, then its claim and quota charge (PreconditionFailed,
        nothing changed, when `if_generation` is given and the VM has changed since)."""
        from vgpu_ctl.service.provision import release_vm
        self._writer("vm delete")
        with self.read() as conn:
            vm = self._vm_row(conn, ref)
        release_vm(self, vm.id, generation=if_generation)
        from vgpu_ctl.service.scheduling import capacity_freed
        capacity_freed(self)  # queued requests that fit now are admitted

    def stop_vm(self, ref: str, force: bool = False, if_generation: int | None = None) -> VmInfo:
        """Shut down a running VM (its devices stay claimed); PreconditionFailed as for release_vm."""
        from vgpu_ctl.service.provision import set_power
        self._writer("vm stop")
        with self.read() as conn:
            vm = self._vm_row(conn, ref)
        set_power(self, vm.id, on=False, force=force, generation=if_generation)
        return self.get_vm(vm.id)

    def start_vm(self, ref: str, if_generation: int | None = None) -> VmInfo:
        """Start a stopped VM; PreconditionFailed as for release_vm."""
        from vgpu_ctl.service.provision import set_power
        self._writer("vm start")
        with self.read() as conn:
            vm = self._vm_row(conn, ref)
        set_power(self, vm.id, on=True, generation=if_generation)
        return self.get_vm(vm.id)

    def vm_xml(self, ref: str) -> str:
        """The domain XML of a VM, rendered from its template and validated."""
        from vgpu_ctl.service.provision import render_vm
        with self.read() as conn:
            vm = self._vm_row(conn, ref)
            return render_vm(self, conn, vm.id)

    # -- operations (run by a server's workers) ---------------------------------------------------------------

    def submit_vm_create(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]], *,
                         vcpus: int, memory_mib: int, pool: str | None = None,
                         labels: Mapping[str, str] | None = None, anti_affinity: str | None = None,
                         idempotency_key: str | None = None, template: str | None = None,
                         priority: str | None = None, preempt: bool | None = None, queue: bool = False,
                         queue_deadline_s: float | None = None, holder: str,
                         lease_seconds: float) -> ops.OperationInfo:
        """Accept a VM request as an operation that `holder` (a worker pool) runs next; InvalidInput,
        NotFound or PermissionDenied at once, nothing recorded, for a request that could never be served (an
        unknown or disallowed priority class, a bad queue deadline included). The scheduling options travel in
        the operation's request to `request_vm`."""
        self._writer("vm create")
        wants = tuple(v if isinstance(v, VgpuRequest) else VgpuRequest(v[0], v[1]) for v in vgpus)
        req = VmRequest(tenant, name, wants, vcpus, memory_mib, pool, dict(labels or {}), anti_affinity,
                        idempotency_key, template, priority=priority)
        req.validate()
        from vgpu_ctl.service import scheduling
        if queue_deadline_s is not None:
            scheduling.check_deadline(queue_deadline_s)
        if template is not None:
            self.hosts.renderer.check_template(template)
        with self.tx() as conn:
            t_id = self._tenant_id(conn, tenant)
            if pool is not None:
                claims.pool_row(conn, pool)
            claims.check_profiles(conn, self.catalog, req, [], offers_too=False)
            scheduling.resolve(conn, t_id, tenant, priority)  # an unknown or disallowed class: refused now
            request = {"tenant": tenant, "name": name, "vgpus": [{"profile": v.profile, "count": v.count}
                                                                 for v in wants],
                       "vcpus": vcpus, "memory_mib": memory_mib, "pool": pool, "labels": dict(labels or {}),
                       "anti_affinity": anti_affinity, "idempotency_key": idempotency_key, "template": template,
                       "priority": priority, "preempt": preempt, "queue": queue,
                       "queue_deadline_s": queue_deadline_s}
            return ops.submit(conn, self.principal, "vm.create", request, tenant_id=t_id, vm_id=None, holder=holder,
                              lease_seconds=lease_seconds)

    def submit_vm_delete(self, ref: str, if_generation: int | None = None, *, holder: str,
                         lease_seconds: float) -> ops.OperationInfo:
        """Accept a VM's deletion as an operation that `holder` runs next; NotFound at once for a VM the
        caller cannot see, PreconditionFailed when `if_generation` is given and the VM has changed since."""
        self._writer("vm delete")
        with self.tx() as conn:
            vm = self._vm_row(conn, ref)
            check_generation(vm, if_generation, "VM", ref)
            return ops.submit(conn, self.principal, "vm.delete", {"vm": ref, "if_generation": if_generation},
                              tenant_id=vm.tenant_id, vm_id=vm.id, holder=holder, lease_seconds=lease_seconds)

    def get_operation(self, op_id: str) -> ops.OperationInfo:
        """One operation (a tenant caller sees only its own)."""
        with self.read() as conn:
            return ops.get(conn, self.principal, op_id)

    def list_operations(self, states: Collection[str] | None = None, limit: int = 100) -> list[ops.OperationInfo]:
        """Operations, newest first (a tenant caller sees only its own)."""
        check_int("limit", limit, 1, MAX_EVENTS)
        with self.read() as conn:
            return ops.list_operations(conn, self.principal, states, limit)

    def run_operation(self, op_id: str, holder: str, lease_seconds: float) -> bool:
        """Run the operation to its end as the principal who asked for it, if `holder` holds it or can take
        it over (nobody else holds it); whether it ran. Admin only: this is a worker's call."""
        self._admin("operation run")
        with self.read() as conn:
            row = ops.own(conn, op_id, holder)
            asker = ops.principal_of(conn, row) if row is not None else None
        if row is None:
            with self.tx() as conn:
                row = ops.take_over(conn, op_id, holder, lease_seconds)
                if row is None:
                    return False
                asker = ops.principal_of(conn, row)
        assert asker is not None
        vm_id, result, error = ops.execute(self.acting_as(asker), row)
        with self.tx() as conn:
            ops.finish(conn, op_id, holder, vm_id=vm_id, result=result, error=error)
        return True

    def rebalance_plan(self, goal: str = "free-gpus", pool: str | None = None,
                       demand: Demand | None = None) -> RebalancePlan:
        """The moves that would free whole GPUs or hosts (or the GPUs the carving advisor wants re-carved), on a
        copy of the store (admin only; nothing written): see `service.rebalance`."""
        from vgpu_ctl.service.rebalance import plan_rebalance
        return plan_rebalance(self, goal, pool, demand)

    def rebalance_apply(self, moves: Sequence[Move]) -> dict[str, Any]:
        """Carry a rebalance plan's moves out one at a time, each audited (`vm.move`) and undone on failure (the VM
        back where it was); stops at the first that fails. Admin only: see `service.rebalance.move_vm`."""
        from vgpu_ctl.service.rebalance import apply_moves
        return apply_moves(self, moves)

    def events(self, tenant: str | None = None, since: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Audit events, newest last (a tenant caller sees only its own); at most `limit` (1 to MAX_EVENTS)."""
        check_int("limit", limit, 1, MAX_EVENTS)
        if self.principal.tenant is not None:
            tenant = self.principal.tenant
        with self.read() as conn:
            rows = STORE.events.event_rows(conn, tenant, since, limit)
        return [{"id": r.id, "time": r.time.isoformat(), "actor": r.actor, "tenant": r.tenant, "action": r.action,
                 "target": r.target, "params": r.params, "result": r.result, "error": r.error} for r in rows]

    def reconcile(self, fix: bool = False, progress: Any = None,
                  confirm_undefine: Callable[[Any], bool] | None = None,
                  confirm_adopt: Callable[[Any], bool] | None = None) -> Any:
        """Compare store and hosts (orphan devices, unknown domains, lost VMs, interrupted requests: those no
        process holds a lease on); repair with fix (a domain of a VM the store does not know is adopted when
        `confirm_adopt(finding)` says yes, else a running one undefined only when `confirm_undefine(finding)`
        says yes)."""
        self._admin("reconcile")
        from vgpu_ctl.service.reconcile import reconcile
        return reconcile(self, fix=fix, progress=progress, confirm_undefine=confirm_undefine,
                         confirm_adopt=confirm_adopt)


__all__ = ["BASE_RESOURCES", "Controller", "Principal", "hash_token"]
