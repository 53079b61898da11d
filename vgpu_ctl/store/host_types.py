"""What each host calls each profile (`gpu_type_id`: mdev type ids, vendor-VFIO type ids, NVML MIG profile ids,
per GPU), and the profiles a GPU's host lacks ids for (`gpu.lacks`, `gpu.lacked_types`)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from sqlalchemy import Table, bindparam, select

from vgpu_ctl.store.models import GpuTypeId
from vgpu_ctl.store.prepared import Prepared, end_read
from vgpu_ctl.store.tables import GPU, HOST
from vgpu_ctl.store.unit import Tx, utcnow

TYPE_ID: Table = GpuTypeId.__table__  # type: ignore[attr-defined]
KINDS = ("mdev", "vfio", "mig")
TypeIds = dict[str, dict[str, str]]  # kind -> profile -> the host's id


class TypedGpu(NamedTuple):
    """A GPU as a discovery of its host compares it: what it is declared as, what it holds, what it lacks."""

    id: int
    pci_address: str
    model: str
    mode: str
    pinned_type: str | None
    layout: str
    mig_layout: str
    lacks: int
    lacked_types: dict[str, str] | None


class LackingGpu(NamedTuple):
    """A GPU whose host lacks type ids for some profiles, with what to do for each."""

    host: str
    pci_address: str
    lacked_types: dict[str, str]


_IDS_OF = Prepared(select(TYPE_ID.c.kind, TYPE_ID.c.profile, TYPE_ID.c.type_id)
                   .where(TYPE_ID.c.gpu_id == bindparam("gpu_id")))


def type_ids(tx: Tx, gpu_ids: Collection[int]) -> dict[int, TypeIds]:
    """The ids recorded for each of these GPUs, by kind and profile (every kind present, empty or not)."""
    out: dict[int, TypeIds] = {}
    for gpu_id in gpu_ids:
        ids: TypeIds = out.setdefault(gpu_id, {k: {} for k in KINDS})
        for kind, profile, type_id in _IDS_OF.run(tx, {"gpu_id": gpu_id}).fetchall():
            ids[kind][profile] = type_id
    if not tx.in_transaction():
        end_read(tx)
    return out


def replace_type_ids(tx: Tx, gpu_id: int, ids: Mapping[str, Mapping[str, str]]) -> None:
    """Make `ids` (kind -> profile -> id) all the ids recorded for the GPU, seen now."""
    tx.execute(TYPE_ID.delete().where(TYPE_ID.c.gpu_id == gpu_id))
    now = utcnow()
    rows = [{"gpu_id": gpu_id, "kind": k, "profile": p, "type_id": t, "seen_at": now}
            for k, v in ids.items() for p, t in sorted(v.items())]
    if rows:
        tx.execute(TYPE_ID.insert(), rows)


def discovered_gpus(tx: Tx, host_id: int) -> list[TypedGpu]:
    """The host's GPUs, by PCI address."""
    return [TypedGpu._make(r) for r in tx.execute(
        select(*(GPU.c[name] for name in TypedGpu._fields)).where(GPU.c.host_id == host_id)
        .order_by(GPU.c.pci_address))]


def set_lacked(tx: Tx, gpu_id: int, lacks: int, lacked_types: dict[str, str] | None, fits: int) -> None:
    """Set the profiles the GPU's host lacks (mask and what to do for each) and its fit mask, with a new
    version (a claim planned on the old mask retries)."""
    tx.execute(GPU.update().where(GPU.c.id == gpu_id).values(lacks=lacks, lacked_types=lacked_types, fits=fits,
                                                             version=GPU.c.version + 1))


def lacking_gpus(tx: Tx, pool_id: int) -> list[LackingGpu]:
    """The pool's GPUs whose host lacks type ids for some profiles, by GPU id."""
    return [LackingGpu(str(r.name), str(r.pci_address), dict(r.lacked_types or {})) for r in tx.execute(
        select(HOST.c.name, GPU.c.pci_address, GPU.c.lacked_types).join(HOST, HOST.c.id == GPU.c.host_id)
        .where(GPU.c.pool_id == pool_id, GPU.c.lacks != 0).order_by(GPU.c.id))]
