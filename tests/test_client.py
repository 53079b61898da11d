"""vgpu_ctl.Client against a real `vgpuctl serve`: the Controller's methods, types and errors over HTTP, and
retries that reuse one Idempotency-Key."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverfixtures import DEMO, RunningServer, free_port, server, shared_server

from vgpu_ctl import Client, Conflict, Controller, InvalidInput, NotFound, PermissionDenied, QuotaExceeded, VgpuCtlError
from vgpu_ctl.api import VgpuApi
from vgpu_ctl.service.requests import OperationInfo, Placement, ReconcileReport, VmInfo

__all__ = ["server", "shared_server"]  # the fixtures, used by name
SMALL = {"vcpus": 2, "memory_mib": 4096}


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def acme(shared_server: RunningServer) -> Iterator[Client]:
    """A Client holding tenant acme's token."""
    with Client(shared_server.url, shared_server.tenant_token) as c:
        yield c


@pytest.fixture
def admin(shared_server: RunningServer) -> Iterator[Client]:
    """A Client holding an admin API token."""
    with Client(shared_server.url, shared_server.admin_token) as c:
        yield c


def test_a_tenant_with_a_token_and_the_url_runs_its_vms(acme: Client) -> None:
    name = _name("life")
    vm = acme.request_vm("acme", name, [("A100D-10C", 1)], vcpus=2, memory_mib=4096)
    assert isinstance(vm, VmInfo) and vm.state == "running" and vm.tenant == "acme" and vm.simulated
    assert [d.profile for d in vm.devices] == ["A100D-10C"]
    assert name in [v.name for v in acme.list_vms()]
    assert acme.get_vm(name) == acme.get_vm(f"acme/{name}") == acme.get_vm(vm.id[:8])
    assert acme.stop_vm(f"acme/{name}").state == "stopped"
    started = acme.start_vm(vm.id)
    assert started.state == "running" and started.generation > vm.generation
    assert "<domain" in acme.vm_xml(name)
    acme.release_vm(f"acme/{name}")
    with pytest.raises(NotFound) as err:
        acme.get_vm(vm.id)
    assert err.value.exit_code == 4
    assert name not in [v.name for v in acme.list_vms()]
    ops = acme.list_operations()
    assert all(isinstance(o, OperationInfo) for o in ops)
    assert {o.kind for o in ops if o.vm_id == vm.id} >= {"vm.create", "vm.delete"}
    assert acme.get_operation(ops[0].id) == ops[0]


def test_a_dry_run_is_a_placement_and_claims_nothing(acme: Client) -> None:
    before = acme.list_vms()
    placement = acme.request_vm("acme", _name("dry"), "H100-1-10C", dry_run=True, vcpus=2, memory_mib=4096)
    assert isinstance(placement, Placement) and placement.pool == "inference"
    assert placement.devices[0].profile == "H100-1-10C" and placement.host == "kvm-h100-01"
    assert acme.list_vms() == before


def test_results_are_the_controllers_own(shared_server: RunningServer, acme: Client) -> None:
    name = _name("same")
    made = acme.request_vm("acme", name, "L40S-12C", pool="workstations", vcpus=2, memory_mib=4096)
    with Controller(shared_server.db, token=shared_server.tenant_token) as local:
        assert acme.get_vm(name) == local.get_vm(name) == made
        assert acme.list_vms() == local.list_vms()
        assert acme.profiles("H100-80GB") == local.profiles("H100-80GB")
        assert acme.tenant_usage("acme") == local.tenant_usage("acme")
        assert acme.list_operations(["succeeded"], limit=5) == local.list_operations(["succeeded"], limit=5)
    acme.release_vm(name)


