#!/usr/bin/env python3
"""Benchmark the admin commands at fleet scale, as an admin runs them: each one a `vgpuctl` process.

For each fleet size (GPUs, 8 per host on simulated hosts; hosts rotate A100-80GB vgpu-equal (every fourth GPU
pinned to A100D-10C) / H100-80GB mig (every fourth GPU with a declared MIG layout) / L40S vgpu-mixed, in the pools
`ampere`, `hopper`, `ada`), in a fresh temporary folder (inventory file, SQLite store, simulated hosts' state):

1. `vgpuctl init`, then `vgpuctl inventory apply FILE` (the first apply: every host and GPU added);
   (text output, one line per change, as an admin sees it);
2. `--vms N` VMs requested through the Python API and provisioned end to end on the simulated hosts (devices
   carved, domains defined and started), so that status, doctor, metrics and reconcile have something to read;
3. timed, each a fresh `vgpuctl` process, so start-up (imports, opening the store) counts: the same apply again
   (nothing changed; the parsed file read from the user cache the first apply filled, in the folder's own
   $XDG_CACHE_HOME), the same again with no cache to read (parsed from YAML), `status` (the summary),
   `status --gpus --limit 100`, `doctor`, `metrics dump`, `reconcile` (read-only: every simulated host listed and
   compared with the store).

Start-up on its own: `vgpuctl --help` and `vgpuctl profiles list` (no store), the median of `--startup-runs`
runs (default 10); with `--baseline SRC` (a checkout of another commit, e.g. `git worktree add /tmp/before
HEAD~1`), the same commands from that tree are timed beside, run for run, so a before/after comparison sees
the same load. `--sizes ""` times the start-up only.

Every command runs as an installed package does, its bytecode compiled once and cached (in the work folder,
`PYTHONPYCACHEPREFIX`), also where the environment sets PYTHONDONTWRITEBYTECODE.

Each figure in step 3 is the best of `--runs` runs (default 3) of the same command, since those commands
change nothing and the machine may be shared; the first apply runs once. Beside the wall-clock seconds,
the CPU seconds (user + system) of that run's process, and the load average before and after, so a slow figure
on a busy machine can be told from a slow command.
Targets (issue 12): apply of 100k GPUs < 30 s, every other command < 5 s at 100k GPUs, --help and profiles list
< 0.3 s. Each command's exit status is checked (doctor and reconcile must find the fleet consistent).

Usage: bench_admin.py [--sizes 10000,100000] [--vms 200] [--runs 3] [--startup-runs 10] [--baseline SRC]
                      [--json] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GPUS_PER_HOST = 8
HOST_KINDS = (("A100-80GB", "vgpu-equal", "ampere"), ("H100-80GB", "mig", "hopper"), ("L40S", "vgpu-mixed", "ada"))
PCI_BUSES = (0x17, 0x3B, 0x4C, 0x5D, 0x9A, 0xBB, 0xCA, 0xDB)
MIG_LAYOUT = '["4g.40gb@0", "2g.20gb@4", "1g.10gb@6"]'
APPLY_TARGET_S = 30.0
COMMAND_TARGET_S = 5.0
START_TARGET_S = 0.3
# name, arguments after `vgpuctl --db URL`, target in seconds (at the largest size), exit statuses accepted
NO_CACHE = "re-apply, no parse cache"  # the same re-apply with no user cache to read or fill

TIMED: tuple[tuple[str, tuple[str, ...], float, tuple[int, ...]], ...] = (
    ("re-apply (no changes)", ("inventory", "apply", "{file}"), COMMAND_TARGET_S, (0,)),
    (NO_CACHE, ("inventory", "apply", "{file}"), COMMAND_TARGET_S, (0,)),
    ("status", ("status",), COMMAND_TARGET_S, (0,)),
    ("status --gpus --limit 100", ("status", "--gpus", "--limit", "100"), COMMAND_TARGET_S, (0,)),
    ("doctor", ("doctor",), COMMAND_TARGET_S, (0,)),
    ("metrics dump", ("metrics", "dump"), COMMAND_TARGET_S, (0,)),
    ("reconcile", ("reconcile", "--json"), COMMAND_TARGET_S, (0,)),
)


def write_inventory(path: Path, n_gpus: int) -> int:
    """An inventory of `n_gpus` GPUs (8 per simulated host, rotating models); the number of hosts."""
    hosts = (n_gpus + GPUS_PER_HOST - 1) // GPUS_PER_HOST
    out = ["pools:"]
    for _, mode, pool in HOST_KINDS:
        out.append(f"  - {{name: {pool}, policy: pack, description: \"{mode} GPUs\"}}")
    out.append("hosts:")
    left = n_gpus
    for i in range(hosts):
        model, mode, pool = HOST_KINDS[i % len(HOST_KINDS)]
        name = f"kvm-{model.split('-')[0].lower()}-{i:06d}"
        out += [f"  - name: {name}", f"    uri: \"simulated:///{name}\"", "    driver: simulated",
                f"    labels: {{rack: r{i // 32}, zone: z{i % 3}}}", "    vcpus: 256", "    memory_mib: 2097152",
                "    cpu_overcommit: 2.0", "    gpus:"]
        for j in range(min(GPUS_PER_HOST, left)):
            extra = ""
            if mode == "vgpu-equal" and j % 4 == 3:
                extra = ", vgpu_type: A100D-10C"
            elif mode == "mig" and j % 4 == 3:
                extra = f", mig_layout: {MIG_LAYOUT}"
            out.append(f"      - {{pci: \"0000:{PCI_BUSES[j]:02x}:00.0\", model: {model}, mode: {mode}, "
                       f"pool: {pool}{extra}}}")
        left -= GPUS_PER_HOST
    path.write_text("\n".join(out) + "\n")
    return hosts


def vgpuctl() -> list[str]:
    """The command line that starts `vgpuctl` from this interpreter's environment."""
    script = Path(sys.executable).parent / "vgpuctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vgpu_ctl.cli.main"]


