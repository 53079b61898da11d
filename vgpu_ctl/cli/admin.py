"""Admin commands: init, profiles, inventory, hosts, pools, tenants, quotas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from vgpu_ctl.cli.common import console, handled, parse_mib, print_json, progress, run
from vgpu_ctl.errors import InvalidInput

profiles_app = typer.Typer(help="The profile catalog.", no_args_is_help=True)
inventory_app = typer.Typer(help="Declared hosts, GPUs and pools.", no_args_is_help=True)
host_app = typer.Typer(help="Live hosts.", no_args_is_help=True)
pool_app = typer.Typer(help="Pools.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenants, their tokens and usage.", no_args_is_help=True)
quota_app = typer.Typer(help="Tenant limits.", no_args_is_help=True)


@profiles_app.command("list")
def profiles_list(model: str = typer.Option(None, help="Only this GPU model (e.g. H100-80GB)."),
                  as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the profiles each GPU model offers."""
    from vgpu_ctl.catalog import load_catalog
    with handled(as_json):
        profiles = load_catalog().profiles(model)
    if as_json:
        print_json([p.to_dict() for p in profiles])
        return
    table = Table("model", "profile", "kind", "framebuffer", "max", "slices c/m", "placements", "confirmed")
    for p in profiles:
        slices = f"{p.compute_slices}/{p.memory_slices}" if p.compute_slices else ""
        places = p.mixed_placement_ids or p.placements or ()
        table.add_row(p.model, p.name, str(p.kind), f"{p.framebuffer_mib // 1024} GiB", str(p.max_instances), slices,
                      ",".join(map(str, places[:10])) + ("…" if len(places) > 10 else ""),
                      "yes" if p.confirmed else "[yellow]UNCONFIRMED[/]")
    console.print(table)