def test_errors_are_the_controllers_own(shared_server: RunningServer, acme: Client, admin: Client) -> None:
    with pytest.raises(InvalidInput) as bad:
        acme.request_vm("acme", _name("bad"), "A100D-11C", vcpus=2, memory_mib=4096)
    assert bad.value.exit_code == 2 and "unknown profile 'A100D-11C'" in bad.value.message
    assert bad.value.reasons == [{"field": "profile", "value": "A100D-11C"}]

    tenant = _name("quota")
    admin.create_tenant(tenant)
    token = admin.issue_token(tenant)
    admin.set_quota(tenant, {"vgpus": 1})
    with Client(shared_server.url, token) as mine:
        first = mine.request_vm(tenant, "one", "A100D-10C", vcpus=2, memory_mib=4096)
        with pytest.raises(QuotaExceeded) as over:
            mine.request_vm(tenant, "two", "A100D-10C", vcpus=2, memory_mib=4096)
        assert over.value.exit_code == 3
        assert [(r["kind"], r["resource"], r["limit"]) for r in over.value.reasons] == [("quota", "vgpus", 1)]
        assert [v.name for v in mine.list_vms()] == ["one"]
        with Client(shared_server.url, shared_server.other_token) as globex:  # another tenant's VM: not found
            for ref in (first.id, f"{tenant}/one"):
                with pytest.raises(NotFound):
                    globex.get_vm(ref)
            with pytest.raises(NotFound):
                globex.release_vm(first.id)
        mine.release_vm("one")
    admin.delete_tenant(tenant)
    with pytest.raises(NotFound):
        admin.get_tenant(tenant)


def test_a_bad_or_missing_credential_is_refused(shared_server: RunningServer) -> None:
    with Client(shared_server.url, "vgt-not-a-token") as c, pytest.raises(PermissionDenied) as err:
        c.list_vms()
    assert err.value.exit_code == 7 and err.value.code == "permission_denied" and "not valid" in err.value.message
    with pytest.raises(InvalidInput) as empty:
        Client(shared_server.url, " ")
    assert empty.value.reasons[0]["field"] == "token"
    with pytest.raises(InvalidInput) as url:
        Client("ftp://127.0.0.1:1", "x")
    assert url.value.reasons == [{"field": "server", "value": "ftp://127.0.0.1:1"}]
    with pytest.raises(InvalidInput) as retries:
        Client(shared_server.url, "x", retries=-1)
    assert retries.value.reasons == [{"field": "retries", "value": -1}]


def test_an_unreachable_server_is_a_clear_error_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, "x", retries=2, backoff=0.01) as c, pytest.raises(VgpuCtlError) as err:
        c.list_vms()
    assert err.value.code == "unreachable" and url in err.value.message


class _Flaky(httpx.HTTPTransport):
    """Forwards to the server; the first `lose` POSTs to `path` reach it but their answers are lost (a read
    error), and the first `busy` ones are answered 503 without reaching it. Records each POST's key."""

    def __init__(self, path: str, *, lose: int = 0, busy: int = 0) -> None:
        super().__init__()
        self.path, self.lose, self.busy = path, lose, busy
        self.keys: list[str] = []
        self.replayed: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == self.path:
            self.keys.append(request.headers["idempotency-key"])
            if self.busy:
                self.busy -= 1
                return httpx.Response(503, json={"code": "draining", "message": "busy", "reasons": []})
            response = super().handle_request(request)
            self.replayed.append(response.headers.get("idempotent-replayed"))
            if self.lose:
                self.lose -= 1
                response.read()
                response.close()
                raise httpx.ReadError("connection lost before the answer", request=request)
            return response
        return super().handle_request(request)


def test_a_retry_after_a_lost_answer_reuses_the_key_and_makes_one_vm(shared_server: RunningServer) -> None:
    flaky = _Flaky("/v1/vms", lose=1, busy=1)
    name = _name("retry")
    with Client(shared_server.url, shared_server.tenant_token, backoff=0.01, transport=flaky) as c:
        vm = c.request_vm("acme", name, "A100D-10C", vcpus=2, memory_mib=4096)
        assert len(flaky.keys) == 3 and len(set(flaky.keys)) == 1  # 503, lost answer, replayed answer
        assert flaky.replayed == [None, "true"]
        assert [v.id for v in c.list_vms() if v.name == name] == [vm.id]
        c.release_vm(vm.id)
        other = _Flaky("/v1/vms")
        with Client(shared_server.url, shared_server.tenant_token, transport=other) as d:
            d.request_vm("acme", _name("again"), "A100D-10C", dry_run=False, vcpus=2, memory_mib=4096)
            d.release_vm(d.list_vms()[-1].id)
        assert other.keys[0] != flaky.keys[0]  # a new logical call, a new key


