"""VMs, placements and operations: what tenants use."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from vgpu_ctl.errors import InvalidInput, VgpuCtlError, error_from_dict
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.operations import OperationInfo

from .deps import controller, etag, if_match, principal_of, runtime, wait_seconds
from .problems import problem_of
from .schemas import StopVm, VmCreate

router = APIRouter(prefix="/v1", tags=["vms"])
MAX_PAGE = 1000


def _tenant_of(request: Request, body: VmCreate) -> str:
    if body.tenant is not None:
        return body.tenant
    p = principal_of(request)
    if p.tenant is None:
        raise InvalidInput("tenant is required when the caller is not a tenant", reasons=[{"field": "tenant"}])
    return p.tenant


def _operation_response(request: Request, info: OperationInfo) -> Response:
    """A finished create as 201 with the VM, a finished delete as 200, a failure as its problem, else 202."""
    location = {"Location": f"/v1/operations/{info.id}"}
    if info.state == "failed" and info.error is not None:
        resp = problem_of(error_from_dict(info.error))
        resp.headers["Location"] = location["Location"]
        return resp
    if info.state == "succeeded" and info.kind == "vm.create" and info.result is not None:
        return JSONResponse(info.result, status_code=201, headers={
            "Location": f"/v1/vms/{info.result['id']}", "ETag": etag(int(info.result.get("generation", 0))),
            "Operation-Location": location["Location"]})
    if info.state == "succeeded":
        return JSONResponse(info.to_dict(), status_code=200, headers=location)
    return JSONResponse(info.to_dict(), status_code=202, headers=location)


def _accepting(request: Request) -> None:
    if not runtime(request).accepting:
        raise VgpuCtlError("the server is shutting down; retry on another replica", code="draining")


@router.post("/vms", status_code=202, summary="Request a VM (asynchronous: an operation)")
def create_vm(request: Request, body: VmCreate, wait: str | None = Query(None)) -> Response:
    """Accept a VM request as an operation: 202 with `Location: /v1/operations/ID`; with `?wait=30s`, the VM
    (201) or the refusal when it ends within that time."""
    seconds = wait_seconds(wait)
    _accepting(request)
    rt = runtime(request)
    info = controller(request).submit_vm_create(
        _tenant_of(request, body), body.name, [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
        memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
        idempotency_key=body.idempotency_key, template=body.template, holder=rt.holder,
        lease_seconds=rt.cfg.operation_lease_s)
    rt.dispatch(info.id)
    if seconds > 0:
        info = rt.wait(info.id, seconds, principal_of(request))
    return _operation_response(request, info)


@router.post("/placements", summary="Where a VM would go (dry run: nothing is claimed)")
def dry_run(request: Request, body: VmCreate) -> dict[str, Any]:
    """The placement a VM request would get now, or the refusal with its reasons per pool."""
    placement = controller(request).request_vm(
        _tenant_of(request, body), body.name, [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
        memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
        template=body.template, dry_run=True)
    return placement.to_dict()


@router.get("/vms", summary="List VMs")
def list_vms(request: Request, tenant: str | None = None, state: str | None = None, host: str | None = None,
             pool: str | None = None, limit: int = Query(100), offset: int = Query(0)) -> dict[str, Any]:
    """VMs (a tenant sees only its own), filtered, ordered by tenant and name, one page:
    `{"items", "total", "offset", "limit"}`."""
    check_int("limit", limit, 1, MAX_PAGE)
    check_int("offset", offset, 0, 10**12)
    vms = [v for v in controller(request).list_vms(tenant)
           if (state is None or v.state == state) and (host is None or v.host == host)
           and (pool is None or v.pool == pool)]
    return {"items": [v.to_dict() for v in vms[offset:offset + limit]], "total": len(vms), "offset": offset,
            "limit": limit}


@router.get("/vms/{ref}", summary="One VM")
def get_vm(request: Request, ref: str, response: Response) -> dict[str, Any]:
    """A VM by id (or unique prefix), name, or TENANT/NAME, with its ETag."""
    vm = controller(request).get_vm(ref)
    response.headers["ETag"] = etag(vm.generation)
    return vm.to_dict()


@router.get("/vms/{ref}/xml", response_class=PlainTextResponse, summary="A VM's domain XML")
def vm_xml(request: Request, ref: str) -> str:
    """The VM's rendered, validated libvirt domain XML."""
    return controller(request).vm_xml(ref)


@router.post("/vms/{ref}/stop", summary="Stop a running VM")
def stop_vm(request: Request, ref: str, response: Response, body: StopVm | None = None) -> dict[str, Any]:
    """Shut the VM down (its vGPUs stay claimed); `If-Match` guards against a stale read."""
    vm = controller(request).stop_vm(ref, force=bool(body and body.force), if_generation=if_match(request))
    response.headers["ETag"] = etag(vm.generation)
    return vm.to_dict()


@router.post("/vms/{ref}/start", summary="Start a stopped VM")
def start_vm(request: Request, ref: str, response: Response) -> dict[str, Any]:
    """Start the VM; `If-Match` guards against a stale read."""
    vm = controller(request).start_vm(ref, if_generation=if_match(request))
    response.headers["ETag"] = etag(vm.generation)
    return vm.to_dict()


@router.delete("/vms/{ref}", status_code=202, summary="Delete a VM (asynchronous: an operation)")
def delete_vm(request: Request, ref: str, wait: str | None = Query(None)) -> Response:
    """Accept the VM's deletion as an operation (202, `Location`); with `?wait=`, 200 once done."""
    seconds = wait_seconds(wait)
    _accepting(request)
    rt = runtime(request)
    info = controller(request).submit_vm_delete(ref, if_generation=if_match(request), holder=rt.holder,
                                                lease_seconds=rt.cfg.operation_lease_s)
    rt.dispatch(info.id)
    if seconds > 0:
        info = rt.wait(info.id, seconds, principal_of(request))
    return _operation_response(request, info)


@router.get("/operations/{op_id}", summary="One operation")
def get_operation(request: Request, op_id: str, wait: str | None = Query(None)) -> dict[str, Any]:
    """An operation: its state, the VM, the result or the error, its times (`?wait=` until it is done)."""
    seconds = wait_seconds(wait)
    info = controller(request).get_operation(op_id)
    if seconds > 0 and not info.done:
        info = runtime(request).wait(op_id, seconds, principal_of(request))
    return info.to_dict()


@router.get("/operations", summary="List operations")
def list_operations(request: Request, state: list[str] | None = Query(None),
                    limit: int = Query(100)) -> list[dict[str, Any]]:
    """Operations, newest first (a tenant sees only its own)."""
    return [o.to_dict() for o in controller(request).list_operations(state, limit)]

