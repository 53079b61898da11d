"""VM commands for tenants and admins: create, delete, list, show, start, stop, xml."""

from __future__ import annotations

from typing import Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    Output,
    console,
    emit,
    fail,
    machine,
    out_format,
    parse_mib,
    print_table,
    run,
    short_id,
)
from vgpu_ctl.cli.scheduling import parse_duration
from vgpu_ctl.cli.table import PlainTable
from vgpu_ctl.errors import InvalidInput

vm_app = typer.Typer(help="Virtual machines, with vGPUs or without.", no_args_is_help=True)
VM_ARG = typer.Argument(..., help="VM id (or a unique prefix of it, as `vm list` shows), name, or TENANT/NAME.")


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidInput(f"--label {item!r} must be KEY=VALUE", reasons=[{"field": "label", "value": item}])
        out[k] = v
    return out


def print_vm(vm: Any) -> None:
    """A VM in a few readable lines."""
    sim = " [cyan](simulated host)[/]" if vm.simulated else ""
    console.print(f"[bold]{vm.tenant}/{vm.name}[/] {vm.id} {vm.state} on {vm.host or '-'}{sim} pool={vm.pool} "
                  f"vCPUs={vm.vcpus} memory={vm.memory_mib}MiB")
    for d in vm.devices:
        console.print(f"  {d.profile} ({d.kind}) on {d.gpu} at {d.start}+{d.size} {d.backing} {d.uuid}")
    if vm.error:
        console.print(f"  [red]error:[/] {vm.error}")


def _show(fmt: Output, vm: Any) -> None:
    emit(fmt, vm.to_dict()) if machine(fmt) else print_vm(vm)


