"""What every CLI command shares: opening the controller, output formats, printing results and errors, exit
codes, and the process-level behaviour of `vgpuctl` (a closed stdout pipe, usage errors as JSON)."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, cast

import typer
from typer._click.exceptions import ClickException
from typer.core import TyperGroup

from vgpu_ctl.cli.table import PlainTable, output_mode, output_width
from vgpu_ctl.errors import InvalidInput, VgpuCtlError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

TOKEN_ENV = "VGPU_CTL_TOKEN"  # as vgpu_ctl.service.controller.TOKEN_ENV (not imported: the remote CLI needs no store)


class _LazyConsole:
    """A rich Console made on first use, so that a command which prints nothing through rich (--help, a plain
    table, JSON) does not import it."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console
            self._console = Console(**self._options)
        return getattr(self._console, name)


console = cast("Console", _LazyConsole(highlight=False, soft_wrap=True))
err_console = cast("Console", _LazyConsole(stderr=True, highlight=False, soft_wrap=True))
WIDE = 1000  # the console width of `-o wide`: a table as wide as its cells, nothing cut


class Output(StrEnum):
    """Output formats of `-o/--output`."""

    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


JSON_OPT = typer.Option(False, "--json", help="Print JSON (the same as -o json).")
OUTPUT_OPT = typer.Option(Output.table, "--output", "-o", help="table (fits the terminal), wide (nothing cut), "
                          "json or yaml.", case_sensitive=False)


class State:
    """Global options of one CLI invocation."""

    db: str | None = None
    token: str | None = None
    actor: str | None = None
    server: str | None = None  # --server / $VGPU_CTL_SERVER: commands talk to that server, not to a store


STATE = State()


def out_format(as_json: bool, output: Output | str | None = None) -> Output:
    """The output format of a command from its --json and -o options (--json wins)."""
    return Output.json if as_json else Output(output or Output.table)


def machine(fmt: Output | bool) -> bool:
    """True when the output is for programs (json or yaml)."""
    return fmt is True or fmt in (Output.json, Output.yaml)


def _plain(data: Any) -> Any:
    return json.loads(json.dumps(data, default=str))


def print_json(data: Any) -> None:
    """Print `data` as JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def emit(fmt: Output | bool, data: Any) -> None:
    """Print `data` as YAML with -o yaml, else as JSON."""
    if fmt is Output.yaml:
        import yaml
        sys.stdout.write(yaml.safe_dump(_plain(data), sort_keys=False, allow_unicode=True))
    else:
        print_json(data)


def print_table(table: Table | PlainTable, fmt: Output | bool = Output.table) -> None:
    """Print a table as wide as the terminal ($COLUMNS, else 80 when not a terminal); with -o wide as wide as
    its cells. A PlainTable is written without rich when its lines would be rich's own (it fits, its cells are
    plain)."""
    wide = fmt is Output.wide
    if isinstance(table, PlainTable):
        mode = output_mode()
        lines = None if mode is None else table.render(WIDE if wide else output_width(), ansi=mode == "ansi")
        if lines is not None:
            sys.stdout.write(lines)
            return
        table = table.to_rich()
    if wide:
        from rich.console import Console
        Console(highlight=False, width=WIDE, file=sys.stdout).print(table)
    else:
        console.print(table)


def short_id(vm_id: str, fmt: Output | bool = Output.table) -> str:
    """A VM id as a table shows it: its first 8 characters (any unique prefix is accepted back), whole with -o
    wide."""
    return vm_id if fmt is Output.wide else vm_id[:8]


def open_controller(init: bool = True) -> Any:
    """The Controller for this invocation (admin, or the tenant of --token / $VGPU_CTL_TOKEN); InvalidInput
    naming the URL and the accepted forms when the store URL is wrong or its store can't be opened. With
    --server (or $VGPU_CTL_SERVER), a Client of that server instead, with the same methods, results and
    errors, acting as the holder of the token (which is then required)."""
    token = STATE.token if STATE.token is not None else os.environ.get(TOKEN_ENV)  # "" is refused, not admin
    if STATE.server is not None:
        if token is None:
            raise InvalidInput(f"--server {STATE.server} needs a token: give --token (or set ${TOKEN_ENV}) to "
                               "a tenant's token or an API token", reasons=[{"field": "token"}])
        from vgpu_ctl.client import Client
        return Client(STATE.server, token)
    from vgpu_ctl.service.controller import Controller
    return Controller(STATE.db, token=token, actor=STATE.actor, init=init)


def remote() -> bool:
    """True when this invocation talks to a server (--server or $VGPU_CTL_SERVER), not to a store."""
    return STATE.server is not None


# Commands that work on the store (or the host) of this machine only: refused with --server, exit 2.
LOCAL_ONLY = {("init",), ("serve",), ("agent",), ("db",), ("plan",), ("advise",), ("host", "check"),
              ("host", "discover"), ("metrics", "serve"), ("metrics", "sample")}


def local_only_error(path: Sequence[str], server: str) -> InvalidInput:
    """The error of a local-only command given --server: it names the command and --server."""
    command = " ".join(path)
    return InvalidInput(f"`vgpuctl {command}` works on this machine's store and hosts only, not through a "
                        f"server: drop --server {server} (and unset $VGPU_CTL_SERVER) and run it where the store is",
                        reasons=[{"field": "server", "value": server, "command": command}])


def _reason_lines(exc: VgpuCtlError) -> list[str]:
    lines = []
    for r in exc.reasons:
        if r.get("kind") == "capacity":
            lines.append(f"  pool {r['pool']}: of {r['gpus']} GPUs considered, {refusal_counts(r['counts'])}")
        elif r.get("kind") == "quota":
            scope = "all pools" if r["scope"] == "*" else f"pool {r['scope']}"
            lines.append(f"  {r['resource']} ({scope}): used {r['used']} + requested {r['requested']} "
                         f"> limit {r['limit']}")
    return lines


def refusal_counts(counts: dict[str, int]) -> str:
    """The counts of a capacity refusal in an admin's words."""
    from vgpu_ctl.core.placement import describe_refusal
    return describe_refusal(counts)


