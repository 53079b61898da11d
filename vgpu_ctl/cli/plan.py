"""`vgpuctl plan` and `vgpuctl advise carving`: what-if replays of a demand on a copy of the fleet, never the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    Output,
    console,
    emit,
    handled,
    machine,
    open_controller,
    out_format,
    print_table,
)
from vgpu_ctl.errors import InvalidInput

# The core (and with it the catalog and pydantic) is imported inside the commands: every other command's start-up
# would pay for it otherwise.
FLEET_MODES = ("vgpu-equal", "vgpu-mixed", "mig")

advise_app = typer.Typer(help="Advice computed from a demand: how to carve the GPUs (admin).", no_args_is_help=True)

DEMAND_OPT = typer.Option(..., "--demand", help="A YAML demand (request shapes with counts, optional 'changes') or "
                          "an Alibaba-format trace CSV (openb_pod_list_*.csv), read in place.")
FLEET_OPT = typer.Option(None, "--fleet", help="An inventory YAML file, or a trace node list CSV "
                         "(openb_node_list_gpu_node.csv).")
STORE_OPT = typer.Option(False, "--from-store", help="Plan on the store's fleet as it is now (read only).")
POLICY_OPT = typer.Option("pack", "--policy", help="Placement policy of the replay (a pool policy; an unknown name "
                          "is refused with the list of known ones).")
SCALE_OPT = typer.Option(1.0, "--scale", help="Multiply the demand's VMs by this (a seeded draw for the fraction).")
GPUS_OPT = typer.Option(None, "--gpus", help="With a trace node list: repeat its nodes until the fleet has this "
                        "many GPUs.")
MODE_OPT = typer.Option("vgpu-equal", "--fleet-mode", help="With a trace node list: the mode of every GPU that has "
                        "it (vgpu-equal, vgpu-mixed, mig); others stay vgpu-equal.")
REPORT_OPT = typer.Option(None, "--report", help="Also write a self-contained HTML report to this file.")


def _fleet(catalog: Any, fleet: Path | None, from_store: bool, gpus: int | None, fleet_mode: str) -> Any:
    from vgpu_ctl.planning.fleet import fleet_from_inventory, fleet_from_trace

    if (fleet is None) == (not from_store):
        raise InvalidInput("give exactly one of --fleet FILE and --from-store (field fleet)",
                           reasons=[{"field": "fleet"}])
    if fleet_mode not in FLEET_MODES:
        raise InvalidInput(f"field fleet-mode: {fleet_mode!r} is not vgpu-equal, vgpu-mixed or mig",
                           reasons=[{"field": "fleet-mode", "value": fleet_mode}])
    if gpus is not None and not 1 <= gpus <= 10_000_000:
        raise InvalidInput(f"field gpus: must be from 1 to 10000000, got {gpus}", reasons=[{"field": "gpus"}])
    if fleet is not None:
        if fleet.suffix.lower() == ".csv":
            return fleet_from_trace(fleet, catalog, fleet_mode, gpus)
        return fleet_from_inventory(fleet, catalog)
    from vgpu_ctl.cli.common import STATE
    from vgpu_ctl.service.fleet_snapshot import fleet_snapshot, require_store

    require_store(STATE.db)
    ctl = open_controller(init=False)
    try:
        return fleet_snapshot(ctl)
    finally:
        ctl.close()


def _inputs(demand: Path, fleet: Path | None, from_store: bool, policy: str, scale: float, gpus: int | None,
            fleet_mode: str) -> tuple[Any, Any, Any]:
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.core.placement import POLICIES
    from vgpu_ctl.planning.demand import load_demand, scaled

    if policy not in POLICIES:
        raise InvalidInput(f"unknown placement policy {policy!r} (field policy); known: {', '.join(sorted(POLICIES))}",
                           reasons=[{"field": "policy", "value": policy}])
    catalog = load_catalog()
    d = load_demand(demand, catalog)
    if scale != 1.0:
        d = scaled(d, scale)
    return catalog, _fleet(catalog, fleet, from_store, gpus, fleet_mode), d


def _write_report(path: Path, html: str) -> None:
    try:
        path.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"field report: cannot write {path}: {exc.strerror}",
                           reasons=[{"field": "report", "value": str(path)}]) from None


def plan_cmd(demand: Path = DEMAND_OPT, fleet: Path = FLEET_OPT, from_store: bool = STORE_OPT,
             policy: str = POLICY_OPT, scale: float = SCALE_OPT, gpus: int = GPUS_OPT, fleet_mode: str = MODE_OPT,
             report: Path = REPORT_OPT, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """What if this demand came: replay it on a copy of the fleet (a file, or the store read-only, plus the
    demand's declared changes); placed, refused (with reasons), stranded capacity by cause, hosts to add."""
    from vgpu_ctl.planning.report_html import render
    from vgpu_ctl.planning.whatif import make_plan

    fmt = out_format(as_json, output)
    with handled(fmt):
        catalog, base, d = _inputs(demand, fleet, from_store, policy, scale, gpus, fleet_mode)
        result = make_plan(catalog, base, d, policy)
        data = result.to_dict(gpus=report is not None)
        if report is not None:
            _write_report(report, render(data, title=f"vgpu-ctl plan: {d.source}"))
    if machine(fmt):
        data.pop("gpus", None)
        emit(fmt, data)
        return
    _print_plan(data, fmt)
    if report is not None:
        console.print(f"report: {report}")


def _print_plan(data: dict[str, Any], fmt: Output) -> None:
    from rich.table import Table
    s = data["summary"]
    console.print(f"fleet: {data['fleet']['source']} ({data['fleet']['hosts']} hosts, {data['fleet']['gpus']} GPUs); "
                  f"demand: {data['demand']['source']} ({data['demand']['vms']} VMs); policy {data['policy']}")
    console.print(f"placed {s['placed_vms']} VMs, refused {s['refused_vms']}: {s['placed_pct']}% of the demand's "
                  f"GPUs' worth placed; {s['stranded_gpus']} GPUs' worth stranded ({s['seconds']} s)")
    t = Table("request", "shape", "asked", "placed", "refused", "first refusal: GPUs considered", title="requests")
    rows = data["requests"]
    shown = rows if len(rows) <= 30 else sorted(rows, key=lambda r: -r["refused"])[:30]
    for r in shown:
        t.add_row(r["request"], r["shape"], str(r["asked"]), str(r["placed"]), str(r["refused"]), r["reason"] or "")
    print_table(t, fmt)
    if len(rows) > len(shown):
        console.print(f"({len(rows) - len(shown)} more request shapes; -o json lists them all)")
    st = Table("cause", "GPUs' worth", title="free capacity by cause (stranded unless usable)")
    for cause, v in data["stranded"].items():
        st.add_row(cause, f"{v:g}")
    print_table(st, fmt)
    for line in data["add_hosts"]:
        console.print(line)
    if data["add_hosts"] and data["still_refused_after_adding"]:
        console.print(f"still refused after adding them: {data['still_refused_after_adding']} VMs")
    elif not s["refused_vms"]:
        console.print("everything placed: no host to add")


def carving_cmd(demand: Path = DEMAND_OPT, pool: str = typer.Option(None, "--pool", help="Re-carve only this "
                                                                       "pool's GPUs."),
                fleet: Path = FLEET_OPT, from_store: bool = STORE_OPT, policy: str = POLICY_OPT,
                scale: float = SCALE_OPT, gpus: int = GPUS_OPT, fleet_mode: str = MODE_OPT,
                report: Path = REPORT_OPT, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Per GPU, the mode and vGPU type or MIG layout that places the most of the demand, and the gain over
    today's carving; only GPUs holding no devices change, in-use GPUs whose VMs would have to move are listed."""
    from vgpu_ctl.planning.carving import advice_dict, advise
    from vgpu_ctl.planning.report_html import render
    from vgpu_ctl.planning.whatif import hypothetical, make_plan

    fmt = out_format(as_json, output)
    with handled(fmt):
        catalog, base, d = _inputs(demand, fleet, from_store, policy, scale, gpus, fleet_mode)
        target = hypothetical(catalog, base, d)
        if pool is not None and pool not in target.pools():
            raise InvalidInput(f"field pool: no GPU of the fleet is in pool {pool!r} (pools: "
                               f"{', '.join(sorted(target.pools())) or 'none'})",
                               reasons=[{"field": "pool", "value": pool}])
        advice = advise(catalog, target, d, policy, pool)
        data = advice_dict(advice)
        if report is not None:
            plan = make_plan(catalog, base, d, policy, advise_hosts=False).to_dict()
            _write_report(report, render(plan, data, title=f"vgpu-ctl carving advice: {d.source}"))
    if machine(fmt):
        emit(fmt, data)
        return
    from rich.table import Table
    today, adv, gain = data["today"], data["advised"], data["gain"]
    console.print(f"today's carving places {today['placed_vms']} VMs ({today['placed_pct']}%); advised "
                  f"({data['winner']}): {adv['placed_vms']} ({adv['placed_pct']}%): gain {gain['vms']:+d} VMs, "
                  f"{gain['points']:+.2f} points")
    c = Table("candidate", "placed %", "placed VMs", "GPUs re-carved", "on", title="candidates")
    for s in data["candidates"]:
        c.add_row(s["name"], f"{s['placed_pct']:.2f}", str(s["placed_vms"]), str(s["gpus_changed"]),
                  "sample" if s["sampled"] else "fleet")
    print_table(c, fmt)
    rows = [g for g in data["gpus"] if g["action"] != "keep" or len(data["gpus"]) <= 40]
    t = Table("host", "pci", "model", "pool", "devices", "today", "advised", "action", title="per GPU")
    for g in rows[:200]:
        t.add_row(g["host"], g["pci"], g["model"], g["pool"] or "-", str(g["devices"]), g["today"], g["advised"],
                  g["action"])
    print_table(t, fmt)
    if len(rows) > 200:
        console.print(f"({len(rows) - 200} more GPUs to change; -o json lists them all)")
    if data["move_first"]:
        console.print(f"in use, VMs to move first: {', '.join(data['move_first'])}")
    if report is not None:
        console.print(f"report: {report}")


def register(app: typer.Typer) -> None:
    """Add `plan` and `advise carving` to the vgpuctl command."""
    app.command("plan")(plan_cmd)
    advise_app.command("carving")(carving_cmd)
    app.add_typer(advise_app, name="advise")
