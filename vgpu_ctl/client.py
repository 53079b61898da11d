"""The Python client of a vgpu-ctl server (`vgpuctl serve`): the Controller's typed methods over HTTP.

    from vgpu_ctl import Client
    with Client("http://127.0.0.1:8730", token) as c:
        vm = c.request_vm("acme", "train-a", [("A100D-40C", 1)], vcpus=16, memory_mib=65536)

It returns the same types as the Controller (VmInfo, Placement, ProfileInfo, OperationInfo, ReconcileReport)
and raises the same errors (the server's problem details raised again with `error_from_dict`). A call that
meets a connection error, a 502 or a 503 is retried (`retries` times, backing off), every POST carrying one
`Idempotency-Key` for all the tries of one call, so a retry never makes a second VM. Creating and deleting a
VM are operations on the server; the client waits for them to end (at most `operation_timeout` seconds).

This module imports neither the store nor the service's flows: only httpx, the errors and the result types.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import suppress
from dataclasses import fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar, overload
from urllib.parse import quote

import httpx

from vgpu_ctl.catalog import ProfileInfo, ProfileKind
from vgpu_ctl.errors import (
    InvalidInput,
    InventoryError,
    NotFound,
    PermissionDenied,
    VgpuCtlError,
    error_from_dict,
)
from vgpu_ctl.service.requests import (
    DeviceInfo,
    Finding,
    OperationInfo,
    PlacedDevice,
    Placement,
    ReconcileReport,
    VgpuRequest,
    VmInfo,
)
from vgpu_ctl.service.scheduling_types import PreemptionPlan

SERVER_ENV = "VGPU_CTL_SERVER"
RETRY_STATUS = (502, 503)
PAGE = 1000  # VMs per page when listing
POLL_WAIT_S = 30.0  # how long one request waits on the server for an operation to end
MAX_RETRY_AFTER_S = 10.0
_T = TypeVar("_T")
_UNSET: Any = object()  # a tenant setting not given (None clears it)


def _build(cls: type[_T], data: Mapping[str, Any], **override: Any) -> _T:
    """A dataclass from its JSON form (keys it does not know, from a newer server, are left out)."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{**{k: v for k, v in data.items() if k in names}, **override})


def vm_from_dict(d: Mapping[str, Any]) -> VmInfo:
    """A VmInfo from its `to_dict()` form."""
    return _build(VmInfo, d, devices=tuple(_build(DeviceInfo, x) for x in d.get("devices") or ()))


def placement_from_dict(d: Mapping[str, Any]) -> Placement:
    """A Placement from its `to_dict()` form."""
    return Placement(d["host"], d.get("pool"), tuple(_build(PlacedDevice, x) for x in d.get("devices") or ()))


def profile_from_dict(d: Mapping[str, Any]) -> ProfileInfo:
    """A ProfileInfo from its `to_dict()` form."""
    tuples = {k: tuple(d[k]) for k in ("placements", "mixed_placement_ids") if d.get(k) is not None}
    rest = {k: v for k, v in d.items() if k not in tuples and k != "kind"}
    return _build(ProfileInfo, rest, kind=ProfileKind(d["kind"]), **tuples)


def operation_from_dict(d: Mapping[str, Any]) -> OperationInfo:
    """An OperationInfo from its `to_dict()` form."""
    return _build(OperationInfo, d)


def report_from_dict(d: Mapping[str, Any]) -> ReconcileReport:
    """A ReconcileReport from its `to_dict()` form."""
    return ReconcileReport([_build(Finding, f) for f in d.get("findings") or ()], int(d.get("hosts", 0)))


