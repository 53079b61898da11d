"""`vgpuctl serve` (the REST API server) and `vgpuctl token` (API tokens with a role)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from vgpu_ctl.cli.common import (
    JSON_OPT,
    OUTPUT_OPT,
    STATE,
    Output,
    console,
    emit,
    handled,
    machine,
    out_format,
    print_table,
    run,
)
from vgpu_ctl.cli.table import PlainTable

token_app = typer.Typer(help="API tokens with a role (admin, reader) for the REST API.", no_args_is_help=True)


def serve(listen: str = typer.Option(None, "--listen", help="HOST:PORT to listen on (default 127.0.0.1:8730)."),
          tls_cert: Path = typer.Option(None, "--tls-cert", help="TLS certificate (PEM); with --tls-key."),
          tls_key: Path = typer.Option(None, "--tls-key", help="TLS private key (PEM)."),
          workers: int = typer.Option(None, "--workers", help="Threads running operations (default 4)."),
          config: Path = typer.Option(None, "--config", envvar="VGPU_CTL_CONFIG",
                                      help="TOML settings file (see contrib/config.toml)."),
          reconcile_interval: float = typer.Option(None, "--reconcile-interval",
                                                   help="Seconds between the leader's reconcile runs (0: none)."),
          operation_lease: float = typer.Option(None, "--operation-lease",
                                                help="Seconds before a dead server's operations are taken over."),
          metrics_access: str = typer.Option(None, "--metrics-access",
                                             help="Who may read /metrics: token, loopback or open."),
          log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error.")) -> None:
    """Serve the REST API (OpenAPI at /openapi.json) on this store; run operations and, when elected leader,
    the recovery and reconcile loops. SIGTERM drains in-flight work."""
    from vgpu_ctl.server.config import ServerConfig, load_config
    overrides: dict[str, Any] = {"listen": listen, "tls_cert": str(tls_cert) if tls_cert else None,
                                 "tls_key": str(tls_key) if tls_key else None, "workers": workers,
                                 "reconcile_interval_s": reconcile_interval, "operation_lease_s": operation_lease,
                                 "metrics_access": metrics_access, "store": STATE.db}
    with handled(False):
        if STATE.token is not None:
            from vgpu_ctl.errors import InvalidInput
            raise InvalidInput("serve runs with the store, as the admin: drop --token",
                               reasons=[{"field": "token"}])
        if log_level not in ("debug", "info", "warning", "error"):
            from vgpu_ctl.errors import InvalidInput
            raise InvalidInput(f"log-level {log_level!r} is not debug, info, warning or error",
                               reasons=[{"field": "log-level", "value": log_level}])
        if config is not None:
            cfg = load_config(config, overrides)
        else:
            cfg = ServerConfig()
            for key, value in overrides.items():
                if value is not None:
                    setattr(cfg, key, value)
            cfg.check()
        host, port = cfg.host_port()
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from vgpu_ctl.server.runtime import open_store
        open_store(cfg).close()  # open (and upgrade) the store once now, so that a bad one fails before listening
    from vgpu_ctl.server.serving import serve_until_drained
    raise typer.Exit(serve_until_drained(cfg, host, port, log_level))


@token_app.command("create")
def token_create(name: str = typer.Argument(..., help="Token name (shown in the audit trail as token:NAME)."),
                 role: str = typer.Option(..., "--role", help="admin (everything) or reader (reads and metrics)."),
                 as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Issue an API token with a role; it is printed once (only its hash is stored)."""
    fmt = out_format(as_json, output)
    token = run(fmt, lambda c: c.create_api_token(name, role))
    emit(fmt, {"name": name, "role": role, "token": token}) if machine(fmt) else print(token)


@token_app.command("list")
def token_list(as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """The API tokens: name, role, created (never the tokens)."""
    fmt = out_format(as_json, output)
    rows = run(fmt, lambda c: c.list_api_tokens())
    if machine(fmt):
        emit(fmt, rows)
        return
    table = PlainTable("name", "role", "created")
    for r in rows:
        table.add_row(r["name"], r["role"], r["created_at"])
    print_table(table, fmt)


@token_app.command("revoke")
def token_revoke(name: str = typer.Argument(..., help="Token name."),
                 as_json: bool = JSON_OPT, output: Output = OUTPUT_OPT) -> None:
    """Revoke an API token."""
    fmt = out_format(as_json, output)
    run(fmt, lambda c: c.revoke_api_token(name))
    emit(fmt, {"revoked": name}) if machine(fmt) else console.print(f"API token {name} revoked")
