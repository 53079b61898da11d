"""A real `vgpuctl serve` on loopback for tests that talk HTTP, on a SQLite store with inventory/demo.yaml.

Use it from any test module::

    from serverfixtures import server, shared_server  # noqa: F401  (pytest finds fixtures by name)

    def test_something(server: RunningServer) -> None:
        r = httpx.get(f"{server.url}/v1/vms", headers=server.auth(server.tenant_token))
        out = server.cli("vm", "list", "-o", "json", token=server.tenant_token)  # vgpuctl --server URL ...

`server` is a fresh server per test; `shared_server` is one per test module (faster, but tests see each
other's VMs). Both yield a RunningServer with:

- `url`: http://127.0.0.1:PORT
- `admin_token`: an API token with role admin (made with `vgpuctl token create test-admin --role admin`)
- `tenant_token`: the token of tenant `acme` (`vgpuctl tenant token acme`); `other_token`: tenant `globex`'s
- `db`: the store URL (sqlite:///...), `state_dir`: the folder of the simulated hosts' state
- `cli(*args, token=None, remote=True)`: run `vgpuctl` as a process (with `--server URL --token TOKEN` when
  `remote`, else on the store as its admin, or as `token`'s tenant), returning the CompletedProcess
- `env()`: the environment those processes get; `auth(token)`: the Authorization header for httpx

The server runs with `--reconcile-interval 0` (no reconcile loop) and is killed at teardown. Outside pytest,
`start_server(folder)` is the same as a context manager; `free_port()` picks a loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "inventory" / "demo.yaml"
VGPUCTL = str(Path(sys.executable).with_name("vgpuctl"))
START_TIMEOUT_S = 60.0
_CLEARED = ("VGPU_CTL_DATABASE_URL", "VGPU_CTL_TOKEN", "VGPU_CTL_SERVER", "VGPU_CTL_CONFIG")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RunningServer:
    """A `vgpuctl serve` process and what a test needs to talk to it."""

    url: str
    admin_token: str
    tenant_token: str
    other_token: str
    db: str
    state_dir: Path
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The environment of `vgpuctl` processes on this store: its state folder, no inherited store, server
        or token."""
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        env["VGPU_CTL_STATE_DIR"] = str(self.state_dir)
        env.update(self.extra_env)
        return env

    def auth(self, token: str) -> dict[str, str]:
        """The Authorization header of a bearer token."""
        return {"Authorization": f"Bearer {token}"}

    def cli(self, *args: str, token: str | None = None, remote: bool = True, timeout: float = 120.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `vgpuctl ARGS`: against this server (`--server URL --token TOKEN`, the admin token by default)
        when `remote`, else on the store itself (as the admin, or as the tenant of `token`)."""
        if remote:
            head = ["--server", self.url, "--token", token if token is not None else self.admin_token]
        else:
            head = ["--db", self.db] + (["--token", token] if token is not None else [])
        return subprocess.run([VGPUCTL, *head, *args], env=self.env(), capture_output=True, text=True,
                              timeout=timeout, input=input, check=False)

    def log_text(self) -> str:
        """What the server has written so far (stdout and stderr)."""
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""


def _setup(db: str, env: dict[str, str]) -> tuple[str, str, str]:
    def vgpuctl(*args: str) -> Any:
        p = subprocess.run([VGPUCTL, "--db", db, *args], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
        if p.returncode != 0:
            raise RuntimeError(f"vgpuctl {' '.join(args)} failed ({p.returncode}): {p.stdout}{p.stderr}")
        return json.loads(p.stdout) if "-o" in args else None

    vgpuctl("init", "-o", "json")
    vgpuctl("inventory", "apply", str(DEMO), "-o", "json")
    vgpuctl("tenant", "create", "acme", "-o", "json")
    vgpuctl("tenant", "create", "globex", "-o", "json")
    acme = vgpuctl("tenant", "token", "acme", "-o", "json")["token"]
    globex = vgpuctl("tenant", "token", "globex", "-o", "json")["token"]
    admin = vgpuctl("token", "create", "test-admin", "--role", "admin", "-o", "json")["token"]
    return admin, acme, globex


@contextmanager
def start_server(folder: Path, *serve_args: str) -> Iterator[RunningServer]:
    """A server on a new SQLite store under `folder` with the demo inventory, tenants acme and globex (each
    with a token) and an admin API token; killed when the block ends. `serve_args` go to `vgpuctl serve`."""
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / "state"
    state.mkdir(exist_ok=True)
    db = f"sqlite:///{folder / 'store.db'}"
    log_path = folder / "server.log"
    srv = RunningServer("", "", "", "", db, state, log=log_path)
    admin, acme, globex = _setup(db, srv.env())
    srv.admin_token, srv.tenant_token, srv.other_token = admin, acme, globex
    for _attempt in range(3):  # a port taken between free_port() and the bind: try another
        port = free_port()
        srv.url = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            srv.process = subprocess.Popen(
                [VGPUCTL, "--db", db, "serve", "--listen", f"127.0.0.1:{port}", "--reconcile-interval", "0",
                 "--log-level", "warning", *serve_args], env=srv.env(), stdout=log, stderr=subprocess.STDOUT)
        if _wait_healthy(srv):
            break
        _stop(srv.process)
    else:
        raise RuntimeError(f"vgpuctl serve did not become healthy:\n{srv.log_text()}")
    try:
        yield srv
    finally:
        _stop(srv.process)


def _wait_healthy(srv: RunningServer) -> bool:
    assert srv.process is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if srv.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{srv.url}/healthz", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RunningServer]:
    """A fresh server for one test (see the module's docstring)."""
    with start_server(tmp_path / "server") as srv:
        yield srv


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for every test of a module (see the module's docstring)."""
    with start_server(tmp_path_factory.mktemp("server")) as srv:
        yield srv
