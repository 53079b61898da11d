"""Scheduling commands: priority classes, tenants' classes and shares, accounts, settings, `share` (like
`sshare -l`) and `queue`."""

from __future__ import annotations

import re
from typing import Any

import typer

from vgpu_ctl.cli.common import JSON_OPT, OUTPUT_OPT, Output, console, emit, machine, out_format, print_table, run
from vgpu_ctl.cli.table import PlainTable
from vgpu_ctl.errors import InvalidInput

priority_app = typer.Typer(help="Priority classes of VM requests.", no_args_is_help=True)
account_app = typer.Typer(help="Accounts of the fair-share tree.", no_args_is_help=True)
scheduling_app = typer.Typer(help="Scheduling settings: usage half-life, preemption grace period, cool-down.",
                             no_args_is_help=True)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(field: str, text: str) -> float:
    """Seconds from '30', '30s', '10m', '12h' or '7d'; InvalidInput naming the field otherwise."""
    m = _DURATION.match(text)
    if not m:
        raise InvalidInput(f"{field} {text!r} is not a duration (e.g. 30s, 10m, 12h, 7d)",
                           reasons=[{"field": field, "value": text}])
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


@priority_app.command("create")
def priority_create(name: str = typer.Argument(..., help="Class name."),
                    value: int = typer.Option(..., "--value", help="Priority, 0 to 1000000000 (higher first)."),
                    preemptible: bool = typer.Option(False, "--preemptible", help="VMs of it may be preempted."),
                    preemption_policy: str = typer.Option("lower-priority", help="never | lower-priority: may its "
                                                          "requests preempt lower-priority preemptible VMs."),
                    preemption_mode: str = typer.Option("requeue", help="requeue | hibernate | cancel: how its VMs are "
                                                        "freed when preempted (or a mode keeping more of them, as "
                                                        "their host supports)."),
                    default: bool = typer.Option(False, "--default", help="The global default class."),
                    description: str = typer.Option("", help="What the class is for."),
                    as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Add a priority class."""
    fmt = out_format(as_json, output)
    out = run(fmt, lambda c: c.scheduling.create_class(name, value, preemptible=preemptible,
                                                       preemption_policy=preemption_policy,
                                                       preemption_mode=preemption_mode, default=default,
                                                       description=description))
    emit(fmt, out) if machine(fmt) else console.print(f"priority class {name} created (value {value})")


@priority_app.command("list")
def priority_list(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """List priority classes, highest first."""
    fmt = out_format(as_json, output)
    rows = run(fmt, lambda c: c.scheduling.list_classes())
    if machine(fmt):
        emit(fmt, rows)
        return
    table = PlainTable("name", "value", "preemptible", "policy", "mode", "default", "VMs")
    for r in rows:
        table.add_row(r["name"], str(r["value"]), "yes" if r["preemptible"] else "no", r["preemption_policy"],
                      r["preemption_mode"], "yes" if r["default"] else "", str(r["vms"]))
    print_table(table, fmt)


@priority_app.command("delete")
def priority_delete(name: str = typer.Argument(..., help="Class name."),
                    as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Remove a priority class no VM, tenant or queued request uses."""
    fmt = out_format(as_json, output)
    run(fmt, lambda c: c.scheduling.delete_class(name))
    emit(fmt, {"deleted": name}) if machine(fmt) else console.print(f"priority class {name} deleted")


def tenant_set(name: str = typer.Argument(..., help="Tenant."),
               shares: int = typer.Option(None, help="Fair-share shares (1 or more)."),
               account: str = typer.Option(None, help="Account of the share tree ('' for none)."),
               priority_classes: str = typer.Option(None, "--priority-classes",
                                                    help="Comma-separated classes it may use ('' for any)."),
               default_priority: str = typer.Option(None, "--default-priority",
                                                    help="Its default priority class ('' for none)."),
               as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Set a tenant's scheduling: shares, account, allowed priority classes, default class."""
    fmt = out_format(as_json, output)
    kw: dict[str, Any] = {}
    if shares is not None:
        kw["shares"] = shares
    if account is not None:
        kw["account"] = account or None
    if priority_classes is not None:
        kw["priority_classes"] = _names(priority_classes) or None
    if default_priority is not None:
        kw["default_priority"] = default_priority or None
    out = run(fmt, lambda c: c.scheduling.set_tenant(name, **kw))
    if machine(fmt):
        emit(fmt, out)
    else:
        classes = ", ".join(out["priority_classes"]) if out["priority_classes"] else "any"
        console.print(f"tenant {name}: shares {out['shares']}, account {out['account'] or '-'}, classes "
                      f"{classes}, default {out['default_priority'] or '-'}")


@account_app.command("set")
def account_set(name: str = typer.Argument(..., help="Account."),
                shares: int = typer.Option(1, help="Shares among its siblings."),
                parent: str = typer.Option(None, help="Parent account (default: the root)."),
                as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Add or change an account of the fair-share tree."""
    fmt = out_format(as_json, output)
    out = run(fmt, lambda c: c.scheduling.set_account(name, shares, parent))
    emit(fmt, out) if machine(fmt) else console.print(f"account {name}: shares {shares}, parent {parent or '-'}")


@account_app.command("delete")
def account_delete(name: str = typer.Argument(..., help="Account."),
                   as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Remove an account without members."""
    fmt = out_format(as_json, output)
    run(fmt, lambda c: c.scheduling.delete_account(name))
    emit(fmt, {"deleted": name}) if machine(fmt) else console.print(f"account {name} deleted")


@scheduling_app.command("show")
def scheduling_show(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Show the scheduling settings (seconds)."""
    fmt = out_format(as_json, output)
    out = run(fmt, lambda c: c.scheduling.settings())
    emit(fmt, out) if machine(fmt) else console.print(", ".join(f"{k} {v:g}" for k, v in out.items()))


@scheduling_app.command("set")
def scheduling_set(half_life: str = typer.Option(None, help="Half-life of past usage, e.g. 7d."),
                   grace: str = typer.Option(None, help="Grace period of a preempted VM's shutdown, e.g. 30s."),
                   cooldown: str = typer.Option(None, help="Cool-down of a re-admitted victim, e.g. 10m."),
                   as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Change scheduling settings."""
    fmt = out_format(as_json, output)

    def go(c: Any) -> Any:
        values = {k: parse_duration(f, v) for k, f, v in (("half_life_s", "half-life", half_life),
                                                           ("grace_s", "grace", grace),
                                                           ("cooldown_s", "cooldown", cooldown)) if v is not None}
        return c.scheduling.set_settings(**values)

    out = run(fmt, go)
    emit(fmt, out) if machine(fmt) else console.print(", ".join(f"{k} {v:g}" for k, v in out.items()))


def share(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Fair share like `sshare -l`: per account and tenant the shares, decayed usage, level fairshare, rank and
    factor."""
    fmt = out_format(as_json, output)
    rows = run(fmt, lambda c: c.scheduling.share())
    if machine(fmt):
        emit(fmt, rows)
        return
    table = PlainTable("account/tenant", "shares", "norm shares", "fb GiB·h", "slice·h", "usage", "norm usage",
                  "level FS", "rank", "fairshare")
    for r in rows:
        indent = "  " * r["depth"] + (r["name"] + "/" if r["kind"] == "account" else r["name"])
        lf = "inf" if r["level_fairshare"] is None else f"{r['level_fairshare']:.3f}"
        table.add_row(indent, str(r["shares"]), f"{r['norm_shares']:.3f}",
                      "" if r["fb_gib_hours"] is None else f"{r['fb_gib_hours']:.3f}",
                      "" if r["compute_slice_hours"] is None else f"{r['compute_slice_hours']:.3f}",
                      f"{r['usage']:.6f}", f"{r['norm_usage']:.3f}", lf,
                      "" if r["rank"] is None else str(r["rank"]),
                      "" if r["fairshare"] is None else f"{r['fairshare']:.3f}")
    print_table(table, fmt)


def queue(tenant: str = typer.Option(None, help="Only this tenant's requests (positions stay the queue's)."),
          admit: bool = typer.Option(False, "--admit", help="Try to admit what waits now."),
          cancel: str = typer.Option(None, "--cancel", help="Take this queued operation out of the queue."),
          as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """What waits for capacity, in admission order (priority, then fair share, then age), and why."""
    fmt = out_format(as_json, output)

    def go(c: Any) -> Any:
        if tenant is not None:
            c.scheduling.tenant(tenant)  # NotFound for a tenant the caller can't see
        if cancel is not None:
            c.scheduling.cancel(cancel)
        admitted = c.scheduling.admit() if admit else []
        rows = [r for r in c.scheduling.queue() if tenant is None or r["tenant"] == tenant]
        return {"admitted": admitted, "queue": rows}

    out = run(fmt, go)
    if machine(fmt):
        emit(fmt, out["queue"] if not admit and cancel is None else out)
        return
    for vm_id in out["admitted"]:
        console.print(f"admitted VM {vm_id}")
    table = PlainTable("#", "operation", "tenant", "name", "priority", "fairshare", "since", "requeued", "why")
    for r in out["queue"]:
        table.add_row(str(r["position"]), r["operation"][:8], r["tenant"] or "-", r["name"],
                      f"{r['priority_class'] or '-'} ({r['priority']})", f"{r['fairshare']:.3f}", r["since"][:19],
                      "hibernated" if r.get("hibernated") else "yes" if r["requeued"] else "", r["reason"] or "")
    print_table(table, fmt)


def register(app: typer.Typer) -> None:
    """Add the scheduling commands to `vgpuctl` (and `set` to `vgpuctl tenant`)."""
    from vgpu_ctl.cli.admin import tenant_app
    app.add_typer(priority_app, name="priority")
    app.add_typer(account_app, name="account")
    app.add_typer(scheduling_app, name="scheduling")
    app.command("share")(share)
    app.command("queue")(queue)
    tenant_app.command("set")(tenant_set)
