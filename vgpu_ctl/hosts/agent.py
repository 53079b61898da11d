"""The host agent: NVML and vendor-VFIO sysfs work run on the GPU host, asked for by the controller over a
transport. One JSON request in, one JSON answer out (`vgpuctl agent call` on the host reads stdin).

Transports: in process for a local libvirt URI (qemu:///system); over SSH for qemu+ssh:// hosts, with the
URI's own user, port and keyfile, so the agent needs no secret beyond the one libvirt already uses.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from vgpu_ctl import errors
from vgpu_ctl.errors import HostError, VgpuCtlError
from vgpu_ctl.hosts.hostside import HostFacts, HostSide, LocalHostSide
from vgpu_ctl.hosts.nodedev import DeviceBackend
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice
from vgpu_ctl.hosts.utilization import HostSample

PROTOCOL = 1
AGENT_COMMAND_ENV = "VGPU_CTL_AGENT_COMMAND"  # the agent's command line on remote hosts
DEFAULT_AGENT_COMMAND = "vgpuctl agent call"
DEFAULT_STATE_DIR = Path("/var/lib/vgpu-ctl")
BACKENDS = ("mig", "vfio")


# --- the host's end ------------------------------------------------------------------------------------------

def _spec(data: dict[str, Any]) -> DeviceSpec:
    return DeviceSpec(**{**data, "backing": DeviceBacking(data["backing"])})


def handle(side: HostSide, request: str) -> str:
    """Run one JSON request against `side`; the JSON answer (errors included, never raised)."""
    try:
        req = json.loads(request)
        if not isinstance(req, dict) or req.get("protocol") != PROTOCOL:
            raise errors.InvalidInput(f"agent request is not protocol {PROTOCOL}: {request[:200]!r}")
        result = _dispatch(side, req)
        return json.dumps({"protocol": PROTOCOL, "result": result})
    except VgpuCtlError as exc:
        return json.dumps({"protocol": PROTOCOL, "error": {"type": type(exc).__name__, **exc.to_dict()}})
    except Exception as exc:  # the answer must still come back: the controller turns it into HostError
        return json.dumps({"protocol": PROTOCOL, "error": {"type": "HostError", "code": "host",
                                                           "message": f"agent: {type(exc).__name__}: {exc}",
                                                           "reasons": []}})


def _dispatch(side: HostSide, req: dict[str, Any]) -> Any:
    op = req.get("op")
    if op == "facts":
        return side.facts([str(g) for g in req.get("gpus", [])]).to_dict()
    if op == "probe":
        return side.probe()
    if op == "utilization":  # read-only: what the GPUs do now (hosts.utilization)
        from vgpu_ctl.hosts.utilization import sample_side
        return sample_side(side).to_dict()
    backend_name = req.get("backend")
    if backend_name not in BACKENDS:
        raise errors.InvalidInput(f"agent: unknown backend {backend_name!r} (known: {', '.join(BACKENDS)})")
    backend = side.mig() if backend_name == "mig" else side.vfio()
    if op == "create":
        return asdict(backend.create(_spec(req["spec"])))
    if op == "remove":
        backend.remove(_spec(req["spec"]))
        return None
    if op == "list_devices":
        return [asdict(d) for d in backend.list_devices()]
    raise errors.InvalidInput(f"agent: unknown operation {op!r}")


def serve_once(stdin: str, state_dir: Path = DEFAULT_STATE_DIR, sysfs_root: Path = Path("/sys")) -> str:
    """What `vgpuctl agent call` prints for the request read from stdin, on this host."""
    return handle(LocalHostSide(state_dir, sysfs_root), stdin)


# --- the controller's end ------------------------------------------------------------------------------------

class Transport(Protocol):
    """Carries one JSON request to a host's agent and brings its JSON answer back."""

    def call(self, request: str) -> str:
        """The agent's answer to `request`; HostError when the agent cannot be reached."""
        ...


class InProcessTransport:
    """The agent in this process (a local libvirt host): the same JSON requests, no process boundary."""

    def __init__(self, side: HostSide) -> None:
        self.side = side

    def call(self, request: str) -> str:
        """Answer the request with the local side."""
        return handle(self.side, request)


