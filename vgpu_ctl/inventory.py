"""Inventory files: the hosts, GPUs and pools an admin declares, parsed and checked against the catalog."""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from vgpu_ctl.catalog import Catalog
from vgpu_ctl.core.geometry import Mode, geometry_for, parse_mig_layout
from vgpu_ctl.core.placement import POLICIES
from vgpu_ctl.errors import InvalidInput, InventoryError
from vgpu_ctl.user_cache import read_json, write_json

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")  # whole strings only: fullmatch
PCI_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# What a controller needs of libvirt URIs: the KVM driver, locally or over an authenticated, encrypted
# transport; libvirt's test driver; simulated hosts. Never `ext` (it runs a command), never `tcp` (no
# encryption, no authentication), and of the query keys only those that choose a key, a known-hosts file, a
# certificate folder, an SSH auth method or the daemon mode; not `command`, `netcat`, `socket`, `proxy`,
# `no_verify`. Each part of the URI is checked against its own grammar, so `;`, `|`, `$(...)`, quotes,
# spaces and newlines pass nowhere.
URI_TRANSPORTS = ("qemu", "qemu+unix", "qemu+ssh", "qemu+libssh", "qemu+libssh2", "qemu+tls", "test", "simulated")
URI_QUERY_KEYS = ("keyfile", "known_hosts", "pkipath", "sshauth", "no_tty", "mode")
_URI = re.compile(r"(?P<scheme>[a-z0-9+]+)://(?:(?P<user>[a-z_][a-z0-9_.-]{0,31})@)?"
                  r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])?(?::(?P<port>[0-9]{1,5}))?"
                  r"(?P<path>/[A-Za-z0-9_./-]*)(?:\?(?P<query>[^#]*))?")
_URI_VALUE = re.compile(r"[A-Za-z0-9_./,:@+-]{1,255}")
_URI_VALUES = {"sshauth": re.compile(r"(agent|privkey|password|keyboard-interactive)(,(agent|privkey|password|"
                                     r"keyboard-interactive))*"),
               "no_tty": re.compile(r"[01]"), "mode": re.compile(r"auto|legacy|direct")}


def check_uri(field: str, value: str) -> str:
    """A libvirt URI a controller may open (URI_TRANSPORTS, URI_QUERY_KEYS); InvalidInput naming the field,
    the value and what is wrong if not."""
    def bad(why: str) -> InvalidInput:
        return InvalidInput(f"{field} {value!r} is not an allowed host URI: {why} (allowed transports: "
                            f"{', '.join(URI_TRANSPORTS)}; query keys: {', '.join(URI_QUERY_KEYS)})",
                            reasons=[{"field": field, "value": value, "error": why}])

    m = _URI.fullmatch(value)
    if m is None:
        raise bad("it does not read as transport://[user@]host[:port]/path[?key=value&...] with plain names")
    scheme, host, path = m["scheme"], m["host"], m["path"]
    if scheme not in URI_TRANSPORTS:
        raise bad(f"transport {scheme!r} is not allowed")
    if ".." in path.split("/"):
        raise bad("'..' in the path")
    if scheme.startswith("qemu") and path not in ("/system", "/session"):
        raise bad("a qemu URI ends in /system or /session")
    if scheme in ("qemu", "qemu+unix", "test", "simulated") and (host or m["user"] or m["port"]):
        raise bad(f"a {scheme} URI names no remote host")
    if scheme in ("qemu+ssh", "qemu+libssh", "qemu+libssh2", "qemu+tls") and not host:
        raise bad(f"a {scheme} URI names its host")
    if m["port"] is not None and not 0 < int(m["port"]) < 65536:
        raise bad(f"port {m['port']} is not 1-65535")
    if scheme in ("test", "simulated") and m["query"] is not None:
        raise bad(f"a {scheme} URI takes no query")
    seen: set[str] = set()
    for part in (m["query"] or "").split("&") if m["query"] is not None else ():
        key, eq, val = part.partition("=")
        if key not in URI_QUERY_KEYS:
            raise bad(f"query key {key!r} is not allowed")
        if key in seen:
            raise bad(f"query key {key!r} given twice")
        seen.add(key)
        if not eq or not (_URI_VALUES.get(key) or _URI_VALUE).fullmatch(val) or ".." in val.split("/"):
            raise bad(f"the value of {key!r} is not a plain name or path")
    return value


