"""Placement skips GPUs whose host lacks the profile's type id: discovery records the lacked profiles per GPU
(`gpu.lacked_types`) and keeps their bits out of the GPU's fit mask (`gpu.lacks`) through every claim, release,
refit and re-apply; a request lands on a GPU that has the id, or is refused saying which profile, host and GPU
and what to do, with nothing changed."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from hostfixtures import RecordingNodeDevices, pci_device, running_vm, write_node_file  # noqa: E402
from sqlalchemy import select  # noqa: E402

from vgpu_ctl import Controller  # noqa: E402
from vgpu_ctl.core.geometry import geometry_for, profile_bit  # noqa: E402
from vgpu_ctl.errors import NoCapacity, NotFound  # noqa: E402
from vgpu_ctl.hosts.nodedev import parse_mdev_parent  # noqa: E402
from vgpu_ctl.service.fit_masks import ensure_fit_masks  # noqa: E402
from vgpu_ctl.service.hosts import HostFactory  # noqa: E402
from vgpu_ctl.store.tables import GPU  # noqa: E402

TEN, TWENTY, FORTY = ("nvidia-558", "NVIDIA A100D-10C", 8), ("nvidia-559", "NVIDIA A100D-20C", 4), \
    ("nvidia-560", "NVIDIA A100D-40C", 2)
# 41 and 43 offer A100D-10C and -40C but not -20C; 42 offers -20C and -10C.
DEVICES = [pci_device(0x41, "0x20b5", [TEN, FORTY]), pci_device(0x42, "0x20b5", [TWENTY, TEN]),
           pci_device(0x43, "0x20b5", [TEN, FORTY])]
INVENTORY = """\
pools:
  - {name: two, policy: first-fit}
  - {name: one}
hosts:
  - name: kvm1
    uri: "%s"
    vcpus: 64
    memory_mib: 262144
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: two}
      - {pci: "0000:42:00.0", model: A100-80GB, mode: vgpu-equal, pool: two}
      - {pci: "0000:43:00.0", model: A100-80GB, mode: vgpu-equal, pool: one}
"""


class Host:
    """One libvirt host (test driver node devices, mdevs recorded) in a Controller's inventory."""

    def __init__(self, tmp: Path, url: str | None = None) -> None:
        self.tmp = tmp
        self.uri = write_node_file(tmp / "kvm1.xml", DEVICES)
        self.nodedev = RecordingNodeDevices([p for p in map(parse_mdev_parent, (d.strip() for d in DEVICES))
                                             if p is not None])
        self.ctl = Controller(url or f"sqlite:///{tmp / 'store.db'}", state_path=tmp / "state",
                              host_factory=HostFactory(tmp / "state", nodedevs=lambda h: self.nodedev))
        self.inventory = tmp / "inventory.yaml"
        self.inventory.write_text(INVENTORY % self.uri)
        self.changes = self.ctl.apply_inventory(self.inventory)
        self.ctl.create_tenant("acme")

    def gpu(self, pci: str) -> Any:
        with self.ctl.engine.connect() as conn:
            return conn.execute(select(GPU).where(GPU.c.pci_address == pci)).one()

    def takes(self, pci: str, profile: str) -> bool:
        """Whether the GPU's stored fit mask has the profile's bit (what the candidate queries read)."""
        return bool(self.gpu(pci).fits & profile_bit(geometry_for(self.ctl.catalog, "A100-80GB", "vgpu-equal"),
                                                      profile))


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path)
    yield h
    h.ctl.close()


def _vm(host: Host, name: str, profile: str, pool: str) -> Any:
    return running_vm(host.ctl, name, profile, pool)


def test_discovery_records_the_lacked_profiles_with_what_to_do(host: Host) -> None:
    lacked = host.gpu("0000:41:00.0").lacked_types
    assert set(lacked) >= {"A100D-20C"} and "A100D-10C" not in lacked and "A100D-40C" not in lacked
    assert lacked["A100D-20C"].startswith("host kvm1 has no mdev type id for A100D-20C on 0000:41:00.0: ")
    assert "offers other types on this GPU but not these" in lacked["A100D-20C"]
    assert "A100D-20C" not in (host.gpu("0000:42:00.0").lacked_types or {})
    assert not host.takes("0000:41:00.0", "A100D-20C") and host.takes("0000:41:00.0", "A100D-10C")
    assert host.takes("0000:42:00.0", "A100D-20C")


def test_a_request_lands_on_a_gpu_whose_host_has_the_id(host: Host) -> None:
    first = _vm(host, "ten", "A100D-10C", "two")  # first-fit: 41 is the first GPU of the pool
    assert first.devices[0].gpu == "kvm1/0000:41:00.0"
    host.ctl.release_vm(first.id)
    vm = _vm(host, "twenty", "A100D-20C", "two")  # 41 has room but no type id for it: 42
    assert vm.devices[0].gpu == "kvm1/0000:42:00.0"
    define = [c[1] for c in host.nodedev.calls if c[0] == "define"]
    assert "nvidia-559" in define[-1] and "pci_0000_42_00_0" in define[-1]


