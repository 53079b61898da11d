"""A real `vgpuctl serve` on loopback for the API tests: a store with the demo fleet, tenants with tokens, an
admin and a reader API token, the server started as its own process and stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
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

from vgpu_ctl import Controller

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "inventory" / "demo.yaml"
VGPUCTL = Path(sys.executable).parent / "vgpuctl"
ADMIN_TOKEN_NAME = "api-tests-admin-7f3c9d"  # long names: a generated request never revokes them by chance
READER_TOKEN_NAME = "api-tests-reader-7f3c9d"


@dataclass
class ApiServer:
    """A running server: its base URL, its store and the tokens of its callers (admin, reader, tenants)."""

    url: str
    state: Path
    tokens: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path
    store_url: str  # the store the server runs on
    clients: list[httpx.Client] = field(default_factory=list)

    def client(self, who: str | None = None, token: str | None = None) -> httpx.Client:
        """An HTTP client sending `who`'s token (admin, reader or a tenant's name), or `token` as given, or
        none; closed with the server."""
        headers: dict[str, str] = {}
        if who is not None:
            headers["Authorization"] = f"Bearer {self.tokens[who]}"
        elif token is not None:
            headers["Authorization"] = f"Bearer {token}"
        c = httpx.Client(base_url=self.url, headers=headers, timeout=60)
        self.clients.append(c)
        return c

    def ctl(self) -> Controller:
        """The admin's Controller on the server's store (to read it back, or prepare what HTTP can't)."""
        return Controller(self.store_url, state_path=self.state)

    def add_tenant(self, name: str, quota: dict[str, int] | None = None) -> httpx.Client:
        """Create tenant `name` (with `quota`), keep its token and return a client acting as it."""
        with self.ctl() as c:
            c.create_tenant(name)
            if quota:
                c.set_quota(name, dict(quota))
            self.tokens[name] = c.issue_token(name)
        return self.client(name)

    def log_tail(self, n: int = 60) -> str:
        """The last lines the server wrote."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_store(state: Path, tenants: tuple[str, ...], store: str | None = None) -> dict[str, str]:
    """The demo fleet, `tenants` with tokens, an admin and a reader API token on `store` (default: a SQLite
    file under `state`): the tokens by who holds them."""
    state.mkdir(parents=True, exist_ok=True)
    tokens: dict[str, str] = {}
    with Controller(store or f"sqlite:///{state / 's.db'}", state_path=state) as c:
        c.apply_inventory(DEMO)
        for t in tenants:
            c.create_tenant(t)
            tokens[t] = c.issue_token(t)
        tokens["admin"] = c.create_api_token(ADMIN_TOKEN_NAME, "admin")
        tokens["reader"] = c.create_api_token(READER_TOKEN_NAME, "reader")
    return tokens


@contextmanager
def api_server(base: Path, tenants: tuple[str, ...] = ("acme", "globex"), store: str | None = None,
               **settings: Any) -> Iterator[ApiServer]:
    """Build a store (`store`, default a SQLite file under `base`) and serve it on a free loopback port until
    the block ends (SIGTERM, then kill after 20 s). `settings` are ServerConfig keys for its config file."""
    state = base / "state"
    store = store or f"sqlite:///{state / 's.db'}"
    tokens = build_store(state, tenants, store)
    port = free_port()
    conf = {"listen": f"127.0.0.1:{port}", "reconcile_interval_s": 0, "recovery_interval_s": 0.5,
            "workers": 2, "drain_timeout_s": 10, **settings}
    cfg = base / "server.toml"
    cfg.write_text("[server]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in conf.items()))
    log = base / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_CTL_")}
    env.update(VGPU_CTL_STATE_DIR=str(state), VGPU_CTL_DATABASE_URL=store)
    with log.open("wb") as out:
        proc = subprocess.Popen([str(VGPUCTL), "serve", "--config", str(cfg), "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=base)
    server = ApiServer(f"http://127.0.0.1:{port}", state, tokens, proc, log, store)
    try:
        _wait_up(server)
        yield server
    finally:
        for c in server.clients:
            c.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _wait_up(server: ApiServer, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s:\n{server.log_tail()}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def wait_operation(client: httpx.Client, location: str, timeout: float = 30.0) -> dict[str, Any]:
    """The operation at `location` once it is done (polled), as the server reports it."""
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(location)
        assert r.status_code == 200, (r.status_code, r.text)
        op: dict[str, Any] = r.json()
        if op["state"] in ("succeeded", "failed") or time.monotonic() > deadline:
            return op
        time.sleep(0.05)


def problem_of(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The problem details of an error response, checked: its status, its media type, the RFC 9457 members
    and the CLI's code."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/problem+json", response.headers
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["code"] == code, body
    assert body["type"] == f"urn:vgpu-ctl:error:{code}" and body["title"] and body["detail"] == body["message"]
    assert isinstance(body["reasons"], list)
    return body


def require_module_ran(request: pytest.FixtureRequest, ran: set[str], fixture: str) -> None:
    """Skip unless every other test of the module that records its calls (through `fixture`) is in `ran`, the
    tests that ran in this process (not so with -k, -m or xdist by test)."""
    import inspect
    mine = {n for n, f in vars(request.module).items() if n.startswith("test_")
            and fixture in inspect.signature(f).parameters} - {request.node.originalname}
    if mine - ran:
        pytest.skip(f"counts what the module's other tests called; {len(mine - ran)} of them did not run here")

