"""Operating commands: status, events, doctor, metrics, db backup/restore, and vm create-many."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vgpu_ctl.cli.common import console, handled, open_controller, parse_mib, print_json, progress, run
from vgpu_ctl.errors import VgpuCtlError

metrics_app = typer.Typer(help="Prometheus metrics of the fleet (admin).", no_args_is_help=True)
db_app = typer.Typer(help="The state store: backup and restore (admin).", no_args_is_help=True)
JSON_OPT = typer.Option(False, "--json", help="Print JSON.")


def _fits_text(fits: dict[str, int]) -> str:
    return ", ".join(f"{p} {'[green]' if n else '[dim]'}{n}[/]" for p, n in fits.items()) or "-"


def _usage_text(rows: list[dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        if r["scope"] != "*" or (r["resource"].startswith("profile:") and r["limit"] is None):
            continue
        used, limit, name = r["used"], r["limit"], r["resource"]
        colour = "red" if limit is not None and used >= limit else "green"
        if name.endswith("_mib"):
            name, used, limit = name[:-4], _gib(used), None if limit is None else _gib(limit)
        parts.append(f"{name} [{colour}]{used}[/]/{'∞' if limit is None else limit}")
    return ", ".join(parts)


def _gib(mib: int) -> str:
    return f"{mib / 1024:g}GiB"


def _print(table: Table) -> None:
    """Print a table; when piped, as wide as it needs (nothing cut off)."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(highlight=False, width=250).print(table)


def _bar(text: str) -> Text:
    """The occupancy text with free cells dimmed and taken cells coloured (no markup parsing)."""
    out = Text()
    for ch in text:
        taken = text.startswith("[") and ch not in "[]"
        out.append(ch, style="dim" if ch == "·" else "cyan" if taken else "")
    return out


def status(pool: str = typer.Option(None, help="Only this pool."),
           host: str = typer.Option(None, help="Only this host's GPUs."), as_json: bool = JSON_OPT) -> None:
    """What occupies each GPU, how many more of each profile fit per pool, and tenants' usage."""
    from vgpu_ctl.ops.status import fleet_status
    out = run(as_json, lambda c: fleet_status(c, pool=pool, host=host))
    if as_json:
        print_json(out)
        return
    if out["gpus"]:
        table = Table("host", "pci", "model", "mode", "pool", "occupancy", "free", title="GPUs",
                      box=box.SIMPLE_HEAD)
        for g in out["gpus"]:
            host_name = g["host"] if g["host_state"] == "active" else \
                f"{g['host']} [yellow]({g['host_state']})[/]"
            table.add_row(host_name, g["pci"], g["model"], g["mode"], g["pool"] or "-",
                          _bar(g["occupancy"]),
                          f"{g['free_units']}/{g['axis_units']}")
        _print(table)
    table = Table("pool", "GPUs", "still fits now (per profile, alone)", title="Pools", box=box.SIMPLE_HEAD)
    for p in out["pools"]:
        table.add_row(p["name"], str(p["gpus"]), _fits_text(p["fits"]))
    _print(table)
    table = Table("tenant", "usage / limit", title="Tenants", box=box.SIMPLE_HEAD)
    for t in out["tenants"]:
        table.add_row(t["name"], _usage_text(t["usage"]))
    _print(table)


def events(tenant: str = typer.Option(None, help="Only this tenant's events."),
           since: str = typer.Option(None, help="ISO time, or a span back from now: 30m, 1h, 2d."),
           limit: int = typer.Option(1000, help="At most this many events."),
           as_json: bool = JSON_OPT) -> None:
    """The audit trail: who did what to which object, when, with what result."""
    from vgpu_ctl.ops.events import list_events
    rows = run(as_json, lambda c: list_events(c, tenant=tenant, since=since, limit=limit))
    if as_json:
        print_json(rows)
        return
    table = Table("time", "actor", "tenant", "action", "target", "result", "details")
    for e in rows:
        result = e["result"] if e["result"] == "ok" else f"[red]{e['result']}[/] {e['error'] or ''}"
        details = ", ".join(f"{k}={v}" for k, v in e["params"].items() if k not in ("devices", "message"))
        table.add_row(e["time"][:19], e["actor"], e["tenant"] or "-", e["action"], e["target"], result,
                      details)
    _print(table)


