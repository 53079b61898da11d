"""Hosts as the service sees them: the driver of each host of a store, and a host's scheduling state."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpu_ctl.core.vm_state import VmState
from vgpu_ctl.errors import InvalidInput, NotFound
from vgpu_ctl.hosts.hostside import HostSide
from vgpu_ctl.hosts.nodedev import NodeDeviceApi
from vgpu_ctl.hosts.protocol import HostDriver
from vgpu_ctl.render import TemplateRenderer
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.urls import StoreUrl, database_name, masked, sqlite_file

HOST_STATES = ("active", "draining", "down")


def store_key(url: str | StoreUrl, state_path: Path) -> str:
    """What identifies a store across processes and copies of the state folder: a SQLite file by its path
    (relative to `state_path` when inside it), any other store by its URL without the password."""
    file = sqlite_file(url)
    if file is not None:
        db = Path(file).absolute()
        base = state_path.absolute()
        return f"sqlite:{db.relative_to(base) if db.is_relative_to(base) else db}"
    return masked(url)


def simulated_state_dir(url: str | StoreUrl, state_path: Path) -> Path:
    """Where the simulated hosts of the store at `url` keep their devices and domains, so that two stores never
    see each other's: `state_path/hosts` belongs to the first store that used it (named in its `.store` file);
    any other store gets `state_path/stores/<database>-<hash>/hosts`."""
    key = store_key(url, state_path)
    shared = state_path / "hosts"
    marker = shared / ".store"
    shared.mkdir(parents=True, exist_ok=True)
    if not marker.exists():
        tmp = shared / f".store.{os.getpid()}.{secrets.token_hex(4)}"
        tmp.write_text(key)
        try:
            os.link(tmp, marker)  # atomic: the first store to get here owns the folder
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    if marker.read_text() == key:
        return shared
    stem = Path(database_name(url) or "store").name
    name = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in stem)[:40]
    return state_path / "stores" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}" / "hosts"


class HostFactory:
    """Gives the HostDriver of a host row: simulated hosts keep state in `simulated_dir` (by default
    `state_path/hosts`; the Controller passes the folder of its store), libvirt hosts talk to their URI
    (vendor-VFIO hosts also get the sysfs backend)."""

    def __init__(self, state_path: Path, template_dirs: tuple[Path, ...] = (),
                 simulated_dir: Path | None = None, sides: Callable[[Any], HostSide] | None = None,
                 nodedevs: Callable[[Any], NodeDeviceApi] | None = None) -> None:
        self.state_path = state_path
        self._side_of = sides  # default: hosts.hostside.open_host_side (the host agent)
        self._nodedev_of = nodedevs  # default: libvirt's node-device API over the host's connection
        self._sides: dict[str, HostSide] = {}
        self.simulated_dir = simulated_dir or state_path / "hosts"
        self.renderer = TemplateRenderer(template_dirs)
        self._drivers: dict[str, HostDriver] = {}

    def get(self, host: Any) -> HostDriver:
        """The driver of a host row (with `name`, `uri`, `driver`, `vgpu_backing`)."""
        driver = self._drivers.get(host.name)
        if driver is None:
            driver = self._open(host)
            self._drivers[host.name] = driver
        return driver

    def _open(self, host: Any) -> HostDriver:
        if host.driver == "simulated":
            from vgpu_ctl.hosts.simulated import SimulatedHost
            return SimulatedHost(host.name, self.simulated_dir)
        from vgpu_ctl.hosts.libvirt_host import LibvirtHost
        side = self.side(host)
        return LibvirtHost(host.name, host.uri, renderer=self.renderer, mig=side.mig(),
                           vfio=side.vfio() if host.vgpu_backing == "vfio" else None,
                           nodedev=self._nodedev_of(host) if self._nodedev_of is not None else None)

    def side(self, host: Any) -> HostSide:
        """What only a libvirt host itself can do (NVML, vendor-VFIO sysfs), reached through its agent."""
        side = self._sides.get(host.name)
        if side is None:
            from vgpu_ctl.hosts.hostside import open_host_side
            side = self._side_of(host) if self._side_of is not None else open_host_side(host, self.state_path)
            self._sides[host.name] = side
        return side

    def close(self) -> None:
        """Close every open driver."""
        for d in self._drivers.values():
            d.close()
        self._drivers.clear()


def set_host_state(conn: Tx, name: str, state: str) -> dict[str, Any]:
    """Set a host's scheduling state (active: takes new VMs; draining: keeps its VMs, takes no new ones; down:
    takes none). The host, its state before and after, and the VMs still on it."""
    if state not in HOST_STATES:
        raise InvalidInput(f"host state {state!r} is not one of {', '.join(HOST_STATES)}",
                           reasons=[{"field": "state", "value": state}])
    row = STORE.hosts.host_state(conn, name)
    if row is None:
        known = ", ".join(STORE.hosts.host_names(conn))
        raise NotFound(f"host {name!r} not found (known: {known or 'none'})",
                       reasons=[{"field": "host", "value": name}])
    if row.state != state:
        STORE.hosts.set_host_state(conn, row.id, state)
    vms = sorted(f"{tenant}/{vm}" for tenant, vm in STORE.hosts.vms_on_host(conn, row.id, VmState.FAILED.value))
    return {"host": name, "from": row.state, "to": state, "vms": vms}
