"""`vgpuctl rebalance`: the moves that would free whole GPUs or hosts (--plan, on a copy of the store), carrying
them out one at a time (--apply, after confirmation), and moving a VM back (--undo VM, after confirmation). Admin
only, on this machine's store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    STATE,
    Output,
    confirm,
    console,
    emit,
    fail,
    handled,
    local_only_error,
    machine,
    open_controller,
    out_format,
    print_table,
    remote,
)
from vgpu_ctl.errors import Conflict, HostError, InvalidInput

GOALS = ("free-gpus", "free-hosts", "advised")
ERRORS = {Conflict.code: Conflict.exit_code, HostError.code: HostError.exit_code}  # a failed move's exit code


def _table(data: dict[str, Any], fmt: Output) -> None:
    from rich.table import Table
    s = data["summary"]
    console.print(f"fleet: {data['fleet']}; goal {data['goal']}" + (f", pool {data['pool']}" if data["pool"] else ""))
    console.print(f"{_n(s['moves'], 'move')} of {_n(s['vms_moved'], 'VM')} free {_n(s['gpus_freed'], 'GPU')} and "
                  f"{_n(s['hosts_freed'], 'host')} (in-use GPUs {s['in_use_gpus_before']} -> "
                  f"{s['in_use_gpus_after']})")
    f = Table("freed", "VMs touched", "VMs", title="freed")
    for r in data["freed"]:
        f.add_row(r["target"], str(r["vms_touched"]), ", ".join(v[:8] for v in r["vms"]))
    print_table(f, fmt)
    m = Table("#", "VM", "from", "to", "frees", title="moves, in order (stop, re-place, start)")
    for n, mv in enumerate(data["moves"], 1):
        m.add_row(str(n), f"{mv['tenant']}/{mv['name']}", _side(mv["from"]), _side(mv["to"]), mv["frees"])
    print_table(m, fmt)
    for b in data["blocked"][:20]:
        console.print(f"not freed: {b['target']}: {b['reason']}")
    if len(data["blocked"]) > 20:
        console.print(f"({len(data['blocked']) - 20} more not freed; -o json lists them all)")


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _side(side: dict[str, Any]) -> str:
    return str(side["host"]) + " " + " ".join(f"{d['pci']}:{d['profile']}@{d['start']}" for d in side["devices"])


def rebalance_cmd(
        plan: bool = typer.Option(False, "--plan", help="Print the moves (computed on a copy; nothing changes)."),
        apply: bool = typer.Option(False, "--apply", help="Carry the plan's moves out, one at a time, after "
                                   "confirmation."),
        pool: str = typer.Option(None, "--pool", help="Free only this pool's GPUs (hosts)."),
        goal: str = typer.Option("free-gpus", "--goal", help="free-gpus, free-hosts, or advised (the in-use GPUs "
                                 "`advise carving --demand` wants re-carved)."),
        demand: Path = typer.Option(None, "--demand", help="With --goal advised: the demand the advisor weighs."),
        undo: str = typer.Option(None, "--undo", metavar="VM", help="Move VM back to where its last rebalance "
                                 "move took it from (after confirmation)."),
        yes: bool = typer.Option(False, "--yes", "-y", help="With --apply or --undo: do not ask (for scripts)."),
        as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """The moves (stop, re-place, start) that would free whole GPUs or hosts, or the GPUs the carving advisor
    wants re-carved, with the VMs touched per GPU (host) freed; --apply carries them out after confirmation;
    --undo VM moves a VM back where its last move took it from."""
    fmt = out_format(as_json, output)
    if remote():
        fail(local_only_error(["rebalance"], str(STATE.server)), fmt)
    if undo is not None:
        _undo(undo, plan or apply, pool, demand, yes, fmt)
        return
    with handled(fmt):
        if plan == apply:
            raise InvalidInput("give exactly one of --plan, --apply and --undo (field plan)",
                               reasons=[{"field": "plan"}])
        if goal not in GOALS:
            raise InvalidInput(f"field goal: {goal!r} is not one of {', '.join(GOALS)}",
                               reasons=[{"field": "goal", "value": goal}])
        if demand is not None and goal != "advised":
            raise InvalidInput("field demand: --demand goes with --goal advised only", reasons=[{"field": "demand"}])
        from vgpu_ctl.service.fleet_snapshot import require_store

        require_store(STATE.db)
        ctl = open_controller(init=False)
        try:
            d = None
            if demand is not None:
                from vgpu_ctl.planning.demand import load_demand
                d = load_demand(demand, ctl.catalog)
            from vgpu_ctl.service.rebalance import plan_dict
            result = ctl.rebalance_plan(goal, pool, d)
            data = plan_dict(result)
            if apply:
                data = _apply(ctl, result, data, yes, fmt)
        finally:
            ctl.close()
    if machine(fmt):
        emit(fmt, data)
    elif not apply:
        _table(data, fmt)
    if apply and data.get("failed"):
        raise typer.Exit(ERRORS.get(data["failed"]["code"], 1))


def _undo(ref: str, other: bool, pool: str | None, demand: Path | None, yes: bool, fmt: Output) -> None:
    """rebalance --undo VM: the VM's last move reversed, after confirmation."""
    with handled(fmt):
        if other or pool is not None or demand is not None:
            raise InvalidInput("field undo: --undo goes alone (no --plan, --apply, --pool or --demand)",
                               reasons=[{"field": "undo", "value": ref}])
        from vgpu_ctl.service.fleet_snapshot import require_store
        require_store(STATE.db)
        ctl = open_controller(init=False)
        try:
            if not yes:
                ctl.get_vm(ref)  # an unknown VM is refused before the question
                confirm(f"move VM {ref} back where its last rebalance move took it from (stopped, moved and "
                        "started again)?", fmt)
            from vgpu_ctl.service.rebalance import undo_move
            done = undo_move(ctl, ref)
        finally:
            ctl.close()
    if machine(fmt):
        emit(fmt, done)
    else:
        console.print(f"moved {done['tenant']}/{done['name']} back: {done['from']} -> {done['to']}")


def _apply(ctl: Any, result: Any, data: dict[str, Any], yes: bool, fmt: Output) -> dict[str, Any]:
    if not result.moves:
        return {**data, "applied": [], "done": True}
    if not yes:
        if not machine(fmt):
            _table(data, fmt)
        confirm(f"carry out these {_n(len(result.moves), 'move')}, one at a time (each VM stopped, moved and "
                "started again)?", fmt)
    report = ctl.rebalance_apply(result.moves)
    if not machine(fmt):
        for r in report["applied"]:
            console.print(f"moved {r['tenant']}/{r['name']}: {r['from']} -> {r['to']}")
        if report.get("failed"):
            f = report["failed"]
            console.print(f"move of {f['tenant']}/{f['name']} failed and was undone (it runs where it was): "
                          f"{f['error']}; the remaining {report['not_tried']} moves were not tried")
    return {**data, **report}


def register(app: typer.Typer) -> None:
    """Add `rebalance` to the vgpuctl command."""
    app.command("rebalance")(rebalance_cmd)
