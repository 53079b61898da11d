"""Running the API under uvicorn with a drain on SIGTERM.

uvicorn on its own stops listening at the first SIGTERM, waits `timeout_graceful_shutdown` for open
connections, and only then runs the lifespan shutdown, where the runtime would wait for its operations: by
then no caller could read how they ended, a new request got "connection refused" instead of an answer, and
the signal was raised again after the shutdown, so the process died of it (exit 143) even after a clean stop.
Here the first SIGTERM (or SIGINT) drains first, with the server still listening: new VM creates and deletes
get 503 `draining`, reads and `GET /v1/operations/ID` still answer, and the operations running here finish
(up to drain_timeout_s). Then uvicorn stops as usual and the process exits 0. A second signal stops waiting.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

import uvicorn

from .app import create_app
from .config import ServerConfig
from .runtime import Runtime

log = logging.getLogger("vgpu_ctl.server")
GRACE_S = 5  # after the drain: how long open connections (a `?wait=` on another replica's work) may take


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the runtime before it stops listening (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, runtimes: list[Runtime], drain_timeout_s: float) -> None:
        super().__init__(config)
        self._runtimes = runtimes
        self._drain_timeout_s = drain_timeout_s
        self._draining: threading.Thread | None = None
        self.drained: bool | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First SIGTERM or SIGINT: drain on a thread, then stop; a second one: exit at once (what still runs
        stays leased to this process and the next leader takes it over once the process is gone)."""
        if self._draining is not None:
            log.warning("second signal: exiting without waiting for the operations still running")
            os._exit(1)
        if not self._runtimes or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # not started yet: nothing to drain
            return
        log.info("signal %d: draining (new operations get 503 draining)", sig)
        self._draining = threading.Thread(target=self._drain, name="vgpu-drain", daemon=True)
        self._draining.start()

    def _drain(self) -> None:
        self.drained = self._runtimes[0].drain(self._drain_timeout_s)
        self.should_exit = True  # uvicorn's main loop sees it within 0.1 s; the signal is not raised again


def serve_until_drained(cfg: ServerConfig, host: str, port: int, log_level: str) -> int:
    """Serve the API on host:port until a signal, draining first; the exit status: 0 once every operation
    of this process ended, 1 when the drain timed out (those left are taken over by the next leader)."""
    runtimes: list[Runtime] = []

    def make_runtime() -> Runtime:
        rt = Runtime(cfg)
        runtimes.append(rt)
        return rt

    config = uvicorn.Config(create_app(make_runtime), host=host, port=port, log_level=log_level,
                            ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key,
                            timeout_graceful_shutdown=GRACE_S)
    server = DrainingServer(config, runtimes, cfg.drain_timeout_s)
    server.run()
    if not server.started:
        return 1  # could not listen (the address is in use, a bad certificate): uvicorn said why
    if runtimes and runtimes[0].drained is False:
        log.warning("exiting with operations still running: the next leader takes them over")
        os._exit(1)  # worker threads still run; the store stays as they left it, leased to this process
    return 0
