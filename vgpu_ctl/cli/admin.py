"""Admin commands: init, profiles, inventory, hosts, pools, tenants, quotas."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    Output,
    confirm,
    console,
    emit,
    err_console,
    handled,
    machine,
    out_format,
    parse_mib,
    print_table,
    progress,
    remote,
    run,
)
from vgpu_ctl.cli.table import PlainTable
from vgpu_ctl.errors import InvalidInput

profiles_app = typer.Typer(help="The profile catalog.", no_args_is_help=True)
inventory_app = typer.Typer(help="Declared hosts, GPUs and pools.", no_args_is_help=True)
host_app = typer.Typer(help="Live hosts: discover their GPUs; cordon, drain and uncordon them.",
                       no_args_is_help=True)
pool_app = typer.Typer(help="Pools.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenants, their tokens and usage.", no_args_is_help=True)
quota_app = typer.Typer(help="Tenant limits.", no_args_is_help=True)


@profiles_app.command("list")
def profiles_list(model: str = typer.Option(None, help="Only this GPU model (e.g. H100-80GB; any case)."),
                  as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """List the profiles each GPU model offers (slices: compute/memory slices of a MIG profile; confirmed: "no"
    where the catalog's entry is inferred, not captured from NVIDIA's tools or documents)."""
    from vgpu_ctl.cli.catalog_cache import listed_profiles
    fmt = out_format(as_json, output)
    if remote():  # the server's catalog, which its admin may have extended
        profiles = run(fmt, lambda c: c.profiles(model))
    else:
        with handled(fmt):
            profiles = listed_profiles(model)
    if machine(fmt):
        emit(fmt, [p.to_dict() for p in profiles])
        return
    wide = fmt is Output.wide
    table = PlainTable("model", "profile", "kind", "memory", "max", "slices",
                       *(["placements"] if wide else []), "confirmed")
    for p in profiles:
        slices = f"{p.compute_slices}/{p.memory_slices}" if p.compute_slices else ""
        places = p.mixed_placement_ids or p.placements or ()
        extra = [",".join(map(str, places))] if wide else []
        table.add_row(p.model, p.name, str(p.kind), f"{p.framebuffer_mib // 1024}GiB", str(p.max_instances), slices,
                      *extra, "yes" if p.confirmed else "[yellow]no[/]")
    print_table(table, fmt)


@inventory_app.command("apply")
def inventory_apply(file: Path = typer.Argument(..., help="Inventory YAML file."),
                    prune: bool = typer.Option(False, "--prune", help="Also remove the hosts, GPUs and pools the "
                                               "file leaves out (asks first; see --yes)."),
                    yes: bool = typer.Option(False, "--yes", "-y", help="Don't ask before removing (scripts)."),
                    dry_run: bool = typer.Option(False, "--dry-run", help="Show the changes, make none."),
                    as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Add and update the pools, hosts and GPUs an inventory file declares, and print the changes. What the file
    leaves out is kept unless --prune is given."""
    from vgpu_ctl.service.inventory_apply import removals
    fmt = out_format(as_json, output)
    expected = None
    if prune and not dry_run and not yes:
        preview = run(fmt, lambda c: c.apply_inventory(file, dry_run=True, prune=True))
        expected = removals(preview)
        if expected:
            err_console.print(f"applying {file} with --prune removes:", markup=False)
            for kind, name in expected:
                err_console.print(f"  {kind} {name}", markup=False)
            confirm(f"remove these {len(expected)}?", fmt)
    with progress(disable=machine(fmt)) as bar:
        task = bar.add_task("applying inventory", total=None)

        def step(done: int, total: int, host: str) -> None:
            bar.update(task, completed=done, total=total, description=f"host {host}")

        changes = run(fmt, lambda c: c.apply_inventory(file, dry_run=dry_run, progress=step, prune=prune,
                                                       expected_removals=expected))
    if machine(fmt):
        emit(fmt, {"changes": [c for c in changes if c["action"] != "keep"], "dry_run": dry_run,
                   "kept": [c for c in changes if c["action"] == "keep"]})
        return
    made = [c for c in changes if c["action"] != "keep"]
    kept = [c for c in changes if c["action"] == "keep"]
    if not made:
        console.print("no changes")
    lines = []  # written at once, as plain text: 100k change lines through rich took seconds
    for ch in made:
        fields = ", ".join(f"{k}={v}" for k, v in ch.get("fields", {}).items())
        lines.append(f"{'would ' if dry_run else ''}{ch['action']} {ch['kind']} {ch['name']}"
                     + (f": {fields}" if fields else "") + "\n")
    sys.stdout.write("".join(lines))
    if kept:
        names = ", ".join(f"{c['kind']} {c['name']}" for c in kept)
        console.print(f"kept {len(kept)} not in the file ({names}); --prune removes them", markup=False)


