"""Operating commands: status, events, doctor, metrics, db backup/restore, and vm create-many."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    Output,
    confirm,
    console,
    emit,
    handled,
    machine,
    open_controller,
    out_format,
    parse_mib,
    print_table,
    progress,
    remote,
    run,
)
from vgpu_ctl.errors import InvalidInput, VgpuCtlError

if TYPE_CHECKING:
    from rich.table import Table
    from rich.text import Text

metrics_app = typer.Typer(help="Prometheus metrics of the fleet (admin).", no_args_is_help=True)
db_app = typer.Typer(help="The state store: backup and restore (admin).", no_args_is_help=True)


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


def _bar(text: str) -> Text:
    """The occupancy text with free cells dimmed and taken cells coloured (no markup parsing)."""
    from rich.text import Text
    out = Text()
    for ch in text:
        taken = text.startswith("[") and ch not in "[]"
        out.append(ch, style="dim" if ch == "·" else "cyan" if taken else "")
    return out


def _pause(seconds: float) -> None:
    """Wait between two rounds of --watch or --follow."""
    time.sleep(seconds)


def _summary_table(summary: dict[str, Any], hint: bool) -> Table:
    """The fleet at a glance: GPUs per mode, how many hold devices, devices, free units; hosts by state (and,
    with `hint`, how to see the GPUs one by one)."""
    from rich import box
    from rich.table import Column, Table
    states = ", ".join(f"{n:,} {state}" for state, n in summary["hosts_by_state"].items())
    caption = f"{summary['hosts']:,} hosts ({states or 'none'})" + ("; per-GPU rows: --gpus" if hint else "")
    table = Table(Column("GPUs by mode", no_wrap=True), Column("GPUs", justify="right"),
                  Column("in use", justify="right"), Column("devices", justify="right"),
                  Column("free units", justify="right"), title="Fleet", box=box.SIMPLE_HEAD,
                  caption=caption,
                  caption_justify="left")
    for name, m in [*summary["by_mode"].items(), ("all", summary)]:
        share = f" ({m['free_units'] / m['axis_units']:.0%})" if m["axis_units"] else ""
        table.add_row(name, f"{m['gpus']:,}", f"{m['in_use']:,}", f"{m['devices']:,}",
                      f"{m['free_units']:,}/{m['axis_units']:,}{share}")
    return table


def _gpu_table(out: dict[str, Any], fmt: Output) -> Table:
    from rich import box
    from rich.table import Column, Table
    wide = fmt is Output.wide
    page = out["page"]
    first, shown = page["offset"] + 1, len(out["gpus"])
    more = page["offset"] + shown < page["total"]
    caption = f"GPUs {first:,}-{first + shown - 1:,} of {page['total']:,}" + (
        f"; next page: --offset {page['offset'] + shown}" if more else "")
    table = Table(Column("GPU", no_wrap=True), Column("model", overflow="fold"),
                  Column("mode", overflow="fold"), Column("pool", overflow="fold"),
                  Column("occupancy", no_wrap=True), Column("free", no_wrap=True, justify="right"),
                  title="GPUs", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
                  caption=caption, caption_justify="left")
    last = None
    for g in out["gpus"]:
        pci = g["pci"] if wide else g["pci"].removeprefix("0000:")
        host = g["host"] if g["host_state"] == "active" else f"{g['host']} [yellow]({g['host_state']})[/]"
        name = f"{host}/{pci}" if wide or g["host"] != last else f"{' ' * (len(g['host']) - 1)}…/{pci}"
        last = g["host"]
        mode = g["mode"] if wide else g["mode"].removeprefix("vgpu-")
        table.add_row(name, g["model"], mode, g["pool"] or "-", _bar(g["occupancy"]),
                      f"{g['free_units']}/{g['axis_units']}")
    return table


def _status_tables(out: dict[str, Any], fmt: Output) -> list[Table]:
    from rich import box
    from rich.table import Table
    tables = []
    if out.get("summary"):
        tables.append(_summary_table(out["summary"], hint="gpus" not in out))
    if out.get("gpus"):
        tables.append(_gpu_table(out, fmt))
    table = Table("pool", "GPUs", "still fits now (per profile, alone)", title="Pools", box=box.SIMPLE_HEAD)
    for p in out["pools"]:
        table.add_row(p["name"], str(p["gpus"]), _fits_text(p["fits"]))
    tables.append(table)
    table = Table("tenant", "usage / limit", title="Tenants", box=box.SIMPLE_HEAD)
    for t in out["tenants"]:
        table.add_row(t["name"], _usage_text(t["usage"]))
    tables.append(table)
    if out.get("idle") is not None:
        tables.append(_idle_table(out["idle"]))
    return tables


def _idle_table(idle: dict[str, Any]) -> Table:
    """Allocated vGPUs below the idle threshold (status --idle), and the hosts that could not be sampled."""
    from rich import box
    from rich.table import Table
    missed = [f"{h}: {why}" for h, why in idle["hosts"].items() if why is not None and not why.startswith("simulated")]
    caption = (f"below {idle['threshold']:.0%} utilization; idle after {idle['idle_for_s']:g}s"
               + ("; not sampled: " + "; ".join(missed) if missed else ""))
    table = Table("device", "tenant/vm", "host", "profile", "now", "below for", "idle", title="Idle vGPUs",
                  box=box.SIMPLE_HEAD, caption=caption, caption_justify="left")
    for v in idle["vgpus"]:
        table.add_row(v["device"][:8], f"{v['tenant'] or '-'}/{v['vm'] or '-'}", v["host"], v["profile"] or "-",
                      f"{v['utilization']:.0%}" if v["why"] == "utilization" else v["why"],
                      f"{v['below_for_s']:g}s", "[yellow]idle[/]" if v["idle"] else "not yet")
    return table


def status(pool: str = typer.Option(None, help="Only this pool."),
           host: str = typer.Option(None, help="Only this host's GPUs."),
           gpus: bool = typer.Option(False, "--gpus", help="Also list the GPUs, one row each, a page at a time "
                                     "(see --limit and --offset)."),
           limit: int = typer.Option(None, "--limit", help="With --gpus: at most this many GPU rows (default "
                                     "100; implies --gpus)."),
           offset: int = typer.Option(0, "--offset", help="With --gpus: skip this many GPU rows first (implies "
                                      "--gpus)."),
           watch: float = typer.Option(None, "--watch", "-w", min=0.5, max=3600,
                                       help="Redraw every SECONDS until Ctrl-C (JSON/YAML: one document each time)."),
           idle: bool = typer.Option(False, "--idle", help="Also list allocated vGPUs below --idle-threshold in "
                                     "the utilization samples the store keeps (admin or reader); idle once below "
                                     "it for --idle-for."),
           idle_threshold: float = typer.Option(0.05, "--idle-threshold", help="With --idle: utilization ratio "
                                                "below which a vGPU is unused (0.05 = 5 %)."),
           idle_for: float = typer.Option(1800.0, "--idle-for", help="With --idle: seconds below the threshold "
                                          "before a vGPU counts as idle."),
           as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """The fleet in summary (GPUs by mode, hosts by state), how many more of each profile fit per pool, and
    tenants' usage; with --gpus, what occupies each GPU, a page at a time."""
    from vgpu_ctl.inventory import check_int
    from vgpu_ctl.ops.status import DEFAULT_PAGE, MAX_PAGE, fleet_status
    fmt = out_format(as_json, output)
    rows = gpus or limit is not None or offset != 0
    with handled(fmt):  # a bad page is refused before the store is opened
        if limit is not None:
            check_int("limit", limit, 1, MAX_PAGE)
        check_int("offset", offset, 0)
        tracker = _idle_tracker(idle, idle_threshold, idle_for)
    page_size = (DEFAULT_PAGE if limit is None else limit) if rows else None

    def read(c: Any) -> dict[str, Any]:
        if remote():
            out: dict[str, Any] = c.status(pool, host, gpus=rows, limit=page_size, offset=offset)
            return out
        return fleet_status(c, pool=pool, host=host, gpus=rows, limit=page_size, offset=offset, idle=tracker)

    if watch is None:
        out = run(fmt, read)
        if machine(fmt):
            emit(fmt, out)
            return
        for table in _status_tables(out, fmt):
            print_table(table, fmt)
        return
    with handled(fmt):
        ctl = open_controller()
    try:
        if machine(fmt) or not console.is_terminal:
            while True:
                with handled(fmt):
                    out = read(ctl)
                if machine(fmt):
                    emit(fmt, out)
                else:
                    console.print(f"-- {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC", markup=False)
                    for table in _status_tables(out, fmt):
                        print_table(table, fmt)
                _pause(watch)
        from rich.console import Group
        from rich.live import Live
        from rich.text import Text
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                with handled(fmt):
                    out = read(ctl)
                stamp = Text(f"every {watch:g}s, {datetime.now(UTC):%H:%M:%S} UTC (Ctrl-C to stop)", style="dim")
                live.update(Group(stamp, *_status_tables(out, fmt)), refresh=True)
                _pause(watch)
    except KeyboardInterrupt:
        pass
    finally:
        ctl.close()