class _Unsent(httpx.HTTPTransport):
    """The first `fail` DELETEs: `connect` never reach the server (a connection refused); `lost` reach it and
    their answers are lost."""

    def __init__(self, mode: str, fail: int = 1) -> None:
        super().__init__()
        self.mode, self.fail, self.deletes = mode, fail, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.deletes += 1
            if self.fail:
                self.fail -= 1
                if self.mode == "connect":
                    raise httpx.ConnectError("connection refused", request=request)
                super().handle_request(request).close()
                raise httpx.ReadError("connection lost before the answer", request=request)
        return super().handle_request(request)


def test_a_delete_is_sent_again_only_when_it_never_reached_the_server(shared_server: RunningServer) -> None:
    unsent = _Unsent("connect")
    with Client(shared_server.url, shared_server.tenant_token, backoff=0.01, transport=unsent) as c:
        vm = c.request_vm("acme", _name("del"), "A100D-10C", vcpus=2, memory_mib=4096)
        c.release_vm(vm.id)
        assert unsent.deletes == 2
        with pytest.raises(NotFound):
            c.get_vm(vm.id)
    lost = _Unsent("lost")
    with Client(shared_server.url, shared_server.tenant_token, backoff=0.01, transport=lost) as c:
        vm = c.request_vm("acme", _name("del"), "A100D-10C", vcpus=2, memory_mib=4096)
        with pytest.raises(VgpuCtlError) as err:
            c.release_vm(vm.id)
        assert err.value.code == "unreachable" and "may have been done" in err.value.message
        assert lost.deletes == 1
        c.wait_operation(c.list_operations(limit=1)[0])
        with pytest.raises(NotFound):  # it was done, once
            c.get_vm(vm.id)


def test_the_same_key_twice_gives_one_vm(acme: Client) -> None:
    key, name = str(uuid.uuid4()), _name("key")
    body = {"name": name, "vgpus": [{"profile": "A100D-10C", "count": 1}], **SMALL}
    first = acme.request("POST", "/v1/vms", params={"wait": "30s"}, json=body, idempotency_key=key).json()
    again = acme.request("POST", "/v1/vms", params={"wait": "30s"}, json=body, idempotency_key=key)
    assert again.headers.get("idempotent-replayed") == "true" and again.json()["id"] == first["id"]
    assert [v.id for v in acme.list_vms() if v.name == name] == [first["id"]]
    with pytest.raises(VgpuCtlError) as reused:  # the same key with another body
        acme.request("POST", "/v1/vms", json={**body, "vcpus": 4}, idempotency_key=key)
    assert reused.value.code == "idempotency_key_reused"
    acme.release_vm(first["id"])


def test_the_admin_runs_the_fleet_remotely(shared_server: RunningServer, admin: Client) -> None:
    assert [p["name"] for p in admin.pools()] == ["inference", "training", "workstations"]
    assert len(admin.inventory()["hosts"]) == 3
    assert [c for c in admin.apply_inventory(DEMO, dry_run=True) if c["action"] != "keep"] == []
    assert [c for c in admin.apply_inventory(DEMO, prune=True, expected_removals=[]) if c["action"] != "keep"] == []
    smaller = shared_server.state_dir / "smaller.yaml"
    smaller.write_text(DEMO.read_text().split("  - name: kvm-l40s-01")[0])
    with pytest.raises(Conflict) as unconfirmed:  # the apply would remove a host the preview did not show
        admin.apply_inventory(smaller, prune=True, expected_removals=[])
    assert "host kvm-l40s-01" in unconfirmed.value.message and unconfirmed.value.exit_code == 5
    assert len(admin.inventory()["hosts"]) == 3
    cordoned = admin.set_host_state("kvm-l40s-01", "draining")
    assert (cordoned["from"], cordoned["to"]) == ("active", "draining")
    assert admin.set_host_state("kvm-l40s-01", "active")["from"] == "draining"
    name = _name("tok")
    token = admin.create_api_token(name, "reader")
    assert name in [t["name"] for t in admin.list_api_tokens()]
    with Client(shared_server.url, token) as reader:
        assert reader.inventory()["pools"]
        assert "vgpu" in reader.metrics_text()
    admin.revoke_api_token(name)
    assert name not in [t["name"] for t in admin.list_api_tokens()]
    report = admin.reconcile()
    assert isinstance(report, ReconcileReport) and report.hosts == 3 and report.clean
    checks = admin.doctor()
    assert checks and all(c["ok"] for c in checks)
    status = admin.status(gpus=True, limit=2)
    assert len(status["gpus"]) == 2 and status["page"]["total"] == 9
    events = admin.events(limit=5)
    assert len(events) == 5 and all("action" in e for e in events)
    assert admin.events(tenant="acme", since="1h", limit=1)[0]["tenant"] == "acme"