def fail(exc: VgpuCtlError, fmt: Output | bool) -> NoReturn:
    """Print an error (JSON or YAML on stdout for programs, text on stderr) and exit with its code."""
    if machine(fmt):
        emit(fmt, {"error": exc.to_dict()})
    else:
        from rich.markup import escape
        err_console.print(f"[bold red]error[/] ({exc.code}): {escape(exc.message)}", markup=True)
        for line in _reason_lines(exc):
            err_console.print(line, markup=False)
    raise typer.Exit(exc.exit_code)


@contextmanager
def handled(fmt: Output | bool = False) -> Iterator[None]:
    """Turn vgpu-ctl errors into a message and the documented exit code."""
    try:
        yield
    except VgpuCtlError as exc:
        fail(exc, fmt)


def run(fmt: Output | bool, fn: Callable[[Any], Any]) -> Any:
    """Open the controller, call fn(controller) with errors handled, close it."""
    with handled(fmt):
        ctl = open_controller()
        try:
            return fn(ctl)
        finally:
            ctl.close()


def confirm(question: str, fmt: Output | bool) -> None:
    """Ask on the terminal; a no (or no answer: stdin closed) ends the command with exit 1, nothing changed."""
    try:
        yes = typer.confirm(question, default=False, err=True)
    except typer.Abort:  # stdin closed: no answer
        err_console.print()
        yes = False
    if not yes:
        fail(VgpuCtlError("not confirmed; nothing was changed (pass --yes to skip the question)",
                          code="not_confirmed"), fmt)


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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=disable or not console.is_terminal)


# -- the process: usage errors in the asked format, a closed pipe ------------------------------------------------

def _asked_format(args: Sequence[str]) -> Output | None:
    """json or yaml when the command line asks for it (--json, -o json, --output=yaml, -ojson); else None."""
    for i, a in enumerate(args):
        if a == "--json":
            return Output.json
        value = None
        if a in ("-o", "--output") and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--output="):
            value = a.split("=", 1)[1]
        elif a.startswith("-o") and len(a) > 2:
            value = a[2:]
        if value is not None and value.lower() in ("json", "yaml"):
            return Output(value.lower())
    return None


class VgpuctlGroup(TyperGroup):
    """The top-level command group: with --json or -o json|yaml, usage errors (unknown option, bad number,
    missing argument) are printed as `{"error": {"code": "usage", ...}}`, exit 2, like every other error."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        fmt = _asked_format(argv)
        if fmt is None or not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, windows_expand_args, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, False, windows_expand_args, **extra)
        except ClickException as exc:
            emit(fmt, {"error": {"code": "usage", "message": exc.format_message(), "reasons": []}})
            sys.exit(2)
        except typer.Abort:
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: Any) -> Any:
        """Run the command; with --server, a local-only one (LOCAL_ONLY) is refused first, exit 2."""
        server = ctx.params.get("server")
        args = [*ctx._protected_args, *ctx.args]
        if server and "--help" not in args:
            path = self._command_path(ctx, args)
            if path[:1] in LOCAL_ONLY or path[:2] in LOCAL_ONLY:
                fail(local_only_error(path, server), _asked_format(args) or Output.table)
        return super().invoke(ctx)

    def _command_path(self, ctx: Any, args: Sequence[str]) -> tuple[str, ...]:
        """The command and, for a group, its subcommand that `args` name (e.g. ("db", "backup"))."""
        if not args:
            return ()
        cmd = self.get_command(ctx, args[0])
        if cmd is None:
            return (args[0],)
        if isinstance(cmd, TyperGroup):
            leaf = next((a for a in args[1:] if not a.startswith("-")), None)
            return (args[0], leaf) if leaf else (args[0],)
        return (args[0],)


class PipeClosed(Exception):
    """stdout's reader went away (`vgpuctl vm list | head -1`): not an error of the command."""


class _PipeGuard:
    """stdout that turns a broken pipe into PipeClosed (which click does not catch as an OSError)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def _closed(self) -> PipeClosed:
        self.broken = True
        return PipeClosed()

    def write(self, text: str) -> int:
        if self.broken:
            raise PipeClosed
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise self._closed() from None

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise self._closed() from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run_app(app: Callable[[], Any]) -> None:
    """Run the CLI as a process: a closed stdout pipe ends it quietly (exit 0 if the command had not failed)."""
    real = sys.stdout
    guard = _PipeGuard(real)
    sys.stdout = guard  # type: ignore[assignment,unused-ignore]
    code: Any = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    except PipeClosed:
        code = 0
    with suppress(PipeClosed):
        guard.flush()
    sys.stdout = real
    if guard.broken:  # the interpreter's last flush must not hit the closed pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), real.fileno())
    sys.exit(code)