def as_installed(env: Mapping[str, str], root: Path) -> dict[str, str]:
    """`env` for a `vgpuctl` that runs as an installed package does: its modules' bytecode compiled once and
    cached (pip compiles it on install), here under `root` (not in the checkout), even where the environment
    sets PYTHONDONTWRITEBYTECODE (each command then compiled every module of vgpu_ctl again, 0.12-0.14 s)."""
    out = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: Sequence[str], env: Mapping[str, str], ok: Sequence[int] = (0,)) -> tuple[float, float, str]:
    """Run one command; (wall seconds, CPU seconds of its process, stdout). Raises when its exit status is not
    in `ok`."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    res = subprocess.run(list(args), env=dict(env), capture_output=True, text=True, check=False)
    took, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if res.returncode not in ok:
        raise RuntimeError(f"{' '.join(args)}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return took, cpu, res.stdout


def best_of(runs: int, args: Sequence[str], env: Mapping[str, str], ok: Sequence[int] = (0,)
            ) -> tuple[float, float, str]:
    """The fastest of `runs` runs of a command that changes nothing: (wall seconds, CPU seconds, stdout)."""
    return min((timed(args, env, ok) for _ in range(runs)), key=lambda r: r[0])


def provision_vms(url: str, state: Path, n_vms: int) -> int:
    """Request and provision `n_vms` VMs of a few profiles through the Python API; how many were placed."""
    from vgpu_ctl import Controller, VgpuCtlError
    profiles = [("A100D-10C", "ampere"), ("3g.40gb", "hopper"), ("L40S-12C", "ada"), ("A100D-20C", "ampere")]
    placed = 0
    with Controller(url, state_path=state) as ctl:
        ctl.create_tenant("bench")
        for i in range(n_vms):
            profile, pool = profiles[i % len(profiles)]
            try:
                ctl.request_vm("bench", f"vm{i:05d}", [(profile, 1)], vcpus=4, memory_mib=16384, pool=pool)
                placed += 1
            except VgpuCtlError as exc:
                print(f"  vm{i:05d}: {exc.message}", file=sys.stderr)
    return placed


def bench_size(n_gpus: int, n_vms: int, root: Path, runs: int) -> dict[str, Any]:
    """Every timed command at one fleet size; a row of results."""
    work = root / f"gpus-{n_gpus}"
    work.mkdir(parents=True)
    inv = work / "fleet.yaml"
    t0 = time.perf_counter()
    hosts = write_inventory(inv, n_gpus)
    gen_s = time.perf_counter() - t0
    url = f"sqlite:///{work / 'store.db'}"
    env = as_installed({**os.environ, "VGPU_CTL_STATE_DIR": str(work / "state"), "VGPU_CTL_DATABASE_URL": url,
                        "COLUMNS": "120", "XDG_CACHE_HOME": str(work / "cache")}, root)  # a new user's cache
    env.pop("VGPU_CTL_TOKEN", None)
    cli = vgpuctl()
    timed([*cli, "init"], env)
    apply_s, apply_cpu, out = timed([*cli, "inventory", "apply", str(inv)], env)  # a line a change, as printed
    added = sum(1 for line in out.splitlines() if line.startswith("add "))
    os.environ.update({"VGPU_CTL_STATE_DIR": env["VGPU_CTL_STATE_DIR"]})
    placed = provision_vms(url, work / "state", n_vms)
    row: dict[str, Any] = {"gpus": n_gpus, "hosts": hosts, "file_mib": inv.stat().st_size / 2**20,
                           "generate_s": gen_s, "added": added, "vms": placed,
                           "times": {"inventory apply": apply_s}, "cpu": {"inventory apply": apply_cpu},
                           "load": [os.getloadavg()[0]]}
    for name, args, _target, ok in TIMED:
        run_env = {**env, "XDG_CACHE_HOME": str(inv)} if name == NO_CACHE else env  # a file: no cache
        took, cpu, out = best_of(runs, [*cli, *(a.format(file=inv) for a in args)], run_env, ok)
        row["times"][name] = took
        row["cpu"][name] = cpu
        if name.startswith("re-apply"):
            row["reapply_changes"] = "none" if out.strip() == "no changes" else "SOME"
        if name == "reconcile":
            row["reconcile_clean"] = json.loads(out)["clean"]
    row["load"].append(os.getloadavg()[0])
    return row


def startup(root: Path, runs: int = 10, baseline: Path | None = None) -> dict[str, dict[str, tuple[float, float]]]:
    """Per tree ("this", and "baseline" when given: its sources first on PYTHONPATH), the median (wall, CPU)
    seconds of `runs` runs of `vgpuctl --help` and `vgpuctl profiles list` (no store is opened), the trees'
    runs interleaved (bytecode cached under `root`)."""
    cli = vgpuctl()
    env = as_installed({**os.environ, "COLUMNS": "120"}, root)
    trees = {"this": env}
    if baseline is not None:
        trees["baseline"] = {**env, "PYTHONPATH": os.pathsep.join([str(baseline), env.get("PYTHONPATH", "")])}
    out: dict[str, dict[str, tuple[float, float]]] = {tree: {} for tree in trees}
    for name, args in (("--help", ["--help"]), ("profiles list", ["profiles", "list"])):
        seen: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
        for tree_env in trees.values():
            timed([*cli, *args], tree_env)  # warm the file cache (and fill the catalog's cache)
        for _ in range(runs):
            for tree, tree_env in trees.items():
                wall, cpu, _ = timed([*cli, *args], tree_env)
                seen[tree].append((wall, cpu))
        for tree, got in seen.items():
            out[tree][name] = (statistics.median(w for w, _ in got), statistics.median(c for _, c in got))
    return out


def target_of(command: str) -> float:
    """The target of a command at 100k GPUs, in seconds."""
    if command == "inventory apply":
        return APPLY_TARGET_S
    if command in ("--help", "profiles list"):
        return START_TARGET_S
    return COMMAND_TARGET_S


def render(report: Mapping[str, Any]) -> str:
    """The results as a text table: one row per command, one column per fleet size (wall seconds, CPU seconds
    of the process in brackets), the target beside, met or not at the largest size."""
    rows = report["sizes"]
    width = 20
    head = f"{'command':34}" + "".join(f"{format(r['gpus'], ',') + ' GPUs':>{width}}" for r in rows) \
        + f"{'target':>10}  result"
    lines = [head, f"{'':34}" + "".join(f"{'wall s (cpu s)':>{width}}" for _ in rows)]
    largest = rows[-1] if rows else None
    for name in ["inventory apply", *(t[0] for t in TIMED)] if rows else []:
        target = target_of(name)
        cells = "".join(f"{format(r['times'][name], '.2f') + ' (' + format(r['cpu'][name], '.2f') + ')':>{width}}"
                        for r in rows)
        verdict = ""
        if largest is not None:
            verdict = "met" if largest["times"][name] < target else "MISSED"
        lines.append(f"{name:34}{cells}{'< ' + format(target, 'g') + ' s':>10}  {verdict}")
    for tree, times in report["startup"].items():
        for name, (wall, cpu) in times.items():
            target = target_of(name)
            pad = " " * (width * max(0, len(rows) - 1))
            cell = f"{wall:.2f} ({cpu:.2f})"
            label = "vgpuctl " + name + (" (baseline)" if tree == "baseline" else "")
            lines.append(f"{label:34}{pad}{cell:>{width}}{'< ' + format(target, 'g') + ' s':>10}  "
                         f"{'met' if wall < target else 'MISSED'}")
    for r in rows:
        lines.append(f"  {r['gpus']:,} GPUs: {r['hosts']:,} hosts, inventory {r['file_mib']:.1f} MiB, "
                     f"{r['added']:,} objects added, re-apply changes: {r['reapply_changes']}, {r['vms']} VMs "
                     f"provisioned, reconcile {'clean' if r['reconcile_clean'] else 'NOT clean'}, load average "
                     f"{r['load'][0]:.1f} -> {r['load'][1]:.1f}")
    lines.append(f"  best of {report['runs']} runs per command (the first apply: one), start-up the median of "
                 f"{report['startup_runs']}" + (f" (baseline: {report['baseline']}, run for run)"
                                                  if report.get("baseline") else "")
                 + f"; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table (or JSON); exit 1 when a target is missed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="10000,100000", help="GPU counts, comma-separated")
    ap.add_argument("--vms", type=int, default=200, help="VMs provisioned before the timed commands")
    ap.add_argument("--runs", type=int, default=3, help="runs of each command that changes nothing; the best counts")
    ap.add_argument("--startup-runs", type=int, default=10, help="runs of each start-up command; the median counts")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="another source tree whose start-up is timed beside this one's, run for run")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (default: a temp dir)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-admin-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        report: dict[str, Any] = {"startup": startup(root, args.startup_runs, args.baseline), "sizes": [],
                                  "runs": args.runs, "startup_runs": args.startup_runs,
                                  "baseline": str(args.baseline) if args.baseline else None}
        for n in sizes:
            print(f"... {n:,} GPUs", file=sys.stderr, flush=True)
            report["sizes"].append(bench_size(n, args.vms, root, args.runs))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=2) if args.json else render(report))
    largest = report["sizes"][-1] if report["sizes"] else {"times": {}}
    walls = [*largest["times"].items(), *((n, wall) for n, (wall, _) in report["startup"]["this"].items())]
    missed = [n for n, t in walls if t >= target_of(n)]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
