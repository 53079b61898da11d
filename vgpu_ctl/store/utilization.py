"""The fleet's utilization in the store: what a utilization round joins its host samples with (the sampled hosts'
GPUs and the devices on them), and each GPU host's latest sample (`utilization_sample`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Table, delete, insert, select

from vgpu_ctl.store.models import UtilizationSample
from vgpu_ctl.store.tables import DEVICE, GPU, HOST, POOL, TENANT, VM
from vgpu_ctl.store.unit import Tx

SAMPLE: Table = UtilizationSample.__table__  # type: ignore[attr-defined]


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


class SampleRow(NamedTuple):
    """A GPU host's latest sample: when it was taken (None: never) and last tried, the try's error, the interval
    it was taken on, and what it holds."""

    host_id: int
    attempted_at: datetime
    sampled_at: datetime | None
    error: str | None
    interval_s: float
    sample: dict[str, Any] | None


class HostSample(NamedTuple):
    """A kept sample with its host's name."""

    host: str
    row: SampleRow


_SAMPLE_COLUMNS = [SAMPLE.c[name] for name in SampleRow._fields]


def host_ids(tx: Tx, host_names: Collection[str]) -> dict[str, int]:
    """The ids of the named hosts (those that exist), by name."""
    return {str(r.name): int(r.id) for r in tx.execute(
        select(HOST.c.id, HOST.c.name).where(HOST.c.name.in_(list(host_names))))}


def samples_of(tx: Tx, host_ids: Collection[int]) -> dict[int, SampleRow]:
    """The kept samples of these hosts, by host id."""
    return {r.host_id: SampleRow._make(r) for r in tx.execute(
        select(*_SAMPLE_COLUMNS).where(SAMPLE.c.host_id.in_(list(host_ids))))}


def put_samples(tx: Tx, rows: Sequence[SampleRow]) -> None:
    """Make these rows their hosts' kept samples (replacing what each host had)."""
    tx.execute(delete(SAMPLE).where(SAMPLE.c.host_id.in_([r.host_id for r in rows])))
    tx.execute(insert(SAMPLE), [r._asdict() for r in rows])


def host_samples(tx: Tx, host_names: Collection[str] | None) -> list[HostSample]:
    """The kept samples of the named hosts (None: of every host), by host name."""
    query = select(HOST.c.name, *_SAMPLE_COLUMNS).join(HOST, HOST.c.id == SAMPLE.c.host_id).order_by(HOST.c.name)
    if host_names is not None:
        query = query.where(HOST.c.name.in_(list(host_names)))
    return [HostSample(r[0], SampleRow._make(r[1:])) for r in tx.execute(query)]
