"""The README's Scheduling example runs as written: a batch VM preempted by a prod request, requeued, shown
by `queue` and `share`, and admitted again when the prod VM is deleted."""

from __future__ import annotations

from conftest import Cli


def test_readme_scheduling_example(cli: Cli) -> None:
    outputs = cli.readme_block(r"## Scheduling\n")
    dry = next(out for args, out in outputs if "--dry-run" in args)
    assert "preempting 1" in dry and "acme/train (batch 10, requeue)" in dry
    queue = next(out for args, out in outputs if args == ["queue"])
    assert "train" in queue and "yes" in queue
    share = next(out for args, out in outputs if args == ["share"])
    assert "acme" in share and "beta" in share
    vms = cli.json("vm", "list")
    assert sorted((v["tenant"], v["name"], v["state"]) for v in vms) == [("acme", "train", "running")]
    events = [e["action"] for e in cli.json("events")]
    assert events.index("vm.preempt") < events.index("vm.preempted") < events.index("vm.admit")
    assert cli.json("queue") == []
