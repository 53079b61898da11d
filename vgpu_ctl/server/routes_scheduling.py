"""Scheduling: priority classes, tenants' scheduling settings, accounts of the share tree, the settings, the
fair-share report, the queue and preemption previews. Each route calls the Controller's `scheduling` facade as
the caller, so what a caller may see and change is what it may in process: a tenant sees only its own queue
entries and share row, another tenant's object is 404, a reader reads and never writes (403), and only the
admin changes classes, tenants, accounts and settings."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from vgpu_ctl.errors import InvalidInput, NotFound

from .deps import controller, principal_of, writer
from .problems import problem_responses
from .schemas import VmCreate, name_field

router = APIRouter(prefix="/v1", tags=["scheduling"], responses=problem_responses(400, 401, 403, 404),
                   dependencies=[Depends(principal_of)])
_WRITE = problem_responses(409)
Seconds = StrictInt | StrictFloat


class PriorityClassCreate(BaseModel):
    """A new priority class."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"name": "batch", "value": 100, "preemptible": True}]})
    name: str = name_field("The class", "batch")
    value: StrictInt = Field(description="Its priority, 0 to 1000000000 (higher first)",
                             json_schema_extra={"minimum": 0, "maximum": 10 ** 9, "examples": [100]})
    preemptible: StrictBool = Field(False, description="Its VMs may be preempted")
    preemption_policy: str = Field("lower-priority", description="May its requests preempt lower-priority "
                                   "preemptible VMs", json_schema_extra={"enum": ["never", "lower-priority"]})
    preemption_mode: str = Field("requeue", description="How its VMs are freed when preempted",
                                 json_schema_extra={"enum": ["requeue", "hibernate", "cancel"]})
    default: StrictBool = Field(False, description="The global default class")
    description: str = Field("", description="What the class is for", json_schema_extra={"maxLength": 500})


class TenantScheduling(BaseModel):
    """A tenant's scheduling to change: only the fields given change (null clears account, default_priority
    and priority_classes: no account, no default, any class)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"shares": 2, "priority_classes": ["batch", "prod"], "default_priority": "batch"}]})
    shares: StrictInt | None = Field(None, description="Fair-share shares (1 or more)",
                                     json_schema_extra={"minimum": 1, "maximum": 10 ** 9})
    account: str | None = name_field("Its account of the share tree", "research", default=None)
    priority_classes: list[str] | None = Field(None, description="The classes it may use (null: any)")
    default_priority: str | None = name_field("Its default priority class", "batch", default=None)


class AccountSet(BaseModel):
    """An account of the share tree: its shares among its siblings and its parent (null: the root)."""

    model_config = ConfigDict(extra="forbid")
    shares: StrictInt = Field(1, description="Shares among its siblings (1 or more)",
                              json_schema_extra={"minimum": 1, "maximum": 10 ** 9})
    parent: str | None = name_field("The parent account", "research", default=None)


class SettingsSet(BaseModel):
    """Scheduling settings to change, in seconds (null: back to the default); only the fields given change."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"half_life_s": 604800}]})
    half_life_s: Seconds | None = Field(None, description="Half-life of past usage")
    grace_s: Seconds | None = Field(None, description="Grace period of a preempted VM's shutdown")
    cooldown_s: Seconds | None = Field(None, description="Cool-down of a re-admitted victim")


# -- priority classes ---------------------------------------------------------------------------------------------

@router.get("/priority-classes", summary="List priority classes")
def list_classes(request: Request) -> list[dict[str, Any]]:
    """Every priority class, highest first, with how many VMs it has (any caller may read them)."""
    return controller(request).scheduling.list_classes()


@router.post("/priority-classes", status_code=201, summary="Create a priority class", responses=_WRITE)
def create_class(request: Request, body: PriorityClassCreate) -> dict[str, Any]:
    """Add a priority class (admin only)."""
    return writer(request).scheduling.create_class(
        body.name, body.value, preemptible=body.preemptible, preemption_policy=body.preemption_policy,
        preemption_mode=body.preemption_mode, default=body.default, description=body.description)


@router.delete("/priority-classes/{name}", status_code=204, summary="Delete a priority class", responses=_WRITE)
def delete_class(request: Request, name: str) -> Response:
    """Remove a priority class no VM, tenant or queued request uses (admin only)."""
    writer(request).scheduling.delete_class(name)
    return Response(status_code=204)


# -- tenants, accounts, settings ----------------------------------------------------------------------------------

@router.get("/tenants/{tenant}/scheduling", summary="A tenant's scheduling settings")
def get_tenant(request: Request, tenant: str) -> dict[str, Any]:
    """Its shares, account, allowed classes and default class (a tenant sees only its own)."""
    return controller(request).scheduling.tenant(tenant)


