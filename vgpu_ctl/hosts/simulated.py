"""A simulated host: devices and domains in a JSON file and its journal; domain XML still goes through libvirt's
parser.

For tests only, `VGPU_CTL_SIM_HOLD=STEP=PATH[,STEP=PATH...]` holds a step (create_device, define_domain,
start_domain, stop_domain, managed_save, remove_device, undefine_domain) before it acts, for as long as the file
PATH exists, and creates `PATH.waiting` while it waits: a test makes a server's operation stop at a known point,
kills or signals the server there, then lets the step go by removing PATH. Unset, nothing waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import libvirt

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.nodedev import host_error, open_libvirt
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, DomainInfo, HostDevice
from vgpu_ctl.render import PciAddress, parse_xml, read_domain

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_FIRST_VF_FUNCTION = 4  # NVIDIA GPUs put their first SR-IOV VF at function 4 (0000:41:00.4)

State = dict[str, dict[str, dict[str, Any]]]
HOLD_ENV = "VGPU_CTL_SIM_HOLD"
_TOKEN_BYTES = 16  # the lock file's write token (see SimulatedHost._state)
_FOLD_BYTES = 256 * 1024  # a journal this long is folded into a new state file by the next durable change


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


# The parser is one connection shared by the process's threads: one parse at a time, so that no thread's
# undefine removes a domain of the same name another thread is parsing.
_PARSING = threading.Lock()


@lru_cache(maxsize=1)
def _parser_connection() -> Any:
    """A private, empty libvirt test driver for this process, used only to parse domain XML (under `_PARSING`).
    Not test:///default: every connection of a process to that one shares a driver and its domains, so a
    parse there would see, and could undefine, the domains of a test-driver host in the same process."""
    fd, node = tempfile.mkstemp(prefix="vgpu-ctl-parser-", suffix=".xml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("<node>\n</node>\n")
        return open_libvirt(f"test://{node}", "simulated")  # the driver reads the file once, as it opens
    finally:
        os.unlink(node)


def _parsed(xml: str) -> tuple[str, str]:
    """The domain's name and UUID as libvirt's parser reads its XML (libvirtError when it refuses it)."""
    with _PARSING:
        dom = _parser_connection().defineXML(xml)
        try:
            return str(dom.name()), str(dom.UUIDString())
        finally:
            dom.undefine()


class _Step:
    """One step's hold on a host's state (under its lock): the state, and how the step writes what it changed."""

    def __init__(self, host: SimulatedHost, lock: int, read: _Cached) -> None:
        self.host, self.lock, self.read, self.state = host, lock, read, read.state

    def log(self, *entries: dict[str, Any]) -> None:
        """Record undurable changes (devices, the running flag), already made to `state`, in the journal."""
        self.host._append(self.read, entries)

    def save(self, name: str) -> None:
        """Record the durable change of domain `name` (defined, redefined, saved, restored or undefined), already
        made to `state`: a journal line flushed to disk, or, once the journal is long, the whole state as the new
        state file."""
        if self.read.offset >= _FOLD_BYTES:
            self.host._save(self.lock, self.read)
        else:
            self.host._append(self.read, [{"domain": name, "is": self.state["domains"].get(name)}], flush=True)


class SimulatedHost:
    """HostDriver whose GPUs exist only in the inventory; state is kept in `state_dir/<name>.json`.

    Every change is a line appended to the journal `<name>.journal`, which a reader applies over the state file
    `<name>.json` of the same generation. Only what a real host keeps across a reboot is durable: a defined
    domain and its managed save image. A change to those is flushed to disk with its line (one fsync per VM
    provisioned: its domain's definition), and, once the journal passes `_FOLD_BYTES`, is instead written with
    the whole state to a new state file, flushed, renamed over the old one, the journal emptied after. Devices
    and whether a domain runs are not durable (a reboot loses them on a real host too, and reconcile restores
    them): their lines are not flushed. Since a flush writes out every line before it, a line lost or torn by a
    crash loses only undurable changes, or a durable one whose step never returned (and is done again). Each
    state file write (and a new host's first writing step) leaves a new random token in the lock file (before the
    rename); an instance parses the state file again only when the token changed, and otherwise reads only the
    journal lines appended since."""

    simulated = True

    def __init__(self, name: str, state_dir: Path) -> None:
        if not _HOST_NAME.match(name):
            raise InvalidInput(f"host name {name!r} is not a safe identifier",
                               reasons=[{"field": "name", "value": repr(name)}])
        self.name = name
        self.state_dir = state_dir
        self.path = state_dir / f"{name}.json"
        self.journal = state_dir / f"{name}.journal"
        self._lock_path = os.fspath(state_dir / f"{name}.lock")
        self._cached: _Cached | None = None
        self._mutex = threading.Lock()  # this instance's threads, one at a time (the file lock is per process)
        state_dir.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def _state(self, write: bool) -> Iterator[_Step]:
        """The host's state under its file lock (exclusive when `write`); a step writes through the `_Step`."""
        with self._mutex:
            lock = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
                step = _Step(self, lock, self._read(lock, write))
                if write:  # kept again once written: a step that fails half-way leaves its changes in no cache
                    self._cached = None
                yield step
            finally:
                os.close(lock)

    def _read(self, lock: int, write: bool) -> _Cached:
        """The state as the files hold it now (under the caller's lock, exclusive when `write`): the state
        file's, with the journal lines of its generation applied; only the new journal lines when this instance
        holds the rest."""
        token = os.pread(lock, _TOKEN_BYTES, 0)
        c = self._cached
        if c is None or c.token != token or len(token) != _TOKEN_BYTES:
            doc: dict[str, Any] = {}
            if self.path.exists():
                doc = json.loads(self.path.read_text())
            state: State = {"devices": doc.get("devices", {}), "domains": doc.get("domains", {})}
            if len(token) != _TOKEN_BYTES and write:  # no writer left a token yet: without one, every step parses
                token = secrets.token_bytes(_TOKEN_BYTES)
                os.pwrite(lock, token, 0)
            c = self._cached = _Cached(token, int(doc.get("generation", 0)), 0, state)
        try:
            with open(self.journal, "rb") as f:
                f.seek(c.offset)
                tail = f.read()
        except FileNotFoundError:
            tail = b""
        end = tail.rfind(b"\n") + 1  # a line without its newline is being written, or was torn by a crash
        for entry in _entries(tail[:end].splitlines()):
            if entry.get("g") == c.generation:
                _apply(c.state, entry)
        c.offset += end
        return c

    def _append(self, c: _Cached, entries: Sequence[dict[str, Any]], flush: bool = False) -> None:
        """Append `entries` (of the state file's generation `c` read) to the journal, after a newline if a torn
        line ends it; flushed to disk with `flush`."""
        data = b"".join(json.dumps({"g": c.generation, **e}, sort_keys=True).encode() + b"\n" for e in entries)
        with open(self.journal, "ab") as f:
            if f.tell() > c.offset:  # a torn line (a writer died mid-append): end it before ours
                data = b"\n" + data
            f.write(data)
            if flush:
                f.flush()
                os.fsync(f.fileno())
            c.offset = f.tell()
        self._cached = c

    def _save(self, lock: int, c: _Cached) -> None:
        """Write the whole state as the next generation's state file, flushed to disk, renamed over the old one;
        the journal (folded in) is emptied after, and its lines, of the old generation, are ignored meanwhile."""
        generation = c.generation + 1
        fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=f".{self.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"generation": generation, **c.state}, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
        token = secrets.token_bytes(_TOKEN_BYTES)
        os.pwrite(lock, token, 0)
        os.replace(tmp, self.path)
        with open(self.journal, "wb"):
            pass
        self._cached = _Cached(token, generation, 0, c.state)

    def create_device(self, spec: DeviceSpec) -> DeviceHandle:
        """Record the device (idempotent: an existing one with this uuid is returned)."""
        _hold("create_device")
        with self._state(write=True) as step:
            devices = step.state["devices"]
            if spec.uuid not in devices:
                devices[spec.uuid] = self._new_device(spec, devices.values())
                step.log({"device": spec.uuid, "is": devices[spec.uuid]})
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
        with self._state(write=True) as step:
            if step.state["devices"].pop(spec.uuid, None) is not None:
                step.log({"device": spec.uuid, "is": None})

    def list_devices(self) -> list[HostDevice]:
        """Every device recorded on this host."""
        with self._state(write=False) as step:
            return [HostDevice(DeviceBacking(d["backing"]), gpu_pci=d["gpu_pci"], uuid=d["uuid"],
                               pci_address=d["pci_address"], gpu_instance_id=d["gpu_instance_id"],
                               profile=d["profile"])
                    for d in step.state["devices"].values()]

    def define_domain(self, xml: str) -> str:
        """Check the XML with libvirt's parser, then record (or redefine) the domain; returns its UUID."""
        _hold("define_domain")
        try:
            name, uuid = _parsed(xml)
        except libvirt.libvirtError as exc:
            raise host_error(self.name, "defining domain", exc) from None
        with self._state(write=True) as step:
            domains = step.state["domains"]
            old = domains.get(name)
            # a redefinition without <uuid> keeps the domain's (libvirt made one up for it)
            if old is not None and parse_xml(xml).findtext("uuid") is None:
                uuid = old["uuid"]
            elif old is not None and old["uuid"] != uuid:
                raise HostError(f"host {self.name}: domain {name} already exists with uuid {old['uuid']}",
                                reasons=[{"host": self.name, "domain": name}])
            clash = next((n for n, d in domains.items() if d["uuid"] == uuid and n != name), None)
            if clash is not None:
                raise HostError(f"host {self.name}: domain {clash} is already defined with uuid {uuid}",
                                reasons=[{"host": self.name, "domain": name}])
            domains[name] = {"uuid": uuid, "xml": xml, "active": bool(old and old["active"])}
            step.save(name)
        return uuid

    def start_domain(self, name: str) -> None:
        """Mark the domain running (idempotent); like libvirt, refuses when one of its mdevs is missing."""
        _hold("start_domain")
        with self._state(write=True) as step:
            dom = step.state["domains"].get(name)
            if dom is None:
                raise HostError(f"host {self.name}: domain {name} is not defined",
                                reasons=[{"host": self.name, "domain": name}])
            missing = [u for u in _mdev_uuids(dom["xml"]) if u not in step.state["devices"]]
            if missing:
                raise HostError(f"host {self.name}: starting domain {name} failed: mediated device "
                                f"{missing[0]} not found", reasons=[{"host": self.name, "domain": name}])
            dom["active"] = True
            if dom.pop("saved", False):  # like libvirt: a start restores the managed save image, then drops it
                dom["restores"] = int(dom.get("restores", 0)) + 1
                step.save(name)  # the image is gone: a durable change
            else:
                step.log({"domain": name, "active": True})

    def stop_domain(self, name: str, force: bool = False) -> None:
        """Mark the domain stopped (idempotent: stopped or absent is fine)."""
        _hold("stop_domain")
        with self._state(write=True) as step:
            dom = step.state["domains"].get(name)
            if dom is not None and dom["active"]:
                dom["active"] = False
                step.log({"domain": name, "active": False})

    def managed_save(self, name: str) -> None:
        """Mark the running domain saved and stopped (idempotent: already saved is fine); its next start restores
        it (counted in the state file's `restores`)."""
        _hold("managed_save")
        with self._state(write=True) as step:
            dom = step.state["domains"].get(name)
            if dom is None or not (dom["active"] or dom.get("saved")):
                raise HostError(f"host {self.name}: domain {name} is not running and has no managed save image, "
                                "so there is nothing to save", reasons=[{"host": self.name, "domain": name}])
            dom["active"], dom["saved"] = False, True
            step.save(name)

    def undefine_domain(self, name: str) -> None:
        """Forget the domain (idempotent: absent is fine)."""
        _hold("undefine_domain")
        with self._state(write=True) as step:
            if step.state["domains"].pop(name, None) is not None:
                step.save(name)

    def list_domains(self) -> list[DomainInfo]:
        """Every domain recorded on this host, with the controller's metadata."""
        with self._state(write=False) as step:
            return [DomainInfo(n, d["uuid"], d["active"], *read_domain(d["xml"]), saved=bool(d.get("saved")))
                    for n, d in sorted(step.state["domains"].items())]

    def close(self) -> None:
        """Nothing to release: every call opens and closes the state file."""


@dataclass(slots=True)
class _Cached:
    """What an instance last read or wrote: the lock file's token then, the state file's generation, how far
    into the journal it has applied, and the state."""

    token: bytes
    generation: int
    offset: int
    state: State


def _entries(lines: list[bytes]) -> list[dict[str, Any]]:
    """The journal lines' entries, all parsed at once (a fresh reader may have tens of thousands), or one by one
    when one of them does not parse: a line torn by a crash, an undurable change lost as a reboot would lose it."""
    with contextlib.suppress(ValueError):
        entries: list[dict[str, Any]] = json.loads(b"[" + b",".join(lines) + b"]")
        # one entry a line: a torn line that the join made into valid JSON with the next ones made fewer
        if len(entries) == len(lines):
            return entries
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _apply(state: State, entry: dict[str, Any]) -> None:
    """Apply one journal line: a device recorded or forgotten, a domain (re)defined or forgotten, or a domain's
    running flag."""
    key, kind = ("device", "devices") if "device" in entry else ("domain", "domains")
    if "is" in entry:
        if entry["is"] is None:
            state[kind].pop(entry[key], None)
        else:
            state[kind][entry[key]] = entry["is"]
    elif entry.get("domain") in state["domains"]:  # the line's generation has the domain
        state["domains"][entry["domain"]]["active"] = bool(entry["active"])


def _vf_address(pf: PciAddress, index: int) -> PciAddress:
    """Address of the PF's `index`-th virtual function, as NVIDIA GPUs lay them out."""
    offset = pf.function + _FIRST_VF_FUNCTION + index
    return PciAddress(pf.domain, pf.bus, pf.slot + offset // 8, offset % 8)


def _mdev_uuids(xml: str) -> list[str]:
    """UUIDs of the mdev hostdevs of a domain XML."""
    addresses = parse_xml(xml).iterfind("devices/hostdev[@type='mdev']/source/address")
    return [a.get("uuid", "") for a in addresses]
