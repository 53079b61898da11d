"""The queue and the preemption metrics: a new host admits what waits; queue length and oldest wait by class,
preemptions by reason and mode, in Prometheus form; a tenant sees only its own queued requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import Cli, write_inventory
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from vgpu_ctl import Controller, InvalidInput
from vgpu_ctl.service import scheduling_metrics
from vgpu_ctl.service.requests import OperationInfo

EXTRA_HOST = """
pools:
  - name: training
    policy: pack
hosts:
  - name: kvm-a100-02
    uri: "simulated:///kvm-a100-02"
    driver: simulated
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:c1:00.0", model: A100-80GB, mode: passthrough, pool: training}
"""


def _whole(ctl: Controller, tenant: str, name: str, **kw: object) -> object:
    return ctl.request_vm(tenant, name, "A100-80GB", vcpus=4, memory_mib=8192, pool="training",
                          **kw)  # type: ignore[call-overload]


class _Scrape(Collector):
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    def collect(self):  # type: ignore[no-untyped-def]
        yield from scheduling_metrics.collect(self.ctl)


def _metrics(ctl: Controller) -> str:
    reg = CollectorRegistry()
    reg.register(_Scrape(ctl))
    return generate_latest(reg).decode()


def test_new_host_admits_the_queue(ctl: Controller, tmp_path: Path) -> None:
    ctl.create_tenant("acme")
    ctl.scheduling.create_class("std", 100, default=True, preemption_policy="never")
    _whole(ctl, "acme", "a")
    op = _whole(ctl, "acme", "b", queue=True)
    assert isinstance(op, OperationInfo) and op.state == "pending"
    text = _metrics(ctl)
    assert 'vgpuctl_queue_length{priority_class="std"} 1.0' in text
    assert "vgpuctl_queue_oldest_wait_seconds" in text
    ctl.apply_inventory(write_inventory(tmp_path, EXTRA_HOST))  # a new host: what waits is admitted
    assert ctl.scheduling.queue() == []
    assert ctl.get_vm("acme/b").host == "kvm-a100-02"
    assert ctl.get_operation(op.id).state == "succeeded"
    assert "vgpuctl_queue_length{" not in _metrics(ctl)


def test_preemption_metric_by_reason(ctl: Controller) -> None:
    ctl.create_tenant("acme")
    ctl.scheduling.create_class("batch", 10, preemptible=True)
    ctl.scheduling.create_class("prod", 1000)
    _whole(ctl, "acme", "low", priority="batch")
    _whole(ctl, "acme", "high", priority="prod")
    text = _metrics(ctl)
    assert 'vgpuctl_preemptions_total{mode="requeue",reason="capacity"} 1.0' in text
    assert 'vgpuctl_queue_length{priority_class="batch"} 1.0' in text


def test_tenant_sees_only_its_own_queue(ctl: Controller) -> None:
    for t in ("acme", "beta"):
        ctl.create_tenant(t)
    _whole(ctl, "acme", "a")
    _whole(ctl, "acme", "b", queue=True)
    _whole(ctl, "beta", "c", queue=True)
    # equal priority: fair share first, and beta has used nothing while acme holds a whole GPU
    assert [(q["name"], q["fairshare"]) for q in ctl.scheduling.queue()] == [("c", 1.0), ("b", 0.5)]
    token = ctl.issue_token("beta")
    with Controller(ctl.engine.url.render_as_string(hide_password=False), token=token,
                    state_path=ctl.state_path) as beta:
        assert [(q["name"], q["position"]) for q in beta.scheduling.queue()] == [("c", 1)]
        assert [r["name"] for r in beta.scheduling.share()] == ["beta"]


def test_queue_deadline(ctl: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl.create_tenant("acme")
    _whole(ctl, "acme", "a")
    with pytest.raises(InvalidInput, match="field queue_deadline"):
        _whole(ctl, "acme", "b", queue=True, queue_deadline_s=-5)
    op = _whole(ctl, "acme", "b", queue=True, queue_deadline_s=60)
    assert isinstance(op, OperationInfo)
    assert ctl.scheduling.queue()[0]["deadline"] == pytest.approx(time.time() + 60, abs=5)
    real = time.time
    monkeypatch.setattr("time.time", lambda: real() + 120)  # two minutes on
    ctl.scheduling.admit()
    assert ctl.scheduling.queue() == []
    done = ctl.get_operation(op.id)
    assert done.state == "failed" and done.error is not None and done.error["code"] == "deadline"


def test_cli_queue_deadline_bad_input(cli: Cli) -> None:
    args = ["vm", "create", "--tenant", "acme", "--name", "b", "--profile", "A100-80GB", "--vcpus", "4", "--memory",
            "8GiB", "--pool", "training", "--queue"]
    bad = cli.json(*args, "--queue-deadline", "soon", code=2)
    assert bad["error"]["reasons"][0] == {"field": "queue-deadline", "value": "soon"}
    assert cli.json("vm", "list") == [] and cli.json("queue") == []
    assert cli.json(*args, "--queue-deadline", "2h")["state"] == "running"  # it fits: no waiting
    op = cli.json(*[a if a != "b" else "c" for a in args], "--queue-deadline", "2h")
    assert op["state"] == "pending"
    (waiting,) = cli.json("queue")
    assert waiting["operation"] == op["id"] and waiting["deadline"] == pytest.approx(time.time() + 7200, abs=60)


def test_cli_queue_by_tenant(cli: Cli) -> None:
    cli.json("tenant", "create", "beta")
    args = ["--profile", "A100-80GB", "--vcpus", "4", "--memory", "8GiB", "--pool", "training", "--queue"]
    cli.json("vm", "create", "--tenant", "acme", "--name", "a", *args)
    cli.json("vm", "create", "--tenant", "acme", "--name", "b", *args)
    cli.json("vm", "create", "--tenant", "beta", "--name", "c", *args)
    assert [(q["name"], q["position"]) for q in cli.json("queue", "--tenant", "acme")] == [("b", 2)]
    assert [q["name"] for q in cli.json("queue")] == ["c", "b"]  # beta has used nothing: fair share first
    assert cli.json("queue", "--tenant", "nobody", code=4)["error"]["code"] == "not_found"


def test_a_request_being_tried_stays_in_the_queue(ctl: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl.errors import Conflict
    from vgpu_ctl.service import scheduling
    from vgpu_ctl.service.ports import STORE, utcnow

    ctl.create_tenant("acme")
    _whole(ctl, "acme", "a")
    first = _whole(ctl, "acme", "b", queue=True, queue_deadline_s=60)
    second = _whole(ctl, "acme", "c", queue=True)
    assert isinstance(first, OperationInfo) and isinstance(second, OperationInfo)
    before = ctl.scheduling.queue()
    trying = f"{scheduling.ADMITTER}other-process"
    with ctl.tx() as conn:  # another admitter (the server's periodic try) holds b while it tries it
        assert STORE.scheduling.take_queued(conn, first.id, scheduling.QUEUE_HOLDER, trying, utcnow())
    assert ctl.scheduling.queue() == before  # still listed, in its place
    assert 'vgpuctl_queue_length{priority_class="none"} 2.0' in _metrics(ctl)
    with pytest.raises(Conflict, match="being tried for admission right now") as refused:
        ctl.scheduling.cancel(first.id)
    assert refused.value.reasons == [{"field": "operation", "value": first.id}]
    now = time.time()
    monkeypatch.setattr(scheduling.time, "time", lambda: now + 120)  # past b's deadline
    assert ctl.scheduling.admit() == []  # this admitter leaves b to the other one: it neither drops nor tries it
    assert ctl.scheduling.queue() == before and ctl.get_operation(first.id).state == "pending"
    with ctl.tx() as conn:  # the other try fails: b waits in the queue again
        STORE.scheduling.end_admission(conn, first.id, trying, "pending", holder_after=scheduling.QUEUE_HOLDER,
                                       vm_id=None, result=None, error=None, now=utcnow())
    monkeypatch.undo()
    ctl.scheduling.cancel(first.id)
    assert [q["name"] for q in ctl.scheduling.queue()] == ["c"]
