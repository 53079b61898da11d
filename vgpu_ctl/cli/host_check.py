"""`vgpuctl host check NAME|URI`: the preflight of a host, each finding with what to do; `vgpuctl agent call`:
the host agent's end of the controller's requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from vgpu_ctl.cli.common import JSON_OPT, OUTPUT_OPT, Output, console, emit, handled, machine, out_format, run


def record_written(found: Any, as_json: Any) -> list[dict[str, Any]]:
    """`host discover --write`: store the discovered type ids when the host is in the store; print the changes
    and findings unless output is for machines."""
    from vgpu_ctl.service.host_types import record_discovered
    changes: list[dict[str, Any]] = run(as_json, lambda c: record_discovered(c, found))
    if not (as_json is True or str(as_json) in ("json", "yaml")):
        for ch in changes:
            console.print(f"store: {ch['action']} {ch['kind']} {ch['name']}: "
                          + ", ".join(f"{k}={v}" for k, v in ch["fields"].items()))
    return changes


def host_check(target: str = typer.Argument(..., help="Host name in the store, or a libvirt URI."),
               backing: str = typer.Option("mdev", help="For a URI: how its vGPUs are made (mdev or vfio)."),
               as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Check a host for vGPUs: libvirt and QEMU, IOMMU, vfio, NVIDIA driver, mdev bus or SR-IOV VFs, MIG mode,
    mdevctl. Exit 1 when a check fails."""
    from vgpu_ctl.service.host_side import host_by_uri, preflight

    fmt = out_format(as_json, output)
    if "://" in target:
        host: Any = host_by_uri(target, backing=backing)
    else:
        from vgpu_ctl.service.host_types import host_row
        host = run(fmt, lambda c: host_row(c, target))
    with handled(fmt):
        report = preflight(host)
    if machine(fmt):
        emit(fmt, report.to_dict())
    else:
        colour = {"ok": "green", "warn": "yellow", "fail": "red"}
        console.print(f"host {report.host} ({report.uri})")
        for c in report.checks:
            console.print(f"[{colour[c.status]}]{c.status:4}[/] {c.check}: {c.detail}")
            if c.do:
                console.print(f"     do: {c.do}")
    if not report.ok:
        raise typer.Exit(1)


agent_app = typer.Typer(help="The host agent: runs on a GPU host, does its NVML and vendor-VFIO sysfs work.",
                        no_args_is_help=True)


@agent_app.command("call")
def agent_call(state_dir_: Path = typer.Option(Path("/var/lib/vgpu-ctl"), "--state-dir",
                                               help="Where the agent keeps which device is which VF or instance."),
               sysfs_root: Path = typer.Option(Path("/sys"), help="The sysfs to read and write.")) -> None:
    """Answer one JSON request read from stdin (what the controller sends over SSH); the answer on stdout."""
    import sys

    from vgpu_ctl.service.host_side import answer_agent_request
    sys.stdout.write(answer_agent_request(sys.stdin.read(), state_dir_, sysfs_root) + "\n")