@inventory_app.command("show")
def inventory_show(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Show pools, hosts and GPUs as the store holds them."""
    fmt = out_format(as_json, output)
    inv = run(fmt, lambda c: c.inventory())
    if machine(fmt):
        emit(fmt, inv)
        return
    for h in inv["hosts"]:
        sim = " [cyan](simulated)[/]" if h["simulated"] else ""
        console.print(f"[bold]{h['name']}[/]{sim} {h['uri']} {h['state']} vCPUs {h['used_vcpus']}/{h['vcpus']} "
                      f"memory {h['used_memory_mib']}/{h['memory_mib']} MiB")
        for g in h["gpus"]:
            console.print(f"  {g['pci']} {g['model']} {g['mode']} pool={g['pool']} devices={g['devices']} "
                          f"free={g['free_units']}/{g['axis_units']}")


@host_app.command("discover")
def host_discover(uri: str = typer.Argument(..., help="libvirt URI of the host."),
                  name: str = typer.Option(None, help="Host name (default: from the URI)."),
                  write: Path = typer.Option(None, help="Write the inventory YAML here (apply it to add the host)."),
                  as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Read a live host's GPUs and mdev types into inventory YAML, reporting every mismatch with the catalog."""
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.cli.host_check import record_written
    from vgpu_ctl.service.host_side import discover
    fmt = out_format(as_json, output)
    with handled(fmt):
        found = discover(uri, load_catalog(), name)
    if write is not None:
        write.write_text(found.to_yaml())
        record_written(found, fmt)
    if machine(fmt):
        emit(fmt, {"inventory": found.to_inventory(), "mismatches": found.mismatches})
        return
    console.print(found.to_yaml())
    for m in found.mismatches:
        console.print(f"[yellow]mismatch[/] {m['gpu']}: {m['kind']}: {m['detail']}")


HOST_ARG = typer.Argument(..., help="Host name, as in the inventory.")


def _host_state(host: str, state: str, fmt: Output) -> dict[str, Any]:
    out: dict[str, Any] = run(fmt, lambda c: c.set_host_state(host, state))
    if machine(fmt):
        emit(fmt, out)
    return out


@host_app.command("cordon")
def host_cordon(host: str = HOST_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Stop placing new VMs on a host (state draining); its VMs keep running."""
    fmt = out_format(as_json, output)
    out = _host_state(host, "draining", fmt)
    if not machine(fmt):
        console.print(f"host {host} cordoned: no new VMs go there ({len(out['vms'])} VMs stay)", markup=False)


@host_app.command("drain")
def host_drain(host: str = HOST_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Cordon a host and list the VMs still on it: delete them (and create them again, elsewhere) to empty it."""
    fmt = out_format(as_json, output)
    out = _host_state(host, "draining", fmt)
    if machine(fmt):
        return
    if not out["vms"]:
        console.print(f"host {host} is drained: no new VMs go there and none are left", markup=False)
        return
    console.print(f"host {host} cordoned; {len(out['vms'])} VMs still on it (vgpu-ctl does not migrate VMs: "
                  "delete each and create it again to move it):", markup=False)
    for vm in out["vms"]:
        console.print(f"  {vm}", markup=False)


@host_app.command("uncordon")
def host_uncordon(host: str = HOST_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Let a cordoned or drained host take new VMs again (state active)."""
    fmt = out_format(as_json, output)
    out = _host_state(host, "active", fmt)
    if not machine(fmt):
        console.print(f"host {host} takes new VMs again (was {out['from']})", markup=False)


@pool_app.command("list")
def pool_list(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """List pools with their policy and the profiles they offer."""
    fmt = out_format(as_json, output)
    pools = run(fmt, lambda c: c.pools())
    if machine(fmt):
        emit(fmt, pools)
        return
    table = PlainTable("pool", "policy", "GPUs", "profiles")
    for p in pools:
        table.add_row(p["name"], p["policy"], str(p["gpus"]), ", ".join(p["profiles"]))
    print_table(table, fmt)


TENANT_ARG = typer.Argument(..., help="Tenant name.")


@tenant_app.command("create")
def tenant_create(name: str = typer.Argument(..., help="Name of the new tenant (lower-case letters, digits, "
                                             "'_', '.', '-')."),
                  as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Add a tenant."""
    fmt = out_format(as_json, output)
    out = run(fmt, lambda c: c.create_tenant(name))
    emit(fmt, out) if machine(fmt) else console.print(f"tenant {name} created")


@tenant_app.command("list")
def tenant_list(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """List tenants."""
    fmt = out_format(as_json, output)
    rows = run(fmt, lambda c: c.list_tenants())
    if machine(fmt):
        emit(fmt, rows)
        return
    table = PlainTable("tenant", "VMs", "vGPUs", "framebuffer MiB", "token")
    for t in rows:
        table.add_row(t["name"], str(t["vms"]), str(t["vgpus"]), str(t["framebuffer_mib"]),
                      "yes" if t["has_token"] else "")
    print_table(table, fmt)


@tenant_app.command("delete")
def tenant_delete(name: str = TENANT_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Remove a tenant that has no VMs."""
    fmt = out_format(as_json, output)
    run(fmt, lambda c: c.delete_tenant(name))
    emit(fmt, {"deleted": name}) if machine(fmt) else console.print(f"tenant {name} deleted")


@tenant_app.command("token")
def tenant_token(name: str = TENANT_ARG,
                 revoke: bool = typer.Option(False, "--revoke", help="Revoke instead of issuing."),
                 as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Issue (or revoke) the tenant's API token; it is shown once and stored only as a hash."""
    fmt = out_format(as_json, output)
    if revoke:
        run(fmt, lambda c: c.revoke_token(name))
        emit(fmt, {"revoked": name}) if machine(fmt) else console.print(f"token of {name} revoked")
        return
    token = run(fmt, lambda c: c.issue_token(name))
    emit(fmt, {"tenant": name, "token": token}) if machine(fmt) else console.print(token, markup=False)


@tenant_app.command("usage")
def tenant_usage(name: str = TENANT_ARG, as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Each limit of a tenant with its usage, its guaranteed part and how much of the usage is borrowed (above
    the guarantee: reclaimable by tenants below theirs)."""
    fmt = out_format(as_json, output)
    rows = run(fmt, lambda c: c.tenant_usage(name))
    if machine(fmt):
        emit(fmt, {"tenant": name, "usage": rows})
        return
    table = PlainTable("scope", "resource", "used", "guarantee", "limit", "borrowed")
    for r in rows:
        g, b = r.get("guarantee"), r.get("borrowed")
        table.add_row("all pools" if r["scope"] == "*" else r["scope"], r["resource"], str(r["used"]),
                      "-" if g is None else str(g), "unlimited" if r["limit"] is None else str(r["limit"]),
                      "-" if b is None else str(b))
    print_table(table, fmt)


def _limit(field: str, text: str | None, size: bool = False) -> int | None:
    if text is None:
        raise AssertionError
    if text.lower() in ("unlimited", "none"):
        return None
    if size:
        return parse_mib(field, text)
    if not text.isdigit():
        raise InvalidInput(f"--{field} {text!r} must be a whole number >= 0 or 'unlimited'",
                           reasons=[{"field": field, "value": text}])
    return int(text)


@quota_app.command("set")
def quota_set(tenant: str = TENANT_ARG, pool: str = typer.Option(None, help="Limit within this pool only."),
              vms: str = typer.Option(None, help="Most VMs (or 'unlimited')."),
              vgpus: str = typer.Option(None, help="Most vGPUs."),
              framebuffer: str = typer.Option(None, help="Most framebuffer, e.g. 80GiB."),
              vcpus: str = typer.Option(None, help="Most vCPUs."),
              memory: str = typer.Option(None, help="Most memory, e.g. 512GiB."),
              profile: list[str] = typer.Option([], help="PROFILE=N: most vGPUs of one profile (repeatable)."),
              guarantee_vms: str = typer.Option(None, "--guarantee-vms", help="Guaranteed part of --vms."),
              guarantee_vgpus: str = typer.Option(None, "--guarantee-vgpus", help="Guaranteed part of --vgpus: "
                                                  "vGPUs above it are borrowed, reclaimable by tenants below "
                                                  "their guarantee ('none' clears it)."),
              guarantee_framebuffer: str = typer.Option(None, "--guarantee-framebuffer",
                                                        help="Guaranteed part of --framebuffer, e.g. 40GiB."),
              guarantee_vcpus: str = typer.Option(None, "--guarantee-vcpus", help="Guaranteed part of --vcpus."),
              guarantee_memory: str = typer.Option(None, "--guarantee-memory",
                                                   help="Guaranteed part of --memory, e.g. 256GiB."),
              as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Set a tenant's limits and their guaranteed parts; a limit not given is left as it is, 'unlimited' clears
    one, 0 allows none. Usage above a guarantee is borrowed (up to the limit, the burst) and reclaimable by
    tenants below their guarantee. A limit below what the tenant already uses is set, with a warning: its VMs
    stay, new requests are refused."""
    fmt = out_format(as_json, output)

    def build_guarantees() -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for field, key, text, size in (("guarantee-vms", "vms", guarantee_vms, False),
                                       ("guarantee-vgpus", "vgpus", guarantee_vgpus, False),
                                       ("guarantee-framebuffer", "framebuffer_mib", guarantee_framebuffer, True),
                                       ("guarantee-vcpus", "vcpus", guarantee_vcpus, False),
                                       ("guarantee-memory", "memory_mib", guarantee_memory, True)):
            if text is not None:
                out[key] = _limit(field, text, size)
        return out

    def build() -> dict[str, int | None]:
        limits: dict[str, int | None] = {}
        for field, key, text, size in (("vms", "vms", vms, False), ("vgpus", "vgpus", vgpus, False),
                                       ("framebuffer", "framebuffer_mib", framebuffer, True),
                                       ("vcpus", "vcpus", vcpus, False), ("memory", "memory_mib", memory, True)):
            if text is not None:
                limits[key] = _limit(field, text, size)
        for item in profile:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise InvalidInput(f"--profile {item!r} must be PROFILE=N (e.g. A100D-10C=4)",
                                   reasons=[{"field": "profile", "value": item}])
            limits[f"profile:{name}"] = _limit("profile", value)
        if not limits and not build_guarantees():
            raise InvalidInput("give at least one limit (--vms, --vgpus, --framebuffer, --vcpus, --memory, --profile)"
                               " or guarantee (--guarantee-vgpus, ...)")
        return limits

    def go(c: Any) -> tuple[dict[str, int | None], list[dict[str, Any]]]:
        limits, guarantees = build(), build_guarantees()
        changes = c.set_quota(tenant, limits, pool=pool, guarantees=guarantees or None)
        return changes, c.tenant_usage(tenant)

    changes, usage = run(fmt, go)
    scope = pool or "*"
    below = [{"resource": r["resource"], "limit": r["limit"], "used": r["used"]} for r in usage
             if r["scope"] == scope and r["resource"] in changes and r["limit"] is not None
             and r["used"] > r["limit"]]
    if machine(fmt):
        emit(fmt, {"tenant": tenant, "pool": pool, "limits": changes, "below_usage": below})
        return
    for k, v in changes.items():
        unset = "none" if k.startswith("guarantee:") else "unlimited"
        console.print(f"{tenant} {k}{' in ' + pool if pool else ''}: {unset if v is None else v}", markup=False)
    for b in below:
        err_console.print(f"[yellow]warning[/]: {tenant} already uses {b['used']} {b['resource']}"
                          f"{' in ' + pool if pool else ''}, more than the new limit {b['limit']}: its VMs keep "
                          "running, and new requests are refused until usage falls below the limit")


def reconcile_cmd(fix: bool = typer.Option(False, "--fix", help="Repair what is safe to repair (asks before "
                                           "undefining a running domain the store does not know)."),
                  yes: bool = typer.Option(False, "--yes", "-y", help="With --fix: undefine such running domains "
                                           "(or with --adopt, adopt them) without asking."),
                  adopt: bool = typer.Option(False, "--adopt", help="With --fix: offer to adopt each domain the "
                                             "store does not know (claim its VM again as its metadata records)."),
                  as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Compare store and hosts: orphan devices, unknown domains, lost VMs, stuck claims; repair with --fix."""
    fmt = out_format(as_json, output)

    def confirm(f: Any, what: str, question: str) -> bool:
        if yes:
            return True
        bar.stop()
        err_console.print(f"{f.host}: domain {f.target} {what}, but its VM is not in this store "
                          "(another store's, or one restored from an older backup?)", markup=False)
        try:
            answer = bool(typer.confirm(question, default=False, err=True))
        except typer.Abort:
            answer = False
        bar.start()
        return answer

    def ask(f: Any) -> bool:
        return confirm(f, "is running", "undefine it (destroying the running VM)?")

    def ask_adopt(f: Any) -> bool:
        return confirm(f, "was made by vgpu-ctl", "adopt it (claim its VM in this store, as it is on the host)?")

    with progress(disable=machine(fmt)) as bar:
        task = bar.add_task("reconciling hosts", total=None)
        report = run(fmt, lambda c: c.reconcile(fix=fix, progress=lambda h: bar.update(task, description=h),
                                                confirm_undefine=ask, confirm_adopt=ask_adopt if adopt else None))
    if machine(fmt):
        emit(fmt, report.to_dict())
    else:
        for f in report.findings:
            state = "[green]fixed[/]" if f.fixed else (f"[red]failed: {f.error}[/]" if f.error else f.action)
            console.print(f"{f.kind} {f.host} {f.target}: {f.detail} -> {state}")
        console.print(f"{report.hosts} hosts checked, {len(report.findings)} findings")
    if not report.clean:
        raise typer.Exit(1)
