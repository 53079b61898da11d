"""What the CLI asks of a GPU host itself, outside the store: its preflight (`host check`), discovery of its
GPUs and types (`host discover`), and the agent's end of a request (`agent call`). The CLI reaches the host
drivers only through here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.hosts.discovery import Discovery, discover_host
from vgpu_ctl.hosts.preflight import Report, check_host
from vgpu_ctl.store.engine import state_dir


def host_by_uri(uri: str, name: str | None = None, backing: str = "mdev") -> Any:
    """A host given by libvirt URI as the host tools see one: name (default: from the URI), URI, vGPU backing."""
    return SimpleNamespace(name=name or urlsplit(uri).hostname or "localhost", uri=uri, vgpu_backing=backing)


def _side(host: Any) -> Any:
    from vgpu_ctl.hosts.hostside import open_host_side
    return open_host_side(host, state_dir())


def preflight(host: Any) -> Report:
    """The preflight of a host (a store row or `host_by_uri`): libvirt over its URI, the rest from its agent."""
    return check_host(host.name, host.uri, _side(host), host.vgpu_backing)


def discover(uri: str, catalog: Catalog, name: str | None = None) -> Discovery:
    """The GPUs and vGPU types of the live host at `uri` against the catalog, with what its agent reports."""
    return discover_host(uri, catalog, name, _side(host_by_uri(uri, name)))


def answer_agent_request(request: str, agent_state: Path, sysfs_root: Path) -> str:
    """The host agent's answer to one JSON request (what `vgpuctl agent call` prints), on this host."""
    from vgpu_ctl.hosts.agent import serve_once
    return serve_once(request, agent_state, sysfs_root)
