"""Against a real libvirtd and KVM (qemu:///system): tiny guests without vGPUs (64 MiB, a 1 MiB qcow2 base)
created, run, stopped, started and deleted through the Controller, leaving nothing behind (no domain, no
overlay, quota back to zero); an mdev hostdev refused by the real QEMU driver; reconcile against real domains.
Skipped only where /dev/kvm is absent. The GPU side (node devices) is emulated.

Where a running guest must hold GPU space (preemption), its pool `nogpu` renders the project's template without
its hostdev loop (`nogpu.xml.j2`), as the real QEMU driver refuses an mdev hostdev without VFIO."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from hostfixtures import RecordingNodeDevices  # noqa: E402

from vgpu_ctl import Controller  # noqa: E402
from vgpu_ctl.errors import HostError  # noqa: E402
from vgpu_ctl.service.hosts import HostFactory  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
URI = "qemu:///system"

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="no /dev/kvm: real KVM guests cannot run")

INVENTORY = """\
pools:
  - {name: kvm}
  - {name: nogpu, template: nogpu.xml.j2}
hosts:
  - name: kvm-real
    uri: "qemu:///system"
    vcpus: 4
    memory_mib: 4096
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, mode: vgpu-equal, pool: kvm}
      - {pci: "0000:42:00.0", model: A100-80GB, mode: vgpu-equal, pool: nogpu}
"""
HOSTDEV_LOOP = "{%- for h in hostdevs %}\n{%- if h.backing.value == 'mdev' %}"


def _nogpu_template(folder: Path) -> None:
    """The project's domain template with its hostdev loop cut out."""
    text = (ROOT / "templates" / "domain.xml.j2").read_text()
    start = text.index(HOSTDEV_LOOP)
    end = text.index("{%- endfor %}", text.index("</hostdev>", text.rindex("<hostdev", start))) + len("{%- endfor %}")
    (folder / "nogpu.xml.j2").write_text(text[:start] + text[end:])


@pytest.fixture(scope="module")
def libvirtd() -> Any:
    """A connection to qemu:///system, with the daemons and the default network started if they were not."""
    subprocess.run(["bash", "-c", "source scripts/libvirtd.sh && ensure_libvirtd"], cwd=ROOT, check=True,
                   timeout=120)
    import libvirt
    conn = libvirt.open(URI)
    yield conn
    conn.close()


class Real:
    """A Controller whose one host is this machine's libvirtd; the GPU side (node devices) emulated."""

    def __init__(self, conn: Any) -> None:
        # QEMU runs as libvirt-qemu: the images folder must be reachable by it, so not under pytest's 0700 tmp
        self.dir = Path(tempfile.mkdtemp(prefix="vgpuctl-kvm-", dir="/var/tmp"))
        self.dir.chmod(0o755)
        self.conn = conn
        self.images = self.dir / "state" / "images"
        self.images.mkdir(parents=True)
        self.dir.joinpath("state").chmod(0o755)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(self.images / "base.qcow2"), "1M"],
                       check=True)
        self.nodedev = RecordingNodeDevices()
        _nogpu_template(self.dir)
        factory = HostFactory(self.dir / "state", template_dirs=(self.dir,), nodedevs=lambda h: self.nodedev)
        self.ctl = Controller(f"sqlite:///{self.dir / 'store.db'}", state_path=self.dir / "state",
                              host_factory=factory)
        inv = self.dir / "inventory.yaml"
        inv.write_text(INVENTORY)
        self.changes = self.ctl.apply_inventory(inv)
        self.ctl.create_tenant("acme")
        from vgpu_ctl.service.fit_masks import ensure_fit_masks
        from vgpu_ctl.service.ports import STORE
        from vgpu_ctl.store.tables import GPU

        # the GPU side is emulated: the type ids an earlier discovery would have recorded, and nothing lacked
        # (this machine's real discovery finds no NVIDIA GPU there); mdev calls recorded
        with self.ctl.tx() as conn:
            for gpu_id in conn.execute(GPU.select().with_only_columns(GPU.c.id)).scalars():
                STORE.host_types.replace_type_ids(conn, gpu_id, {"mdev": {"A100D-10C": "nvidia-558"}})
            conn.execute(GPU.update().values(lacked_types=None))
        ensure_fit_masks(self.ctl.engine, self.ctl.catalog, force=True)

    def domains(self) -> set[str]:
        return {d.name() for d in self.conn.listAllDomains(0)}

    def mine(self) -> set[str]:
        """Domains of this test's controller (by the VM id suffix of their names)."""
        ids = {v.id[:8] for v in self.ctl.list_vms()}
        return {n for n in self.domains() if n.rsplit("-", 1)[-1] in ids}

    def close(self) -> None:
        for vm in self.ctl.list_vms():
            with contextlib.suppress(Exception):  # cleanup goes on; the domain is removed below
                self.ctl.release_vm(vm.id)
        for dom in self.conn.listAllDomains(0):
            if dom.name().startswith("vgpuctl-test-") or str(self.dir) in dom.XMLDesc(0):
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
        for pool in self.conn.listAllStoragePools(0):
            if str(self.dir) in pool.XMLDesc(0):
                pool.destroy()
        self.ctl.close()
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


@pytest.fixture
def real(libvirtd: Any) -> Iterator[Real]:
    r = Real(libvirtd)
    yield r
    r.close()


def _usage(real: Real) -> dict[str, int]:
    return {u["resource"]: u["used"] for u in real.ctl.tenant_usage("acme")}


def _state(conn: Any, name: str) -> str:
    import libvirt
    dom = conn.lookupByName(name)
    return "running" if dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING else f"state {dom.state()[0]}"


