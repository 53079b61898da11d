"""The request bodies of the API, and the shapes of its answers that the Python API has no type for (a VM
and an operation are the Python API's own `VmInfo` and `OperationInfo`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from vgpu_ctl.service.requests import VmInfo


class VgpuSpec(BaseModel):
    """`count` vGPUs of `profile`."""

    model_config = ConfigDict(extra="forbid")
    profile: str
    count: StrictInt = 1


class VmCreate(BaseModel):
    """A VM request; `tenant` defaults to the caller's tenant."""

    model_config = ConfigDict(extra="forbid")
    tenant: str | None = None
    name: str
    vgpus: list[VgpuSpec] = Field(min_length=1)
    vcpus: StrictInt
    memory_mib: StrictInt
    pool: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    anti_affinity: str | None = None
    idempotency_key: str | None = None
    template: str | None = None


class TenantCreate(BaseModel):
    """A new tenant."""

    model_config = ConfigDict(extra="forbid")
    name: str


class QuotaSet(BaseModel):
    """Limits to set (a number) or clear (null), globally or within `pool`. Keys: vms, vgpus,
    framebuffer_mib, vcpus, memory_mib, profile:NAME."""

    model_config = ConfigDict(extra="forbid")
    limits: dict[str, StrictInt | None]
    pool: str | None = None


class TokenCreate(BaseModel):
    """A new API token."""

    model_config = ConfigDict(extra="forbid")
    name: str
    role: str


class HostState(BaseModel):
    """A host's scheduling state: active, draining or down."""

    model_config = ConfigDict(extra="forbid")
    state: str


class ReconcileRun(BaseModel):
    """A reconcile run; with `fix`, repairs (never undefining a running domain the store does not know)."""

    model_config = ConfigDict(extra="forbid")
    fix: StrictBool = False


class StopVm(BaseModel):
    """How to stop: `force` destroys instead of shutting down."""

    model_config = ConfigDict(extra="forbid")
    force: StrictBool = False


class Problem(BaseModel):
    """An error as RFC 9457 problem details (`application/problem+json`): `code`, `message` and `reasons`
    are what the CLI prints with `--json`; `detail` repeats the message, `type` is `urn:vgpu-ctl:error:CODE`."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    message: str
    reasons: list[dict[str, Any]]


class VmPage(BaseModel):
    """One page of VMs: `items` from `offset`, at most `limit`, of `total` that match."""

    items: list[VmInfo]
    total: int
    offset: int
    limit: int


class TenantInfo(BaseModel):
    """A tenant with its generation (its ETag), whether it has a token, and each limit with its usage."""

    name: str
    generation: int
    has_token: bool
    created_at: str
    quota: list[dict[str, Any]]


class TenantRow(BaseModel):
    """A tenant in the list: its usage and generation."""

    name: str
    vms: int
    vgpus: int
    framebuffer_mib: int
    has_token: bool
    generation: int


class TenantToken(BaseModel):
    """A tenant's token just issued: shown once (only its hash is kept); the previous one stops working."""

    tenant: str
    token: str


class ApiTokenIssued(BaseModel):
    """An API token just issued, with its role: shown once (only its hash is kept)."""

    name: str
    role: str
    token: str