def error_of(response: httpx.Response) -> VgpuCtlError:
    """The vgpu-ctl error a failed response carries (a problem+json body), raised again as the Controller
    would have raised it; a body that is not one becomes a VgpuCtlError naming the HTTP status."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "code" not in body:
        text = response.text.strip()[:300]
        return VgpuCtlError(f"the server answered {response.status_code} {response.reason_phrase}"
                            + (f": {text}" if text else ""), code=f"http_{response.status_code}")
    if body["code"] == "unauthenticated":  # a 401: what the Controller raises for a bad token
        return PermissionDenied(str(body.get("message", "")), list(body.get("reasons") or []))
    return error_from_dict(body)


def _q(segment: str) -> str:
    return quote(segment, safe="")


def _check_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) <= len("http://"):
        raise InvalidInput(f"server {url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8730)",
                           reasons=[{"field": "server", "value": url}])
    return url.rstrip("/")


class Client:
    """The Controller's typed API on a vgpu-ctl server, as the holder of `token` (a tenant's or an API
    token)."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0, retries: int = 3, backoff: float = 0.2,
                 operation_timeout: float = 600.0, verify: bool | str = True,
                 transport: httpx.BaseTransport | None = None) -> None:
        """Talk to the server at `url`; InvalidInput naming the field for a URL that is not http(s), an empty
        token, or a negative timeout or retry count. Nothing is sent until the first call."""
        self.url = _check_url(url)
        if not isinstance(token, str) or not token.strip():
            raise InvalidInput("token is empty: give a tenant's token or an API token (--token or "
                               "$VGPU_CTL_TOKEN)", reasons=[{"field": "token", "value": token}])
        for name, value in (("timeout", timeout), ("retries", retries), ("backoff", backoff),
                            ("operation_timeout", operation_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidInput(f"{name} {value!r} must be a number >= 0", reasons=[{"field": name, "value": value}])
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.operation_timeout = float(operation_timeout)
        self._http = httpx.Client(base_url=self.url, timeout=self.timeout, verify=verify, transport=transport,
                                  headers={"Authorization": f"Bearer {token.strip()}",
                                           "Accept": "application/json, application/problem+json"})

    # -- plumbing ---------------------------------------------------------------------------------------------

    @property
    def scheduling(self) -> RemoteScheduling:
        """Scheduling's API on the server, with the methods of the Controller's `scheduling`."""
        return RemoteScheduling(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def request(self, method: str, path: str, *, params: Any = None, json: Any = None, content: str | None = None,
                headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
                timeout: float | None = None) -> httpx.Response:
        """One logical call: sent, and sent again on a connection error, a 502 or a 503 (and, for a POST, a 409
        saying the same key is still in flight) up to `retries` times, with the same Idempotency-Key on every
        try of a POST. A DELETE, which carries no key, is sent again only when it never reached the server.
        The response when it is a success; else the error it carries, raised."""
        sent = dict(headers or {})
        if method == "POST":
            sent["Idempotency-Key"] = idempotency_key or str(uuid.uuid4())
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, params=params, json=json, content=content,
                                              headers=sent, timeout=timeout if timeout is not None else self.timeout)
            except httpx.TransportError as exc:
                reached = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                if reached and method == "DELETE":  # no Idempotency-Key: a second try could act twice
                    raise VgpuCtlError(f"the server {self.url} did not answer {method} {path} "
                                       f"({exc or type(exc).__name__}); it may have been done: look before retrying",
                                       reasons=[{"field": "server", "value": self.url}], code="unreachable") from None
                if attempt >= self.retries:
                    raise VgpuCtlError(f"can't reach the server {self.url}: {exc or type(exc).__name__}",
                                       reasons=[{"field": "server", "value": self.url}], code="unreachable") from None
                self._pause(attempt, None)
                attempt += 1
                continue
            if response.is_success:
                return response
            retry = response.status_code in RETRY_STATUS or (
                response.status_code == 409 and method == "POST"
                and response.headers.get("content-type", "").startswith("application/problem+json")
                and _code(response) == "idempotency_key_in_flight")
            if retry and attempt < self.retries:
                self._pause(attempt, response.headers.get("retry-after"))
                attempt += 1
                continue
            raise error_of(response)

    def _pause(self, attempt: int, retry_after: str | None) -> None:
        delay = self.backoff * (2 ** attempt)
        if retry_after is not None:
            with suppress(ValueError):  # an HTTP date instead of seconds: the backoff alone
                delay = max(delay, min(float(retry_after), MAX_RETRY_AFTER_S))
        time.sleep(delay)

    def _get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None}).json()

    @staticmethod
    def _if_match(generation: int | None) -> dict[str, str]:
        return {} if generation is None else {"If-Match": f'"{generation}"'}

    # -- catalog and inventory --------------------------------------------------------------------------------

    def profiles(self, model: str | None = None) -> list[ProfileInfo]:
        """The server's catalog's profiles, of one model or all."""
        return [profile_from_dict(p) for p in self._get("/v1/profiles", model=model)]

    def pools(self) -> list[dict[str, Any]]:
        """Each pool with its policy, GPU count, the profiles it offers and its demand."""
        out: list[dict[str, Any]] = self._get("/v1/pools")
        return out

    def inventory(self) -> dict[str, Any]:
        """Pools, hosts and GPUs as the server's store holds them (the admin and readers)."""
        out: dict[str, Any] = self._get("/v1/inventory")
        return out

    def apply_inventory(self, path: str | Path, dry_run: bool = False,
                        progress: Callable[[int, int, str], None] | None = None, *, prune: bool = False,
                        expected_removals: Collection[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        """Send the inventory file's YAML to the server to apply (with `prune`, also removing what it leaves
        out); the changes (none made with dry_run). With `expected_removals` (what a preview showed), Conflict
        and nothing changed if the apply would remove anything else. Errors name the file as `path` says.
        `progress` is called once, when the server has answered."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InventoryError(f"inventory file {path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise InventoryError(f"inventory file {path}: not UTF-8 text") from None
        params: dict[str, Any] = {"dry_run": dry_run, "prune": prune, "source": str(path)}
        if expected_removals is not None:
            params["check_removals"] = True
            params["expect_removal"] = [f"{kind}:{name}" for kind, name in expected_removals]
        changes: list[dict[str, Any]] = self.request(
            "POST", "/v1/inventory", params=params, content=text,
            headers={"Content-Type": "application/yaml"}).json()
        if progress is not None:
            progress(1, 1, self.url)
        return changes

    def set_host_state(self, name: str, state: str) -> dict[str, Any]:
        """Set a host's scheduling state (active, draining, down); the host, the state before and after, and the
        VMs still on it."""
        out: dict[str, Any] = self.request("PUT", f"/v1/hosts/{_q(name)}/state", json={"state": state}).json()
        return out

    # -- tenants, quotas, tokens ------------------------------------------------------------------------------

    def create_tenant(self, name: str) -> dict[str, Any]:
        """Add a tenant (no limits until quotas are set); `{"name": name}`, as the Controller returns."""
        self.request("POST", "/v1/tenants", json={"name": name})
        return {"name": name}

    def list_tenants(self) -> list[dict[str, Any]]:
        """Tenants with their usage (a tenant caller sees only itself)."""
        out: list[dict[str, Any]] = self._get("/v1/tenants")
        return out

    def get_tenant(self, name: str) -> dict[str, Any]:
        """One tenant with its generation, usage and limits."""
        out: dict[str, Any] = self._get(f"/v1/tenants/{_q(name)}")
        return out

    def delete_tenant(self, name: str, if_generation: int | None = None) -> None:
        """Remove a tenant that has no VMs (PreconditionFailed when it changed since `if_generation`)."""
        self.request("DELETE", f"/v1/tenants/{_q(name)}", headers=self._if_match(if_generation))

    def issue_token(self, name: str) -> str:
        """A new token for the tenant (the previous one stops working)."""
        return str(self.request("POST", f"/v1/tenants/{_q(name)}/token").json()["token"])

    def revoke_token(self, name: str) -> None:
        """Revoke the tenant's token."""
        self.request("DELETE", f"/v1/tenants/{_q(name)}/token")

    def set_quota(self, tenant: str, limits: Mapping[str, int | None], pool: str | None = None,
                  if_generation: int | None = None,
                  guarantees: Mapping[str, int | None] | None = None) -> dict[str, Any]:
        """Set (int) or clear (None) limits of a tenant, and their guaranteed parts, globally or within one
        pool; the changes."""
        body: dict[str, Any] = {"limits": dict(limits), "pool": pool}
        if guarantees:
            body["guarantees"] = dict(guarantees)
        out: dict[str, Any] = self.request("PUT", f"/v1/tenants/{_q(tenant)}/quota", json=body,
                                           headers=self._if_match(if_generation)).json()
        return out

    def tenant_usage(self, tenant: str) -> list[dict[str, Any]]:
        """Each limit of the tenant with its usage."""
        out: list[dict[str, Any]] = self._get(f"/v1/tenants/{_q(tenant)}/quota")
        return out

    def create_api_token(self, name: str, role: str) -> str:
        """Issue an API token for `role` (admin or reader); the token, shown once."""
        return str(self.request("POST", "/v1/tokens", json={"name": name, "role": role}).json()["token"])

    def list_api_tokens(self) -> list[dict[str, Any]]:
        """The API tokens (name, role, created), never the tokens themselves."""
        out: list[dict[str, Any]] = self._get("/v1/tokens")
        return out

    def revoke_api_token(self, name: str) -> None:
        """Revoke an API token."""
        self.request("DELETE", f"/v1/tokens/{_q(name)}")

    # -- VMs --------------------------------------------------------------------------------------------------

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, priority: str | None = None,
                   preempt: bool | None = None, queue: Literal[False] = False,
                   queue_deadline_s: float | None = None) -> VmInfo:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[False] = False, priority: str | None = None,
                   preempt: bool | None = None, queue: Literal[True],
                   queue_deadline_s: float | None = None) -> VmInfo | OperationInfo:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: Literal[True], priority: str | None = None,
                   preempt: bool | None = None, queue: bool = False,
                   queue_deadline_s: float | None = None) -> Placement:
        ...

    @overload
    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: bool = False, priority: str | None = None,
                   preempt: bool | None = None, queue: bool = False,
                   queue_deadline_s: float | None = None) -> VmInfo | Placement | OperationInfo:
        ...

    def request_vm(self, tenant: str, name: str, vgpus: Sequence[VgpuRequest | tuple[str, int]] | str, *,
                   vcpus: int, memory_mib: int, pool: str | None = None, labels: Mapping[str, str] | None = None,
                   anti_affinity: str | None = None, idempotency_key: str | None = None,
                   template: str | None = None, dry_run: bool = False, priority: str | None = None,
                   preempt: bool | None = None, queue: bool = False,
                   queue_deadline_s: float | None = None) -> VmInfo | Placement | OperationInfo:
        """Request a VM and wait until it runs (its VmInfo) or is refused (QuotaExceeded, NoCapacity, ...,
        with the reasons); with dry_run, where it would go (a Placement), nothing claimed. `idempotency_key`
        is the VM's own (the same key twice gives the same VM), apart from the HTTP Idempotency-Key. As with
        the Controller, `priority` names its class, `preempt` asks to preempt lower-priority preemptible VMs
        when it does not fit (None: as the class's policy says), and with `queue` a request that does not fit
        waits: its queued operation (pending, an OperationInfo) is returned, for at most `queue_deadline_s`."""
        if isinstance(vgpus, str):
            vgpus = [VgpuRequest(vgpus, 1)]
        wants = [v if isinstance(v, VgpuRequest) else VgpuRequest(v[0], v[1]) for v in vgpus]
        body = {"tenant": tenant, "name": name, "vgpus": [{"profile": v.profile, "count": v.count} for v in wants],
                "vcpus": vcpus, "memory_mib": memory_mib, "pool": pool, "labels": dict(labels or {}),
                "anti_affinity": anti_affinity, "idempotency_key": idempotency_key, "template": template,
                "priority": priority, "preempt": preempt, "queue": queue, "queue_deadline_s": queue_deadline_s}
        if dry_run:
            return placement_from_dict(self.request("POST", "/v1/placements", json=body).json())
        response = self.request("POST", "/v1/vms", params={"wait": self._wait_param()}, json=body,
                                timeout=self.timeout + POLL_WAIT_S)
        if response.status_code == 201:
            return vm_from_dict(response.json())
        op = operation_from_dict(response.json())
        if op.state == "pending":  # a create's own operation runs from the start: this is the queued request
            return op
        op = self.wait_operation(op)
        if op.result is not None and "queued" in op.result:
            return operation_from_dict(op.result["queued"])
        if op.result is not None:
            return vm_from_dict(op.result)
        assert op.vm_id is not None, op
        return self.get_vm(op.vm_id)

    def wait_operation(self, op: OperationInfo | str) -> OperationInfo:
        """The operation once it has ended (polled, at most `operation_timeout` seconds); its error raised as
        the Controller would have raised it when it failed."""
        info = op if isinstance(op, OperationInfo) else self.get_operation(op)
        deadline = time.monotonic() + self.operation_timeout
        while not info.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VgpuCtlError(f"operation {info.id} ({info.kind}) has not ended after "
                                   f"{self.operation_timeout:g}s; see GET /v1/operations/{info.id}",
                                   reasons=[{"operation": info.id, "state": info.state}], code="timeout")
            wait = max(min(POLL_WAIT_S, left), 0.001)
            info = operation_from_dict(self.request("GET", f"/v1/operations/{_q(info.id)}",
                                                    params={"wait": f"{wait:.3f}s"},
                                                    timeout=self.timeout + wait).json())
        if info.state == "failed" and info.error is not None:
            raise error_from_dict(info.error)
        return info

    def _wait_param(self) -> str:
        return f"{max(min(POLL_WAIT_S, self.operation_timeout), 0.001):.3f}s"

    def _vm_path(self, ref: str) -> str:
        """The URL of a VM named by id, id prefix, name or TENANT/NAME (a TENANT/NAME is looked up in the
        tenant's list: a path segment cannot hold the slash)."""
        if "/" not in ref:
            return f"/v1/vms/{_q(ref)}"
        tenant, _, name = ref.partition("/")
        try:
            vms = self.list_vms(tenant)
        except NotFound:
            vms = []
        found = [v for v in vms if v.name == name]
        if not found:
            raise NotFound(f"VM {ref!r} not found", reasons=[{"field": "vm", "value": ref}])
        return f"/v1/vms/{_q(found[0].id)}"

    def get_vm(self, ref: str) -> VmInfo:
        """One VM by id (or unique prefix), name, or TENANT/NAME (a tenant caller sees only its own)."""
        return vm_from_dict(self._get(self._vm_path(ref)))

    def list_vms(self, tenant: str | None = None) -> list[VmInfo]:
        """VMs, of one tenant or all (a tenant caller sees only its own), every page."""
        out: list[VmInfo] = []
        while True:
            page = self._get("/v1/vms", tenant=tenant, limit=PAGE, offset=len(out))
            out += [vm_from_dict(v) for v in page["items"]]
            if not page["items"] or len(out) >= int(page["total"]):
                return out

    def release_vm(self, ref: str, if_generation: int | None = None) -> None:
        """Delete a VM and wait until it is gone (its domain, devices, claim and quota charge)."""
        response = self.request("DELETE", self._vm_path(ref), params={"wait": self._wait_param()},
                                headers=self._if_match(if_generation), timeout=self.timeout + POLL_WAIT_S)
        self.wait_operation(operation_from_dict(response.json()))

    def stop_vm(self, ref: str, force: bool = False, if_generation: int | None = None) -> VmInfo:
        """Shut down a running VM (its devices stay claimed); with force, destroy it."""
        return vm_from_dict(self.request("POST", f"{self._vm_path(ref)}/stop", json={"force": force},
                                         headers=self._if_match(if_generation)).json())

    def start_vm(self, ref: str, if_generation: int | None = None) -> VmInfo:
        """Start a stopped VM."""
        return vm_from_dict(self.request("POST", f"{self._vm_path(ref)}/start",
                                         headers=self._if_match(if_generation)).json())

    def vm_xml(self, ref: str) -> str:
        """The domain XML of a VM, rendered from its template and validated."""
        return self.request("GET", f"{self._vm_path(ref)}/xml").text

    # -- operations -------------------------------------------------------------------------------------------

    def get_operation(self, op_id: str) -> OperationInfo:
        """One operation (a tenant caller sees only its own)."""
        return operation_from_dict(self._get(f"/v1/operations/{_q(op_id)}"))

    def list_operations(self, states: Collection[str] | None = None, limit: int = 100) -> list[OperationInfo]:
        """Operations, newest first (a tenant caller sees only its own)."""
        params: dict[str, Any] = {"limit": limit}
        if states is not None:
            params["state"] = list(states)
        return [operation_from_dict(o) for o in self.request("GET", "/v1/operations", params=params).json()]

    # -- the operator's views ---------------------------------------------------------------------------------

    def events(self, tenant: str | None = None, since: Any = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Audit events, oldest first (a tenant caller sees only its own); `since` an aware datetime, an ISO
        time or a span back from now (30m, 1h, 2d)."""
        when = since.isoformat() if isinstance(since, datetime) else since
        out: list[dict[str, Any]] = self._get("/v1/events", tenant=tenant, since=when, limit=limit)
        return out

    def reconcile(self, fix: bool = False, progress: Any = None,
                  confirm_undefine: Callable[[Any], bool] | None = None,
                  confirm_adopt: Callable[[Any], bool] | None = None) -> ReconcileReport:
        """One reconcile run on the server (admin only). The server never undefines a running domain the store
        does not know, so `confirm_undefine` is not asked; adopting one asks the admin at the store's machine,
        so `confirm_adopt` is refused; `progress` is called with the server's URL."""
        if confirm_adopt is not None:
            raise InvalidInput("reconcile --adopt asks about each domain: run it on the store's machine, "
                               "without --server", reasons=[{"field": "--server", "value": self.url}])
        if progress is not None:
            progress(self.url)
        return report_from_dict(self.request("POST", "/v1/reconcile", json={"fix": fix}).json())

    def status(self, pool: str | None = None, host: str | None = None, *, gpus: bool = False,
               limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        """The fleet status as `vgpuctl status` shows it (GET /v1/status)."""
        out: dict[str, Any] = self._get("/v1/status", pool=pool, host=host, gpus=gpus, limit=limit, offset=offset)
        return out

    def doctor(self, stuck_minutes: float = 10.0) -> list[dict[str, Any]]:
        """Every consistency check of the server's store with what it found, in JSON form (admin only)."""
        out: list[dict[str, Any]] = self._get("/v1/doctor", stuck_minutes=stuck_minutes)
        return out

    def metrics_text(self) -> str:
        """The server's /metrics in Prometheus' text format (the store's metrics and the server's own)."""
        return self.request("GET", "/metrics").text


class RemoteScheduling:
    """`Controller.scheduling` over HTTP: priority classes, tenants' scheduling, accounts, settings, the
    fair-share report, the queue and preemption previews, with the same methods, results and errors."""

    def __init__(self, client: Client) -> None:
        """Act through `client` (as the holder of its token)."""
        self.client = client

    def _get(self, path: str, **params: Any) -> Any:
        return self.client._get(path, **params)

    def create_class(self, name: str, value: int, *, preemptible: bool = False,
                     preemption_policy: str = "lower-priority", preemption_mode: str = "requeue",
                     default: bool = False, description: str = "") -> dict[str, Any]:
        """Add a priority class (admin only); the class."""
        out: dict[str, Any] = self.client.request("POST", "/v1/priority-classes", json={
            "name": name, "value": value, "preemptible": preemptible, "preemption_policy": preemption_policy,
            "preemption_mode": preemption_mode, "default": default, "description": description}).json()
        return out

    def list_classes(self) -> list[dict[str, Any]]:
        """Every priority class, highest first, with its VMs."""
        out: list[dict[str, Any]] = self._get("/v1/priority-classes")
        return out

    def delete_class(self, name: str) -> None:
        """Remove an unused priority class (admin only)."""
        self.client.request("DELETE", f"/v1/priority-classes/{_q(name)}")

    def tenant(self, tenant: str) -> dict[str, Any]:
        """A tenant's scheduling settings (a tenant caller sees only its own)."""
        out: dict[str, Any] = self._get(f"/v1/tenants/{_q(tenant)}/scheduling")
        return out

    def set_tenant(self, tenant: str, *, shares: int | None = None, account: str | None = _UNSET,
                   default_priority: str | None = _UNSET,
                   priority_classes: Collection[str] | None = _UNSET) -> dict[str, Any]:
        """Change a tenant's shares, account, default class or allowed classes (admin only): only those given
        (None clears account, default class and allowed classes)."""
        body: dict[str, Any] = {} if shares is None else {"shares": shares}
        for key, value in (("account", account), ("default_priority", default_priority)):
            if value is not _UNSET:
                body[key] = value
        if priority_classes is not _UNSET:
            body["priority_classes"] = None if priority_classes is None else list(priority_classes)
        out: dict[str, Any] = self.client.request("PUT", f"/v1/tenants/{_q(tenant)}/scheduling", json=body).json()
        return out

    def set_account(self, name: str, shares: int = 1, parent: str | None = None) -> dict[str, Any]:
        """Add or change an account of the share tree (admin only)."""
        out: dict[str, Any] = self.client.request("PUT", f"/v1/accounts/{_q(name)}",
                                                  json={"shares": shares, "parent": parent}).json()
        return out

    def delete_account(self, name: str) -> None:
        """Remove an account without members (admin only)."""
        self.client.request("DELETE", f"/v1/accounts/{_q(name)}")

    def settings(self) -> dict[str, float]:
        """The scheduling settings (half-life, grace, cool-down, in seconds)."""
        out: dict[str, float] = self._get("/v1/scheduling/settings")
        return out

    def set_settings(self, **values: float | None) -> dict[str, float]:
        """Change scheduling settings (admin only); all of them after."""
        out: dict[str, float] = self.client.request("PUT", "/v1/scheduling/settings", json=values).json()
        return out

    def share(self, now: float | None = None) -> list[dict[str, Any]]:
        """The fair-share report (`sshare -l`); a tenant caller sees only its own row."""
        out: list[dict[str, Any]] = self._get("/v1/scheduling/share", now=now)
        return out

    def queue(self) -> list[dict[str, Any]]:
        """What waits, in admission order (a tenant caller sees only its own)."""
        out: list[dict[str, Any]] = self._get("/v1/queue")
        return out

    def admit(self) -> list[str]:
        """Try to admit what waits now (admin only); the VMs admitted."""
        return [str(v) for v in self.client.request("POST", "/v1/queue/admit").json()["admitted"]]

    def cancel(self, op_id: str) -> None:
        """Take a queued request out of the queue (the admin, or the tenant that asked)."""
        self.client.request("DELETE", f"/v1/queue/{_q(op_id)}")

    def preview(self, tenant: str, name: str, vgpus: Sequence[tuple[str, int]], *, vcpus: int, memory_mib: int,
                pool: str | None = None, labels: Mapping[str, str] | None = None, anti_affinity: str | None = None,
                priority: str | None = None) -> PreemptionPlan:
        """The victims preempting for this request would free (a dry run: nothing changes)."""
        body = {"tenant": tenant, "name": name, "vgpus": [{"profile": p, "count": n} for p, n in vgpus],
                "vcpus": vcpus, "memory_mib": memory_mib, "pool": pool, "labels": dict(labels or {}),
                "anti_affinity": anti_affinity, "priority": priority}
        return PreemptionPlan.from_dict(self.client.request("POST", "/v1/scheduling/preview", json=body).json())

    def preemption_counts(self) -> dict[tuple[str, str], int]:
        """Preemptions so far by (reason, mode)."""
        return {(str(r["reason"]), str(r["mode"])): int(r["count"]) for r in self._get("/v1/scheduling/preemptions")}


def _code(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return str(body.get("code")) if isinstance(body, dict) else None


__all__ = ["SERVER_ENV", "Client", "RemoteScheduling", "error_of"]
