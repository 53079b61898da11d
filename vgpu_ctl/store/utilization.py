"""What a utilization round joins its host samples with: the sampled hosts' GPUs and the devices on them."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

from sqlalchemy import select

from vgpu_ctl.store.tables import DEVICE, GPU, HOST, POOL, TENANT, VM
from vgpu_ctl.store.unit import Tx


class SampledGpu(NamedTuple):
    """A GPU with its host's and pool's names."""

    id: int
    pci_address: str
    model: str
    host: str
    pool: str | None


class SampledDevice(NamedTuple):
    """A device with its VM and tenant."""

    id: str
    uuid: str | None
    profile: str
    gpu_id: int
    handle: dict[str, Any] | None
    state: str
    framebuffer_mib: int
    backing: str
    vm_id: str
    vm: str
    vm_state: str
    domain_uuid: str | None
    tenant: str


def gpus_on_hosts(tx: Tx, host_names: Collection[str]) -> list[SampledGpu]:
    """The GPUs of the named hosts."""
    return [SampledGpu._make(r) for r in tx.execute(
        select(GPU.c.id, GPU.c.pci_address, GPU.c.model, HOST.c.name.label("host"), POOL.c.name.label("pool"))
        .join(HOST, HOST.c.id == GPU.c.host_id).outerjoin(POOL, POOL.c.id == GPU.c.pool_id)
        .where(HOST.c.name.in_(list(host_names))))]


def devices_on_gpus(tx: Tx, gpu_ids: Collection[int]) -> list[SampledDevice]:
    """The devices on these GPUs, with their VM and its tenant."""
    return [SampledDevice._make(r) for r in tx.execute(
        select(DEVICE.c.id, DEVICE.c.uuid, DEVICE.c.profile, DEVICE.c.gpu_id, DEVICE.c.handle, DEVICE.c.state,
               DEVICE.c.framebuffer_mib, DEVICE.c.backing, VM.c.id.label("vm_id"), VM.c.name.label("vm"),
               VM.c.state.label("vm_state"), VM.c.domain_uuid, TENANT.c.name.label("tenant"))
        .join(VM, VM.c.id == DEVICE.c.vm_id).join(TENANT, TENANT.c.id == VM.c.tenant_id)
        .where(DEVICE.c.gpu_id.in_(list(gpu_ids))))]
