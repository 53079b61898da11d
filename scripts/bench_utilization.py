#!/usr/bin/env python3
"""Time what keeping utilization in the store costs: one sampling round written (`record_usage`: every host's
attributed sample and idle marks, in one transaction, as the server's leader does every utilization_interval_s),
a second round (the idle marks carried on from the first), and a scrape: `read`, the utilization families built
from the store (no host called), and `scrape`, those read and rendered to text by prometheus_client as /metrics
does, per fleet size, on SQLite (and PostgreSQL with --pg URL).

The fleet is bench_admin's inventory (8 GPUs per simulated host); the samples are made up, not read from NVML:
each GPU with every value, `--vgpus` vGPUs per GPU attributed to a device, VM, tenant and pool. What NVML and the
SSH sessions to the agents cost is not here: that is the sampler's, off the scrape's path since the store keeps
the samples. Target: the read under 5 s at every size (issue 12's `metrics dump` target). The text rendering
(prometheus_client, a few microseconds per label) is most of a scrape: it grows with the series, 8 per GPU and 8
per vGPU here, as it did when every scrape sampled the hosts.

Usage: bench_utilization.py [--gpus 1000,10000] [--vgpus 4] [--pg URL] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_admin import write_inventory

from vgpu_ctl.ops.utilization import UtilizationCollector
from vgpu_ctl.service.controller import Controller
from vgpu_ctl.service.utilization import FleetUsage, GpuUsage, IdleRule, VgpuUsage
from vgpu_ctl.service.utilization_samples import record_usage

TARGET_S = 5.0


def made_up(ctl: Controller, vgpus_per_gpu: int, now: float, busy: int) -> FleetUsage:
    """A round of samples for every GPU of the store: the GPU's values and `vgpus_per_gpu` attributed vGPUs."""
    from sqlalchemy import select

    from vgpu_ctl.store.tables import GPU, HOST
    with ctl.engine.connect() as conn:
        rows = conn.execute(select(GPU.c.id, GPU.c.pci_address, GPU.c.model, HOST.c.name)
                            .join(HOST, HOST.c.id == GPU.c.host_id)).all()
    usage = FleetUsage(now)
    for n, g in enumerate(rows):
        usage.hosts[g.name] = None
        uuid = f"GPU-{n:08d}"
        usage.gpus.append(GpuUsage(g.name, g.pci_address, uuid, n % 8, "NVIDIA A100 80GB PCIe", g.model, "p",
                                   g.id, False, 0.37, 0.12, 20 * 2**30, 80 * 2**30, 215.0, 61.0, 0, 0))
        for v in range(vgpus_per_gpu):
            dev = f"{n:08d}-{v:04d}-4000-8000-000000000000"
            usage.vgpus.append(VgpuUsage(g.name, g.pci_address, uuid, n % 8, "vgpu", dev, dev, "A100D-10C",
                                         f"vm{n}-{v}", dev, f"t{n % 50}", "p", sm=(busy + v) % 100 / 100,
                                         memory=0.1, encoder=0.0, decoder=0.0, fb_used_bytes=2**30,
                                         fb_total_bytes=10 * 2**30))
    return usage


def scrape(ctl: Controller) -> tuple[float, float, int]:
    """Seconds to read the utilization families from the store, to read and render them as /metrics does, and
    how many lines they are."""
    collector = UtilizationCollector(ctl, IdleRule(0.05, 1800))
    t = time.perf_counter()
    list(collector.collect())
    read = time.perf_counter() - t
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    t = time.perf_counter()
    text = generate_latest(reg)
    return read, time.perf_counter() - t, text.count(b"\n")


def bench(url: str, inventory: Path, n_gpus: int, vgpus: int) -> dict[str, Any]:
    """One size on one store: the times of the rounds and the scrape."""
    with Controller(url) as ctl:
        ctl.apply_inventory(inventory)
        now = time.time()
        out: dict[str, Any] = {"gpus": n_gpus, "vgpus": n_gpus * vgpus}
        for key, busy, at in (("round_s", 50, now - 60), ("next_round_s", 2, now)):
            usage = made_up(ctl, vgpus, at, busy)
            t = time.perf_counter()
            with ctl.tx() as conn:
                out["hosts"] = record_usage(conn, usage, 60.0)
            out[key] = time.perf_counter() - t
        out["read_s"], out["scrape_s"], out["lines"] = min(scrape(ctl) for _ in range(3))
    return out


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The table."""
    head = (f"{'store':<10} {'GPUs':>7} {'vGPUs':>7} {'hosts':>6} {'keep a round':>13} {'next round':>11} "
            f"{'read':>7} {'scrape':>8} {'lines':>8}  target: read < {TARGET_S:g} s")
    lines = [head, "-" * len(head)]
    for r in rows:
        met = "met" if r["read_s"] < TARGET_S else "MISSED"
        lines.append(f"{r['store']:<10} {r['gpus']:>7} {r['vgpus']:>7} {r['hosts']:>6} {r['round_s']:>12.2f}s "
                     f"{r['next_round_s']:>10.2f}s {r['read_s']:>6.2f}s {r['scrape_s']:>7.2f}s {r['lines']:>8}  {met}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sizes, print the table (or JSON); 1 when a read misses its target."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="1000,10000", help="fleet sizes, comma-separated")
    ap.add_argument("--vgpus", type=int, default=4, help="vGPUs per GPU in the samples")
    ap.add_argument("--pg", help="also on this PostgreSQL URL (an empty database or schema)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.gpus.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench-util-") as tmp:
            os.environ["VGPU_CTL_STATE_DIR"] = tmp  # the simulated hosts' state, not the user's
            inventory = Path(tmp) / "inv.yaml"
            write_inventory(inventory, n)
            stores = [("sqlite", f"sqlite:///{Path(tmp) / 'store.db'}")]
            if args.pg:
                stores.append(("postgres", args.pg))
            for name, url in stores:
                rows.append({"store": name, **bench(url, inventory, n, args.vgpus)})
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0 if all(r["read_s"] < TARGET_S for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
