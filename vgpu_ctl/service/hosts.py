"""Opening the right driver for each host of the store, once per controller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vgpu_ctl.hosts.protocol import HostDriver
from vgpu_ctl.render import TemplateRenderer


class HostFactory:
    """Gives the HostDriver of a host row: simulated hosts keep state under `state_path/hosts`, libvirt
    hosts talk to their URI (vendor-VFIO hosts also get the sysfs backend)."""

    def __init__(self, state_path: Path, template_dirs: tuple[Path, ...] = ()) -> None:
        self.state_path = state_path
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
        vfio = None
        if host.vgpu_backing == "vfio":
            from vgpu_ctl.hosts.vfio import VfioSysfs
            vfio = VfioSysfs(state_file=self.state_path / f"vfio-{host.name}.json")
        return LibvirtHost(host.name, host.uri, vfio=vfio, renderer=self.renderer)

    def close(self) -> None:
        """Close every open driver."""
        for d in self._drivers.values():
            d.close()
        self._drivers.clear()
