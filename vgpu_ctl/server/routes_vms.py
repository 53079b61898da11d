"""VMs, placements and operations: what tenants use."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from vgpu_ctl.errors import InvalidInput, VgpuCtlError, error_from_dict
from vgpu_ctl.inventory import check_int
from vgpu_ctl.service.operations import OperationInfo
from vgpu_ctl.service.requests import Placement, VmInfo

from .deps import IF_MATCH, controller, etag, if_match, principal_of, runtime, wait_done, wait_seconds, writer
from .problems import problem_of, problem_responses
from .runtime import Runtime
from .schemas import StopVm, VmCreate, VmPage

# Every route authenticates its caller before its parameters and body are read: 401 comes first.
router = APIRouter(prefix="/v1", tags=["vms"], responses=problem_responses(400, 401, 403, 404),
                   dependencies=[Depends(principal_of)])
MAX_PAGE = 1000
WAIT_DOC = "Wait up to this long for the end (30s, 500ms, 2m; at most 300 s)"
_LONG = problem_responses(409, 412, 422, 502, 503)
_WRITE = problem_responses(409, 412, 422)
_ETAG = {"ETag": {"description": "The VM's generation", "schema": {"type": "string"}}}
REF = Path(description="A VM: its id, a unique prefix of it (4+ characters), or its name",
           json_schema_extra={"examples": ["job1"]})
_LOCATION = {"Location": {"description": "The operation: /v1/operations/ID", "schema": {"type": "string"}}}


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
    if info.state == "succeeded" and info.kind == "vm.create" and info.result is not None \
            and "queued" in info.result:  # it waits in the queue: 202 with the queued request's operation
        queued = info.result["queued"]
        return JSONResponse(queued, status_code=202, headers={"Location": f"/v1/operations/{queued['id']}",
                                                              "Operation-Location": location["Location"]})
    if info.state == "succeeded" and info.kind == "vm.create" and info.result is not None:
        return JSONResponse(info.result, status_code=201, headers={
            "Location": f"/v1/vms/{info.result['id']}", "ETag": etag(int(info.result.get("generation", 0))),
            "Operation-Location": location["Location"]})
    if info.state == "succeeded":
        return JSONResponse(info.to_dict(), status_code=200, headers=location)
    return JSONResponse(info.to_dict(), status_code=202, headers=location)


async def _run_operation(request: Request, seconds: float,
                         submit: Callable[[Runtime], OperationInfo]) -> Response:
    """Accept long work as an operation this server runs (`submit` records it, as the caller, leased to this
    server), then answer: at once, or once it ended within `seconds`."""
    def accept() -> OperationInfo:
        rt = runtime(request)
        if not rt.accepting:
            raise VgpuCtlError("the server is shutting down; retry on another replica", code="draining")
        info = submit(rt)
        rt.dispatch(info.id)
        return info

    info = await run_in_threadpool(accept)
    if seconds > 0:
        info = await wait_done(request, info, seconds)
    return _operation_response(request, info)


@router.post("/vms", status_code=202, summary="Request a VM (asynchronous: an operation)",
             response_model=OperationInfo, responses={
                 202: {"description": "Accepted: the operation, pending", "headers": _LOCATION},
                 201: {"model": VmInfo, "description": "Created (with ?wait, once it ended within the wait)",
                       "headers": {**_ETAG, "Location": {"description": "The VM: /v1/vms/ID",
                                                         "schema": {"type": "string"}}}},
                 **_LONG})
async def create_vm(request: Request, body: VmCreate,
                    wait: str | None = Query(None, description=WAIT_DOC)) -> Response:
    """Accept a VM request as an operation: 202 with `Location: /v1/operations/ID`; with `?wait=30s`, the VM
    (201) or the refusal (409 for quota or capacity) when it ends within that time. A request with `queue` that
    does not fit waits: with `?wait=`, 202 with the queued request's operation (its `Location`; the create's
    own operation in `Operation-Location`)."""
    seconds = wait_seconds(wait)

    def submit(rt: Runtime) -> OperationInfo:
        return writer(request).submit_vm_create(
            _tenant_of(request, body), body.name, [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
            memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
            idempotency_key=body.idempotency_key, template=body.template, priority=body.priority,
            preempt=body.preempt, queue=body.queue, queue_deadline_s=body.queue_deadline_s, holder=rt.holder,
            lease_seconds=rt.cfg.operation_lease_s)

    return await _run_operation(request, seconds, submit)


@router.post("/placements", summary="Where a VM would go (dry run: nothing is claimed)",
             response_model=Placement, responses=problem_responses(409, 422))
def dry_run(request: Request, body: VmCreate) -> Placement:
    """The placement a VM request would get now, or the refusal (409) with its reasons per pool."""
    return controller(request).request_vm(
        _tenant_of(request, body), body.name, [(v.profile, v.count) for v in body.vgpus], vcpus=body.vcpus,
        memory_mib=body.memory_mib, pool=body.pool, labels=body.labels, anti_affinity=body.anti_affinity,
        template=body.template, dry_run=True, priority=body.priority, preempt=body.preempt, queue=body.queue,
        queue_deadline_s=body.queue_deadline_s)


@router.get("/vms", summary="List VMs", response_model=VmPage)
def list_vms(request: Request, tenant: str | None = None, state: str | None = None, host: str | None = None,
             pool: str | None = None, limit: int = Query(100), offset: int = Query(0)) -> VmPage:
    """VMs (a tenant sees only its own), filtered, ordered by tenant and name, one page:
    `{"items", "total", "offset", "limit"}`."""
    check_int("limit", limit, 1, MAX_PAGE)
    check_int("offset", offset, 0, 10**12)
    vms = [v for v in controller(request).list_vms(tenant)
           if (state is None or v.state == state) and (host is None or v.host == host)
           and (pool is None or v.pool == pool)]
    return VmPage(items=vms[offset:offset + limit], total=len(vms), offset=offset, limit=limit)


@router.get("/vms/{ref}", summary="One VM", response_model=VmInfo, responses={200: {"headers": _ETAG}})
def get_vm(request: Request, response: Response, ref: str = REF) -> VmInfo:
    """A VM by id (or unique prefix) or name, with its ETag."""
    vm = controller(request).get_vm(ref)
    response.headers["ETag"] = etag(vm.generation)
    return vm


@router.get("/vms/{ref}/xml", response_class=PlainTextResponse, summary="A VM's domain XML",
            responses=problem_responses(502))
def vm_xml(request: Request, ref: str = REF) -> str:
    """The VM's rendered, validated libvirt domain XML."""
    return controller(request).vm_xml(ref)


