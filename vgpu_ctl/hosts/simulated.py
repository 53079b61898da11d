"""A simulated host: devices and domains in a JSON file; domain XML still goes through libvirt's parser.

For tests only, `VGPU_CTL_SIM_HOLD=STEP=PATH[,STEP=PATH...]` holds a step (create_device, define_domain,
start_domain, stop_domain, managed_save, remove_device, undefine_domain) before it acts, for as long as the file
PATH exists, and creates `PATH.waiting` while it waits: a test makes a server's operation stop at a known point,
kills or signals the server there, then lets the step go by removing PATH. Unset, nothing waits.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import libvirt

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.nodedev import host_error, open_libvirt
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, DomainInfo, HostDevice
from vgpu_ctl.render import PciAddress, parse_xml, read_claim, read_hostdevs, read_metadata

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_FIRST_VF_FUNCTION = 4  # NVIDIA GPUs put their first SR-IOV VF at function 4 (0000:41:00.4)

State = dict[str, dict[str, dict[str, Any]]]
HOLD_ENV = "VGPU_CTL_SIM_HOLD"
_TOKEN_BYTES = 16  # the lock file's write token (see SimulatedHost._state)


def _hold(step: str) -> None:
    """Wait before `step` while the gate file named for it in VGPU_CTL_SIM_HOLD exists (tests only)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    gates = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    gate = gates.get(step)
    if gate is None:
        return
    waiting = Path(f"{gate}.waiting")
    while os.path.exists(gate):
        waiting.touch()
        time.sleep(0.02)


@lru_cache(maxsize=1)
def _parser_connection() -> Any:
    """One empty in-process libvirt test driver per process, used only to parse domain XML."""
    conn = open_libvirt("test:///default", "simulated")
    for dom in conn.listAllDomains(0):
        if dom.isActive():
            dom.destroy()
        dom.undefine()
    return conn


