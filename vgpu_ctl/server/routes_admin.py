"""Catalog, inventory, hosts, tenants, quotas, tokens, and the operator's views (status, events, doctor,
reconcile)."""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response

from vgpu_ctl.ops.doctor import diagnose
from vgpu_ctl.ops.events import list_events
from vgpu_ctl.ops.status import fleet_status

from .deps import IF_MATCH, controller, etag, if_match, principal_of, writer
from .problems import problem_responses
from .schemas import (
    NAME_PATTERN,
    ApiTokenIssued,
    HostState,
    QuotaSet,
    ReconcileRun,
    TenantCreate,
    TenantInfo,
    TenantRow,
    TenantToken,
    TokenCreate,
)

# Every route authenticates its caller before its parameters and body are read: 401 comes first.
router = APIRouter(prefix="/v1", tags=["admin"], responses=problem_responses(400, 401, 403, 404),
                   dependencies=[Depends(principal_of)])
_WRITE = problem_responses(409, 412, 422)
TENANT = Path(description="The tenant", json_schema_extra={"pattern": NAME_PATTERN, "examples": ["acme"]})
HOST = Path(description="The host", json_schema_extra={"pattern": NAME_PATTERN, "examples": ["kvm-l40s-01"]})
TOKEN = Path(description="The API token's name", json_schema_extra={"pattern": NAME_PATTERN})
_ETAG: dict[int | str, dict[str, Any]] = {
    200: {"headers": {"ETag": {"description": "The tenant's generation", "schema": {"type": "string"}}}}}


@router.get("/profiles", summary="The catalog's profiles")
def profiles(request: Request, model: str | None = None) -> list[dict[str, Any]]:
    """Every profile of every model (or of one), as `vgpuctl profiles list` shows them."""
    return [p.to_dict() for p in controller(request).profiles(model)]


@router.get("/pools", summary="Pools")
def pools(request: Request) -> list[dict[str, Any]]:
    """Each pool with its policy, GPU count, the profiles it offers and its demand."""
    return controller(request).pools()


@router.get("/inventory", summary="Pools, hosts and GPUs")
def inventory(request: Request) -> dict[str, Any]:
    """The inventory as the store holds it (the admin and readers)."""
    return controller(request).inventory()


@router.post("/inventory", summary="Apply an inventory (YAML body)",
             responses={**_WRITE, **problem_responses(502)})
def apply_inventory(request: Request, body: str = Body(..., media_type="application/yaml"),
                    dry_run: bool = False, prune: bool = False,
                    source: str | None = Query(None, max_length=4096, description="The file's name as the caller "
                                               "knows it: errors and the audit trail name it"),
                    expect_removal: list[str] | None = Query(None, description="KIND:NAME of each removal a "
                                                             "preview showed (with check_removals)"),
                    check_removals: bool = Query(False, description="409, nothing changed, if the apply would "
                                                 "remove anything not in expect_removal")) -> list[dict[str, Any]]:
    """Add and update what the YAML inventory in the body declares (with `prune`, also remove what it leaves
    out); the changes, none made with `dry_run`."""
    from vgpu_ctl.errors import InvalidInput
    from vgpu_ctl.inventory import parse_inventory
    ctl = writer(request)
    ctl.principal.require_admin("inventory apply")
    expected = [(kind, name) for kind, _, name in (r.partition(":") for r in expect_removal or ())] \
        if check_removals else None
    with tempfile.TemporaryDirectory(prefix="vgpu-inv-") as d:
        path = pathlib.Path(d) / "inventory.yaml"
        path.write_text(body)
        try:
            inv = parse_inventory(path, ctl.catalog)
        except InvalidInput as exc:  # name the file as the caller knows it, not this temporary copy
            if source is not None:
                exc.message = exc.message.replace(str(path), source)
                exc.reasons = [{k: source if v == str(path) else v for k, v in r.items()} for r in exc.reasons]
            raise
        return ctl.apply_declaration(inv, dry_run=dry_run, source=source or "api", prune=prune,
                                     expected_removals=expected)


@router.get("/hosts", summary="Hosts")
def hosts(request: Request) -> list[dict[str, Any]]:
    """Hosts with their GPUs (the admin and readers)."""
    out: list[dict[str, Any]] = controller(request).inventory()["hosts"]
    return out


@router.put("/hosts/{name}/state", summary="Cordon, drain or mark a host down", responses=_WRITE)
def host_state(request: Request, body: HostState, name: str = HOST) -> dict[str, Any]:
    """Set the host's scheduling state; the state before and after, and the VMs still on it."""
    return writer(request).set_host_state(name, body.state)


@router.get("/tenants", summary="Tenants", response_model=list[TenantRow])
def tenants(request: Request) -> list[dict[str, Any]]:
    """Tenants with their usage (a tenant sees only itself)."""
    return controller(request).list_tenants()


@router.post("/tenants", status_code=201, summary="Create a tenant", response_model=TenantInfo,
             responses=_WRITE)