@router.post("/vms/{ref}/stop", summary="Stop a running VM", response_model=VmInfo,
             responses={200: {"headers": _ETAG}, **_WRITE, **problem_responses(502)}, openapi_extra=IF_MATCH)
def stop_vm(request: Request, response: Response, ref: str = REF, body: StopVm | None = None) -> VmInfo:
    """Shut the VM down (its vGPUs stay claimed); `If-Match` guards against a stale read."""
    vm = writer(request).stop_vm(ref, force=bool(body and body.force), if_generation=if_match(request))
    response.headers["ETag"] = etag(vm.generation)
    return vm


@router.post("/vms/{ref}/start", summary="Start a stopped VM", response_model=VmInfo,
             responses={200: {"headers": _ETAG}, **_WRITE, **problem_responses(502)}, openapi_extra=IF_MATCH)
def start_vm(request: Request, response: Response, ref: str = REF) -> VmInfo:
    """Start the VM; `If-Match` guards against a stale read."""
    vm = writer(request).start_vm(ref, if_generation=if_match(request))
    response.headers["ETag"] = etag(vm.generation)
    return vm


@router.delete("/vms/{ref}", status_code=202, summary="Delete a VM (asynchronous: an operation)",
               response_model=OperationInfo, responses={
                   202: {"description": "Accepted: the operation, pending", "headers": _LOCATION},
                   200: {"model": OperationInfo, "description": "Deleted (with ?wait, once done within it)"},
                   **_LONG}, openapi_extra=IF_MATCH)
async def delete_vm(request: Request, ref: str = REF,
                    wait: str | None = Query(None, description=WAIT_DOC)) -> Response:
    """Accept the VM's deletion as an operation (202, `Location`); with `?wait=`, 200 once done."""
    seconds = wait_seconds(wait)

    def submit(rt: Runtime) -> OperationInfo:
        return writer(request).submit_vm_delete(ref, if_generation=if_match(request), holder=rt.holder,
                                                lease_seconds=rt.cfg.operation_lease_s)

    return await _run_operation(request, seconds, submit)


@router.get("/operations/{op_id}", summary="One operation", response_model=OperationInfo)
async def get_operation(request: Request, op_id: str,
                        wait: str | None = Query(None, description=WAIT_DOC)) -> OperationInfo:
    """An operation: its state, the VM, the result or the error, its times (`?wait=` until it is done)."""
    seconds = wait_seconds(wait)
    info = await run_in_threadpool(controller(request).get_operation, op_id)
    if seconds > 0:
        info = await wait_done(request, info, seconds)
    return info


@router.get("/operations", summary="List operations", response_model=list[OperationInfo])
def list_operations(request: Request, state: list[str] | None = Query(None),
                    limit: int = Query(100)) -> list[OperationInfo]:
    """Operations, newest first (a tenant sees only its own)."""
    return controller(request).list_operations(state, limit)