@router.put("/tenants/{tenant}/scheduling", summary="Change a tenant's scheduling settings", responses=_WRITE)
def set_tenant(request: Request, tenant: str, body: TenantScheduling) -> dict[str, Any]:
    """Change the fields given (admin only); the tenant's settings after."""
    given = body.model_fields_set
    kw: dict[str, Any] = {k: getattr(body, k) for k in ("account", "priority_classes", "default_priority")
                          if k in given}
    return writer(request).scheduling.set_tenant(tenant, shares=body.shares, **kw)


@router.put("/accounts/{name}", summary="Add or change an account of the share tree", responses=_WRITE)
def set_account(request: Request, name: str, body: AccountSet) -> dict[str, Any]:
    """The account with its shares and parent (admin only)."""
    return writer(request).scheduling.set_account(name, body.shares, body.parent)


@router.delete("/accounts/{name}", status_code=204, summary="Delete an account", responses=_WRITE)
def delete_account(request: Request, name: str) -> Response:
    """Remove an account without members (admin only)."""
    writer(request).scheduling.delete_account(name)
    return Response(status_code=204)


@router.get("/scheduling/settings", summary="Scheduling settings")
def get_settings(request: Request) -> dict[str, float]:
    """Half-life, grace period and cool-down, in seconds."""
    return controller(request).scheduling.settings()


@router.put("/scheduling/settings", summary="Change scheduling settings")
def set_settings(request: Request, body: SettingsSet) -> dict[str, float]:
    """Change the settings given (admin only); all of them after."""
    return writer(request).scheduling.set_settings(**{k: getattr(body, k) for k in body.model_fields_set})


# -- reports: share, queue, preemptions ---------------------------------------------------------------------------

@router.get("/scheduling/share", summary="Fair share (like sshare -l)")
def share(request: Request, now: float | None = Query(None, description="As of this time (epoch seconds; "
                                                                        "default: now)")) -> list[dict[str, Any]]:
    """Per account and tenant the shares, decayed usage, level fairshare, rank and factor (a tenant sees its
    own row only)."""
    return controller(request).scheduling.share(now)


@router.get("/queue", summary="What waits for capacity")
def queue(request: Request, tenant: str | None = Query(None, description="Only this tenant's requests "
                                                                          "(positions stay the queue's)")
          ) -> list[dict[str, Any]]:
    """The queued requests in admission order (priority, fair share, age) and why each waits (a tenant sees
    only its own; another tenant named is 404)."""
    ctl = controller(request)
    if tenant is not None:
        ctl.scheduling.tenant(tenant)  # NotFound for a tenant the caller can't see
    return [r for r in ctl.scheduling.queue() if tenant is None or r["tenant"] == tenant]


@router.get("/queue/{op_id}", summary="One queued request")
def queued(request: Request, op_id: str) -> dict[str, Any]:
    """A queued request as the queue lists it; 404 when it is not queued or not the caller's."""
    for r in controller(request).scheduling.queue():
        if r["operation"] == op_id:
            return r
    raise NotFound(f"queued request {op_id!r} not found", reasons=[{"field": "operation", "value": op_id}])


@router.post("/queue/admit", summary="Try to admit what waits now")
def admit(request: Request) -> dict[str, list[str]]:
    """Admit each queued request that fits now (admin only: it acts for every asker); the VMs admitted."""
    return {"admitted": writer(request).scheduling.admit()}


@router.delete("/queue/{op_id}", status_code=204, summary="Take a request out of the queue")
def cancel(request: Request, op_id: str) -> Response:
    """Its operation fails as cancelled (the admin, or the tenant that asked; another's is 404)."""
    writer(request).scheduling.cancel(op_id)
    return Response(status_code=204)


@router.post("/scheduling/preview", summary="Preemption dry run: the victims", responses=problem_responses(409))
def preview(request: Request, body: VmCreate) -> dict[str, Any]:
    """Which VMs preempting for this request would free, and where it would go (nothing changes; a tenant
    sees other tenants' victims as '(another tenant)')."""
    p = principal_of(request)
    tenant = body.tenant if body.tenant is not None else p.tenant
    if tenant is None:
        raise InvalidInput("tenant is required when the caller is not a tenant", reasons=[{"field": "tenant"}])
    plan = controller(request).scheduling.preview(
        tenant, body.name, [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
        memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
        priority=body.priority)
    return plan.to_dict()


@router.get("/scheduling/preemptions", summary="Preemptions so far by reason and mode")
def preemptions(request: Request) -> list[dict[str, Any]]:
    """`[{"reason", "mode", "count"}]`, from the audit trail (every replica's)."""
    counts = controller(request).scheduling.preemption_counts()
    return [{"reason": r, "mode": m, "count": n} for (r, m), n in sorted(counts.items())]