def test_a_vm_without_vgpus_runs_stops_starts_and_leaves_nothing_behind(real: Real) -> None:
    before = real.domains()
    vm = real.ctl.request_vm("acme", "plain", [], vcpus=1, memory_mib=64, pool="kvm")
    assert vm.state == "running", vm.error
    assert vm.devices == () and _usage(real)["vms"] == 1 and _usage(real)["vgpus"] == 0
    (name,) = real.domains() - before
    assert name == f"plain-{vm.id[:8]}" and _state(real.conn, name) == "running"
    overlay = real.images / f"{vm.id}.qcow2"
    info = subprocess.run(["qemu-img", "info", "-U", str(overlay)], check=True, capture_output=True,
                          text=True).stdout
    assert f"backing file: {real.images / 'base.qcow2'}" in info
    dom = real.conn.lookupByName(name)
    assert "<model type='none'/>" in dom.XMLDesc(0) and "vgpu-ctl.dev/xmlns/vm/1" in dom.XMLDesc(0)
    assert "<hostdev" not in dom.XMLDesc(0)
    real.ctl.stop_vm(vm.id, force=True)
    assert real.ctl.get_vm(vm.id).state == "stopped" and not dom.isActive()
    real.ctl.start_vm(vm.id)
    assert dom.isActive()
    assert _state(real.conn, name) == "running"
    real.ctl.release_vm(vm.id)
    assert real.domains() == before
    assert not overlay.exists() and (real.images / "base.qcow2").exists()
    assert real.ctl.list_vms() == [] and set(_usage(real).values()) == {0}
    assert real.nodedev.calls == [] and real.nodedev.mdevs == {}  # no device was ever made


def test_an_mdev_hostdev_is_defined_and_the_real_qemu_driver_refuses_it_clearly(real: Real) -> None:
    before = real.domains()
    with pytest.raises(HostError) as err:
        real.ctl.request_vm("acme", "gpu", [("A100D-10C", 1)], vcpus=1, memory_mib=64, pool="kvm")
    vm = real.ctl.get_vm("gpu")
    assert f"starting domain gpu-{vm.id[:8]} failed" in err.value.message
    assert "Mediated host device assignment requires VFIO support" in err.value.message
    assert err.value.exit_code == 6
    assert real.nodedev.names() == ["define", "start", "set_autostart", "destroy", "undefine"]
    assert vm.state == "failed" and real.domains() == before and not (real.images / f"{vm.id}.qcow2").exists()


def test_reconcile_against_real_domains(real: Real) -> None:
    vm = real.ctl.request_vm("acme", "rec", [], vcpus=1, memory_mib=64, pool="kvm")
    name = f"rec-{vm.id[:8]}"
    foreign = f"vgpuctl-test-{uuidlib.uuid4().hex[:8]}"
    real.conn.defineXML(f"<domain type='kvm'><name>{foreign}</name><memory unit='MiB'>64</memory>"
                        "<os><type arch='x86_64' machine='q35'>hvm</type></os></domain>")
    report = real.ctl.reconcile()
    kinds = {(f.kind, f.target) for f in report.findings}
    assert ("foreign-domain", foreign) in kinds
    assert not [f for f in report.findings if f.kind != "foreign-domain"]
    real.conn.lookupByName(name).destroy()  # behind the controller's back
    real.conn.lookupByName(name).undefine()
    report = real.ctl.reconcile(fix=True)
    lost = [f for f in report.findings if f.kind == "lost-vm"]
    assert len(lost) == 1 and lost[0].fixed, lost
    assert _state(real.conn, name) == "running"
    assert real.conn.lookupByName(foreign).isActive() == 0  # a foreign domain is left alone


def test_a_hibernated_victim_is_managed_saved_and_restored(real: Real) -> None:
    """Preemption's hibernate mode on real KVM: the victim's domain is managed-saved (inactive, with a save
    image) to free the host's memory for a higher-priority VM, and restored (not booted afresh) when that one
    goes."""
    import libvirt
    from sqlalchemy import text
    with real.ctl.tx() as conn:  # a host short of memory (160 MiB), declaring hibernation for every profile
        conn.execute(text("UPDATE host SET memory_mib = 160, victim_modes = :m"),
                     {"m": '{"*": ["requeue", "hibernate"]}'})
        conn.execute(text("UPDATE gpu SET lacked_types = NULL"))  # the emulated GPU side lacks no type id
    from vgpu_ctl.service.fit_masks import ensure_fit_masks
    ensure_fit_masks(real.ctl.engine, real.ctl.catalog, force=True)
    real.ctl.scheduling.create_class("batch", 10, preemptible=True, preemption_mode="hibernate")
    real.ctl.scheduling.create_class("prod", 1000)
    low = real.ctl.request_vm("acme", "low", [("A100D-10C", 1)], vcpus=1, memory_mib=64, pool="nogpu",
                              priority="batch")
    assert low.state == "running", low.error
    dom = real.conn.lookupByName(f"low-{low.id[:8]}")
    high = real.ctl.request_vm("acme", "high", [("A100D-10C", 1)], vcpus=1, memory_mib=128, pool="nogpu",
                               priority="prod")  # 64 + 128 MiB > 160: the host's memory must be freed
    assert high.state == "running", high.error
    assert real.ctl.get_vm(low.id).state == "hibernated"
    assert not dom.isActive() and dom.hasManagedSaveImage(0) == 1
    real.ctl.release_vm(high.id)  # room again: the queue resumes it from its save image
    assert real.ctl.get_vm(low.id).state == "running"
    state, reason = dom.state()
    assert (state, reason) == (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_RESTORED)
    assert dom.hasManagedSaveImage(0) == 0
