"""The request bodies of the API (responses are the Python API's own types)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VgpuSpec(BaseModel):
    """`count` vGPUs of `profile`."""

    model_config = ConfigDict(extra="forbid")
    profile: str
    count: int = 1


class VmCreate(BaseModel):
    """A VM request; `tenant` defaults to the caller's tenant."""

    model_config = ConfigDict(extra="forbid")
    tenant: str | None = None
    name: str
    vgpus: list[VgpuSpec] = Field(min_length=1)
    vcpus: int
    memory_mib: int
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
    limits: dict[str, int | None]
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
    fix: bool = False


class StopVm(BaseModel):
    """How to stop: `force` destroys instead of shutting down."""

    model_config = ConfigDict(extra="forbid")
    force: bool = False