class SshTransport:
    """The agent on a remote host, run over SSH with the user, port and keyfile of its qemu+ssh:// URI."""

    def __init__(self, host: str, uri: str, command: str | None = None, ssh: str = "ssh",
                 timeout_s: float = 120) -> None:
        self.host = host
        self.uri = uri
        self.ssh = ssh
        self.command = command or os.environ.get(AGENT_COMMAND_ENV, DEFAULT_AGENT_COMMAND)
        self.timeout_s = timeout_s

    @property
    def argv(self) -> list[str]:
        """The ssh command line (HostError for a URI that is not reached over SSH)."""
        return ssh_argv(self.uri, self.command, self.ssh)

    def call(self, request: str) -> str:
        """Run the agent once over SSH with the request on its stdin."""
        argv = self.argv
        try:
            done = subprocess.run(argv, input=request, capture_output=True, text=True,
                                  timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HostError(f"host {self.host}: cannot run the host agent ({shlex.join(argv)}): {exc}",
                            reasons=[{"host": self.host, "command": argv}]) from None
        if done.returncode != 0 or not done.stdout.strip():
            err = done.stderr.strip()[-500:]
            raise HostError(f"host {self.host}: the host agent failed (exit {done.returncode}): {err or 'no output'}; "
                            f"is vgpu-ctl installed there, with `{self.command}` on the login's PATH?",
                            reasons=[{"host": self.host, "command": argv, "stderr": err}])
        return done.stdout


def ssh_argv(uri: str, command: str, ssh: str = "ssh") -> list[str]:
    """The ssh command line that runs `command` on the host of a qemu+ssh:// URI, as libvirt would log in."""
    parts = urlsplit(uri)
    if parts.scheme not in ("qemu+ssh", "qemu+libssh2", "qemu+libssh") or not parts.hostname:
        raise HostError(f"{uri}: the host agent is reached over SSH only (qemu+ssh://user@host/system); "
                        "run vgpu-ctl on the host itself for other transports",
                        reasons=[{"uri": uri}])
    query = parse_qs(parts.query)
    argv = [ssh, "-o", "BatchMode=yes"]
    if parts.port:
        argv += ["-p", str(parts.port)]
    if "keyfile" in query:
        argv += ["-i", query["keyfile"][0]]
    if query.get("no_verify", ["0"])[0] == "1":
        argv += ["-o", "StrictHostKeyChecking=no"]
    target = f"{parts.username}@{parts.hostname}" if parts.username else parts.hostname
    return [*argv, target, "--", *shlex.split(command)]


def _raise(error: dict[str, Any], host: str) -> None:
    cls = getattr(errors, str(error.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, VgpuCtlError)):
        cls = HostError
    raise cls(f"{error.get('message', 'agent error')}", reasons=list(error.get("reasons") or [{"host": host}]))


class AgentClient:
    """Requests to one host's agent."""

    def __init__(self, host: str, transport: Transport) -> None:
        self.host = host
        self.transport = transport

    def request(self, op: str, **fields: Any) -> Any:
        """Send one request; its result, or the agent's error raised as the same error class."""
        answer = self.transport.call(json.dumps({"protocol": PROTOCOL, "op": op, **fields}))
        try:
            data = json.loads(answer)
        except ValueError:
            raise HostError(f"host {self.host}: the host agent answered something that is not JSON: "
                            f"{answer[:200]!r}") from None
        if not isinstance(data, dict) or data.get("protocol") != PROTOCOL:
            raise HostError(f"host {self.host}: the host agent speaks another protocol than {PROTOCOL}: "
                            f"{answer[:200]!r}; install the same vgpu-ctl version there")
        if "error" in data:
            _raise(data["error"], self.host)
        return data.get("result")


class AgentBackend:
    """A DeviceBackend ("mig" or "vfio") whose work the host agent does."""

    def __init__(self, client: AgentClient, backend: str) -> None:
        self.client = client
        self.backend = backend

    def create(self, spec: DeviceSpec) -> DeviceHandle:
        """Make the device exist on the host (idempotent)."""
        out = self.client.request("create", backend=self.backend, spec=asdict(spec))
        return DeviceHandle(**{**out, "backing": DeviceBacking(out["backing"])})

    def remove(self, spec: DeviceSpec) -> None:
        """Remove the device on the host (idempotent)."""
        self.client.request("remove", backend=self.backend, spec=asdict(spec))

    def list_devices(self) -> list[HostDevice]:
        """Devices of this backing on the host."""
        return [HostDevice(**{**d, "backing": DeviceBacking(d["backing"])})
                for d in self.client.request("list_devices", backend=self.backend)]


class AgentHostSide:
    """HostSide whose every call goes through the host agent's protocol."""

    def __init__(self, host: str, transport: Transport) -> None:
        self.client = AgentClient(host, transport)

    def mig(self) -> DeviceBackend:
        """MIG instances through the agent."""
        return AgentBackend(self.client, "mig")

    def vfio(self) -> DeviceBackend:
        """Vendor-VFIO VFs through the agent."""
        return AgentBackend(self.client, "vfio")

    def facts(self, gpus: Sequence[str]) -> HostFacts:
        """The host's facts, read by the agent."""
        return HostFacts.from_dict(self.client.request("facts", gpus=list(gpus)))

    def probe(self) -> dict[str, Any]:
        """The host's preflight facts, read by the agent."""
        out: dict[str, Any] = self.client.request("probe")
        return out

    def utilization(self) -> HostSample:
        """What the host's GPUs and vGPUs do now, sampled by the agent (read-only)."""
        return HostSample.from_dict(self.client.request("utilization"))


def remote_host_side(host: str, uri: str) -> HostSide:
    """The HostSide of a remote libvirt host: its agent over SSH."""
    return AgentHostSide(host, SshTransport(host, uri))