@inventory_app.command("apply")
def inventory_apply(file: Path = typer.Argument(..., help="Inventory YAML file."),
                    dry_run: bool = typer.Option(False, "--dry-run", help="Show the changes, make none."),
                    as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Make the store match an inventory file and print the changes."""
    with progress(disable=as_json) as bar:
        task = bar.add_task("applying inventory", total=None)

        def step(done: int, total: int, host: str) -> None:
            bar.update(task, completed=done, total=total, description=f"host {host}")

        changes = run(as_json, lambda c: c.apply_inventory(file, dry_run=dry_run, progress=step))
    if as_json:
        print_json({"changes": changes, "dry_run": dry_run})
        return
    if not changes:
        console.print("no changes")
    for ch in changes:
        fields = ", ".join(f"{k}={v}" for k, v in ch.get("fields", {}).items())
        console.print(f"{'would ' if dry_run else ''}{ch['action']} {ch['kind']} {ch['name']}"
                      + (f": {fields}" if fields else ""))


@inventory_app.command("show")
def inventory_show(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show pools, hosts and GPUs as the store holds them."""
    inv = run(as_json, lambda c: c.inventory())
    if as_json:
        print_json(inv)
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
                  write: Path = typer.Option(None, help="Write the inventory YAML here."),
                  as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Read a live host's GPUs and mdev types into inventory YAML, reporting every mismatch with the catalog."""
    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.cli.host_check import record_written, side_for
    from vgpu_ctl.hosts.discovery import discover_host
    with handled(as_json):
        found = discover_host(uri, load_catalog(), name, side_for(uri, name))
    if write is not None:
        write.write_text(found.to_yaml())
        record_written(found, as_json)
    if as_json:
        print_json({"inventory": found.to_inventory(), "mismatches": found.mismatches})
        return
    console.print(found.to_yaml())
    for m in found.mismatches:
        console.print(f"[yellow]mismatch[/] {m['gpu']}: {m['kind']}: {m['detail']}")


@pool_app.command("list")
def pool_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List pools with their policy and the profiles they offer."""
    pools = run(as_json, lambda c: c.pools())
    if as_json:
        print_json(pools)
        return
    table = Table("pool", "policy", "GPUs", "profiles")
    for p in pools:
        table.add_row(p["name"], p["policy"], str(p["gpus"]), ", ".join(p["profiles"]))
    console.print(table)


@tenant_app.command("create")
def tenant_create(name: str, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Add a tenant."""
    out = run(as_json, lambda c: c.create_tenant(name))
    print_json(out) if as_json else console.print(f"tenant {name} created")


@tenant_app.command("list")
def tenant_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List tenants."""
    rows = run(as_json, lambda c: c.list_tenants())
    if as_json:
        print_json(rows)
        return
    table = Table("tenant", "VMs", "vGPUs", "framebuffer MiB", "token")
    for t in rows:
        table.add_row(t["name"], str(t["vms"]), str(t["vgpus"]), str(t["framebuffer_mib"]),
                      "yes" if t["has_token"] else "")
    console.print(table)


@tenant_app.command("delete")
def tenant_delete(name: str, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Remove a tenant that has no VMs."""
    run(as_json, lambda c: c.delete_tenant(name))
    print_json({"deleted": name}) if as_json else console.print(f"tenant {name} deleted")


@tenant_app.command("token")
def tenant_token(name: str, revoke: bool = typer.Option(False, "--revoke", help="Revoke instead of issuing."),
                 as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Issue (or revoke) the tenant's API token; it is shown once and stored only as a hash."""
    if revoke:
        run(as_json, lambda c: c.revoke_token(name))
        print_json({"revoked": name}) if as_json else console.print(f"token of {name} revoked")
        return
    token = run(as_json, lambda c: c.issue_token(name))
    print_json({"tenant": name, "token": token}) if as_json else console.print(token)


@tenant_app.command("usage")
def tenant_usage(name: str, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Each limit of a tenant with its usage."""
    rows = run(as_json, lambda c: c.tenant_usage(name))
    if as_json:
        print_json({"tenant": name, "usage": rows})
        return
    table = Table("scope", "resource", "used", "limit")
    for r in rows:
        table.add_row("all pools" if r["scope"] == "*" else r["scope"], r["resource"], str(r["used"]),
                      "unlimited" if r["limit"] is None else str(r["limit"]))
    console.print(table)


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
def quota_set(tenant: str, pool: str = typer.Option(None, help="Limit within this pool only."),
              vms: str = typer.Option(None, help="Most VMs (or 'unlimited')."),
              vgpus: str = typer.Option(None, help="Most vGPUs."),
              framebuffer: str = typer.Option(None, help="Most framebuffer, e.g. 80GiB."),
              vcpus: str = typer.Option(None, help="Most vCPUs."),
              memory: str = typer.Option(None, help="Most memory, e.g. 512GiB."),
              profile: list[str] = typer.Option([], help="PROFILE=N: most vGPUs of one profile (repeatable)."),
              as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Set a tenant's limits; a limit not given is left as it is, 'unlimited' clears one, 0 allows none."""
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
        if not limits:
            raise InvalidInput("give at least one limit (--vms, --vgpus, --framebuffer, --vcpus, --memory, --profile)")
        return limits

    def go(c: Any) -> Any:
        return c.set_quota(tenant, build(), pool=pool)

    changes = run(as_json, go)
    if as_json:
        print_json({"tenant": tenant, "pool": pool, "limits": changes})
        return
    for k, v in changes.items():
        console.print(f"{tenant} {k}{' in ' + pool if pool else ''}: {'unlimited' if v is None else v}")


def reconcile_cmd(fix: bool = typer.Option(False, "--fix", help="Repair what is safe to repair."),
                  stuck_after: float = typer.Option(300, help="Seconds after which an unfinished step is stuck."),
                  as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Compare store and hosts: orphan devices, unknown domains, lost VMs, stuck claims; repair with --fix."""
    with progress(disable=as_json) as bar:
        task = bar.add_task("reconciling hosts", total=None)
        report = run(as_json, lambda c: c.reconcile(fix=fix, stuck_after_seconds=stuck_after,
                                                    progress=lambda h: bar.update(task, description=h)))
    if as_json:
        print_json(report.to_dict())
    else:
        for f in report.findings:
            state = "[green]fixed[/]" if f.fixed else (f"[red]failed: {f.error}[/]" if f.error else f.action)
            console.print(f"{f.kind} {f.host} {f.target}: {f.detail} -> {state}")
        console.print(f"{report.hosts} hosts checked, {len(report.findings)} findings")
    if not report.clean:
        raise typer.Exit(1)