@vm_app.command("create")
def vm_create(tenant: str = typer.Option(..., help="Tenant that owns the VM."),
              name: str = typer.Option(..., help="VM name (unique per tenant)."),
              profile: list[str] = typer.Option([], help="vGPU profile (repeatable for several profiles; none: "
                                                         "a VM without vGPUs)."),
              count: int | None = typer.Option(None, help="vGPUs of each profile (default 1)."),
              vcpus: int = typer.Option(..., help="vCPUs."),
              memory: str = typer.Option(..., help="Memory, e.g. 32GiB."),
              pool: str = typer.Option(None, help="Pool to place in (default: any)."),
              label: list[str] = typer.Option([], help="KEY=VALUE host label required (repeatable)."),
              anti_affinity: str = typer.Option(None, help="Group: no two VMs of it on one host."),
              idempotency_key: str = typer.Option(None, help="Same key twice gives the same VM."),
              template: str = typer.Option(None, help="Domain template name."),
              dry_run: bool = typer.Option(False, "--dry-run", help="Show where it would go; claim nothing."),
              priority: str = typer.Option(None, help="Priority class (default: the tenant's, else the global)."),
              preempt: bool = typer.Option(None, "--preempt/--no-preempt",
                                           help="Preempt lower-priority preemptible VMs if it does not fit "
                                                "(default: as its class's policy says); with --dry-run, show them."),
              queue: bool = typer.Option(False, "--queue", help="Wait in the queue if it does not fit."),
              queue_deadline: str = typer.Option(None, help="With --queue, wait at most this long (e.g. 2h)."),
              as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Request a VM, with vGPUs or none: place, claim, create devices, define and start it."""
    fmt = out_format(as_json, output)
    if count is not None and not profile:
        fail(InvalidInput(f"--count {count} needs a --profile to count (a VM without vGPUs takes none)",
                          reasons=[{"field": "count", "value": count}]), fmt)
    each = 1 if count is None else count

    def go(c: Any) -> Any:
        if dry_run and preempt:  # the victims (through a server: POST /v1/scheduling/preview)
            return c.scheduling.preview(tenant, name, [(p, each) for p in profile], vcpus=vcpus,
                                        memory_mib=parse_mib("memory", memory), pool=pool, labels=_labels(label),
                                        anti_affinity=anti_affinity, priority=priority)
        return c.request_vm(tenant, name, [(p, each) for p in profile], vcpus=vcpus,
                            memory_mib=parse_mib("memory", memory), pool=pool, labels=_labels(label),
                            anti_affinity=anti_affinity, idempotency_key=idempotency_key, template=template,
                            dry_run=dry_run, priority=priority, preempt=preempt, queue=queue,
                            queue_deadline_s=None if queue_deadline is None else
                            parse_duration("queue-deadline", queue_deadline))

    out = run(fmt, go)
    if machine(fmt):
        emit(fmt, out.to_dict())
    elif dry_run and preempt:
        console.print(f"would go to {out.host} (pool {out.pool}) at priority {out.priority_class or '-'} "
                      f"({out.priority}), preempting {len(out.victims) or 'nothing'}:")
        for v in out.victims:
            console.print(f"  {v.tenant}/{v.name} ({v.priority_class} {v.priority}, {v.mode}) on {v.host}: "
                          f"{', '.join(v.devices)}")
    elif getattr(out, "kind", None) == "vm.create":
        console.print(f"VM {name} waits in the queue (operation {out.id}): {(out.error or {}).get('message', '')}")
    elif dry_run:
        console.print(f"would place on {out.host} (pool {out.pool}):")
        for d in out.devices:
            console.print(f"  {d.profile} on {d.gpu} at {d.start}+{d.size}")
    else:
        print_vm(out)


@vm_app.command("delete")
def vm_delete(vm: str = VM_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Delete a VM: domain, then devices, then claim and quota."""
    fmt = out_format(as_json, output)
    run(fmt, lambda c: c.release_vm(vm))
    emit(fmt, {"deleted": vm}) if machine(fmt) else console.print(f"VM {vm} deleted")


@vm_app.command("list")
def vm_list(tenant: str = typer.Option(None, help="Only this tenant's VMs."),
            as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """List VMs (ids shortened to 8 characters, which commands accept back; whole with -o wide)."""
    fmt = out_format(as_json, output)
    vms = run(fmt, lambda c: c.list_vms(tenant))
    if machine(fmt):
        emit(fmt, [v.to_dict() for v in vms])
        return
    columns = ["id", "tenant", "name", "state", "host", "pool", "vGPUs"]
    if fmt is Output.wide:
        columns += ["vCPUs", "memory MiB", "devices"]
    table = PlainTable(*columns)
    for v in vms:
        row = [short_id(v.id, fmt), v.tenant, v.name, v.state, v.host or "-", v.pool or "-",
               ", ".join(d.profile for d in v.devices)]
        if fmt is Output.wide:
            row += [str(v.vcpus), str(v.memory_mib), ", ".join(f"{d.gpu}@{d.start}" for d in v.devices)]
        table.add_row(*row)
    print_table(table, fmt)


@vm_app.command("show")
def vm_show(vm: str = VM_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Show one VM with its devices."""
    fmt = out_format(as_json, output)
    _show(fmt, run(fmt, lambda c: c.get_vm(vm)))


@vm_app.command("start")
def vm_start(vm: str = VM_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Start a stopped VM."""
    fmt = out_format(as_json, output)
    _show(fmt, run(fmt, lambda c: c.start_vm(vm)))


@vm_app.command("stop")
def vm_stop(vm: str = VM_ARG, force: bool = typer.Option(False, "--force", help="Destroy instead of shutting down."),
            as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Stop a running VM (its vGPUs stay claimed)."""
    fmt = out_format(as_json, output)
    _show(fmt, run(fmt, lambda c: c.stop_vm(vm, force=force)))


@vm_app.command("xml")
def vm_xml(vm: str = VM_ARG) -> None:
    """Print the VM's rendered, validated domain XML."""
    print(run(False, lambda c: c.vm_xml(vm)))