class SimulatedHost:
    """HostDriver whose GPUs exist only in the inventory; state is kept in `state_dir/<name>.json`."""

    simulated = True

    def __init__(self, name: str, state_dir: Path) -> None:
        if not _HOST_NAME.match(name):
            raise InvalidInput(f"host name {name!r} is not a safe identifier",
                               reasons=[{"field": "name", "value": repr(name)}])
        self.name = name
        self.state_dir = state_dir
        self.path = state_dir / f"{name}.json"
        self._cached: tuple[bytes, State] | None = None
        state_dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _state(self, write: bool, durable: bool = False) -> Iterator[State]:
        """The host's state under a file lock; written back atomically (a rename) when `write` is set, and
        flushed to disk first when `durable` is. Only what a real host keeps across a reboot is durable: a
        defined domain and its managed save image. Devices and whether a domain runs are not (a reboot loses
        them on a real host too, and reconcile restores them), so provisioning a VM costs one fsync, its
        domain's definition. Each write also leaves a new random token in the lock file (before the rename,
        so a crash between the two only makes others read the file again); the file is parsed again only
        when the token is not the one this instance last read or wrote."""
        lock = os.open(self.state_dir / f"{self.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
            token = os.pread(lock, _TOKEN_BYTES, 0)
            state = self._read(token)
            if not write:
                yield state
                return
            self._cached = None  # a step that fails half-way leaves its changes only in this dict
            yield state
            fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=f".{self.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(state, sort_keys=True))
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            token = secrets.token_bytes(_TOKEN_BYTES)
            os.pwrite(lock, token, 0)
            os.replace(tmp, self.path)
            self._cached = (token, state)
        finally:
            os.close(lock)

    def _read(self, token: bytes) -> State:
        """The state as the file holds it now (under the caller's lock, the lock file holding `token`)."""
        if self._cached is not None and self._cached[0] == token and len(token) == _TOKEN_BYTES:
            return self._cached[1]
        state: State = {"devices": {}, "domains": {}}
        if self.path.exists():
            state = json.loads(self.path.read_text())
        self._cached = (token, state)
        return state

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        """Record the device (idempotent: an existing one with this uuid is returned)."""
        _hold("create_device")
        with self._state(write=True) as state:
            devices = state["devices"]
            if spec.uuid not in devices:
                devices[spec.uuid] = self._new_device(spec, devices.values())
            d = devices[spec.uuid]
        return DeviceHandle(DeviceBacking(d["backing"]), uuid=d["uuid"], pci_address=d["pci_address"],
                            gpu_instance_id=d["gpu_instance_id"])

    @staticmethod
    def _new_device(spec: DeviceSpec, existing: Iterable[dict[str, Any]]) -> dict[str, Any]:
        same_gpu = [d for d in existing if d["gpu_pci"] == spec.gpu_pci and d["backing"] == spec.backing]
        pci_address: str | None = None
        gi: int | None = None
        if spec.backing is DeviceBacking.PCI:
            pci_address = spec.gpu_pci
        elif spec.backing is DeviceBacking.VFIO_VF:
            pf = PciAddress.parse(spec.gpu_pci)
            used = {d["pci_address"] for d in same_gpu}
            pci_address = next(a for a in map(str, (_vf_address(pf, n) for n in range(256))) if a not in used)
        elif spec.backing is DeviceBacking.MIG:
            gi = next(i for i in range(1, 1000) if i not in {d["gpu_instance_id"] for d in same_gpu})
        return {"backing": str(spec.backing), "gpu_pci": spec.gpu_pci, "profile": spec.profile,
                "uuid": spec.uuid,
                "pci_address": pci_address, "gpu_instance_id": gi, "start": spec.start, "size": spec.size}

    def remove_device(self, spec: DeviceSpec) -> None:
        """Forget the device (idempotent: absent is fine)."""
        _hold("remove_device")
        with self._state(write=True) as state:
            state["devices"].pop(spec.uuid, None)

    def list_devices(self) -> list[HostDevice]:
        """Every device recorded on this host."""
        with self._state(write=False) as state:
            return [HostDevice(DeviceBacking(d["backing"]), gpu_pci=d["gpu_pci"], uuid=d["uuid"],
                               pci_address=d["pci_address"], gpu_instance_id=d["gpu_instance_id"],
                               profile=d["profile"])
                    for d in state["devices"].values()]

    def define_domain(self, xml: str) -> str:
        """Check the XML with libvirt's parser, then record (or redefine) the domain; returns its UUID."""
        _hold("define_domain")
        conn = _parser_connection()
        try:
            dom = conn.defineXML(xml)
            name, uuid = str(dom.name()), str(dom.UUIDString())
            dom.undefine()
        except libvirt.libvirtError as exc:
            raise host_error(self.name, "defining domain", exc) from None
        given_uuid = parse_xml(xml).findtext("uuid")
        with self._state(write=True, durable=True) as state:
            domains = state["domains"]
            old = domains.get(name)
            if old is not None and given_uuid is None:
                uuid = old["uuid"]
            elif old is not None and old["uuid"] != uuid:
                raise HostError(f"host {self.name}: domain {name} already exists with uuid {old['uuid']}",
                                reasons=[{"host": self.name, "domain": name}])
            clash = next((n for n, d in domains.items() if d["uuid"] == uuid and n != name), None)
            if clash is not None:
                raise HostError(f"host {self.name}: domain {clash} is already defined with uuid {uuid}",
                                reasons=[{"host": self.name, "domain": name}])
            domains[name] = {"uuid": uuid, "xml": xml, "active": bool(old and old["active"])}
        return uuid

    def start_domain(self, name: str) -> None:
        """Mark the domain running (idempotent); like libvirt, refuses when one of its mdevs is missing."""
        _hold("start_domain")
        with self._state(write=True) as state:
            dom = state["domains"].get(name)
            if dom is None:
                raise HostError(f"host {self.name}: domain {name} is not defined",
                                reasons=[{"host": self.name, "domain": name}])
            missing = [u for u in _mdev_uuids(dom["xml"]) if u not in state["devices"]]
            if missing:
                raise HostError(f"host {self.name}: starting domain {name} failed: mediated device "
                                f"{missing[0]} not found", reasons=[{"host": self.name, "domain": name}])
            dom["active"] = True
            if dom.pop("saved", False):  # like libvirt: a start restores the managed save image, then drops it
                dom["restores"] = int(dom.get("restores", 0)) + 1

    def stop_domain(self, name: str, force: bool = False) -> None:
        """Mark the domain stopped (idempotent: stopped or absent is fine)."""
        _hold("stop_domain")
        with self._state(write=True) as state:
            dom = state["domains"].get(name)
            if dom is not None:
                dom["active"] = False

    def managed_save(self, name: str) -> None:
        """Mark the running domain saved and stopped (idempotent: already saved is fine); its next start restores
        it (counted in the state file's `restores`)."""
        _hold("managed_save")
        with self._state(write=True, durable=True) as state:
            dom = state["domains"].get(name)
            if dom is None or not (dom["active"] or dom.get("saved")):
                raise HostError(f"host {self.name}: domain {name} is not running and has no managed save image, "
                                "so there is nothing to save", reasons=[{"host": self.name, "domain": name}])
            dom["active"], dom["saved"] = False, True

    def undefine_domain(self, name: str) -> None:
        """Forget the domain (idempotent: absent is fine)."""
        _hold("undefine_domain")
        with self._state(write=True, durable=True) as state:
            state["domains"].pop(name, None)

    def list_domains(self) -> list[DomainInfo]:
        """Every domain recorded on this host, with the controller's metadata."""
        with self._state(write=False) as state:
            return [DomainInfo(n, d["uuid"], d["active"], read_metadata(d["xml"]), read_hostdevs(d["xml"]),
                               read_claim(d["xml"]), bool(d.get("saved")))
                    for n, d in sorted(state["domains"].items())]

    def close(self) -> None:
        """Nothing to release: every call opens and closes the state file."""


def _vf_address(pf: PciAddress, index: int) -> PciAddress:
    """Address of the PF's `index`-th virtual function, as NVIDIA GPUs lay them out."""
    offset = pf.function + _FIRST_VF_FUNCTION + index
    return PciAddress(pf.domain, pf.bus, pf.slot + offset // 8, offset % 8)


def _mdev_uuids(xml: str) -> list[str]:
    """UUIDs of the mdev hostdevs of a domain XML."""
    addresses = parse_xml(xml).iterfind("devices/hostdev[@type='mdev']/source/address")
    return [a.get("uuid", "") for a in addresses]
