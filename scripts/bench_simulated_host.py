#!/usr/bin/env python3
"""Benchmark a simulated host's provisioning steps as the number of domains it holds grows, side by side.

For each `--domains` count D, a host whose state file already holds D defined domains (written directly, in the
format every tree reads), then `--vms` new VMs provisioned on it the way `provision_vm` drives a host: the
mdev created, the domain defined (the durable step), then started; each step timed. With `--baseline TREE`
the same runs also use another checkout's `SimulatedHost` (TREE: its root), alternating, best of `--rounds`,
each run in its own process on a fresh copy of the state. A real KVM host keeps one file per domain, so what
a definition costs should not grow with D.

Usage: bench_simulated_host.py [--domains 0,200,1000] [--vms 100] [--rounds 3] [--baseline TREE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid as uuidlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("create_device", "define_domain", "start_domain")

# Run by each tree's Python: provisions the VMs of a work file on one host, timing every step.
_RUN = """
import json, sys, time
from pathlib import Path
import vgpu_ctl
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceSpec
from vgpu_ctl.hosts.simulated import SimulatedHost
work = json.loads(Path(sys.argv[1]).read_text())
host = SimulatedHost("h1", Path(work["state_dir"]))
host.list_domains()  # the state file parsed once, as a long-lived controller holds it
times = {"create_device": 0.0, "define_domain": 0.0, "start_domain": 0.0}
for vm in work["vms"]:
    spec = DeviceSpec(device_id=vm["device"], gpu_pci=vm["gpu"], backing=DeviceBacking.MDEV, profile="A100D-10C",
                      start=0, size=10, uuid=vm["mdev"])
    for step, call in (("create_device", lambda: host.create_device(spec)),
                       ("define_domain", lambda: host.define_domain(vm["xml"])),
                       ("start_domain", lambda: host.start_domain(vm["name"]))):
        t0 = time.perf_counter()
        call()
        times[step] += time.perf_counter() - t0
print(json.dumps({"code": vgpu_ctl.__file__, **{k: 1000 * v / len(work["vms"]) for k, v in times.items()}}))
"""


def _xml(name: str, vm_id: str, mdev: str) -> str:
    """A domain's XML as the project's template renders it for one mdev vGPU."""
    from vgpu_ctl.hosts.protocol import DeviceBacking
    from vgpu_ctl.render import DomainContext, HostdevContext, TemplateRenderer

    hostdev = HostdevContext(device_id=str(uuidlib.uuid4()), profile="A100D-10C", backing=DeviceBacking.MDEV,
                             uuid=mdev, pci=None, gpu_pci="0000:41:00.0", start=0, size=10)
    ctx = DomainContext(name=name, uuid=vm_id, tenant="t1", vm_id=vm_id, vcpus=4, memory_mib=8192,
                        disk_base_image="/var/lib/vgpu-ctl/images/base.qcow2",
                        disk_overlay=f"/var/lib/vgpu-ctl/images/{vm_id}.qcow2", network="default",
                        network_type="network", hostdevs=[hostdev], compute_only=True)
    return TemplateRenderer().render_domain("domain.xml.j2", ctx)


def _vm(i: int) -> dict[str, str]:
    """The i-th VM: its domain name, ids, mdev and XML."""
    vm_id, mdev = str(uuidlib.uuid4()), str(uuidlib.uuid4())
    name = f"vm{i:06d}-{vm_id[:8]}"
    return {"name": name, "id": vm_id, "mdev": mdev, "device": str(uuidlib.uuid4()), "gpu": "0000:41:00.0",
            "xml": _xml(name, vm_id, mdev)}


def _state_file(existing: Sequence[dict[str, str]]) -> dict[str, Any]:
    """A state file holding `existing` as defined, running domains with their mdevs."""
    devices = {vm["mdev"]: {"backing": "mdev", "gpu_pci": vm["gpu"], "profile": "A100D-10C", "uuid": vm["mdev"],
                            "pci_address": None, "gpu_instance_id": None, "start": 0, "size": 10}
               for vm in existing}
    domains = {vm["name"]: {"uuid": vm["id"], "xml": vm["xml"], "active": True} for vm in existing}
    return {"generation": 1, "devices": devices, "domains": domains}


def _run_in(tree: Path, work: Path) -> dict[str, float]:
    """The per-VM step times of one run with `tree`'s vgpu_ctl."""
    done = subprocess.run([sys.executable, "-c", _RUN, str(work)], capture_output=True, text=True, cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if done.returncode:
        raise SystemExit(f"the run with {tree} failed:\n{done.stderr}")
    out = json.loads(done.stdout.splitlines()[-1])
    if not Path(out.pop("code")).is_relative_to(tree):
        raise SystemExit(f"the run meant for {tree} imported another vgpu_ctl")
    return {k: float(v) for k, v in out.items()}


def bench(n_domains: int, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The per-VM step times on a host already holding `n_domains`, for each tree (best round by total)."""
    existing = [_vm(i) for i in range(n_domains)]
    new = [_vm(n_domains + i) for i in range(args.vms)]
    state = json.dumps(_state_file(existing), sort_keys=True)
    trees = {"after": ROOT, **({"before": Path(args.baseline).resolve()} if args.baseline else {})}
    best: dict[str, dict[str, float]] = {}
    for rnd in range(args.rounds):
        for label, tree in trees.items():
            state_dir = tmp / f"d{n_domains}-r{rnd}-{label}"
            shutil.rmtree(state_dir, ignore_errors=True)
            state_dir.mkdir()
            (state_dir / "h1.json").write_text(state)
            work = state_dir / "work.json"
            work.write_text(json.dumps({"state_dir": str(state_dir), "vms": new}))
            times = _run_in(tree, work)
            if label not in best or sum(times.values()) < sum(best[label].values()):
                best[label] = times
            shutil.rmtree(state_dir)
    return [{"domains": n_domains, "tree": label if args.baseline else "", **best[label],
             "per_vm": sum(best[label].values())} for label in reversed(trees)]


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    out = ["| domains on the host | code | create_device ms | define_domain ms | start_domain ms | per VM ms |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['domains']:,} | {r['tree']} | {r['create_device']:.3f} | {r['define_domain']:.3f} | "
                   f"{r['start_domain']:.3f} | {r['per_vm']:.3f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--domains", default="0,200,1000", help="domains the host holds before, comma-separated")
    ap.add_argument("--vms", type=int, default=100, help="VMs provisioned on the host per run")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each tree (best one kept)")
    ap.add_argument("--baseline", help="root of another checkout whose SimulatedHost also runs (before)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-simhost-") as tmp:
        rows = [row for d in args.domains.split(",") for row in bench(int(d), args, Path(tmp))]
    print(json.dumps(rows, indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