def doctor(stuck_minutes: float = typer.Option(10.0, help="Fail VMs in an intermediate state this long."),
           as_json: bool = JSON_OPT) -> None:
    """Check the store's invariants; exit 1 and say how to fix it when any fails."""
    from vgpu_ctl.ops.doctor import diagnose
    results = run(as_json, lambda c: diagnose(c, stuck_minutes))
    ok = all(r.ok for r in results)
    if as_json:
        print_json({"ok": ok, "checks": [r.to_dict() for r in results]})
    else:
        for r in results:
            console.print(f"{'[green]ok[/]  ' if r.ok else '[red]FAIL[/]'} {r.name}: {r.description}")
            for p in r.problems:
                console.print(f"     {p.object}: {p.message}\n       fix: {p.fix}", markup=False)
        console.print("[green]store is consistent[/]" if ok else "[red]problems found[/]")
    if not ok:
        raise typer.Exit(1)


@metrics_app.command("dump")
def metrics_dump() -> None:
    """Print the metrics once in Prometheus' text format."""
    from vgpu_ctl.ops.metrics import dump
    print(run(False, dump), end="")


@metrics_app.command("serve")
def metrics_serve(port: int = typer.Option(9839, help="TCP port."),
                  address: str = typer.Option("127.0.0.1", help="Address to listen on (default: loopback).")
                  ) -> None:
    """Serve /metrics over HTTP; each scrape reads the store. Stop with Ctrl-C."""
    from vgpu_ctl.ops.metrics import serve
    with handled(False):
        ctl = open_controller()
        try:
            server, _thread = serve(ctl, port, address)
        except OSError as exc:
            ctl.close()
            from vgpu_ctl.errors import InvalidInput
            raise InvalidInput(f"can't listen on {address}:{port}: {exc}") from None
        except VgpuCtlError:
            ctl.close()
            raise
    console.print(f"serving metrics on http://{address}:{server.server_port}/metrics")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
        ctl.close()


@db_app.command("backup")
def db_backup(file: Path = typer.Argument(..., help="Backup file to write (replaced if it exists)."),
              as_json: bool = JSON_OPT) -> None:
    """Copy the SQLite store to FILE, consistently, while the controller is in use."""
    from vgpu_ctl.ops.backup import backup
    out = run(as_json, lambda c: backup(c, file))
    print_json(out) if as_json else console.print(f"backed up {out['store']} to {out['file']} "
                                                  f"({out['bytes']} bytes, schema {out['schema']})")


@db_app.command("restore")
def db_restore(file: Path = typer.Argument(..., help="A backup written by `vgpuctl db backup`."),
               yes: bool = typer.Option(False, "--yes", "-y", help="Don't ask for confirmation."),
               as_json: bool = JSON_OPT) -> None:
    """Replace the store with FILE (all at once); refuses files that aren't vgpu-ctl stores or are newer."""
    from vgpu_ctl.ops.backup import inspect_file, restore
    with handled(as_json):
        inspect_file(file)
    if not yes:
        typer.confirm(f"replace the whole store with {file}?", abort=True)
    with handled(as_json):
        ctl = open_controller(init=False)  # the store may be broken: restoring is what mends it
        try:
            out = restore(ctl, file)
        finally:
            ctl.close()
    print_json(out) if as_json else console.print(f"restored {out['store']} from {out['file']} "
                                                  f"(schema {out['restored_schema']} -> {out['schema']})")


