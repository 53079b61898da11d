"""The request bodies of the API, and the shapes of its answers that the Python API has no type for (a VM
and an operation are the Python API's own `VmInfo` and `OperationInfo`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from vgpu_ctl.inventory import MAX_LIMIT, MAX_MEMORY_MIB, MAX_VM_VCPUS, NAME_RE
from vgpu_ctl.service.hosts import HOST_STATES
from vgpu_ctl.service.principals import ROLES
from vgpu_ctl.service.requests import VmInfo

# What the service accepts, declared in the schema for clients and generated tests; the service checks it
# (so that its messages are the CLI's), hence `json_schema_extra` rather than constraints pydantic enforces.
NAME_PATTERN = f"^{NAME_RE.pattern}$"


def name_field(what: str, *examples: str, default: Any = ...) -> Any:
    """A field holding a safe name (lower-case letters, digits, `_ . -`, at most 63)."""
    return Field(default, description=f"{what}: a safe name (lower-case letters, digits, '_', '.', '-', "
                 "at most 63, starting with a letter or digit)",
                 json_schema_extra={"pattern": NAME_PATTERN, "examples": list(examples)})


def whole(what: str, low: int, high: int, example: int, default: Any = ...) -> Any:
    """A field holding a whole number from `low` to `high` (booleans refused)."""
    return Field(default, description=f"{what}: a whole number from {low} to {high}",
                 json_schema_extra={"minimum": low, "maximum": high, "examples": [example]})


class VgpuSpec(BaseModel):
    """`count` vGPUs of `profile`."""

    model_config = ConfigDict(extra="forbid")
    profile: str = Field(description="A profile of the catalog (GET /v1/profiles)",
                         json_schema_extra={"examples": ["1g.10gb", "A100D-10C", "L40S-12C"]})
    count: StrictInt = whole("vGPUs of the profile", 1, 16, 1, default=1)


class VmCreate(BaseModel):
    """A VM request; `tenant` defaults to the caller's tenant."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"tenant": "acme", "name": "job1", "vgpus": [{"profile": "1g.10gb", "count": 1}], "vcpus": 2,
         "memory_mib": 4096}]})
    tenant: str | None = name_field("The tenant (default: the caller's)", "acme", default=None)
    name: str = name_field("The VM's name, unique per tenant", "job1")
    vgpus: list[VgpuSpec] = Field(default_factory=list, description="Its vGPUs (none: a VM without vGPUs)",
                                  json_schema_extra={"maxItems": 16})
    vcpus: StrictInt = whole("vCPUs", 1, MAX_VM_VCPUS, 2)
    memory_mib: StrictInt = whole("Memory in MiB", 1, MAX_MEMORY_MIB, 4096)
    pool: str | None = name_field("Place only in this pool", "inference", default=None)
    labels: dict[str, str] = Field(default_factory=dict, description="Host labels required")
    anti_affinity: str | None = name_field("No two VMs of this group on one host", "web", default=None)
    idempotency_key: str | None = Field(None, description="The same key gives the same VM (1-128 characters)",
                                        json_schema_extra={"minLength": 1, "maxLength": 128})
    template: str | None = Field(None, description="A domain template of the template folder, by name")
    priority: str | None = name_field("Its priority class (default: the tenant's, else the global default)",
                                      "batch", default=None)
    preempt: StrictBool | None = Field(None, description="If it does not fit, preempt lower-priority preemptible "
                                       "VMs (null: as its class's policy says)")
    queue: StrictBool = Field(False, description="If it does not fit, wait in the queue: the operation ends "
                              "with the result {\"queued\": OPERATION}, the queued request's own operation")
    queue_deadline_s: StrictInt | StrictFloat | None = Field(
        None, description="With queue, wait at most this many seconds (1 to a year)",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": 366 * 86400, "examples": [7200]})


class TenantCreate(BaseModel):
    """A new tenant."""

    model_config = ConfigDict(extra="forbid")
    name: str = name_field("The tenant", "initech")


class QuotaSet(BaseModel):
    """Limits to set (a number) or clear (null), globally or within `pool`. Keys: vms, vgpus,
    framebuffer_mib, vcpus, memory_mib, profile:NAME; `guarantees` the same for the base resources."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"limits": {"vgpus": 8, "framebuffer_mib": 163840, "profile:A100D-10C": 4}}]})
    limits: dict[str, StrictInt | None] = Field(json_schema_extra={
        "propertyNames": {"pattern": "^(vms|vgpus|framebuffer_mib|vcpus|memory_mib|profile:.+)$"},
        "additionalProperties": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LIMIT},
                                           {"type": "null"}]}})
    pool: str | None = name_field("Limits within this pool only", "inference", default=None)
    guarantees: dict[str, StrictInt | None] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"pattern": "^(vms|vgpus|framebuffer_mib|vcpus|memory_mib)$"},
        "additionalProperties": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LIMIT},
                                           {"type": "null"}]}},
        description="The guaranteed part of each base limit (null clears it): use above it is borrowed, "
                    "reclaimable by tenants below their guarantee")


class TokenCreate(BaseModel):
    """A new API token."""

    model_config = ConfigDict(extra="forbid")
    name: str = name_field("The token's name (the audit trail shows token:NAME)", "dashboard")
    role: str = Field(json_schema_extra={"enum": list(ROLES)})


class HostState(BaseModel):
    """A host's scheduling state: active, draining or down."""

    model_config = ConfigDict(extra="forbid")
    state: str = Field(json_schema_extra={"enum": list(HOST_STATES)})


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
