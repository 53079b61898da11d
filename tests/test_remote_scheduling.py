"""The scheduling commands with `vgpuctl --server URL --token T`: priority classes, `tenant set`, `scheduling`,
`share`, `queue` and `vm create --priority/--preempt/--queue/--queue-deadline` (and `--dry-run --preempt`) print
what they print on the store with the same exit code: a queued request admitted when a VM is deleted, a
preemption with its victim requeued and re-admitted, refusals and bad input."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from serverfixtures import RunningServer, shared_server

__all__ = ["shared_server"]  # the fixture, used by name
WHOLE = ["--profile", "A100-80GB", "--vcpus", "4", "--memory", "8GiB", "--pool", "training"]  # one at a time


def _json(p: subprocess.CompletedProcess[str]) -> Any:
    try:
        return json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"not JSON (exit {p.returncode}): {p.stdout!r} {p.stderr!r}") from None


def _alike(a: Any, b: Any, rel: float = 0.05) -> bool:
    """Equal, but fractional numbers within `rel` (or 0.002): decayed usage and fair share grow while VMs run,
    so they move between the store's run and the server's a moment later."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=rel,
                                                                                         abs_tol=min(rel, 0.002))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_alike(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_alike(x, y, rel) for x, y in zip(a, b, strict=True))
    return bool(a == b)


_FRACTION = re.compile(r"\d+\.\d+")
_PADDING = re.compile(r"[ ━─]+")


def _shape(text: str) -> str:
    """The text with its fractional numbers (usage, fair share) as `#` and the padding they widen squeezed."""
    return _PADDING.sub(" ", _FRACTION.sub("#", text))


def both(srv: RunningServer, *args: str, token: str | None = None) -> tuple[Any, int]:
    """Run a command on the store and through the server (as the admin, or as `token`'s holder); assert both
    print the same (fractional figures within 5%: see `_alike`) and end with the same exit code; what they
    printed (JSON with -o json) and the code."""
    local = srv.cli(*args, token=token, remote=False)
    remote = srv.cli(*args, token=token if token is not None else srv.admin_token)
    assert remote.returncode == local.returncode, (args, local.stdout, local.stderr, remote.stdout, remote.stderr)
    if "json" in args:
        assert _alike(_json(remote), _json(local)), (args, local.stdout, remote.stdout)
        return _json(local), local.returncode
    assert _shape(remote.stdout) == _shape(local.stdout), (args, local.stdout, remote.stdout)
    assert remote.stderr == local.stderr, (args, local.stderr, remote.stderr)
    return local.stdout + local.stderr, local.returncode


def remote(srv: RunningServer, *args: str, token: str | None = None, code: int = 0) -> Any:
    """`vgpuctl --server URL ARGS -o json` as the admin or `token`'s holder: its JSON, the exit code checked."""
    p = srv.cli(*args, "-o", "json", token=token)
    assert p.returncode == code, (args, p.stdout, p.stderr)
    return _json(p)


@pytest.fixture(scope="module")
def classes(shared_server: RunningServer) -> None:
    """batch (10, preemptible) and prod (1000) made through the server; grace 0 s, a long half-life (so that
    usage does not decay between a local and a remote run)."""
    made = remote(shared_server, "priority", "create", "batch", "--value", "10", "--preemptible")
    assert (made["name"], made["value"], made["preemptible"]) == ("batch", 10, True)
    remote(shared_server, "priority", "create", "prod", "--value", "1000")
    settings = remote(shared_server, "scheduling", "set", "--grace", "0", "--half-life", "10000d")
    assert settings["grace_s"] == 0 and settings["half_life_s"] == 10000 * 86400


@pytest.fixture(autouse=True)
def no_vms_left(shared_server: RunningServer) -> Iterator[None]:
    """Each test ends with no VM and an empty queue."""
    yield
    for q in remote(shared_server, "queue"):
        remote(shared_server, "queue", "--cancel", q["operation"])
    for vm in remote(shared_server, "vm", "list"):
        remote(shared_server, "vm", "delete", vm["id"])


