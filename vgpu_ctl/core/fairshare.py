"""Fair share (pure): decayed usage from VMs' lifetimes, and Slurm's Fair Tree ranking of tenants.

Usage is charged per VM as a rate while it holds devices: its framebuffer in GiB and its compute slices (a MIG
instance's slices; a whole GPU or a time-sliced vGPU its share of the GPU's slices), so a 1g slice and a whole GPU
count for what they are. Past usage decays with a half-life: a unit used `h` seconds ago counts 1/2. A tenant's
usage is its dominant share of the fleet over time: max(framebuffer-GiB-hours / fleet GiB, slice-hours / fleet
slices), in GPU-hour-like units, as weighted DRF does for one instant.

Fair Tree (SchedMD, fair_tree.shtml): among siblings, level fairshare LF = S / U with S the node's shares over
its siblings' and U its usage over theirs (an account's usage is its subtree's); siblings are sorted by LF, highest
first, and the tree is walked depth first, so tenants are ranked; the fair-share factor is (n - rank + 1) / n.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vgpu_ctl.errors import InvalidInput

HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Interval:
    """A VM's holding: from `start` to `end` (epoch seconds; None: still held) at `fb_gib` GiB of framebuffer and
    `compute` compute slices."""

    start: float
    end: float | None
    fb_gib: float
    compute: float


@dataclass(frozen=True, slots=True)
class Usage:
    """Decayed usage: framebuffer-GiB-hours and compute-slice-hours, as of some time."""

    fb_gib_h: float = 0.0
    compute_h: float = 0.0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.fb_gib_h + other.fb_gib_h, self.compute_h + other.compute_h)

    def scaled(self, factor: float) -> Usage:
        """This usage times `factor`."""
        return Usage(self.fb_gib_h * factor, self.compute_h * factor)


def check_half_life(seconds: object) -> float:
    """The half-life if it is a positive number of seconds; InvalidInput naming the field else."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise InvalidInput(f"half_life must be a positive number of seconds (field half_life, value {seconds!r})",
                           reasons=[{"field": "half_life", "value": seconds}])
    return float(seconds)


def decay(age_s: float, half_life_s: float) -> float:
    """The weight of something `age_s` seconds old (1 now, 1/2 one half-life ago)."""
    return float(2.0 ** (-max(age_s, 0.0) / half_life_s))


def decayed_hours(start: float, end: float, now: float, half_life_s: float) -> float:
    """The integral from `start` to `end` of the decay weight as of `now`, in hours: how much one unit held over
    that time counts now. Times after `now` count as now."""
    end = min(end, now)
    if end <= start:
        return 0.0
    k = math.log(2.0) / half_life_s
    return (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / k / HOUR


def decayed_usage(intervals: Iterable[Interval], now: float, half_life_s: float) -> Usage:
    """The decayed usage of holdings as of `now` (open ones count up to `now`)."""
    fb = compute = 0.0
    for iv in intervals:
        hours = decayed_hours(iv.start, now if iv.end is None else iv.end, now, half_life_s)
        fb += iv.fb_gib * hours
        compute += iv.compute * hours
    return Usage(fb, compute)


def fold(usage: Usage, as_of: float, now: float, half_life_s: float) -> Usage:
    """Usage decayed as of `as_of`, decayed further to `now` (a ledger's folded past)."""
    return usage.scaled(decay(now - as_of, half_life_s))


def dominant(usage: Usage, fleet_fb_gib: float, fleet_compute: float) -> float:
    """A tenant's usage as one number: its dominant share of the fleet over time, in fleet-hours."""
    parts = [usage.fb_gib_h / fleet_fb_gib if fleet_fb_gib > 0 else 0.0,
             usage.compute_h / fleet_compute if fleet_compute > 0 else 0.0]
    return max(parts)


@dataclass(frozen=True, slots=True)
class Member:
    """A node of the share tree: a tenant (leaf) or an account, its parent account (None: the root) and shares."""

    name: str
    parent: str | None
    shares: int
    usage: float = 0.0  # a tenant's own; an account's is its subtree's
    account: bool = False


@dataclass(frozen=True, slots=True)
class ShareRow:
    """One node of `sshare -l`: shares and usage normalized among siblings, level fairshare, and for tenants
    their rank (1: served first) and fair-share factor."""

    name: str
    parent: str | None
    account: bool
    depth: int
    shares: int
    norm_shares: float
    usage: float
    norm_usage: float
    level_fs: float
    rank: int | None = None
    factor: float | None = None


def fair_tree(members: Iterable[Member]) -> list[ShareRow]:
    """Rank tenants by Fair Tree: rows in walk order (accounts before their members), each tenant with its rank
    and factor. Equal level fairshare among siblings share a rank. InvalidInput for a parent that is not an
    account, or a cycle."""
    nodes = {m.name: m for m in members}
    children: dict[str | None, list[Member]] = {}
    for m in nodes.values():
        if m.parent is not None and (m.parent not in nodes or not nodes[m.parent].account):
            raise InvalidInput(f"share tree: {m.name!r} has parent {m.parent!r}, which is not an account",
                               reasons=[{"field": "parent", "value": m.parent}])
        children.setdefault(m.parent, []).append(m)
    total: dict[str, float] = {}

    def subtree(name: str, seen: frozenset[str]) -> float:
        if name in seen:
            raise InvalidInput(f"share tree: account {name!r} is its own ancestor",
                               reasons=[{"field": "parent", "value": name}])
        if name not in total:
            node = nodes[name]
            total[name] = node.usage + sum(subtree(c.name, seen | {name}) for c in children.get(name, []))
        return total[name]

    for name in nodes:
        subtree(name, frozenset())
    rows: list[ShareRow] = []
    tenants: list[tuple[int, float, str | None]] = []  # row index, level fs, parent: ties share a rank

    def walk(parent: str | None, depth: int) -> None:
        sibs = children.get(parent, [])
        s_sum = sum(m.shares for m in sibs)
        u_sum = sum(total[m.name] for m in sibs)
        scored = []
        for m in sibs:
            s = m.shares / s_sum if s_sum > 0 else 0.0
            u = total[m.name] / u_sum if u_sum > 0 else 0.0
            lf = math.inf if u == 0 and s > 0 else (s / u if u > 0 else 0.0)
            scored.append((lf, m, s, u))
        scored.sort(key=lambda x: (-x[0], x[1].name))
        for lf, m, s, u in scored:
            rows.append(ShareRow(m.name, parent, m.account, depth, m.shares, s, total[m.name], u, lf))
            if m.account:
                walk(m.name, depth + 1)
            else:
                tenants.append((len(rows) - 1, lf, parent))

    walk(None, 0)
    n = len(tenants)
    rank = 0
    prev: tuple[float, str | None] | None = None
    for i, (idx, lf, parent) in enumerate(tenants):
        if prev != (lf, parent):
            rank = i + 1
        prev = (lf, parent)
        r = rows[idx]
        rows[idx] = ShareRow(r.name, r.parent, r.account, r.depth, r.shares, r.norm_shares, r.usage, r.norm_usage,
                             r.level_fs, rank, (n - rank + 1) / n)
    return rows


def factors(rows: Iterable[ShareRow]) -> Mapping[str, float]:
    """Tenant name -> fair-share factor of a `fair_tree` result."""
    return {r.name: r.factor for r in rows if not r.account and r.factor is not None}