def check_name(field: str, value: str) -> str:
    """A safe identifier (lower-case letters, digits, `_ . -`, at most 63); InvalidInput naming the field if not."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidInput(f"{field} {value!r} is not a safe name: use lower-case letters, digits, '_', '.', '-' "
                           "(at most 63, starting with a letter or digit)",
                           reasons=[{"field": field, "value": value}])
    return value


# Bounds of the numbers a request, a quota or an inventory may carry: all fit the store's 64-bit columns.
MAX_VM_VCPUS = 2**20
MAX_HOST_VCPUS = 2**20
MAX_MEMORY_MIB = 2**40  # 1 EiB
MAX_DISK_GIB = 2**30
MAX_LIMIT = 2**62  # a quota limit; BIGINT holds twice that, so usage + a request never overflows
MAX_EVENTS = 1_000_000


def check_int(field: str, value: object, low: int = 0, high: int = MAX_LIMIT) -> int:
    """`value` if it is a whole number (not a bool) in [low, high]; else InvalidInput naming the field and
    value."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown = value if not isinstance(value, int) or isinstance(value, bool) or abs(value) < 10**20 \
            else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise InvalidInput(f"{field} must be a whole number from {low} to {high}, got {shown!r}",
                           reasons=[{"field": field, "value": shown}])
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _numbers(*fields: str) -> Any:
    """A validator, run first, that refuses YAML's true/false in these number fields (a bool is an int to
    Python). Named per model, not on every field: a 100k-GPU file has 600,000 fields and none a number."""
    def no_bools(cls: type[BaseModel], v: object) -> object:
        if isinstance(v, bool):
            raise ValueError(f"expected a number, got {str(v).lower()}")
        return v
    return field_validator(*fields, mode="before")(no_bools)


class _Named(_Strict):
    """A declared object with a safe `name`."""

    name: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a safe name (lower-case letters, digits, '_', '.', '-')")
        return v


class TaskDecl(_Strict):
    """A typical request of a pool's demand: `gpus` vGPUs of `profile` (each on its own GPU), vCPUs, memory."""

    profile: str
    gpus: int = Field(default=1, ge=1, le=16)
    vcpus: int = Field(default=0, ge=0, le=MAX_VM_VCPUS)
    memory_mib: int = Field(default=0, ge=0, le=MAX_MEMORY_MIB)
    weight: float = Field(gt=0, le=1e9)

    _no_bool_numbers = _numbers("gpus", "vcpus", "memory_mib", "weight")


class PoolDecl(_Named):
    """A pool in an inventory file. `demand` says what its requests typically look like, for `pack`: a list of
    typical requests (profile, GPU count, vCPUs, memory, weight), or the short form profile -> weight (one vGPU,
    no vCPUs or memory)."""

    policy: str = "pack"
    template: str | None = None
    description: str = ""
    demand: list[TaskDecl] | None = None

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"{v!r} is not a placement policy (known: {', '.join(sorted(POLICIES))})")
        return v

    @field_validator("demand", mode="before")
    @classmethod
    def _short_form(cls, v: object) -> object:
        if isinstance(v, dict):
            return [{"profile": k, "weight": w} for k, w in v.items()]
        return v

    @field_validator("demand")
    @classmethod
    def _not_empty(cls, v: list[TaskDecl] | None) -> list[TaskDecl] | None:
        if v is not None and not v:
            raise ValueError("an empty demand: leave it out instead")
        return v

    @field_validator("description")
    @classmethod
    def _printable(cls, v: str) -> str:
        if any(not c.isprintable() and c not in "\n\t" for c in v):  # NUL (PostgreSQL refuses it) among them
            raise ValueError("a description holds text, lines and tabs, but no other control character")
        return v

    @field_validator("template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if (v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+\.xml\.j2", v)) or (v and ".." in v):
            raise ValueError(f"{v!r} is not a template name (a file name ending .xml.j2, no folders)")
        return v


class GpuDecl(_Strict):
    """A GPU of a host in an inventory file."""

    pci: str
    model: str
    mode: Mode = Mode.VGPU_EQUAL
    pool: str | None = None
    vgpu_type: str | None = None
    mig_layout: list[str] | None = None

    @field_validator("pci")
    @classmethod
    def _pci(cls, v: str) -> str:
        v = v.lower()
        if len(v) == 7:
            v = "0000:" + v
        if not PCI_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not a PCI address like 0000:41:00.0")
        return v


