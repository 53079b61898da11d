"""Opening the right driver for each host of the store, once per controller."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpu_ctl.hosts.hostside import HostSide
from vgpu_ctl.hosts.nodedev import NodeDeviceApi
from vgpu_ctl.hosts.protocol import HostDriver
from vgpu_ctl.render import TemplateRenderer


class HostFactory:
    """Gives the HostDriver of a host row: simulated hosts keep state under `state_path/hosts`, libvirt
    hosts talk to their URI (vendor-VFIO hosts also get the sysfs backend)."""

    def __init__(self, state_path: Path, template_dirs: tuple[Path, ...] = (),
                 sides: Callable[[Any], HostSide] | None = None,
                 nodedevs: Callable[[Any], NodeDeviceApi] | None = None) -> None:
        self.state_path = state_path
        self._side_of = sides  # default: hosts.hostside.open_host_side (the host agent)
        self._nodedev_of = nodedevs  # default: libvirt's node-device API over the host's connection
        self._sides: dict[str, HostSide] = {}
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
            return SimulatedHost(host.name, self.state_path / "hosts")
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
