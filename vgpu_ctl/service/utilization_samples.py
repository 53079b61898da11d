"""The fleet's utilization as the store keeps it (`utilization_sample`, a row per GPU host): written by one sampling
round (`sample_round`: the server's leader every `utilization_interval_s`, or `vgpuctl metrics sample`), read by
every replica's /metrics, `vgpuctl metrics dump/serve` and `status --idle` without calling a host.

A row holds the host's last sample already joined with the store (service.utilization: each GPU, each vGPU and MIG
instance with its device (claim), VM, tenant and pool) and each allocated vGPU's idle marks, carried from round to
round, so any reader can tell for any threshold since when a vGPU has been below it. A sample older than
`STALE_INTERVALS` times the interval it was taken on is stale: readers show its age, not its values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.service import gpu_loads
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.service.utilization import (
    FleetUsage,
    GpuUsage,
    IdleRule,
    IdleVgpu,
    Marks,
    Sampler,
    VgpuUsage,
    add_mark,
    below_since,
    collect_usage,
    judged,
    load_by_gpu,
)
from vgpu_ctl.store.utilization import SampleRow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

STALE_INTERVALS = 3.0  # a sample older than this many of its intervals is not current
DEFAULT_INTERVAL_S = 60.0


def check_interval(value: object, field_name: str = "interval") -> float:
    """A sampling interval in seconds (more than 0, at most a day); InvalidInput naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 < value <= 86400.0:
        raise InvalidInput(f"{field_name} must be seconds between sampling rounds, more than 0 and at most 86400, "
                           f"got {value!r}", reasons=[{"field": field_name, "value": repr(value)}])
    return float(value)


def _at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _epoch(t: datetime) -> float:
    return (t if t.tzinfo is not None else t.replace(tzinfo=UTC)).timestamp()


def _idle_after(previous: Mapping[str, Any], now: Iterable[tuple[str, VgpuUsage, float, str]],
                at: float) -> dict[str, Any]:
    """A sampled host's idle state after this round: each judged vGPU's marks carried on from `previous` (what the
    host's row held); a vGPU not judged this round is forgotten (busy again, gone, or no longer measurable)."""
    out: dict[str, Any] = {}
    for device, v, busy, why in now:
        before = previous.get(device) or {}
        marks: Marks = [(float(b), None if n is None else float(n)) for b, n in before.get("marks", [])]
        out[device] = {"host": v.host, "gpu_pci": v.gpu_pci, "profile": v.profile, "vm": v.vm, "tenant": v.tenant,
                       "pool": v.pool, "busy": busy, "why": why, "at": at,
                       "first_at": float(before.get("first_at", at)),
                       "marks": [list(m) for m in add_mark(marks, busy, at)]}
    return out


def record_usage(conn: Tx, usage: FleetUsage, interval_s: float) -> int:
    """Keep one round's samples (taken at `usage.time`, on an interval of `interval_s`) as the hosts' latest, in
    the caller's transaction: a sampled host's row is replaced (its idle marks carried on), a host that could not
    be sampled keeps its last sample with this try's error; simulated hosts have nothing to keep. How many rows."""
    interval = check_interval(interval_s, "interval_s")
    ids = STORE.utilization.host_ids(conn, usage.hosts)
    wanted = {h: why for h, why in usage.hosts.items() if h in ids and not (why or "").startswith("simulated")}
    if not wanted:
        return 0
    old = STORE.utilization.samples_of(conn, [ids[h] for h in wanted])
    gpus: dict[str, list[dict[str, Any]]] = {}
    vgpus: dict[str, list[dict[str, Any]]] = {}
    notes: dict[str, list[str]] = {}
    judged_on: dict[str, list[tuple[str, VgpuUsage, float, str]]] = {}
    for g in usage.gpus:
        gpus.setdefault(g.host, []).append(asdict(g))
    for v in usage.vgpus:
        vgpus.setdefault(v.host, []).append(asdict(v))
    for n in usage.notes:
        host, _, text = n.partition(": ")
        notes.setdefault(host, []).append(text)
    for device, (v, busy, reason) in sorted(judged(usage).items()):
        judged_on.setdefault(v.host, []).append((device, v, busy, reason))
    at = _at(usage.time)
    rows = []
    for host, why in sorted(wanted.items()):
        hid = ids[host]
        before = old.get(hid)
        if why is not None:  # not sampled: the last sample stays, with this try's error
            rows.append(SampleRow(hid, at, before.sampled_at if before is not None else None, why, interval,
                                  before.sample if before is not None else None))
            continue
        previous = (before.sample or {}).get("idle", {}) if before is not None else {}
        sample = {"gpus": gpus.get(host, []), "vgpus": vgpus.get(host, []), "notes": notes.get(host, []),
                  "idle": _idle_after(previous, judged_on.get(host, []), usage.time)}
        rows.append(SampleRow(hid, at, at, None, interval, sample))
    STORE.utilization.put_samples(conn, rows)
    return len(rows)


