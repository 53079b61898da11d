"""The README's Scheduling example runs as written: a batch VM preempted by a prod request, requeued, shown
by `queue` and `share`, and admitted again when the prod VM is deleted."""

from __future__ import annotations

import re
import shlex

from conftest import REPO, Cli


def test_readme_scheduling_example(cli: Cli) -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Scheduling\n.*?```sh\n(.*?)```", readme, re.S)
    assert block is not None
    outputs = []
    for line in block.group(1).splitlines():
        args = shlex.split(line, comments=True)
        assert args[0] == "vgpuctl"
        result = cli(*args[1:])
        assert result.exit_code == 0, (line, result.output)
        outputs.append((args[1:], result.output))
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
