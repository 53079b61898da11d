"""What every CLI command shares: opening the controller, printing results and errors, exit codes."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vgpu_ctl.errors import InvalidInput, VgpuCtlError

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


class State:
    """Global options of one CLI invocation."""

    db: str | None = None
    token: str | None = None
    actor: str | None = None


STATE = State()


def open_controller(init: bool = True) -> Any:
    """The Controller for this invocation (admin, or the tenant of --token / $VGPU_CTL_TOKEN)."""
    from vgpu_ctl.service.controller import TOKEN_ENV, Controller
    token = STATE.token if STATE.token is not None else os.environ.get(TOKEN_ENV)  # "" is refused, not admin
    return Controller(STATE.db, token=token, actor=STATE.actor, init=init)


def print_json(data: Any) -> None:
    """Print `data` as JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def fail(exc: VgpuCtlError, as_json: bool) -> NoReturn:
    """Print an error (JSON on stdout with --json, text on stderr) and exit with its code."""
    if as_json:
        print_json({"error": exc.to_dict()})
    else:
        err_console.print(f"[bold red]error[/] ({exc.code}): {exc.message}", markup=True)
        for r in exc.reasons:
            if r.get("kind") == "capacity":
                counts = ", ".join(f"{n} {k}" for k, n in sorted(r["counts"].items())) or "no GPUs"
                err_console.print(f"  pool {r['pool']}: {r['gpus']} GPUs considered: {counts}")
            elif r.get("kind") == "quota":
                scope = "all pools" if r["scope"] == "*" else f"pool {r['scope']}"
                err_console.print(f"  {r['resource']} ({scope}): used {r['used']} + requested {r['requested']} "
                                  f"> limit {r['limit']}")
    raise typer.Exit(exc.exit_code)


@contextmanager
def handled(as_json: bool = False) -> Iterator[None]:
    """Turn vgpu-ctl errors into a message and the documented exit code."""
    try:
        yield
    except VgpuCtlError as exc:
        fail(exc, as_json)


def run(as_json: bool, fn: Callable[[Any], Any]) -> Any:
    """Open the controller, call fn(controller) with errors handled, close it."""
    with handled(as_json):
        ctl = open_controller()
        try:
            return fn(ctl)
        finally:
            ctl.close()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|K|M|G|T|KB|MB|GB|TB)?\s*$", re.IGNORECASE)
_FACTORS = {"b": 1 / 1048576, "k": 1 / 1024, "kib": 1 / 1024, "kb": 1 / 1024, "m": 1, "mib": 1, "mb": 1,
            "g": 1024, "gib": 1024, "gb": 1024, "t": 1048576, "tib": 1048576, "tb": 1048576}


def parse_mib(field: str, text: str) -> int:
    """A size like '80GiB', '512 MiB' or '4096' (MiB) in MiB; InvalidInput naming the field otherwise."""
    m = _SIZE.match(text)
    if not m:
        raise InvalidInput(f"{field} {text!r} is not a size (e.g. 80GiB, 4096MiB, 4096)",
                           reasons=[{"field": field, "value": text}])
    value = float(m.group(1)) * _FACTORS[(m.group(2) or "MiB").lower()]
    if value != int(value):
        raise InvalidInput(f"{field} {text!r} is not a whole number of MiB", reasons=[{"field": field, "value": text}])
    return int(value)


def progress(disable: bool = False) -> Progress:
    """A progress bar on the CLI's console; silent when disabled or when stdout is not a terminal."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=disable or not console.is_terminal)
