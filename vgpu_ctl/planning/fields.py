"""Reading the fields of a planning file: errors that name the file, the field and the value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from vgpu_ctl.errors import InvalidInput, did_you_mean


def fail(path: Path, where: str, msg: str, value: object = None) -> InvalidInput:
    """The error for a bad field: 'demand file F: field W: MSG (value V)'."""
    shown = "" if value is None else f" (value {value!r})"
    return InvalidInput(f"demand file {path}: field {where}: {msg}{shown}",
                        reasons=[{"file": str(path), "field": where, "value": value, "error": msg}])


def mapping(path: Path, where: str, item: object, known: tuple[str, ...]) -> dict[str, object]:
    """`item` as a mapping whose keys are all in `known`; else InvalidInput naming the unknown key."""
    if not isinstance(item, dict):
        raise fail(path, where, f"expected a mapping (keys: {', '.join(known)})", item)
    for key in item:
        if key not in known:
            raise fail(path, f"{where}.{key}", f"unknown key{did_you_mean(str(key), known)}; known: "
                       f"{', '.join(known)}")
    return {str(k): v for k, v in item.items()}


def whole(path: Path, where: str, value: object, low: int, high: int) -> int:
    """`value` if it is a whole number (not a bool) in [low, high]; else InvalidInput naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise fail(path, where, f"must be a whole number from {low} to {high}", value)
    return value


def ratio(path: Path, where: str, value: object) -> float:
    """An overcommit ratio in (0, 1000]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1000:
        raise fail(path, where, "must be a number in (0, 1000]", value)
    return float(value)


_SIZE = re.compile(r"^\s*(\d+)\s*(MiB|GiB|TiB|M|G|T)?\s*$", re.IGNORECASE)
_MIB = {"m": 1, "mib": 1, "g": 1024, "gib": 1024, "t": 1 << 20, "tib": 1 << 20}


def size_mib(path: Path, where: str, value: object) -> int:
    """A memory size in MiB from a whole number (MiB) or text like '64GiB', '512MiB', '2TiB'."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 40:
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or int(m.group(1)) * _MIB[(m.group(2) or "MiB").lower()] > 1 << 40:
        raise fail(path, where, "not a size (e.g. 64GiB, 4096MiB, or a whole number of MiB up to 1 EiB)", value)
    return int(m.group(1)) * _MIB[(m.group(2) or "MiB").lower()]


def read_yaml(path: Path, what: str) -> Any:
    """The YAML document in `path`; InvalidInput naming the file (and line) when it can't be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"{what} file {path}: cannot read: {exc.strerror}",
                           reasons=[{"file": str(path), "error": exc.strerror}]) from None
    except UnicodeDecodeError:
        raise InvalidInput(f"{what} file {path}: not UTF-8 text", reasons=[{"file": str(path)}]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise InvalidInput(f"{what} file {path}{at}: not valid YAML: {getattr(exc, 'problem', exc)}",
                           reasons=[{"file": str(path), "error": "not valid YAML"}]) from None
    except RecursionError:
        raise InvalidInput(f"{what} file {path}: YAML nested too deeply", reasons=[{"file": str(path)}]) from None