def test_with_no_gpu_having_the_id_it_is_refused_saying_why_and_nothing_changes(host: Host) -> None:
    before = host.gpu("0000:43:00.0")
    with pytest.raises(NoCapacity) as err:
        host.ctl.request_vm("acme", "nope", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="one")
    msg = err.value.message
    assert "pool one: 1 GPUs, 1 GPU whose host has no type id for the profile" in msg
    assert "host kvm1 has no mdev type id for A100D-20C on 0000:43:00.0" in msg
    assert "offers other types on this GPU but not these" in msg  # what to do: the apply's finding
    (cap,) = [r for r in err.value.reasons if r["kind"] == "capacity"]
    assert cap["counts"] == {"host-lacks-type": 1}
    assert cap["lacking"] == [{"host": "kvm1", "gpu": "0000:43:00.0", "profile": "A100D-20C",
                               "do": host.gpu("0000:43:00.0").lacked_types["A100D-20C"]}]
    with pytest.raises(NotFound):
        host.ctl.get_vm("nope")
    after = host.gpu("0000:43:00.0")
    assert (after.version, after.fits, after.layout) == (before.version, before.fits, before.layout)
    assert host.nodedev.calls == []
    assert all(u["used"] == 0 for u in host.ctl.tenant_usage("acme"))
    (ev,) = [e for e in host.ctl.events("acme") if e["action"] == "vm.create"]
    assert ev["result"] == "refused"


def test_the_mask_lasts_through_claims_releases_and_refits(host: Host) -> None:
    vm = _vm(host, "ten", "A100D-10C", "one")  # a claim and a release rewrite 43's fit mask from its layout
    assert not host.takes("0000:43:00.0", "A100D-20C")
    host.ctl.release_vm(vm.id)
    assert not host.takes("0000:43:00.0", "A100D-20C") and host.takes("0000:43:00.0", "A100D-10C")
    ensure_fit_masks(host.ctl.engine, host.ctl.catalog, force=True)  # a catalog change recomputes every mask
    assert not host.takes("0000:43:00.0", "A100D-20C") and host.takes("0000:43:00.0", "A100D-10C")
    with pytest.raises(NoCapacity, match="no type id for the profile"):
        host.ctl.request_vm("acme", "nope", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="one")


def test_the_ranking_says_why_a_host_lacking_the_id_is_not_a_candidate(host: Host) -> None:
    (row,) = host.ctl.placement_candidates("acme", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="one")
    assert row["rank"] is None and row["reasons"] == {"host-lacks-type": 1}
    assert "whose host has no type id for the profile" in row["why_not"]


def test_a_host_that_gains_the_type_is_a_candidate_again(host: Host) -> None:
    gained = pci_device(0x43, "0x20b5", [TEN, TWENTY])  # e.g. after a driver update
    write_node_file(host.tmp / "kvm1.xml", [*DEVICES[:2], gained])
    parent = parse_mdev_parent(gained.strip())
    assert parent is not None
    host.nodedev.parents[parent.name] = parent
    host.ctl.apply_inventory(host.inventory)  # discovery again
    assert "A100D-20C" not in host.gpu("0000:43:00.0").lacked_types and host.takes("0000:43:00.0", "A100D-20C")
    vm = _vm(host, "twenty", "A100D-20C", "one")
    assert vm.devices[0].gpu == "kvm1/0000:43:00.0"


def test_host_discover_write_records_what_the_host_lacks(host: Host, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from vgpu_ctl.cli.main import app
    with host.ctl.tx() as conn:  # as before any discovery: nothing lacked, every profile in the mask
        conn.execute(GPU.update().values(lacks=0, lacked_types=None))
    ensure_fit_masks(host.ctl.engine, host.ctl.catalog, force=True)
    assert host.takes("0000:43:00.0", "A100D-20C")
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "cli-state"))
    out = CliRunner().invoke(app, ["--db", str(host.ctl.engine.url), "host", "discover", host.uri, "--name",
                                   "kvm1", "--write", str(tmp_path / "kvm1.yaml")])
    assert out.exit_code == 0, out.output
    assert "A100D-20C" in host.gpu("0000:43:00.0").lacked_types and not host.takes("0000:43:00.0", "A100D-20C")


def test_a_pool_change_keeps_the_mask_while_the_host_is_unreachable(host: Host) -> None:
    moved = host.inventory.read_text().replace(host.uri, f"test://{host.tmp}/missing.xml").replace(
        '"0000:43:00.0", model: A100-80GB, mode: vgpu-equal, pool: one', '"0000:43:00.0", model: A100-80GB, '
        'mode: vgpu-equal, pool: two')
    host.inventory.write_text(moved)
    changes = host.ctl.apply_inventory(host.inventory)
    assert any(c["kind"] == "host-unreachable" for c in changes)
    assert any(c["action"] == "update" and c["name"] == "kvm1/0000:43:00.0" for c in changes)
    gpu = host.gpu("0000:43:00.0")
    assert "A100D-20C" in gpu.lacked_types and not host.takes("0000:43:00.0", "A100D-20C")
    assert host.takes("0000:43:00.0", "A100D-10C")


@pytest.mark.postgres
def test_lacked_types_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    h = Host(tmp_path, pg_url)
    try:
        assert not h.takes("0000:43:00.0", "A100D-20C")
        vm = _vm(h, "twenty", "A100D-20C", "two")
        assert vm.devices[0].gpu == "kvm1/0000:42:00.0"
        with pytest.raises(NoCapacity, match=re.escape("host kvm1 has no mdev type id for A100D-20C on 0000:43:00.0")):
            h.ctl.request_vm("acme", "nope", [("A100D-20C", 1)], vcpus=2, memory_mib=4096, pool="one")
        ten = _vm(h, "ten", "A100D-10C", "one")
        h.ctl.release_vm(ten.id)
        assert not h.takes("0000:43:00.0", "A100D-20C")
    finally:
        h.ctl.close()
