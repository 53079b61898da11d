"""The server's settings: from the command line, or a TOML file (contrib/config.toml shows every key)."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vgpu_ctl.errors import InvalidInput
from vgpu_ctl.inventory import check_int

METRICS_ACCESS = ("token", "loopback", "open")
_TEXT = ("listen", "store", "state_dir", "tls_cert", "tls_key", "metrics_access")
_OPTIONAL = ("store", "state_dir", "tls_cert", "tls_key")
_SECONDS = ("operation_lease_s", "reconcile_interval_s", "recovery_interval_s", "utilization_interval_s",
            "idempotency_ttl_s", "drain_timeout_s")


@dataclass
class ServerConfig:
    """Where to listen, which store, how many workers and how often the loops run."""

    listen: str = "127.0.0.1:8730"
    store: str | None = None  # a store URL; None: the default SQLite store
    state_dir: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    workers: int = 4  # threads running operations (VM create and delete)
    operation_lease_s: float = 30.0  # a dead worker's operations are taken over this long after it stopped
    reconcile_interval_s: float = 300.0  # 0: no reconcile loop
    recovery_interval_s: float = 2.0  # how often the leader looks for operations left behind
    utilization_interval_s: float = 60.0  # how often the leader samples NVML for spread-load (0: never)
    idempotency_ttl_s: float = 86400.0
    metrics_access: str = "token"  # token: an admin or reader token; loopback: also without one from 127.0.0.1
    drain_timeout_s: float = 60.0  # on SIGTERM, how long in-flight operations may take to finish
    allocator: bool = True  # plan claims against the fleet in memory, written by group commit (service/allocator)

    def host_port(self) -> tuple[str, int]:
        """The address and port of `listen`; InvalidInput naming the field otherwise."""
        if not isinstance(self.listen, str):
            raise InvalidInput(f"listen {self.listen!r} must be a string HOST:PORT (e.g. \"127.0.0.1:8730\")",
                               reasons=[{"field": "listen", "value": self.listen}])
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidInput(f"listen {self.listen!r} must be HOST:PORT (e.g. 127.0.0.1:8730)",
                               reasons=[{"field": "listen", "value": self.listen}])
        check_int("listen port", int(port), 1, 65535)
        return host.strip("[]"), int(port)

    def check(self) -> ServerConfig:
        """InvalidInput naming the first bad setting; else itself."""
        for name in _TEXT:
            value = getattr(self, name)
            if not isinstance(value, str) and not (value is None and name in _OPTIONAL):
                raise InvalidInput(f"{name} {value!r} must be a string", reasons=[{"field": name, "value": value}])
            if isinstance(value, str) and name in _OPTIONAL and not value:
                raise InvalidInput(f"{name} must not be empty (leave it out for the default)",
                                   reasons=[{"field": name, "value": value}])
        self.host_port()
        check_int("workers", self.workers, 1, 256)
        if not isinstance(self.allocator, bool):
            raise InvalidInput(f"allocator {self.allocator!r} must be true or false",
                               reasons=[{"field": "allocator", "value": self.allocator}])
        for name in _SECONDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) \
                    or not 0 <= value <= 10**7:
                raise InvalidInput(f"{name} {value!r} must be a number of seconds from 0 to 10000000",
                                   reasons=[{"field": name, "value": value}])
        if self.recovery_interval_s < 0.1:
            raise InvalidInput(f"recovery_interval_s {self.recovery_interval_s!r} must be at least 0.1",
                               reasons=[{"field": "recovery_interval_s", "value": self.recovery_interval_s}])
        if self.operation_lease_s < 1:
            raise InvalidInput(f"operation_lease_s {self.operation_lease_s!r} must be at least 1",
                               reasons=[{"field": "operation_lease_s", "value": self.operation_lease_s}])
        if self.metrics_access not in METRICS_ACCESS:
            raise InvalidInput(f"metrics_access {self.metrics_access!r} is not one of {', '.join(METRICS_ACCESS)}",
                               reasons=[{"field": "metrics_access", "value": self.metrics_access}])
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidInput("tls_cert and tls_key go together: give both or neither",
                               reasons=[{"field": "tls_cert" if self.tls_cert is None else "tls_key"}])
        return self


def load_config(path: Path, overrides: dict[str, Any]) -> ServerConfig:
    """The settings of a TOML file (its [server] table, or the top level), then `overrides` (those not None)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidInput(f"config {str(path)!r} cannot be read: {exc.strerror}",
                           reasons=[{"field": "config", "value": str(path)}]) from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInput(f"config {str(path)!r} is not valid TOML: {exc}",
                           reasons=[{"field": "config", "value": str(path)}]) from None
    table = data.get("server", data)
    if not isinstance(table, dict):
        raise InvalidInput(f"config {str(path)!r}: server must be a table ([server])",
                           reasons=[{"field": "server", "value": table}])
    known = {f.name for f in fields(ServerConfig)}
    outside = [k for k in data if k != "server"] if "server" in data else []
    for key in [*outside, *table]:
        if key in outside or key not in known:
            where = " outside [server]" if key in outside else ""
            raise InvalidInput(f"config {str(path)!r}: unknown setting {key!r}{where} "
                               f"(known: {', '.join(sorted(known))})",
                               reasons=[{"field": key, "value": data[key] if key in outside else table[key]}])
    cfg = ServerConfig(**table)
    for key, value in overrides.items():
        if value is not None:
            setattr(cfg, key, value)
    return cfg.check()
