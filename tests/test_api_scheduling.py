"""Scheduling over HTTP (a real `vgpuctl serve`): a queued request waits and is admitted when a VM is deleted; a
high-priority request preempts a preemptible VM (requeued, then re-admitted); tenants see only their own queue
entries; readers never write; bad input is a 400 naming the field with nothing changed; the leader's loop
expires queue deadlines; the scheduling metrics are on /metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverfixtures import RunningServer, shared_server

from vgpu_ctl import Client
from vgpu_ctl.service.requests import OperationInfo, VmInfo
from vgpu_ctl.service.scheduling_types import PreemptionPlan

__all__ = ["shared_server"]  # the fixture, used by name
WHOLE = "A100-80GB"  # the demo's training pool has one passthrough A100: one whole-GPU VM at a time


def _vm(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "vgpus": [{"profile": WHOLE, "count": 1}], "vcpus": 4, "memory_mib": 8192,
            "pool": "training", **extra}


@pytest.fixture(scope="module")
def http(shared_server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def classes(shared_server: RunningServer, http: httpx.Client) -> None:
    """batch (10, preemptible) and prod (1000, may preempt), made once for the module; grace 0 s."""
    admin = shared_server.auth(shared_server.admin_token)
    for body in ({"name": "batch", "value": 10, "preemptible": True}, {"name": "prod", "value": 1000}):
        r = http.post("/v1/priority-classes", json=body, headers=admin)
        assert r.status_code == 201, r.text
        assert r.json()["name"] == body["name"]
    r = http.put("/v1/scheduling/settings", json={"grace_s": 0}, headers=admin)
    assert r.status_code == 200 and r.json()["grace_s"] == 0


@pytest.fixture(autouse=True)
def no_vms_left(shared_server: RunningServer, http: httpx.Client) -> Iterator[None]:
    """Each test starts and ends with no VM and an empty queue (it cleans up after itself)."""
    yield
    admin = shared_server.auth(shared_server.admin_token)
    for q in http.get("/v1/queue", headers=admin).json():
        http.delete(f"/v1/queue/{q['operation']}", headers=admin)
    for vm in http.get("/v1/vms", headers=admin).json()["items"]:
        assert http.delete(f"/v1/vms/{vm['id']}", params={"wait": "30s"}, headers=admin).status_code == 200


def _wait_op(http: httpx.Client, op_id: str, headers: dict[str, str]) -> dict[str, Any]:
    r = http.get(f"/v1/operations/{op_id}", params={"wait": "30s"}, headers=headers)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_queued_request_is_admitted_when_a_vm_is_deleted(shared_server: RunningServer,
                                                            http: httpx.Client) -> None:
    acme, globex = shared_server.auth(shared_server.tenant_token), shared_server.auth(shared_server.other_token)
    first = http.post("/v1/vms", params={"wait": "30s"}, json=_vm("first"), headers=acme)
    assert first.status_code == 201, first.text
    waits = http.post("/v1/vms", params={"wait": "30s"}, json=_vm("second", queue=True), headers=acme)
    assert waits.status_code == 202, waits.text
    queued = waits.json()
    assert queued["state"] == "pending" and queued["error"]["code"] == "no_capacity"
    assert waits.headers["Location"] == f"/v1/operations/{queued['id']}"
    create_op = _wait_op(http, waits.headers["Operation-Location"].rsplit("/", 1)[1], acme)
    assert create_op["state"] == "succeeded" and create_op["result"]["queued"]["id"] == queued["id"]

    mine = http.get("/v1/queue", headers=acme).json()
    assert [(q["operation"], q["name"], q["position"]) for q in mine] == [(queued["id"], "second", 1)]
    assert "no host can take VM 'second'" in mine[0]["reason"]
    assert http.get(f"/v1/queue/{queued['id']}", headers=acme).json()["name"] == "second"
    # another tenant: none of it, and its entry is 404 (read or cancelled)
    assert http.get("/v1/queue", headers=globex).json() == []
    for r in (http.get(f"/v1/queue/{queued['id']}", headers=globex),
              http.delete(f"/v1/queue/{queued['id']}", headers=globex),
              http.get(f"/v1/operations/{queued['id']}", headers=globex),
              http.get("/v1/queue", params={"tenant": "acme"}, headers=globex)):
        assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    assert http.get(f"/v1/queue/{queued['id']}", headers=acme).status_code == 200  # still queued

    gone = http.delete(f"/v1/vms/{first.json()['id']}", params={"wait": "30s"}, headers=acme)
    assert gone.status_code == 200, gone.text
    admitted = _wait_op(http, queued["id"], acme)
    assert admitted["state"] == "succeeded", admitted
    vm = http.get(f"/v1/vms/{admitted['result']['id']}", headers=acme).json()
    assert (vm["name"], vm["state"]) == ("second", "running")
    assert http.get("/v1/queue", headers=acme).json() == []
    assert http.get(f"/v1/queue/{queued['id']}", headers=acme).status_code == 404


def test_a_high_priority_request_preempts_then_the_victim_comes_back(shared_server: RunningServer,
                                                                     http: httpx.Client, classes: None) -> None:
    acme, globex = shared_server.auth(shared_server.tenant_token), shared_server.auth(shared_server.other_token)
    admin = shared_server.auth(shared_server.admin_token)
    low = http.post("/v1/vms", params={"wait": "30s"}, json=_vm("train", priority="batch"), headers=acme)
    assert low.status_code == 201, low.text
    plan = http.post("/v1/scheduling/preview", json=_vm("serve", priority="prod"), headers=globex)
    assert plan.status_code == 200, plan.text
    assert [(v["vm_id"], v["tenant"], v["name"]) for v in plan.json()["victims"]] == [("", "(another tenant)", "")]
    full = http.post("/v1/scheduling/preview", json=_vm("serve", priority="prod", tenant="globex"),
                     headers=admin).json()
    assert [(v["vm_id"], v["mode"]) for v in full["victims"]] == [(low.json()["id"], "requeue")]
    assert http.get(f"/v1/vms/{low.json()['id']}", headers=acme).json()["state"] == "running"  # a dry run

    high = http.post("/v1/vms", params={"wait": "60s"}, json=_vm("serve", priority="prod"), headers=globex)
    assert high.status_code == 201, high.text
    assert high.json()["state"] == "running"
    assert http.get(f"/v1/vms/{low.json()['id']}", headers=acme).status_code == 404  # freed, waiting again
    requeued = http.get("/v1/queue", headers=acme).json()
    assert [(q["name"], q["requeued"], q["vm_id"], q["priority_class"]) for q in requeued] == \
        [("train", True, low.json()["id"], "batch")]
    counts = http.get("/v1/scheduling/preemptions", headers=admin).json()
    assert {"reason": "capacity", "mode": "requeue", "count": 1} in counts
    metrics = http.get("/metrics", headers=admin).text
    assert 'vgpuctl_preemptions_total{mode="requeue",reason="capacity"}' in metrics
    assert 'vgpuctl_queue_length{priority_class="batch"} 1.0' in metrics
    assert 'vgpuctl_queue_oldest_wait_seconds{priority_class="batch"}' in metrics

    gone = http.delete(f"/v1/vms/{high.json()['id']}", params={"wait": "30s"}, headers=globex)
    assert gone.status_code == 200, gone.text
    back = _wait_op(http, requeued[0]["operation"], acme)
    assert back["state"] == "succeeded", back
    vm = http.get(f"/v1/vms/{low.json()['id']}", headers=acme).json()
    assert (vm["name"], vm["state"]) == ("train", "running")  # the same VM (its id, so its disk)
    assert http.get("/v1/queue", headers=admin).json() == []


def test_readers_read_and_never_write(shared_server: RunningServer, http: httpx.Client, classes: None) -> None:
    admin = shared_server.auth(shared_server.admin_token)
    made = http.post("/v1/tokens", json={"name": f"dash-{uuid.uuid4().hex[:6]}", "role": "reader"}, headers=admin)
    reader = shared_server.auth(made.json()["token"])
    before = http.get("/v1/priority-classes", headers=reader)
    assert before.status_code == 200 and [c["name"] for c in before.json()] == ["prod", "batch"]
    for r in (http.post("/v1/priority-classes", json={"name": "sneaky", "value": 5}, headers=reader),
              http.delete("/v1/priority-classes/batch", headers=reader),
              http.put("/v1/tenants/acme/scheduling", json={"shares": 5}, headers=reader),
              http.put("/v1/scheduling/settings", json={"half_life_s": 60}, headers=reader),
              http.put("/v1/accounts/lab", json={"shares": 2}, headers=reader),
              http.post("/v1/queue/admit", headers=reader)):
        assert r.status_code == 403 and r.json()["code"] == "permission_denied", r.text
    tenant = shared_server.auth(shared_server.tenant_token)
    r = http.post("/v1/priority-classes", json={"name": "sneaky", "value": 5}, headers=tenant)
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
    assert http.get("/v1/priority-classes", headers=reader).json() == before.json()
    assert http.get("/v1/scheduling/settings", headers=reader).json()["grace_s"] == 0
    assert len(http.get("/v1/scheduling/share", headers=reader).json()) >= 2  # every tenant's row
    mine = http.get("/v1/scheduling/share", headers=tenant).json()
    assert [r["name"] for r in mine if r["kind"] == "tenant"] == ["acme"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/vms", _vm("bad", priority="nope"), "priority"),
    ("/v1/vms", _vm("bad", queue=True, queue_deadline_s=-1), "queue_deadline"),
    ("/v1/placements", _vm("bad", priority="nope"), "priority"),
    ("/v1/scheduling/preview", _vm("bad", priority="nope"), "priority"),
])
def test_bad_requests_are_400_naming_the_field(shared_server: RunningServer, http: httpx.Client, path: str,
                                               body: dict[str, Any], field: str) -> None:
    acme = shared_server.auth(shared_server.tenant_token)
    ops_before = http.get("/v1/operations", headers=acme).json()
    r = http.post(path, params={"wait": "10s"} if path == "/v1/vms" else None, json=body, headers=acme)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "invalid" and r.json()["reasons"][0]["field"] == field
    assert http.get("/v1/operations", headers=acme).json() == ops_before  # nothing recorded
    assert http.get("/v1/vms", headers=acme).json()["items"] == []


def test_bad_scheduling_settings_change_nothing(shared_server: RunningServer, http: httpx.Client,
                                                classes: None) -> None:
    admin = shared_server.auth(shared_server.admin_token)
    before = http.get("/v1/tenants/acme/scheduling", headers=admin).json()
    for body, field in (({"shares": -1}, "shares"), ({"default_priority": "nope"}, "default_priority"),
                        ({"priority_classes": ["nope"]}, "priority_classes")):
        r = http.put("/v1/tenants/acme/scheduling", json=body, headers=admin)
        assert r.status_code == 400 and r.json()["reasons"][0]["field"] == field, r.text
    assert http.get("/v1/tenants/acme/scheduling", headers=admin).json() == before
    r = http.post("/v1/priority-classes", json={"name": "neg", "value": -1}, headers=admin)
    assert r.status_code == 400 and r.json()["reasons"][0]["field"] == "value", r.text
    r = http.put("/v1/scheduling/settings", json={"half_life_s": -5}, headers=admin)
    assert r.status_code == 400 and r.json()["reasons"][0]["field"] == "half_life", r.text
    assert [c["name"] for c in http.get("/v1/priority-classes", headers=admin).json()] == ["prod", "batch"]
    # a good change, and back: only the fields given change
    changed = http.put("/v1/tenants/acme/scheduling", json={"shares": 3}, headers=admin).json()
    assert changed == {**before, "shares": 3}
    assert http.put("/v1/tenants/acme/scheduling", json={"shares": before["shares"]},
                    headers=admin).json() == before
    assert http.get("/v1/tenants/acme/scheduling", headers=shared_server.auth(shared_server.other_token)
                    ).status_code == 404


def test_the_leader_expires_queue_deadlines(shared_server: RunningServer, http: httpx.Client) -> None:
    acme = shared_server.auth(shared_server.tenant_token)
    assert http.post("/v1/vms", params={"wait": "30s"}, json=_vm("holds"), headers=acme).status_code == 201
    waits = http.post("/v1/vms", params={"wait": "30s"}, json=_vm("brief", queue=True, queue_deadline_s=1),
                      headers=acme)
    assert waits.status_code == 202, waits.text
    op_id = waits.json()["id"]
    deadline = time.monotonic() + 30  # the leader tries the queue every recovery interval (2 s)
    op = waits.json()
    while op["state"] == "pending" and time.monotonic() < deadline:
        time.sleep(0.5)
        op = http.get(f"/v1/operations/{op_id}", headers=acme).json()
    assert op["state"] == "failed" and op["error"]["code"] == "deadline", op
    assert http.get("/v1/queue", headers=acme).json() == []


def test_the_client_has_the_controllers_scheduling(shared_server: RunningServer, classes: None) -> None:
    with Client(shared_server.url, shared_server.tenant_token) as acme, \
            Client(shared_server.url, shared_server.admin_token) as admin:
        first = acme.request_vm("acme", "c1", WHOLE, vcpus=4, memory_mib=8192, pool="training", priority="batch")
        assert isinstance(first, VmInfo)
        queued = acme.request_vm("acme", "c2", WHOLE, vcpus=4, memory_mib=8192, pool="training", queue=True,
                                 queue_deadline_s=600)
        assert isinstance(queued, OperationInfo) and queued.state == "pending"
        assert [q["operation"] for q in acme.scheduling.queue()] == [queued.id]
        plan = admin.scheduling.preview("globex", "x", [(WHOLE, 1)], vcpus=4, memory_mib=8192, pool="training",
                                        priority="prod")
        assert isinstance(plan, PreemptionPlan) and (plan.priority_class, plan.priority) == ("prod", 1000)
        assert [(v.vm_id, v.tenant, v.mode) for v in plan.victims] == [(first.id, "acme", "requeue")]
        assert acme.get_vm(first.id).state == "running"  # a dry run
        acme.scheduling.cancel(queued.id)
        assert acme.scheduling.queue() == []
        assert acme.get_operation(queued.id).error["code"] == "cancelled"  # type: ignore[index]
        assert admin.scheduling.settings()["grace_s"] == 0
        assert isinstance(admin.scheduling.preemption_counts(), dict)
        acme.release_vm(first.id)


def test_a_queued_create_run_again_after_a_crash_queues_once(ctl: Any) -> None:
    """The worker's operation, run a second time (its first taker died after queueing it), finds the queued
    request instead of queueing another; without queue nothing is looked up."""
    from types import SimpleNamespace

    from sqlalchemy import select

    from vgpu_ctl.service import operations as ops
    from vgpu_ctl.store.tables import OPERATION
    ctl.create_tenant("acme")
    ctl.request_vm("acme", "holds", WHOLE, vcpus=4, memory_mib=8192, pool="training")
    info = ctl.submit_vm_create("acme", "waits", [(WHOLE, 1)], vcpus=4, memory_mib=8192, pool="training",
                                queue=True, queue_deadline_s=600, holder="worker-1", lease_seconds=30)
    assert ctl.run_operation(info.id, "worker-1", 30)
    first = ctl.get_operation(info.id)
    assert first.state == "succeeded" and first.result is not None
    queued_id = first.result["queued"]["id"]
    with ctl.engine.connect() as conn:
        row = conn.execute(select(OPERATION).where(OPERATION.c.id == info.id)).one()
    again = SimpleNamespace(**{**row._mapping, "attempts": 2})
    vm_id, result, error = ops.execute(ctl, again)
    assert (vm_id, error) == (None, None) and result is not None and result["queued"]["id"] == queued_id
    assert [q["operation"] for q in ctl.scheduling.queue()] == [queued_id]