def _idle_tracker(idle: bool, threshold: float, idle_for: float) -> Any:
    """The idle rule of `status --idle` (None without it); InvalidInput naming the option for a bad value, or
    for --idle against a server (the API does not serve the samples yet)."""
    from vgpu_ctl.service.utilization import IdleRule, check_idle_for, check_idle_threshold
    check_idle_threshold(threshold, "idle_threshold")
    check_idle_for(idle_for, "idle_for")
    if not idle:
        return None
    if remote():
        raise InvalidInput("status --idle reads the store's utilization samples, which the API does not serve "
                           "yet; run it where the store is, not against a server (field idle)",
                           reasons=[{"field": "idle", "value": True}])
    return IdleRule(threshold, idle_for)


def _event_row(e: dict[str, Any], fmt: Output) -> list[str]:
    result = e["result"] if e["result"] == "ok" else f"[red]{e['result']}[/] {e['error'] or ''}"
    details = ", ".join(f"{k}={v}" for k, v in e["params"].items() if k not in ("devices", "message"))
    when = e["time"][:19] if fmt is Output.wide else e["time"][5:19].replace("T", " ")
    target = e["target"]
    if fmt is not Output.wide and target.startswith("vm:") and len(target) == 39:  # vm:<uuid>
        target = target[:11]
    return [when, e["actor"], e["tenant"] or "-", e["action"], target, result, details]