def create_tenant(request: Request, body: TenantCreate, response: Response) -> dict[str, Any]:
    """Add a tenant (no limits until quotas are set)."""
    ctl = writer(request)
    ctl.create_tenant(body.name)
    out = ctl.get_tenant(body.name)
    response.headers["Location"] = f"/v1/tenants/{body.name}"
    response.headers["ETag"] = etag(out["generation"])
    return out


@router.get("/tenants/{name}", summary="One tenant", response_model=TenantInfo, responses=_ETAG)
def get_tenant(request: Request, response: Response, name: str = TENANT) -> dict[str, Any]:
    """A tenant with its quota and usage, and its ETag."""
    out = controller(request).get_tenant(name)
    response.headers["ETag"] = etag(out["generation"])
    return out


@router.delete("/tenants/{name}", status_code=204, summary="Delete a tenant", responses=_WRITE,
               openapi_extra=IF_MATCH)
def delete_tenant(request: Request, name: str = TENANT) -> Response:
    """Remove a tenant that has no VMs; `If-Match` guards against a stale read."""
    writer(request).delete_tenant(name, if_generation=if_match(request))
    return Response(status_code=204)


@router.post("/tenants/{name}/token", summary="Issue a tenant's token", response_model=TenantToken,
             responses=_WRITE)
def issue_token(request: Request, name: str = TENANT) -> dict[str, str]:
    """A new token for the tenant (the previous one stops working)."""
    return {"tenant": name, "token": writer(request).issue_token(name)}


@router.delete("/tenants/{name}/token", status_code=204, summary="Revoke a tenant's token", responses=_WRITE)
def revoke_token(request: Request, name: str = TENANT) -> Response:
    """Revoke the tenant's token."""
    writer(request).revoke_token(name)
    return Response(status_code=204)


@router.get("/tenants/{name}/quota", summary="A tenant's limits and usage", responses=_ETAG)
def get_quota(request: Request, response: Response, name: str = TENANT) -> list[dict[str, Any]]:
    """Each limit of the tenant with its usage; the ETag is the tenant's."""
    out = controller(request).get_tenant(name)
    response.headers["ETag"] = etag(out["generation"])
    quota: list[dict[str, Any]] = out["quota"]
    return quota


@router.put("/tenants/{name}/quota", summary="Set a tenant's limits", responses={**_ETAG, **_WRITE},
            openapi_extra=IF_MATCH)
def set_quota(request: Request, body: QuotaSet, response: Response, name: str = TENANT) -> dict[str, Any]:
    """Set or clear limits; `If-Match` (the tenant's ETag) guards against a stale read."""
    ctl = writer(request)
    changes = ctl.set_quota(name, body.limits, pool=body.pool, if_generation=if_match(request),
                            guarantees=body.guarantees)
    response.headers["ETag"] = etag(ctl.get_tenant(name)["generation"])
    return changes


@router.get("/tokens", summary="API tokens")
def tokens(request: Request) -> list[dict[str, Any]]:
    """API tokens: name, role, created (never the token)."""
    return controller(request).list_api_tokens()


@router.post("/tokens", status_code=201, summary="Issue an API token", response_model=ApiTokenIssued,
             responses=_WRITE)
def create_token(request: Request, body: TokenCreate) -> dict[str, str]:
    """A new API token with a role (admin or reader); shown once."""
    return {"name": body.name, "role": body.role, "token": writer(request).create_api_token(body.name, body.role)}


@router.delete("/tokens/{name}", status_code=204, summary="Revoke an API token", responses=_WRITE)
def revoke_api_token(request: Request, name: str = TOKEN) -> Response:
    """Revoke an API token."""
    writer(request).revoke_api_token(name)
    return Response(status_code=204)


@router.get("/status", summary="Fleet status")
def status(request: Request, pool: str | None = None, host: str | None = None, gpus: bool = False,
           limit: int | None = Query(None), offset: int = 0) -> dict[str, Any]:
    """Occupancy by pool and host, what still fits, tenants' usage; per-GPU rows with `gpus`."""
    return fleet_status(controller(request), pool, host, gpus=gpus, limit=limit, offset=offset)


@router.get("/events", summary="Audit events")
def events(request: Request, tenant: str | None = None, since: str | None = None,
           limit: int = Query(1000)) -> list[dict[str, Any]]:
    """Audit events, oldest first (a tenant sees only its own)."""
    return list_events(controller(request), tenant, since, limit)


@router.get("/doctor", summary="Consistency checks of the store")
def doctor(request: Request, stuck_minutes: float = Query(10.0, gt=0, le=10**6)) -> list[dict[str, Any]]:
    """Every check of `vgpuctl doctor` with what it found (admin only); a VM in an intermediate state longer
    than `stuck_minutes` is reported as stuck."""
    return [r.to_dict() for r in diagnose(controller(request), stuck_minutes)]


@router.post("/reconcile", summary="Compare store and hosts; repair with fix",
             responses={**_WRITE, **problem_responses(502)})
def reconcile(request: Request, body: ReconcileRun | None = None) -> dict[str, Any]:
    """One reconcile run (admin only); a running domain the store does not know is reported, never undefined."""
    report = writer(request).reconcile(fix=bool(body and body.fix), confirm_undefine=lambda finding: False)
    out: dict[str, Any] = report.to_dict()
    return out
