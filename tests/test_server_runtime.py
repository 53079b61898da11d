"""The server's settings, its example files in contrib/, leader election and the runtime's drain, without
HTTP (tests/test_replicas.py runs real servers)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from conftest import DEMO, REPO
from serverfixtures import VGPUCTL

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.server.config import ServerConfig, load_config
from vgpu_ctl.store.leader import FileLockElector, lock_key

CONTRIB = REPO / "contrib"


# -- contrib/ -------------------------------------------------------------------------------------------------

def test_example_config_documents_every_setting_with_its_default() -> None:
    text = (CONTRIB / "config.toml").read_text()
    for f in fields(ServerConfig):
        assert re.search(rf"^#? ?{f.name} = ", text, re.M), f"contrib/config.toml does not document {f.name}"
        line = re.search(rf"^(#? ?){f.name} = ", text, re.M)
        assert line is not None
        # Set in the file exactly when the setting has a default; what is unset by default is commented out.
        assert (line.group(1) == "") == (f.default is not None), f.name
        above = text[:line.start()].rstrip().rsplit("\n\n", 1)[-1].splitlines()
        words = [ln for ln in above if ln.startswith("# ") and not re.match(r"# \w+ = ", ln)]
        assert words, f"{f.name} has no explanation above it"
    assert load_config(CONTRIB / "config.toml", {}) == ServerConfig()


def test_systemd_unit_has_the_drain_and_hardening_settings() -> None:
    unit = (CONTRIB / "vgpu-ctl.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert settings["ExecStart"].endswith("vgpuctl serve --config /etc/vgpu-ctl/config.toml")
    assert settings["KillSignal"] == "SIGTERM"
    assert settings["User"] == "vgpu-ctl" and settings["StateDirectory"] == "vgpu-ctl"
    assert settings["NoNewPrivileges"] == "yes" and settings["ProtectSystem"] == "strict"
    assert settings["ReadWritePaths"] == "/var/lib/vgpu-ctl"
    assert settings["Environment"] == "VGPU_CTL_STATE_DIR=/var/lib/vgpu-ctl"
    # systemd waits longer than the drain and uvicorn's grace for connections after it, before SIGKILL.
    from vgpu_ctl.server.serving import GRACE_S
    assert int(settings["TimeoutStopSec"]) > ServerConfig().drain_timeout_s + GRACE_S


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart's program exists: point it at this checkout's vgpuctl.
    unit = tmp_path / "vgpu-ctl.service"
    unit.write_text((CONTRIB / "vgpu-ctl.service").read_text().replace("/usr/local/bin/vgpuctl", VGPUCTL))
    p = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "vgpu-ctl.service" not in p.stderr, p.stderr  # no warning about the unit itself


# -- load_config ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "key"), [
    ("[server]\nworkres = 4\n", "workres"),
    ("[server]\nworkers = 0\n", "workers"),
    ("[server]\nworkers = \"four\"\n", "workers"),
    ("[server]\nlisten = 8730\n", "listen"),
    ("[server]\nlisten = \"localhost\"\n", "listen"),
    ("[server]\nlisten = \"127.0.0.1:99999\"\n", "listen port"),
    ("[server]\noperation_lease_s = 0.5\n", "operation_lease_s"),
    ("[server]\nreconcile_interval_s = -1\n", "reconcile_interval_s"),
    ("[server]\ndrain_timeout_s = nan\n", "drain_timeout_s"),
    ("[server]\ndrain_timeout_s = true\n", "drain_timeout_s"),
    ("[server]\nrecovery_interval_s = 0.01\n", "recovery_interval_s"),
    ("[server]\nmetrics_access = \"everyone\"\n", "metrics_access"),
    ("[server]\nallocator = \"yes\"\n", "allocator"),
    ("[server]\ntls_cert = \"/c.pem\"\n", "tls_key"),
    ("[server]\nstore = 1\n", "store"),
    ("[server]\nstore = \"\"\n", "store"),
    ("workers = 2\n[server]\nlisten = \"127.0.0.1:1\"\n", "workers"),
    ("server = 3\n", "server"),
    ("[server\n", "config"),
])
def test_bad_config_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(InvalidInput) as err:
        load_config(path, {})
    assert err.value.reasons[0]["field"] == key, (err.value.message, err.value.reasons)
    assert key.split()[0] in err.value.message


def test_top_level_keys_without_a_server_table_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("workers = 2\nreconcile_interval_s = 0\n")
    cfg = load_config(path, {"workers": 8, "listen": None})
    assert (cfg.workers, cfg.reconcile_interval_s, cfg.listen) == (8, 0, "127.0.0.1:8730")
    with pytest.raises(InvalidInput) as err:
        load_config(path, {"workers": 1000})
    assert err.value.reasons[0]["field"] == "workers"


@pytest.mark.parametrize(("text", "key"), [("[server]\nworkres = 4\n", "workres"),
                                           ("[server]\noperation_lease_s = \"30s\"\n", "operation_lease_s")])
def test_serve_with_a_bad_config_is_exit_2_naming_the_key(tmp_path: Path, state_dir: Path, text: str,
                                                          key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    db = f"sqlite:///{tmp_path / 'never.db'}"
    p = subprocess.run([VGPUCTL, "--db", db, "serve", "--config", str(path)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert key in p.stderr
    assert not (tmp_path / "never.db").exists()  # refused before the store was opened


def test_serve_with_a_missing_config_is_exit_2(tmp_path: Path, state_dir: Path) -> None:
    p = subprocess.run([VGPUCTL, "--db", f"sqlite:///{tmp_path / 's.db'}", "serve", "--config",
                        str(tmp_path / "absent.toml")], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "absent.toml" in p.stderr and "cannot be read" in p.stderr


# -- leader election ------------------------------------------------------------------------------------------

def test_file_lock_one_holder_at_a_time(tmp_path: Path) -> None:
    a, b = FileLockElector(tmp_path / "x.leader"), FileLockElector(tmp_path / "x.leader")
    assert a.try_lead() and a.try_lead()
    assert not b.try_lead()
    a.resign()
    assert b.try_lead() and not a.try_lead()
    b.resign()


def test_advisory_lock_key_differs_per_schema() -> None:
    keys = {lock_key(s) for s in ("public", "vgpu_a", "vgpu_b")}
    assert len(keys) == 3 and all(-2**63 <= k < 2**63 for k in keys)
    assert lock_key("public") == lock_key("public")


@pytest.mark.postgres
def test_advisory_lock_one_leader_per_store_not_per_database(state_dir: Path) -> None:
    from conftest import pg_schema
    from sqlalchemy import create_engine

    from vgpu_ctl.store.leader import AdvisoryLockElector
    with pg_schema() as url_a, pg_schema() as url_b:
        engines = [create_engine(u.replace("postgresql://", "postgresql+psycopg://", 1)) for u in
                   (url_a, url_a, url_b)]
        try:
            a1, a2, b = (AdvisoryLockElector(e) for e in engines)
            assert a1.try_lead() and a1.try_lead()
            assert not a2.try_lead()
            assert b.try_lead()  # another store in the same database has its own leader
            a1.resign()
            assert a2.try_lead() and not a1.try_lead()
            a2.resign()
            b.resign()
        finally:
            for e in engines:
                e.dispose()


# -- the runtime's drain --------------------------------------------------------------------------------------

def _runtime(tmp_path: Path, **cfg: Any) -> Any:
    from vgpu_ctl.server.runtime import Runtime
    url = f"sqlite:///{tmp_path / 'rt.db'}"
    from vgpu_ctl import Controller
    c = Controller(url)
    c.apply_inventory(DEMO)
    c.create_tenant("acme")
    c.close()
    return Runtime(ServerConfig(store=url, reconcile_interval_s=0, **cfg))


def _held_create(rt: Any, gate: Path, name: str) -> tuple[Any, Any]:
    """A create submitted and dispatched on `rt`, held by the simulated host at the step `gate` guards until
    the gate is removed; the Controller and the operation, once the host waits there."""
    from vgpu_ctl.service.principals import Principal
    ctl = rt.controller(Principal("test"))
    gate.touch()
    info = ctl.submit_vm_create("acme", name, [("A100D-10C", 1)], vcpus=2, memory_mib=4096,
                                holder=rt.holder, lease_seconds=rt.cfg.operation_lease_s)
    rt.dispatch(info.id)
    deadline = time.monotonic() + 30
    while not Path(f"{gate}.waiting").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return ctl, info


@contextmanager
def held_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str,
                 name: str) -> Iterator[tuple[Any, Any, Any, Path]]:
    """A Runtime with a create held by the simulated host before `step` until the gate file is removed: the
    runtime, its Controller, the operation and the gate. After the block the gate is removed and the runtime
    closed."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("VGPU_CTL_SIM_HOLD", f"{step}={gate}")
    rt = _runtime(tmp_path)
    try:
        ctl, info = _held_create(rt, gate, name)
        yield rt, ctl, info, gate
    finally:
        gate.unlink(missing_ok=True)
        rt.close()