class HostDecl(_Named):
    """A host in an inventory file."""

    uri: str
    driver: Literal["libvirt", "simulated"] = "libvirt"
    vgpu_backing: Literal["mdev", "vfio"] = "mdev"
    labels: dict[str, str] = {}
    vcpus: int = Field(ge=0, le=MAX_HOST_VCPUS)
    memory_mib: int = Field(ge=0, le=MAX_MEMORY_MIB)
    cpu_overcommit: float = Field(default=1.0, gt=0, le=1000)
    memory_overcommit: float = Field(default=1.0, gt=0, le=1000)
    state: Literal["active", "draining", "down"] = "active"
    # Per profile name ('*': every profile) the modes a preempted VM here may be freed by; unset: requeue, cancel.
    victim_modes: dict[str, list[Literal["requeue", "hibernate", "cancel"]]] | None = None
    gpus: list[GpuDecl] = []

    _no_bool_numbers = _numbers("vcpus", "memory_mib", "cpu_overcommit", "memory_overcommit")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        try:
            return check_uri("uri", v)
        except InvalidInput as exc:
            raise ValueError(exc.message.removeprefix(f"uri {v!r} is not an allowed host URI: ")
                             + " (e.g. qemu+ssh://root@host/system, test:///default, simulated:///name)") from None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.fullmatch(r"[A-Za-z0-9_./-]{1,63}", k) or not re.fullmatch(r"[A-Za-z0-9_./:-]{0,63}", val):
                raise ValueError(f"label {k}={val!r} must use letters, digits, '_', '.', '/', '-' (':' in values)")
        return v

    @field_validator("victim_modes")
    @classmethod
    def _victim_modes(cls, v: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
        for profile, modes in (v or {}).items():
            if profile != "*" and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}", profile):
                raise ValueError(f"victim_modes key {profile!r} must be a profile name or '*'")
            if len(set(modes)) != len(modes):
                raise ValueError(f"victim_modes of {profile!r} names a mode twice: {', '.join(modes)}")
        return v

    @model_validator(mode="after")
    def _unique_pci(self) -> HostDecl:
        seen: set[str] = set()
        for i, g in enumerate(self.gpus):
            if g.pci in seen:
                raise PydanticCustomError("duplicate_pci", "duplicate PCI address {pci} on host {host}",
                                          {"pci": g.pci, "host": self.name, "gpu_index": i})
            seen.add(g.pci)
        return self


class InventoryDecl(_Strict):
    """A whole inventory file."""

    pools: list[PoolDecl] = []
    hosts: list[HostDecl] = []


def _line_for(root: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == key), None)
            if nxt is None:
                key_node = next((k for k, _ in node.value if getattr(k, "value", None) == key), None)
                return key_node.start_mark.line + 1 if key_node is not None else line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


def _field_name(loc: Sequence[int | str]) -> str:
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: building a large inventory (a million small objects, none of them in
    a cycle) otherwise sets off a full collection again and again, which tripled the time of a 100k-GPU file.
    What the block made (and still holds) then goes to the oldest generation at once (`freeze`, `unfreeze`):
    left in the youngest, the first collection after the block walked every one of those objects (0.15-0.2 s
    for a 100k-GPU file); in the oldest they wait for the next full collection, as long-lived objects do."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


_BASE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, if built with it
_STR, _SEQ, _MAP = "tag:yaml.org,2002:str", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map"
_VALUE = "tag:yaml.org,2002:value"


class _Unusual(Exception):
    """The document holds something the plain builder leaves to PyYAML's own constructor."""