def test_a_queued_request_is_admitted_when_a_vm_is_deleted(shared_server: RunningServer, classes: None) -> None:
    srv, acme, globex = shared_server, shared_server.tenant_token, shared_server.other_token
    holds = remote(srv, "vm", "create", "--tenant", "acme", "--name", "holds", *WHOLE, "--priority", "batch",
                   token=acme)
    assert holds["state"] == "running"
    op = remote(srv, "vm", "create", "--tenant", "acme", "--name", "waits", *WHOLE, "--queue",
                "--queue-deadline", "2h", token=acme)
    assert op["state"] == "pending" and op["kind"] == "vm.create" and op["error"]["code"] == "no_capacity"
    text = srv.cli("vm", "create", "--tenant", "acme", "--name", "also", *WHOLE, "--queue", token=acme)
    assert text.returncode == 0 and "VM also waits in the queue (operation" in text.stdout, text.stderr

    for token in (None, acme):
        queue, _ = both(srv, "queue", "-o", "json", token=token)
        assert [(q["name"], q["position"]) for q in queue] == [("waits", 1), ("also", 2)]
        assert queue[0]["deadline"] is not None and "no host can take VM 'waits'" in queue[0]["reason"]
        both(srv, "queue", token=token)
        both(srv, "queue", "-o", "wide", token=token)
    assert both(srv, "queue", "-o", "json", token=globex)[0] == []
    hidden, code = both(srv, "queue", "--tenant", "acme", "-o", "json", token=globex)
    assert code == 4 and hidden["error"]["code"] == "not_found"
    cancel, code = both(srv, "queue", "--cancel", op["id"], "-o", "json", token=globex)
    assert code == 4 and cancel["error"]["code"] == "not_found"
    also = next(q for q in remote(srv, "queue", token=acme) if q["name"] == "also")
    assert [q["name"] for q in remote(srv, "queue", "--cancel", also["operation"], token=acme)["queue"]] == ["waits"]

    assert remote(srv, "vm", "delete", holds["id"], token=acme) == {"deleted": holds["id"]}
    vm = remote(srv, "vm", "show", "acme/waits", token=acme)
    assert vm["state"] == "running"
    assert remote(srv, "queue", token=acme) == []
    assert any(e["action"] == "vm.admit" for e in remote(srv, "events", token=acme))


def test_a_high_priority_request_preempts_and_the_victim_comes_back(shared_server: RunningServer,
                                                                    classes: None) -> None:
    srv, acme, globex = shared_server, shared_server.tenant_token, shared_server.other_token
    low = remote(srv, "vm", "create", "--tenant", "acme", "--name", "train", *WHOLE, "--priority", "batch",
                 token=acme)
    plan, _ = both(srv, "vm", "create", "--tenant", "globex", "--name", "serve", *WHOLE, "--priority", "prod",
                   "--preempt", "--dry-run", "-o", "json", token=globex)
    assert [(v["tenant"], v["priority_class"]) for v in plan["victims"]] == [("(another tenant)", "batch")]
    text, _ = both(srv, "vm", "create", "--tenant", "globex", "--name", "serve", *WHOLE, "--priority", "prod",
                   "--preempt", "--dry-run")
    assert "preempting 1:" in text and "acme/train (batch 10, requeue)" in text
    assert remote(srv, "vm", "show", low["id"], token=acme)["state"] == "running"  # a dry run

    high = remote(srv, "vm", "create", "--tenant", "globex", "--name", "serve", *WHOLE, "--priority", "prod",
                  token=globex)
    assert high["state"] == "running"
    deadline = time.monotonic() + 30  # the leader tries the queue again (every 2 s): then its reason is settled
    while "preempting does not help" not in (remote(srv, "queue")[0]["reason"] or "") \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    queue, _ = both(srv, "queue", "-o", "json")
    assert [(q["tenant"], q["name"], q["requeued"], q["vm_id"]) for q in queue] == [("acme", "train", True, low["id"])]
    both(srv, "queue")
    assert any(e["action"] == "vm.preempted" for e in remote(srv, "events", token=acme))

    remote(srv, "vm", "delete", high["id"], token=globex)
    back = remote(srv, "vm", "show", low["id"], token=acme)
    assert (back["name"], back["state"]) == ("train", "running")  # the same VM, admitted again
    assert remote(srv, "queue") == []
    remote(srv, "vm", "delete", low["id"], token=acme)  # nothing runs: usage stays as it is between two runs
    rows, _ = both(srv, "share", "-o", "json")
    assert {r["name"] for r in rows if r["kind"] == "tenant"} >= {"acme", "globex"}
    both(srv, "share")
    mine, _ = both(srv, "share", "-o", "json", token=acme)
    assert [r["name"] for r in mine if r["kind"] == "tenant"] == ["acme"]


