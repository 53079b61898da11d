"""Errors of vgpu-ctl. Each carries a stable code, a message, and structured reasons where they help."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VgpuCtlError(Exception):
    """Base error: `code` is stable for automation, `message` is for people, `reasons` are structured details."""

    message: str
    reasons: list[dict[str, Any]] = field(default_factory=list)
    code: str = "error"
    exit_code: int = 1

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        """The error as `{"code", "message", "reasons"}` for JSON output."""
        return {"code": self.code, "message": self.message, "reasons": self.reasons}


@dataclass
class InvalidInput(VgpuCtlError):
    """Bad input: a field holds a value that is not allowed. Nothing was changed."""

    code: str = "invalid"
    exit_code: int = 2


@dataclass
class CatalogError(InvalidInput):
    """A catalog file or entry is broken or unknown."""

    code: str = "catalog"


@dataclass
class InventoryError(InvalidInput):
    """An inventory file is broken, or applying it would break the fleet."""

    code: str = "inventory"


@dataclass
class NotFound(VgpuCtlError):
    """An object named in the request does not exist (or is not visible to the caller)."""

    code: str = "not_found"
    exit_code: int = 4


@dataclass
class Refused(VgpuCtlError):
    """A valid request that cannot be served now: quota, capacity or a policy forbids it."""

    code: str = "refused"
    exit_code: int = 3


@dataclass
class QuotaExceeded(Refused):
    """The request would take a tenant over one of its limits."""

    code: str = "quota_exceeded"


@dataclass
class NoCapacity(Refused):
    """No host and GPU can hold the request; the reasons say why, per pool."""

    code: str = "no_capacity"


@dataclass
class Conflict(VgpuCtlError):
    """The object is in use or in a state that forbids the change."""

    code: str = "conflict"
    exit_code: int = 5


@dataclass
class PreconditionFailed(Conflict):
    """The object changed since the caller read it (its generation is not the one given, as HTTP If-Match)."""

    code: str = "precondition_failed"


@dataclass
class HostError(VgpuCtlError):
    """A host (libvirt, NVML, sysfs) failed to do what was asked."""

    code: str = "host_failure"
    exit_code: int = 6


@dataclass
class PermissionDenied(VgpuCtlError):
    """The caller's credential does not allow this."""

    code: str = "permission_denied"
    exit_code: int = 7


def _subclasses(cls: type[VgpuCtlError]) -> Iterator[type[VgpuCtlError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def error_from_dict(d: Mapping[str, Any]) -> VgpuCtlError:
    """The error whose `to_dict()` is `d` (a server's answer raised again in its client); a code this version
    does not know becomes a VgpuCtlError with that code."""
    code = str(d.get("code", "error"))
    message, reasons = str(d.get("message", code)), list(d.get("reasons") or [])
    for cls in _subclasses(VgpuCtlError):
        if cls.__dataclass_fields__["code"].default == code:
            return cls(message, reasons)
    return VgpuCtlError(message, reasons, code=code)


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """' (did you mean 'X'?)' for the choices closest to a misspelled `value` (case aside), else ''."""
    by_lower: dict[str, str] = {}
    for c in choices:
        by_lower.setdefault(c.lower(), c)
    if value.lower() in by_lower:  # only the case differs
        return f" (did you mean {by_lower[value.lower()]!r}?)"
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(by_lower[c]) for c in close)}?)"