class _InventoryLoader(_BASE_LOADER):  # type: ignore[valid-type,misc]
    """PyYAML's safe loader (libyaml's parser when there is one) whose constructor builds plain mappings,
    sequences and strings directly from the nodes, without the generator per node of PyYAML's constructor
    (two thirds of the time of a 100k-GPU file). Other scalars (numbers, booleans, null, timestamps) are
    constructed by PyYAML; a document with anything else (merge keys, a node used twice through an alias,
    a non-scalar key, another tag) is constructed by PyYAML from the start, so the result is always PyYAML's."""

    # The first characters PyYAML's implicit types (numbers, booleans, null, timestamps, ...) can start with.
    # Exact only without path resolvers or resolvers for any first character, as PyYAML's safe loader has.
    _MAYBE_TYPED = frozenset(k for k in _BASE_LOADER.yaml_implicit_resolvers if k)
    _EXACT = not _BASE_LOADER.yaml_path_resolvers and None not in _BASE_LOADER.yaml_implicit_resolvers

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> Any:
        """The tag PyYAML's resolver gives a node, without its lookups and regular expressions for a scalar that
        is quoted or starts with a character no implicit type starts with (most of an inventory's keys and
        values: a string), nor for a sequence or mapping. A fifth of a 100k-GPU file's parse went to them."""
        if not self._EXACT:
            return super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode:
            if implicit[0] and (not value or value[0] in self._MAYBE_TYPED):
                return super().resolve(kind, value, implicit)
            return _STR
        return _SEQ if kind is yaml.SequenceNode else _MAP

    def construct_document(self, node: yaml.Node) -> Any:
        """The document's data, built from its nodes."""
        try:
            return self._plain(node, set())
        except _Unusual:
            self.constructed_objects: dict[Any, Any] = {}
            self.recursive_objects: dict[Any, Any] = {}
            return super().construct_document(node)

    def _plain(self, node: yaml.Node, seen: set[int]) -> Any:
        cls, tag = type(node), node.tag
        if cls is yaml.ScalarNode:
            return node.value if tag == _STR else self.construct_object(node, deep=True)
        if id(node) in seen:  # an alias: PyYAML shares one object (or builds a recursive one)
            raise _Unusual
        seen.add(id(node))
        scalar, plain = yaml.ScalarNode, self._plain
        if cls is yaml.SequenceNode and tag == _SEQ:  # strings inline: most nodes are
            return [n.value if type(n) is scalar and n.tag == _STR else plain(n, seen) for n in node.value]
        if cls is yaml.MappingNode and tag == _MAP:
            out = {}
            for k, v in node.value:
                if type(k) is not scalar or k.tag == "tag:yaml.org,2002:merge":
                    raise _Unusual
                # A `=` key is the string "=" (PyYAML's flatten_mapping retags it): a string of its own.
                out[k.value if k.tag in (_STR, _VALUE) else plain(k, seen)] = \
                    v.value if type(v) is scalar and v.tag == _STR else plain(v, seen)
            return out
        raise _Unusual


_LOADER: type[yaml.SafeLoader] = _InventoryLoader


class _Lines:
    """Line numbers of an inventory file's entries, for error messages only: the file is composed into YAML
    nodes (a second parse) the first time a line is asked for, never when the file is fine."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._root: yaml.Node | None = None
        self._composed = False

    def of(self, loc: Sequence[int | str]) -> int | None:
        """The line (1-based) of the entry at `loc` (keys and list indexes from the top), or of its nearest
        parent that exists."""
        if not self._composed:
            self._root = yaml.compose(self._text, Loader=_BASE_LOADER)
            self._composed = True
        return _line_for(self._root, loc)


def _too_deep(path: Path) -> InventoryError:
    return InventoryError(f"{path}: YAML nested too deeply to be an inventory",
                          reasons=[{"file": str(path), "error": "nested too deeply"}])


def parse_inventory(path: Path, catalog: Catalog) -> InventoryDecl:
    """Read and check an inventory file; InventoryError naming file, line and field on the first problem.
    The file is parsed once (with libyaml when PyYAML has it); line numbers are worked out only for an error."""
    with paused_gc():
        return _parse_inventory(path, catalog)


def _parse_inventory(path: Path, catalog: Catalog) -> InventoryDecl:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InventoryError(f"inventory file {path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = raw[:exc.start].count(b"\n") + 1
        raise InventoryError(f"{path}:{bad_line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset "
                             f"{exc.start})", reasons=[{"file": str(path), "line": bad_line, "error": "not UTF-8"}]
                             ) from None
    digest = _parsed_digest(path, raw)
    data = read_json(PARSED_CACHE, digest)
    if data is None:
        data = _load_yaml(path, text)
        encoded = _as_json(data)
        if encoded is not None:
            write_json(PARSED_CACHE, digest, data, encoded)
    if not isinstance(data, dict):
        raise InventoryError(f"{path}:1: expected a mapping with 'hosts' and 'pools'")
    return _validate(path, catalog, text, data)


PARSED_CACHE = "inventory-parsed.json"  # the last file parsed: a re-apply of the same file reads no YAML


def _parsed_digest(path: Path, raw: bytes) -> str:
    """The digest of what `_load_yaml` makes of the file: its bytes, PyYAML's version and loader, and this code."""
    loaders = f"{_BASE_LOADER.__module__}.{_BASE_LOADER.__qualname__} {_LOADER.__module__}.{_LOADER.__qualname__}"
    h = hashlib.sha256(f"{path.resolve()}\n{yaml.__version__}\n{loaders}\n{_parser_digest()}\n".encode())
    h.update(raw)
    return h.hexdigest()


