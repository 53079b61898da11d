"""A VM's overlay disk on its host, through libvirt's storage API (so it works over qemu+ssh:// too): made
before the domain is defined, on the base image its XML names, and deleted with the domain."""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any, NamedTuple
from xml.sax.saxutils import escape

import libvirt

from vgpu_ctl.errors import HostError
from vgpu_ctl.hosts.nodedev import libvirt_errors
from vgpu_ctl.render import check_text, parse_xml


class Overlay(NamedTuple):
    """A qcow2 overlay a domain's XML asks for: its path and its base image's."""

    path: str
    base: str


def overlays(xml: str) -> list[Overlay]:
    """The file disks of domain XML that sit on a backing file (the controller's overlays)."""
    out = []
    for disk in parse_xml(xml).iterfind("devices/disk[@type='file']"):
        src, base = disk.find("source"), disk.find("backingStore/source")
        if src is not None and base is not None and src.get("file") and base.get("file"):
            out.append(Overlay(str(src.get("file")), str(base.get("file"))))
    return out


def _volume(conn: Any, path: str) -> Any | None:
    try:
        return conn.storageVolLookupByPath(path)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() in (libvirt.VIR_ERR_NO_STORAGE_VOL, libvirt.VIR_ERR_NO_STORAGE_POOL):
            return None
        raise


def _pool_for(conn: Any, folder: str) -> Any:
    """The active dir pool whose target is `folder`; a transient one is started when there is none."""
    for pool in conn.listAllStoragePools(libvirt.VIR_CONNECT_LIST_STORAGE_POOLS_ACTIVE):
        target = parse_xml(pool.XMLDesc(0)).findtext("target/path")
        if target is not None and posixpath.normpath(target) == folder:
            pool.refresh(0)
            return pool
    check_text("image folder", folder)
    name = "vgpuctl-" + hashlib.sha1(folder.encode()).hexdigest()[:12]
    return conn.storagePoolCreateXML(f"<pool type='dir'><name>{name}</name><target><path>{escape(folder)}"
                                     "</path></target></pool>", 0)


def ensure_overlays(conn: Any, host: str, xml: str) -> list[str]:
    """Create each overlay of the domain XML that does not exist yet; the paths created."""
    made = []
    for ov in overlays(xml):
        with libvirt_errors(host, f"creating the overlay disk {ov.path}"):
            if _volume(conn, ov.path) is not None:
                continue
            _pool_for(conn, posixpath.dirname(posixpath.normpath(ov.base)))  # libvirt sees files via pools
            base = _volume(conn, ov.base)
            if base is None:
                raise HostError(f"host {host}: the base image {ov.base} does not exist there; put a qcow2 image "
                                "at that path on the host (or set the template's base image)",
                                reasons=[{"host": host, "base_image": ov.base}])
            pool = _pool_for(conn, posixpath.dirname(posixpath.normpath(ov.path)))
            capacity = int(base.info()[1])
            pool.createXML(
                f"<volume><name>{escape(posixpath.basename(ov.path))}</name><capacity>{capacity}</capacity>"
                "<target><format type='qcow2'/></target><backingStore>"
                f"<path>{escape(ov.base)}</path><format type='qcow2'/></backingStore></volume>", 0)
            made.append(ov.path)
    return made


def delete_overlays(conn: Any, host: str, xml: str) -> None:
    """Delete the domain's overlay disks (idempotent: absent is fine); base images stay."""
    for ov in overlays(xml):
        with libvirt_errors(host, f"deleting the overlay disk {ov.path}"):
            _pool_for(conn, posixpath.dirname(posixpath.normpath(ov.path)))
            vol = _volume(conn, ov.path)
            if vol is not None:
                vol.delete(0)