@db_app.command("repair-usage")
def db_repair_usage(apply: bool = typer.Option(False, "--apply", help="Make the changes (default: show them)."),
                    as_json: bool = JSON_OPT) -> None:
    """Recompute tenants' and hosts' usage from what is allocated: shows the changes (a dry run), makes them
    with --apply (audited)."""
    changes = run(as_json, lambda c: c.repair_usage(dry_run=not apply))
    if as_json:
        print_json({"applied": apply, "changes": changes})
        return
    for ch in changes:
        console.print(f"{ch['object']}: {ch['resource']} {ch['stored']} -> {ch['allocated']}", markup=False)
    console.print(f"{len(changes)} usage values {'repaired' if apply else 'differ (dry run; --apply repairs)'}"
                  if changes else "usage equals allocations; nothing to repair")


def vm_create_many(tenant: str = typer.Option(..., help="Tenant that owns the VMs."),
                   prefix: str = typer.Option(..., help="Name prefix; VMs are PREFIX01, PREFIX02, ..."),
                   number: int = typer.Option(..., min=1, max=10000, help="How many VMs."),
                   profile: list[str] = typer.Option(..., help="vGPU profile (repeatable)."),
                   count: int = typer.Option(1, help="vGPUs of each profile per VM."),
                   vcpus: int = typer.Option(..., help="vCPUs per VM."),
                   memory: str = typer.Option(..., help="Memory per VM, e.g. 32GiB."),
                   pool: str = typer.Option(None, help="Pool to place in (default: any)."),
                   as_json: bool = JSON_OPT) -> None:
    """Create NUMBER VMs one after another with a progress bar; a summary of placed and refused.
    Exit 0 if all were placed, else the exit code of the first failure (3 refused, 5 conflict, 6 host)."""
    width = len(str(number))
    placed: list[str] = []
    failed: list[dict[str, Any]] = []
    first: VgpuCtlError | None = None
    with handled(as_json):
        memory_mib = parse_mib("memory", memory)
        ctl = open_controller()
    try:
        with progress(disable=as_json) as bar:
            task = bar.add_task(f"creating VMs for {tenant}", total=number)
            for i in range(1, number + 1):
                name = f"{prefix}{i:0{width}d}"
                try:
                    ctl.request_vm(tenant, name, [(p, count) for p in profile], vcpus=vcpus,
                                   memory_mib=memory_mib, pool=pool)
                    placed.append(name)
                except VgpuCtlError as exc:
                    if exc.exit_code in (2, 4, 7):  # bad input, unknown tenant, not allowed: same for all
                        with handled(as_json):
                            raise
                    first = first or exc
                    failed.append({"name": name, "result": "refused" if exc.exit_code == 3 else "failed",
                                   "code": exc.code, "message": exc.message})
                bar.advance(task)
    finally:
        ctl.close()
    _summary(placed, failed, as_json)
    if first is not None:
        raise typer.Exit(first.exit_code)


def _summary(placed: list[str], failed: list[dict[str, Any]], as_json: bool) -> None:
    refused = [f for f in failed if f["result"] == "refused"]
    if as_json:
        print_json({"placed": placed, "refused": refused, "failed": [f for f in failed if f not in refused]})
        return
    console.print(f"[green]placed {len(placed)}[/], [yellow]refused {len(refused)}[/], "
                  f"[red]failed {len(failed) - len(refused)}[/]")
    codes: dict[str, int] = {}
    for f in failed:
        codes[f["code"]] = codes.get(f["code"], 0) + 1
    for code, n in sorted(codes.items()):
        example = next(f for f in failed if f["code"] == code)
        console.print(f"  {n} × {code}, e.g. {example['name']}: {example['message']}", markup=False)


def register(app: typer.Typer) -> None:
    """Add the operating commands to the `vgpuctl` app (and `create-many` to `vgpuctl vm`)."""
    from vgpu_ctl.cli.vm import vm_app
    app.command("status")(status)
    app.command("events")(events)
    app.command("doctor")(doctor)
    app.add_typer(metrics_app, name="metrics")
    app.add_typer(db_app, name="db")
    vm_app.command("create-many")(vm_create_many)
