"""The `vgpuctl` command: global options and the command groups."""

from __future__ import annotations

import typer

from vgpu_ctl.cli.admin import (
    host_app,
    inventory_app,
    pool_app,
    profiles_app,
    quota_app,
    reconcile_cmd,
    tenant_app,
)
from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    STATE,
    Output,
    VgpuctlGroup,
    console,
    emit,
    fail,
    machine,
    out_format,
    run,
    run_app,
)
from vgpu_ctl.cli.host_check import agent_app, host_check
from vgpu_ctl.cli.ops import register as register_ops
from vgpu_ctl.cli.plan import register as register_plan
from vgpu_ctl.cli.rebalance import register as register_rebalance
from vgpu_ctl.cli.scheduling import register as register_scheduling
from vgpu_ctl.cli.serve import serve, token_app
from vgpu_ctl.cli.vm import vm_app
from vgpu_ctl.errors import InvalidInput

app = typer.Typer(help="vgpu-ctl: pools of NVIDIA vGPUs on KVM hosts, handed to tenants' VMs under quotas.",
                  no_args_is_help=True, pretty_exceptions_enable=False, cls=VgpuctlGroup)
app.add_typer(profiles_app, name="profiles")
app.add_typer(inventory_app, name="inventory")
app.add_typer(host_app, name="host")
app.add_typer(pool_app, name="pool")
app.add_typer(tenant_app, name="tenant")
app.add_typer(quota_app, name="quota")
app.add_typer(vm_app, name="vm")
register_ops(app)
register_plan(app)
register_rebalance(app)
register_scheduling(app)
app.command("reconcile")(reconcile_cmd)
host_app.command("check")(host_check)
app.add_typer(agent_app, name="agent")
app.add_typer(token_app, name="token")
app.command("serve")(serve)


def _version(value: bool) -> None:
    if value:
        from vgpu_ctl import __version__
        typer.echo(f"vgpuctl {__version__}")
        raise typer.Exit()


@app.callback()
def main(ctx: typer.Context,
         db: str = typer.Option(None, "--db", envvar="VGPU_CTL_DATABASE_URL",
                                help="Store URL: sqlite:///PATH or postgresql://USER@HOST/DB (default: SQLite "
                                     "under $VGPU_CTL_STATE_DIR or ~/.local/state/vgpu-ctl)."),
         token: str = typer.Option(None, "--token", help="Tenant API token (or $VGPU_CTL_TOKEN): act as that tenant."),
         server: str = typer.Option(None, "--server", envvar="VGPU_CTL_SERVER",
                                    help="URL of a vgpu-ctl server (vgpuctl serve), e.g. http://127.0.0.1:8730: "
                                         "talk to it with --token instead of opening a store."),
         actor: str = typer.Option(None, "--actor", help="Name recorded in the audit trail."),
         version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Global options."""
    if server is not None and db is not None:
        from typer._click.core import ParameterSource

        def named(param: str, option: str, env: str) -> str:
            return option if ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE else f"${env}"

        db_name, server_name = named("db", "--db", "VGPU_CTL_DATABASE_URL"), named("server", "--server",
                                                                                   "VGPU_CTL_SERVER")
        fail(InvalidInput(f"give a store on this machine ({db_name} {db}) or a server ({server_name} {server}), "
                          "not both", reasons=[{"field": "server", "value": server}]), Output.table)
    STATE.db = db
    STATE.token = token
    STATE.actor = actor
    STATE.server = server


@app.command("init")
def init(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Create or upgrade the state store (and recompute every GPU's fit mask from the catalog)."""
    fmt = out_format(as_json, output)

    def go(c: object) -> str:
        return str(c.init(refresh_fit_masks=True))  # type: ignore[attr-defined]

    rev = run(fmt, go)
    emit(fmt, {"schema": rev}) if machine(fmt) else console.print(f"store ready (schema {rev})")


def entry() -> None:
    """The `vgpuctl` console script."""
    run_app(app)


if __name__ == "__main__":
    entry()