def _event_table(rows: list[dict[str, Any]], fmt: Output) -> Table:
    from rich import box
    from rich.table import Column, Table
    table = Table(Column("time (UTC)", no_wrap=True), Column("actor", overflow="fold"),
                  Column("tenant", overflow="fold"), Column("action", no_wrap=True),
                  Column("target", overflow="fold"), Column("result", overflow="fold"),
                  Column("details", overflow="fold", ratio=1), box=box.SIMPLE_HEAD, pad_edge=False)
    for e in rows:
        table.add_row(*_event_row(e, fmt))
    return table


def events(tenant: str = typer.Option(None, help="Only this tenant's events."),
           since: str = typer.Option(None, help="ISO time, or a span back from now: 30m, 1h, 2d."),
           limit: int = typer.Option(1000, min=1, help="At most this many events."),
           follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until Ctrl-C."),
           interval: float = typer.Option(1.0, min=0.1, max=60, help="With --follow: seconds between polls."),
           as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """The audit trail: who did what to which object, when, with what result."""
    fmt = out_format(as_json, output)

    def list_events(c: Any, tenant: str | None, since: str | None, limit: int) -> list[dict[str, Any]]:
        if remote():  # the server reads `since` as this command does
            out: list[dict[str, Any]] = c.events(tenant, since, limit)
            return out
        from vgpu_ctl.ops.events import list_events as read
        return read(c, tenant=tenant, since=since, limit=limit)

    if not follow:
        rows = run(fmt, lambda c: list_events(c, tenant=tenant, since=since, limit=limit))
        if machine(fmt):
            emit(fmt, rows)
            return
        print_table(_event_table(rows, fmt), fmt)
        return
    with handled(fmt):
        ctl = open_controller()
    try:
        seen: set[int] = set()
        after: str | None = since
        while True:
            with handled(fmt):
                rows = list_events(ctl, tenant=tenant, since=after, limit=limit)
            for e in rows:
                if e["id"] in seen:
                    continue
                seen.add(e["id"])
                after = e["time"]
                _print_event(e, fmt)
            sys.stdout.flush()
            _pause(interval)
    except KeyboardInterrupt:
        pass
    finally:
        ctl.close()


def _print_event(e: dict[str, Any], fmt: Output) -> None:
    """One event as it arrives: a JSON object per line, a YAML document, or a line of text."""
    if fmt is Output.json:
        sys.stdout.write(json.dumps(e, default=str) + "\n")
    elif fmt is Output.yaml:
        sys.stdout.write("---\n")
        emit(fmt, e)
    else:
        console.print(" ".join(_event_row(e, fmt)))


def doctor(stuck_minutes: float = typer.Option(10.0, help="Fail VMs in an intermediate state this long."),
           as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Check the store's invariants; exit 1 and say how to fix it when any fails."""
    fmt = out_format(as_json, output)

    def checks(c: Any) -> list[dict[str, Any]]:
        if remote():
            out: list[dict[str, Any]] = c.doctor(stuck_minutes)
            return out
        from vgpu_ctl.ops.doctor import diagnose
        return [r.to_dict() for r in diagnose(c, stuck_minutes)]

    results = run(fmt, checks)
    ok = all(r["ok"] for r in results)
    if machine(fmt):
        emit(fmt, {"ok": ok, "checks": results})
    else:
        for r in results:
            console.print(f"{'[green]ok[/]  ' if r['ok'] else '[red]FAIL[/]'} {r['name']}: {r['description']}")
            for p in r["problems"]:
                console.print(f"     {p['object']}: {p['message']}\n       fix: {p['fix']}", markup=False)
        console.print("[green]store is consistent[/]" if ok else "[red]problems found[/]")
    if not ok:
        raise typer.Exit(1)


@metrics_app.command("dump")
def metrics_dump() -> None:
    """Print the metrics once in Prometheus' text format."""
    def text(c: Any) -> str:
        if remote():  # the store's metrics and the server's own
            return str(c.metrics_text())
        from vgpu_ctl.ops.metrics import dump
        return dump(c)

    print(run(False, text), end="")


@metrics_app.command("sample")
def metrics_sample(interval: float = typer.Option(60.0, "--interval", help="How often this is run, in seconds: "
                                                  "a sample older than three intervals counts as stale."),
                   as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Sample NVML on every GPU host once (through its agent) and keep it in the store, for the metrics, idle
    vGPUs and spread-load pools (admin). `vgpuctl serve`'s leader does this every utilization_interval_s; this
    is for a store without a server (a timer)."""
    from vgpu_ctl.service.utilization_samples import check_interval
    fmt = out_format(as_json, output)
    with handled(fmt):
        check_interval(interval, "interval")

    def one(c: Any) -> dict[str, int]:
        from vgpu_ctl.service.utilization_samples import sample_round
        return sample_round(c, interval_s=interval)

    out = run(fmt, one)
    if machine(fmt):
        emit(fmt, out)
    else:
        console.print(f"kept the samples of {out['hosts']} host(s), the loads of {out['gpu_loads']} GPU(s)")


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
              as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Copy the SQLite store to FILE, consistently, while the controller is in use."""
    from vgpu_ctl.ops.backup import backup
    fmt = out_format(as_json, output)
    out = run(fmt, lambda c: backup(c, file))
    emit(fmt, out) if machine(fmt) else console.print(f"backed up {out['store']} to {out['file']} "
                                                  f"({out['bytes']} bytes, schema {out['schema']})")


@db_app.command("restore")
def db_restore(file: Path = typer.Argument(..., help="A backup written by `vgpuctl db backup`."),
               yes: bool = typer.Option(False, "--yes", "-y", help="Don't ask for confirmation."),
               as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Replace the store with FILE (all at once); refuses files that aren't vgpu-ctl stores or are newer."""
    from vgpu_ctl.ops.backup import inspect_file, restore
    fmt = out_format(as_json, output)
    with handled(fmt):
        inspect_file(file)
    if not yes:
        confirm(f"replace the whole store with {file}?", fmt)
    with handled(fmt):
        ctl = open_controller(init=False)  # the store may be broken: restoring is what mends it
        try:
            out = restore(ctl, file)
        finally:
            ctl.close()
    emit(fmt, out) if machine(fmt) else console.print(f"restored {out['store']} from {out['file']} "
                                                  f"(schema {out['restored_schema']} -> {out['schema']})")


@db_app.command("repair-usage")
def db_repair_usage(apply: bool = typer.Option(False, "--apply", help="Make the changes (default: show them)."),
                    as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Recompute tenants' and hosts' usage from what is allocated: shows the changes (a dry run), makes them
    with --apply (audited)."""
    fmt = out_format(as_json, output)
    changes = run(fmt, lambda c: c.repair_usage(dry_run=not apply))
    if machine(fmt):
        emit(fmt, {"applied": apply, "changes": changes})
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
                   as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Create NUMBER VMs one after another with a progress bar; a summary of placed and refused.
    Exit 0 if all were placed, else the exit code of the first failure (3 refused, 5 conflict, 6 host)."""
    fmt = out_format(as_json, output)
    width = len(str(number))
    placed: list[str] = []
    failed: list[dict[str, Any]] = []
    first: VgpuCtlError | None = None
    with handled(fmt):
        memory_mib = parse_mib("memory", memory)
        ctl = open_controller()
    try:
        with progress(disable=machine(fmt)) as bar:
            task = bar.add_task(f"creating VMs for {tenant}", total=number)
            for i in range(1, number + 1):
                name = f"{prefix}{i:0{width}d}"
                try:
                    ctl.request_vm(tenant, name, [(p, count) for p in profile], vcpus=vcpus,
                                   memory_mib=memory_mib, pool=pool)
                    placed.append(name)
                except VgpuCtlError as exc:
                    if exc.exit_code in (2, 4, 7):  # bad input, unknown tenant, not allowed: same for all
                        with handled(fmt):
                            raise
                    first = first or exc
                    failed.append({"name": name, "result": "refused" if exc.exit_code == 3 else "failed",
                                   "code": exc.code, "message": exc.message})
                bar.advance(task)
    finally:
        ctl.close()
    _summary(placed, failed, fmt)
    if first is not None:
        raise typer.Exit(first.exit_code)


def _summary(placed: list[str], failed: list[dict[str, Any]], fmt: Output) -> None:
    refused = [f for f in failed if f["result"] == "refused"]
    if machine(fmt):
        emit(fmt, {"placed": placed, "refused": refused, "failed": [f for f in failed if f not in refused]})
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