def test_classes_tenants_and_settings_print_the_same(shared_server: RunningServer, classes: None) -> None:
    srv = shared_server
    listed, _ = both(srv, "priority", "list", "-o", "json")
    assert [c["name"] for c in listed] == ["prod", "batch"]
    both(srv, "priority", "list")
    both(srv, "priority", "list", token=srv.tenant_token)
    both(srv, "scheduling", "show", "-o", "json")
    name = f"tmp-{uuid.uuid4().hex[:6]}"
    assert remote(srv, "priority", "create", name, "--value", "7")["value"] == 7
    assert remote(srv, "priority", "delete", name) == {"deleted": name}
    changed = remote(srv, "tenant", "set", "globex", "--shares", "3", "--priority-classes", "batch,prod",
                     "--default-priority", "batch")
    assert (changed["shares"], changed["priority_classes"], changed["default_priority"]) == \
        (3, ["batch", "prod"], "batch")
    text = srv.cli("tenant", "set", "globex", "--shares", "1", "--priority-classes", "", "--default-priority", "")
    assert text.returncode == 0 and text.stdout == "tenant globex: shares 1, account -, classes any, default -\n"
    account = f"lab-{uuid.uuid4().hex[:4]}"
    assert remote(srv, "account", "set", account, "--shares", "2")["shares"] == 2
    assert remote(srv, "account", "delete", account) == {"deleted": account}


def test_refusals_and_bad_input_are_the_same_and_change_nothing(shared_server: RunningServer,
                                                                classes: None) -> None:
    srv, acme = shared_server, shared_server.tenant_token
    before = (remote(srv, "priority", "list"), remote(srv, "share"), remote(srv, "scheduling", "show"))
    for args, field in ((("vm", "create", "--tenant", "acme", "--name", "x", *WHOLE, "--priority", "nope"), "priority"),
                        (("vm", "create", "--tenant", "acme", "--name", "x", *WHOLE, "--queue",
                          "--queue-deadline", "-1"), "queue-deadline"),
                        (("vm", "create", "--tenant", "acme", "--name", "x", *WHOLE, "--priority", "nope",
                          "--preempt", "--dry-run"), "priority")):
        out, code = both(srv, *args, "-o", "json", token=acme)
        assert code == 2 and out["error"]["code"] == "invalid" and out["error"]["reasons"][0]["field"] == field
    for args, field in ((("tenant", "set", "acme", "--shares", "-1"), "shares"),
                        (("tenant", "set", "acme", "--default-priority", "nope"), "default_priority"),
                        (("priority", "create", "bad", "--value", "-1"), "value"),
                        (("scheduling", "set", "--half-life", "0"), "half_life")):
        out, code = both(srv, *args, "-o", "json")
        assert code == 2 and out["error"]["reasons"][0]["field"] == field, out
    text, code = both(srv, "tenant", "set", "acme", "--shares", "-1")
    assert code == 2 and "shares" in text
    denied, code = both(srv, "priority", "create", "mine", "--value", "5", "-o", "json", token=acme)
    assert code == 7 and denied["error"]["code"] == "permission_denied"
    reader = remote(srv, "token", "create", f"dash-{uuid.uuid4().hex[:6]}", "--role", "reader")["token"]
    refused = remote(srv, "priority", "create", "sneaky", "--value", "5", token=reader, code=7)
    assert refused["error"]["code"] == "permission_denied"
    assert [c["name"] for c in remote(srv, "priority", "list", token=reader)] == ["prod", "batch"]
    # the share view's fair share moves in its 6th digit as the run's usage decays, even with a long half-life
    assert _alike([remote(srv, "priority", "list"), remote(srv, "share"), remote(srv, "scheduling", "show")],
                  list(before), rel=1e-4)
    assert remote(srv, "vm", "list") == [] and remote(srv, "queue") == []