@functools.cache
def _parser_digest() -> str:
    """The digest of this module's source, read once a process."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _as_json(data: Any) -> str | None:
    """`data` as JSON text when JSON gives back exactly `data` (plain strings, numbers, booleans, null, lists and
    mappings with string keys: what an inventory holds; not dates, binary or numeric keys), else None."""
    try:
        encoded = json.dumps(data, allow_nan=False)
        return encoded if json.loads(encoded) == data else None
    except (TypeError, ValueError, RecursionError):
        return None


def _load_yaml(path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_LOADER) or {}
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None)
        if problem is not None and "nesting depth" in str(problem):  # libyaml's own limit on depth
            raise _too_deep(path) from None
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise InventoryError(f"{path}{at}: not valid YAML: {problem or exc}") from None
    except RecursionError:
        raise _too_deep(path) from None


def _validate(path: Path, catalog: Catalog, text: str, data: dict[str, Any]) -> InventoryDecl:
    lines = _Lines(text)
    try:
        inv = InventoryDecl.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc: list[int | str] = [k for k in err["loc"] if not (isinstance(k, str) and k.startswith("function-"))]
        if err["type"] == "duplicate_pci":  # point at the second GPU with the address, not at its host
            loc += ["gpus", err["ctx"]["gpu_index"], "pci"]
        line = lines.of(loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown key {loc[-1]!r}"
        value = err.get("input")
        shown = "" if isinstance(value, dict | list) or err["type"] == "extra_forbidden" else f" (value {value!r})"
        raise InventoryError(
            f"{path}:{line}: field {_field_name(loc)}: {msg}{shown}",
            reasons=[{"file": str(path), "line": line, "field": _field_name(loc), "error": msg}],
        ) from None
    _check_semantics(path, lines, inv, catalog)
    return inv


def _check_semantics(path: Path, lines: _Lines, inv: InventoryDecl, catalog: Catalog) -> None:
    def fail(loc: list[int | str], msg: str) -> None:
        line = lines.of(loc)
        raise InventoryError(f"{path}:{line}: field {_field_name(loc)}: {msg}",
                             reasons=[{"file": str(path), "line": line, "field": _field_name(loc), "error": msg}])

    pools = set()
    known = catalog.profile_names()
    for i, p in enumerate(inv.pools):
        if p.name in pools:
            fail(["pools", i, "name"], f"duplicate pool {p.name!r}")
        pools.add(p.name)
        for k, t in enumerate(p.demand or []):
            if t.profile not in known:
                fail(["pools", i, "demand", k, "profile"], f"unknown profile {t.profile!r} (see vgpuctl profiles list)")
    hosts: set[str] = set()
    # A fleet declares a few kinds of GPU many times: each distinct declaration is checked once.
    checked: dict[tuple[Any, ...], tuple[str, str] | None] = {}
    for hi, h in enumerate(inv.hosts):
        if h.name in hosts:
            fail(["hosts", hi, "name"], f"duplicate host {h.name!r}")
        hosts.add(h.name)
        for profile in sorted(set(h.victim_modes or ()) - known - {"*"}):
            fail(["hosts", hi, "victim_modes", profile], f"unknown profile {profile!r} (see vgpuctl profiles list)")
        for gi, g in enumerate(h.gpus):
            key = (g.model, g.mode, g.pool, g.vgpu_type, None if g.mig_layout is None else tuple(g.mig_layout))
            if key not in checked:
                checked[key] = _gpu_problem(catalog, g, pools)
            problem = checked[key]
            if problem is not None:
                fail(["hosts", hi, "gpus", gi, problem[0]], problem[1])


def _gpu_problem(catalog: Catalog, g: GpuDecl, pools: set[str]) -> tuple[str, str] | None:
    """The first thing wrong with a GPU declaration against the catalog and the file's pools, as (field,
    message); None when it is fine."""
    if g.model not in catalog.models:
        return "model", f"unknown GPU model {g.model!r}; known: {', '.join(sorted(catalog.models))}"
    if g.pool is not None and g.pool not in pools:
        return "pool", f"unknown pool {g.pool!r}; pools in this file: {', '.join(sorted(pools))}"
    try:
        geom = geometry_for(catalog, g.model, g.mode)
    except InvalidInput as exc:
        return "mode", exc.message
    if g.vgpu_type is not None:
        if g.mode is not Mode.VGPU_EQUAL:
            return "vgpu_type", "a pinned vgpu_type needs mode vgpu-equal"
        if g.vgpu_type not in geom.shapes:
            return "vgpu_type", f"{g.model} has no vGPU type {g.vgpu_type!r}; known: {', '.join(sorted(geom.shapes))}"
    if g.mig_layout is not None:
        if g.mode is not Mode.MIG:
            return "mig_layout", "a mig_layout needs mode mig"
        try:
            parse_mig_layout(geom, g.mig_layout)
        except InvalidInput as exc:
            return "mig_layout", exc.message
    return None