def test_bad_input_names_the_field_and_changes_nothing(shared_server: RunningServer, admin: Client) -> None:
    before = admin.list_tenants()
    with pytest.raises(InvalidInput) as bad:
        admin.create_tenant("Not A Name")
    assert bad.value.reasons and bad.value.reasons[0].get("field") == "tenant"
    with pytest.raises(InvalidInput) as sched:
        admin.request_vm("acme", "q", "A100D-10C", vcpus=2, memory_mib=4096, queue=True, queue_deadline_s=-1)
    assert sched.value.reasons == [{"field": "queue_deadline", "value": -1}]
    with pytest.raises(InvalidInput) as quota:
        admin.set_quota("acme", {"profile:NOPE": 1})
    assert quota.value.reasons == [{"field": "profile", "value": "NOPE"}]
    from vgpu_ctl.errors import InventoryError
    with pytest.raises(InventoryError):
        admin.apply_inventory(shared_server.state_dir / "missing.yaml")
    assert admin.list_tenants() == before


def _names(api: VgpuApi) -> list[str]:
    """Code written against the protocol: runs the same with a Controller and a Client."""
    return [v.name for v in api.list_vms("acme")]


def test_one_protocol_for_both(shared_server: RunningServer, acme: Client) -> None:
    api: Any
    with Controller(shared_server.db, token=shared_server.tenant_token) as api:
        local = _names(api)
    assert _names(acme) == local


def _readme_blocks(lang: str) -> list[str]:
    from serverfixtures import REPO
    text = (REPO / "README.md").read_text()
    section = text.split("### Remote CLI and Python client\n", 1)[1].split("\n### ", 1)[0]
    return [b.split("\n", 1)[1] for b in section.split("```")[1::2] if b.startswith(lang)]


def test_the_readme_examples_run(server: RunningServer) -> None:
    import os
    import subprocess
    import sys
    from contextlib import redirect_stdout
    from io import StringIO
    assert server.cli("quota", "set", "acme", "--vgpus", "2").returncode == 0
    env = {**server.env(), "VGPU_CTL_SERVER": server.url, "VGPU_CTL_TOKEN": server.tenant_token,
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
    [shell] = _readme_blocks("sh")
    for line in shell.splitlines():
        if line.startswith("vgpuctl "):
            p = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert p.returncode == 0, (line, p.stdout, p.stderr)
    [python] = _readme_blocks("python")
    expected = [line.split("  # ", 1)[1].strip() for line in python.splitlines() if "  # " in line]
    out = StringIO()
    old = {k: os.environ.get(k) for k in ("VGPU_CTL_SERVER", "VGPU_CTL_TOKEN")}
    os.environ.update(VGPU_CTL_SERVER=server.url, VGPU_CTL_TOKEN=server.tenant_token)
    try:
        with redirect_stdout(out):
            exec(compile(python, "README.md", "exec"), {})
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert out.getvalue().splitlines() == expected
    with Client(server.url, server.tenant_token) as c:
        assert c.list_vms() == []
