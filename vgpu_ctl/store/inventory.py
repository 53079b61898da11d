"""The inventory in the store: pools, hosts and GPUs as an inventory apply reads and writes them (every row
read at once, new hosts and GPUs written with multi-row statements, so a 100k-GPU fleet is a few round trips).
Rows are read-only mappings by column name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, literal, select
from sqlalchemy.engine import RowMapping

from vgpu_ctl.store.tables import DEVICE, GPU, HOST, POOL, VM
from vgpu_ctl.store.unit import Tx

Row = RowMapping  # a row by column name
CHUNK = 5000  # rows per multi-row INSERT statement


def _chunks(rows: Sequence[dict[str, Any]], size: int = CHUNK) -> Iterator[Sequence[dict[str, Any]]]:
    for i in range(0, len(rows), size):
        yield rows[i:i + size]


def pool_rows(tx: Tx) -> dict[str, Row]:
    """Every pool, by name."""
    return {r["name"]: r for r in tx.execute(select(POOL)).mappings().all()}


def add_pool(tx: Tx, name: str, fields: Mapping[str, Any]) -> None:
    """Insert a pool."""
    tx.execute(POOL.insert().values(name=name, **fields))


def update_pool(tx: Tx, pool_id: int, fields: Mapping[str, Any]) -> None:
    """Set a pool's columns."""
    tx.execute(POOL.update().where(POOL.c.id == pool_id).values(**fields))


def pool_ids(tx: Tx) -> dict[str, int]:
    """Every pool's id, by name."""
    return {r.name: r.id for r in tx.execute(select(POOL.c.name, POOL.c.id)).all()}


def remove_pool(tx: Tx, pool_id: int) -> None:
    """Delete a pool, its GPUs left in no pool."""
    tx.execute(GPU.update().where(GPU.c.pool_id == pool_id).values(pool_id=None))
    tx.execute(POOL.delete().where(POOL.c.id == pool_id))


def host_rows(tx: Tx) -> dict[str, Row]:
    """Every host, by name."""
    return {r["name"]: r for r in tx.execute(select(HOST)).mappings().all()}


def gpu_declarations(tx: Tx, columns: Sequence[str]) -> dict[int, dict[str, tuple[int, tuple[Any, ...]]]]:
    """Every GPU's id and the values of `columns` (in that order), by host id and PCI address: what a re-apply
    compares with the file. Plain tuples of a few columns, not whole rows: 0.12 s against 0.27 s at 100k GPUs."""
    out: dict[int, dict[str, tuple[int, tuple[Any, ...]]]] = {}
    for r in tx.execute(select(GPU.c.id, GPU.c.host_id, GPU.c.pci_address, *(GPU.c[c] for c in columns))).all():
        out.setdefault(r[1], {})[r[2]] = (r[0], tuple(r[3:]))
    return out


def gpu_row(tx: Tx, gpu_id: int) -> Row:
    """One GPU's whole row."""
    return tx.execute(select(GPU).where(GPU.c.id == gpu_id)).mappings().one()


def update_host(tx: Tx, host_id: int, fields: Mapping[str, Any]) -> None:
    """Set a host's columns."""
    tx.execute(HOST.update().where(HOST.c.id == host_id).values(**fields))


def add_hosts(tx: Tx, rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Insert hosts (each a dict of columns with its name); their ids, by name."""
    for chunk in _chunks(rows):
        tx.execute(HOST.insert(), chunk)
    names = {h["name"] for h in rows}
    return {r.name: r.id for r in tx.execute(select(HOST.c.name, HOST.c.id)) if r.name in names}


def remove_host(tx: Tx, host_id: int) -> None:
    """Delete a host and its GPUs."""
    tx.execute(GPU.delete().where(GPU.c.host_id == host_id))
    tx.execute(HOST.delete().where(HOST.c.id == host_id))


def host_gpu_ids(tx: Tx, host_id: int) -> list[int]:
    """The ids of the host's GPUs."""
    return [int(r[0]) for r in tx.execute(select(GPU.c.id).where(GPU.c.host_id == host_id))]


def vms_on_gpus(tx: Tx, gpu_ids: Sequence[int]) -> list[str]:
    """The names of the VMs with devices on these GPUs, sorted."""
    rows = tx.execute(select(VM.c.name).join(DEVICE, DEVICE.c.vm_id == VM.c.id)
                      .where(DEVICE.c.gpu_id.in_(list(gpu_ids))).distinct()).all()
    return sorted(r[0] for r in rows)


def vms_placed_on(tx: Tx, host_id: int) -> list[str]:
    """The names of the VMs placed on the host, sorted."""
    return sorted(r[0] for r in tx.execute(select(VM.c.name).where(VM.c.host_id == host_id)))


def vms_in_pool(tx: Tx, pool_id: int) -> list[str]:
    """The names of the VMs in the pool, sorted."""
    return sorted(r[0] for r in tx.execute(select(VM.c.name).where(VM.c.pool_id == pool_id)))


def update_gpu(tx: Tx, gpu_id: int, values: Mapping[str, Any], fits: int, less_lacked: bool) -> None:
    """Set a GPU's columns and its fit mask (`fits`, less the bits its host lacks type ids for when
    `less_lacked`), with a new version."""
    mask: Any = literal(fits, BigInteger)
    tx.execute(GPU.update().where(GPU.c.id == gpu_id).values(
        version=GPU.c.version + 1, fits=mask - mask.op("&")(GPU.c.lacks) if less_lacked else fits, **values))


def remove_gpu(tx: Tx, gpu_id: int) -> None:
    """Delete a GPU."""
    tx.execute(GPU.delete().where(GPU.c.id == gpu_id))


def add_gpus(tx: Tx, rows: Sequence[dict[str, Any]]) -> None:
    """Insert GPUs (each a dict of columns with its host_id)."""
    for chunk in _chunks(rows):
        tx.execute(GPU.insert(), chunk)


def pools_by_name(tx: Tx) -> list[Row]:
    """Every pool, by name."""
    return list(tx.execute(select(POOL).order_by(POOL.c.name)).mappings().all())


def hosts_by_name(tx: Tx) -> list[Row]:
    """Every host, by name."""
    return list(tx.execute(select(HOST).order_by(HOST.c.name)).mappings().all())


def host_gpus(tx: Tx, host_id: int) -> list[Row]:
    """The host's GPUs, by PCI address."""
    return list(tx.execute(select(GPU).where(GPU.c.host_id == host_id).order_by(GPU.c.pci_address)).mappings().all())


def pool_gpu_kinds(tx: Tx, pool_id: int) -> list[tuple[str, str]]:
    """(model, mode) of each GPU in the pool."""
    return [(str(m), str(mode))
            for m, mode in tx.execute(select(GPU.c.model, GPU.c.mode).where(GPU.c.pool_id == pool_id))]
