"""Placement policies are one module each: the registry finds every module that defines POLICY, so adding a
policy is adding a file, which the inventory then accepts by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vgpu_ctl.core import policies
from vgpu_ctl.core.placement import CandidateOrder, get_policy
from vgpu_ctl.errors import InvalidInput

NEW_POLICY = '''
from vgpu_ctl.core.placement_types import CandidateOrder, Policy
from vgpu_ctl.core.policies import PolicyDef


def last_host_first(host, gpu, after, profile, start):
    return (-host.order, gpu.gpu_id, start)


POLICY = PolicyDef("last-host-first", "the last host first", lambda demand=None, supply=None: Policy(
    "last-host-first", last_host_first, CandidateOrder.HOST_ORDER, "the last host first"))
'''


def test_every_module_of_the_package_is_a_registered_policy() -> None:
    modules = sorted(p.stem for p in Path(policies.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert sorted(m.replace("_", "-") for m in modules) == sorted(policies.POLICIES)
    for name, definition in policies.POLICIES.items():
        made = definition.make(None, None)
        assert made.name == name and isinstance(made.order, CandidateOrder) and definition.description


def test_a_new_file_is_a_new_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "last_host_first.py").write_text(NEW_POLICY)
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "vgpu_ctl.core.policies.last_host_first", raising=False)
    found = policies._discover()
    assert "last-host-first" in found and set(policies.POLICIES) < set(found)
    monkeypatch.setattr(policies, "POLICIES", found)
    assert get_policy("last-host-first").order is CandidateOrder.HOST_ORDER


def test_an_unknown_policy_names_the_field_and_the_known_ones() -> None:
    with pytest.raises(InvalidInput, match=r"unknown placement policy 'packk' \(field policy\); known: "
                                           r"best-fit, first-fit, pack, spread") as err:
        get_policy("packk")
    assert err.value.reasons == [{"field": "policy", "value": "packk"}]