def test_drain_waits_for_running_operations_and_refuses_new_work(tmp_path: Path, state_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with held_runtime(tmp_path, monkeypatch, "define_domain", "d") as (rt, ctl, info, gate):
        assert rt.in_flight == 1
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(rt.drain(30)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and rt.in_flight == 1 and not rt.accepting
        gate.unlink()
        t.join(30)
        assert result == [True] and rt.in_flight == 0
        assert ctl.get_operation(info.id).state == "succeeded"
        assert ctl.get_vm("acme/d").state == "running"
    assert rt.drained is True


def test_a_drain_that_times_out_bounds_the_next_one(tmp_path: Path, state_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with held_runtime(tmp_path, monkeypatch, "start_domain", "t") as (rt, ctl, info, gate):
        start = time.monotonic()
        assert rt.drain(0.3) is False  # still running: the drain times out, saying so
        assert rt.drain(30) is False  # close() after SIGTERM's drain: no second wait
        assert time.monotonic() - start < 2.0
        assert rt.in_flight == 1 and ctl.get_operation(info.id).state == "running"
        gate.unlink()
        deadline = time.monotonic() + 30
        while rt.in_flight:  # the worker ends by itself once the step goes on
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert ctl.get_operation(info.id).state == "succeeded"
    assert rt.drained is True  # by then nothing ran any more
