"""vGPUs on SR-IOV virtual functions through NVIDIA's vendor-specific VFIO sysfs (vGPU 17+, kernel >= 6.8).

A vGPU is a VF of the GPU whose `nvidia/current_vgpu_type` holds a type id (0 = none). Which VF holds which
controller device is kept in a small JSON state file, so that create and remove are idempotent.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice

DEFAULT_STATE_FILE = Path("/var/lib/vgpu-ctl/vfio-devices.json")
SRIOV_MANAGE = "/usr/lib/nvidia/sriov-manage"
_PCI = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_PARAM = re.compile(r"[A-Za-z0-9_.-]+")


def _pci(value: str) -> str:
    addr = value.strip().lower()
    if not _PCI.fullmatch(addr):
        raise InvalidInput(f"not a PCI address: {value!r} (expected e.g. 0000:41:00.0)")
    return addr


def _type_name(name: str) -> str:
    return name.strip().removeprefix("NVIDIA ").strip()


def _same_type(want: str, types: Mapping[str, int]) -> int | None:
    """The id of type `want` among a VF's types: by name, else by the name after the board prefix (the types of
    one GPU share its board's prefix: the catalog's H200-1-18C is H200X-1-18C on an SXM board)."""
    if want in types:
        return types[want]
    rest = want.partition("-")[2]
    found = [i for name, i in types.items() if rest and name.partition("-")[2] == rest]
    return found[0] if len(found) == 1 else None


class VfioSysfs:
    """Vendor-specific VFIO vGPUs of the GPUs under a sysfs root; device→VF mapping kept in `state_file`."""

    def __init__(self, root: Path = Path("/sys"), state_file: Path = DEFAULT_STATE_FILE) -> None:
        self.root = root
        self.state_file = state_file
        self._devices = root / "bus" / "pci" / "devices"

    # --- queries ---------------------------------------------------------------------------------------
    def list_vfs(self, gpu_pci: str) -> list[str]:
        """The VF addresses of a GPU, in virtfn index order (empty when SR-IOV VFs are not enabled)."""
        gpu = _pci(gpu_pci)
        pf = self._devices / gpu
        if not pf.is_dir():
            raise HostError(f"GPU {gpu} not found: no {pf}")
        links = [p for p in pf.iterdir() if re.fullmatch(r"virtfn\d+", p.name)]
        links.sort(key=lambda p: int(p.name.removeprefix("virtfn")))
        return [os.path.basename(os.readlink(p)) for p in links]

    def creatable_types(self, vf: str) -> dict[str, int]:
        """vGPU types the VF can take now: type name (without "NVIDIA ") -> type id."""
        out: dict[str, int] = {}
        for line in self._read(_pci(vf), "creatable_vgpu_types").splitlines():
            left, sep, right = line.partition(":")
            if sep and left.strip().isdigit():
                out[_type_name(right)] = int(left)
        return out

    def current_type(self, vf: str) -> int:
        """The vGPU type id set on the VF; 0 when it holds no vGPU."""
        text = self._read(_pci(vf), "current_vgpu_type").strip()
        try:
            return int(text or "0")
        except ValueError:
            raise HostError(f"VF {vf}: unexpected content {text!r} in "
                            f"{self._devices / vf / 'nvidia' / 'current_vgpu_type'}") from None

    def known_types(self) -> dict[str, str]:
        """Type ids seen on this host's VFs so far (id -> name), also those no longer creatable now."""
        return dict(self._load()["types"])

    def list_devices(self) -> list[HostDevice]:
        """Every VF on the host that holds a vGPU, with the controller's uuid and type name when known."""
        if not self._devices.is_dir():
            return []
        state = self._load()
        by_vf = {d["vf"]: (uuid, d) for uuid, d in state["devices"].items()}
        out: list[HostDevice] = []
        for path in sorted(self._devices.iterdir()):
            if not (path / "nvidia" / "current_vgpu_type").is_file() or not _PCI.fullmatch(path.name):
                continue
            type_id = self.current_type(path.name)
            if type_id == 0:
                continue
            uuid, entry = by_vf.get(path.name, (None, None))
            known = entry is not None and entry["type_id"] == type_id
            physfn = path / "physfn"
            out.append(HostDevice(
                backing=DeviceBacking.VFIO_VF,
                gpu_pci=os.path.basename(os.readlink(physfn)) if physfn.is_symlink() else "",
                uuid=uuid if known else None, pci_address=path.name,
                profile=state["types"].get(str(type_id)),
            ))
        return out

    # --- changes ---------------------------------------------------------------------------------------
    def create(self, spec: DeviceSpec) -> DeviceHandle:
        """Put a vGPU of `spec.profile` on a free VF of `spec.gpu_pci` (idempotent: the VF already holding
        this device's uuid is returned)."""
        gpu, want = _pci(spec.gpu_pci), _type_name(spec.profile)
        with self._locked():
            state = self._load()
            entry = state["devices"].get(spec.uuid)
            old_vf = entry["vf"] if entry is not None else None
            vfs = self.list_vfs(gpu)
            if entry is not None and old_vf in vfs and self.current_type(entry["vf"]) == entry["type_id"]:
                return DeviceHandle(backing=DeviceBacking.VFIO_VF, uuid=spec.uuid, pci_address=old_vf)
            if not vfs:
                raise HostError(f"no SR-IOV virtual functions are enabled on GPU {gpu} (no virtfn* links in "
                                f"{self._devices / gpu}); enable them with `{SRIOV_MANAGE} -e {gpu}` "
                                "(needed again after each reboot or driver reload)")
            free = [vf for vf in vfs if self.current_type(vf) == 0]
            if not free:
                raise HostError(f"no free VF on GPU {gpu}: all {len(vfs)} VFs hold a vGPU",
                                reasons=[{"gpu": gpu, "vfs": len(vfs)}])
            # a device lost to a reboot gets its old VF back when it is free
            free.sort(key=lambda vf: vf != old_vf)
            seen: dict[str, int] = {}
            for vf in free:
                types = self.creatable_types(vf)
                seen.update(types)
                names = {i: name for name, i in types.items()}
                # the id discovery stored wins: the host may name the type with another board prefix
                type_id = spec.vfio_type_id if spec.vfio_type_id is not None else _same_type(want, types)
                if type_id is not None and type_id in names:
                    self._write(gpu, vf, "current_vgpu_type", f"{type_id}\n")
                    state["types"].update({str(i): name for name, i in seen.items()})
                    # a device that lost this VF (a reboot) no longer has it: it must never get it back now
                    state["devices"] = {u: d for u, d in state["devices"].items() if d["vf"] != vf}
                    state["devices"][spec.uuid] = {"vf": vf, "gpu": gpu, "type_id": type_id,
                                                   "profile": names[type_id]}
                    self._save(state)
                    return DeviceHandle(backing=DeviceBacking.VFIO_VF, uuid=spec.uuid, pci_address=vf)
            listed = ", ".join(f"{name} ({i})" for name, i in sorted(seen.items()))
            listed = listed or "none (the GPU is full)"
            wanted, hint = want, ""
            if spec.vfio_type_id is not None:
                wanted = f"{want} (id {spec.vfio_type_id}, as discovered)"
                if _same_type(want, seen) not in (None, spec.vfio_type_id):
                    hint = ("; the host driver now gives the type another id: discover the host again "
                            "(vgpuctl inventory apply)")
            raise HostError(f"vGPU type {wanted} is not creatable on GPU {gpu} now; creatable: {listed}{hint}",
                            reasons=[{"gpu": gpu, "profile": want, "creatable": sorted(seen)}])

    def remove(self, spec: DeviceSpec) -> None:
        """Remove the device's vGPU from its VF (idempotent: absent is fine)."""
        with self._locked():
            state = self._load()
            entry = state["devices"].get(spec.uuid)
            if entry is None:
                return
            vf = entry["vf"]
            if (self._devices / vf / "nvidia").is_dir() and self.current_type(vf) == entry["type_id"]:
                self._write(entry["gpu"], vf, "current_vgpu_type", "0\n")
            del state["devices"][spec.uuid]
            self._save(state)

    def write_vgpu_params(self, vf: str, params: Mapping[str, str | int]) -> None:
        """Set a VF's vGPU plugin parameters (e.g. {"frame_rate_limiter": 0}); an empty mapping clears."""
        vf = _pci(vf)
        for key, value in params.items():
            if not _PARAM.fullmatch(key) or not _PARAM.fullmatch(str(value)):
                raise InvalidInput(f"vGPU parameter {key}={value!r}: keys and values may only hold letters, "
                                   "digits and _ . -")
        text = ", ".join(f"{k}={v}" for k, v in params.items()) or " "
        physfn = self._devices / vf / "physfn"
        gpu = os.path.basename(os.readlink(physfn)) if physfn.is_symlink() else "?"
        self._write(gpu, vf, "vgpu_params", f"{text}\n")

    # --- internals -------------------------------------------------------------------------------------
    def _read(self, vf: str, name: str) -> str:
        path = self._devices / vf / "nvidia" / name
        try:
            return path.read_text()
        except FileNotFoundError:
            raise HostError(f"VF {vf}: {path} does not exist; the VF is missing, not bound to the nvidia "
                            "driver, or the host driver does not use vendor-specific VFIO (vGPU 17+, "
                            "kernel >= 6.8)") from None
        except OSError as exc:
            raise HostError(f"VF {vf}: cannot read {path}: {exc.strerror or exc}") from None

    def _write(self, gpu: str, vf: str, name: str, text: str) -> None:
        path = self._devices / vf / "nvidia" / name
        try:
            path.write_text(text)
        except PermissionError:
            raise HostError(f"GPU {gpu}, VF {vf}: permission denied writing {path}; vgpu-ctl must run as "
                            "root on the host") from None
        except OSError as exc:
            raise HostError(f"GPU {gpu}, VF {vf}: writing {text.strip()!r} to {path} failed: "
                            f"{exc.strerror or exc}") from None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        path = self.state_file.with_name(self.state_file.name + ".lock")
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            lock = path.open("w")
        except OSError as exc:
            raise HostError(f"cannot open the VFIO state lock {path}: {exc.strerror or exc}") from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {"devices": {}, "types": {}}
        except (OSError, ValueError) as exc:
            raise HostError(f"cannot read the VFIO state file {self.state_file}: {exc}") from None
        return {"devices": dict(data.get("devices", {})), "types": dict(data.get("types", {}))}

    def _save(self, state: dict[str, Any]) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=self.state_file.name + ".")
            with os.fdopen(fd, "w") as fh:
                json.dump(state, fh, indent=2, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.state_file)
        except OSError as exc:
            raise HostError(f"cannot write the VFIO state file {self.state_file}: "
                            f"{exc.strerror or exc}") from None