def sample_round(ctl: Controller, sampler: Sampler | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                 now: float | None = None) -> dict[str, int]:
    """Sample every host now (admin) and keep, in one transaction, each host's sample (for the metrics and idle
    detection) and each GPU's measured load (for spread-load pools): `{"hosts": rows written, "gpu_loads": n}`."""
    ctl.principal.require_admin("sample utilization")
    interval = check_interval(interval_s, "interval_s")
    usage = collect_usage(ctl, sampler, now=time.time() if now is None else now)
    with ctl.tx() as conn:
        loads = gpu_loads.record(conn, load_by_gpu(usage))
        hosts = record_usage(conn, usage, interval)
    return {"hosts": hosts, "gpu_loads": loads}


@dataclass
class StoredUsage:
    """What the store holds of the fleet's utilization, as of `usage.time` (the reader's now): `usage` has the
    current samples only (`usage.hosts`: None for a host whose sample is current and whose last try worked, else
    why not); `ages` every kept sample's age in seconds, stale ones too; `idle` the idle state of current hosts'
    allocated vGPUs (device -> what `record_usage` kept)."""

    usage: FleetUsage
    ages: dict[str, float] = field(default_factory=dict)
    idle: dict[str, dict[str, Any]] = field(default_factory=dict)

    def idle_vgpus(self, rule: IdleRule) -> list[IdleVgpu]:
        """The allocated vGPUs below `rule.threshold` in their latest sample, each with since when and whether
        idle (below it for `rule.idle_for_s` seconds of samples), by device."""
        out = []
        for device, s in sorted(self.idle.items()):
            marks: Marks = [(float(b), None if n is None else float(n)) for b, n in s["marks"]]
            since = below_since(marks, float(s["first_at"]), rule.threshold)
            if since is None:
                continue
            at = float(s["at"])
            out.append(IdleVgpu(device, s["host"], s["gpu_pci"], s["profile"], s["vm"], s["tenant"], s["pool"],
                                float(s["busy"]), since, at, at - since >= rule.idle_for_s, s["why"]))
        return out


def stored_usage(ctl: Controller, now: float | None = None, hosts: Iterable[str] | None = None) -> StoredUsage:
    """The hosts' kept samples (admin or reader; those named, else all), read in one statement, no host called."""
    ctl.principal.require_reader("utilization")
    t = time.time() if now is None else now
    with ctl.read() as conn:
        rows = STORE.utilization.host_samples(conn, None if hosts is None else list(hosts))
    out = StoredUsage(FleetUsage(t))
    for host, r in rows:
        age = None if r.sampled_at is None else t - _epoch(r.sampled_at)
        if age is not None:
            out.ages[host] = max(0.0, age)
        if age is None or age > STALE_INTERVALS * r.interval_s:
            since = "never sampled" if age is None else \
                f"last sample {age:.0f}s old (stale after {STALE_INTERVALS:g} intervals of {r.interval_s:g}s)"
            out.usage.hosts[host] = f"{r.error}; {since}" if r.error else since
            continue
        out.usage.hosts[host] = r.error
        sample = r.sample or {}
        out.usage.gpus += [GpuUsage(**g) for g in sample.get("gpus", [])]
        out.usage.vgpus += [VgpuUsage(**v) for v in sample.get("vgpus", [])]
        out.usage.notes += [f"{host}: {n}" for n in sample.get("notes", [])]
        out.idle.update(sample.get("idle", {}))
    return out
