"""Rendering libvirt XML (domains, mediated devices) from Jinja2 templates, escaped and schema-checked."""

from __future__ import annotations

import re
import uuid as uuidlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jinja2
from lxml import etree
from markupsafe import Markup, escape

from vgpu_ctl.core.backings import DeviceBacking
from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.shipped import template_dir

TEMPLATE_DIR = template_dir()  # templates/ of the checkout, or the copy inside an installed wheel
DOMAIN_SCHEMA = Path("/usr/share/libvirt/schemas/domain.rng")
METADATA_NS = "https://vgpu-ctl.dev/xmlns/vm/1"
MDEV_TEMPLATE = "mdev.xml.j2"

# XML 1.0 cannot carry C0/C1 controls (tab and newline aside), surrogates, U+FFFE or U+FFFF.
_NOT_XML = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")
_PCI = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([01][0-9a-fA-F])\.([0-7])\Z")
_MDEV_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
_NODEDEV_NAME = re.compile(r"^[A-Za-z0-9_]+\Z")


def _xml_value(value: Any) -> Any:
    """Escape a template value so that tabs and newlines survive attribute-value normalisation."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return Markup(str(escape(value)).replace("\n", "&#10;").replace("\t", "&#9;"))
    return value


def _parser() -> etree.XMLParser:
    return etree.XMLParser(resolve_entities=False, no_network=True)


def check_text(field_name: str, value: str) -> None:
    """Refuse a value that XML 1.0 cannot carry (control characters), naming the field."""
    if _NOT_XML.search(value):
        raise InvalidInput(
            f"{field_name} {value!r} contains a control character that XML cannot carry",
            reasons=[{"field": field_name, "value": repr(value)}],
        )


def _check_uuid(field_name: str, value: str) -> None:
    try:
        uuidlib.UUID(value)
    except ValueError:
        raise InvalidInput(f"{field_name} {value!r} is not a UUID",
                           reasons=[{"field": field_name, "value": repr(value)}]) from None


@dataclass(frozen=True)
class PciAddress:
    """A PCI address, domain:bus:slot.function."""

    domain: int
    bus: int
    slot: int
    function: int

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """Parse "0000:41:00.4"; InvalidInput when malformed."""
        m = _PCI.match(text)
        if m is None:
            raise InvalidInput(f"PCI address {text!r} is not of the form 0000:41:00.0",
                               reasons=[{"field": "pci", "value": repr(text)}])
        return cls(*(int(g, 16) for g in m.groups()))

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"

    @property
    def nodedev_name(self) -> str:
        """libvirt's node-device name for this address, e.g. pci_0000_41_00_4."""
        return f"pci_{self.domain:04x}_{self.bus:02x}_{self.slot:02x}_{self.function:x}"


@dataclass(frozen=True)
class HostdevContext:
    """One device handed to the guest."""

    device_id: str
    profile: str
    backing: DeviceBacking
    uuid: str | None
    pci: PciAddress | None
    display: bool = False
    ramfb: bool = False
    gpu_pci: str | None = None  # where the claim is (the physical GPU and its position), kept in the metadata
    start: int | None = None  # so that reconcile can adopt a domain a store lost
    size: int | None = None

    def check(self) -> None:
        """Refuse a device the template cannot express."""
        check_text("device_id", self.device_id)
        check_text("profile", self.profile)
        if self.gpu_pci is not None:
            PciAddress.parse(self.gpu_pci)
            for name in ("start", "size"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidInput(f"device {self.device_id!r}: {name} {value!r} is not a position",
                                       reasons=[{"field": name, "value": repr(value)}])
        where = {"field": "device", "value": self.device_id}
        if self.backing is DeviceBacking.MIG:
            raise InvalidInput(f"device {self.device_id!r}: a bare MIG instance cannot be given to a VM; "
                               "use a MIG-backed vGPU type", reasons=[where])
        if self.backing is DeviceBacking.MDEV:
            if self.uuid is None:
                raise InvalidInput(f"device {self.device_id!r}: an mdev needs its uuid", reasons=[where])
            _check_uuid("uuid", self.uuid)
        elif self.pci is None:
            raise InvalidInput(f"device {self.device_id!r}: a {self.backing} device needs its PCI address",
                               reasons=[where])
        if (self.display or self.ramfb) and self.backing is not DeviceBacking.MDEV:
            raise InvalidInput(f"device {self.device_id!r}: display and ramfb are for mdev vGPUs only",
                               reasons=[where])
        if self.ramfb and not self.display:
            raise InvalidInput(f"device {self.device_id!r}: ramfb needs display on", reasons=[where])


@dataclass(frozen=True)
class DomainContext:
    """Everything the domain template needs for one VM."""

    name: str
    uuid: str
    tenant: str
    vm_id: str
    vcpus: int
    memory_mib: int
    disk_base_image: str
    disk_overlay: str
    network: str
    network_type: Literal["network", "bridge"]
    hostdevs: list[HostdevContext] = field(default_factory=list)
    compute_only: bool = True

    def check(self) -> None:
        """Refuse values XML cannot carry or the template cannot express, naming the field."""
        for name in ("name", "tenant", "vm_id", "disk_base_image", "disk_overlay", "network"):
            check_text(name, getattr(self, name))
        if "/" in self.name or not self.name.strip():
            raise InvalidInput(f"name {self.name!r} is empty or holds '/', which libvirt refuses",
                               reasons=[{"field": "name", "value": repr(self.name)}])
        _check_uuid("uuid", self.uuid)
        if self.network_type not in ("network", "bridge"):
            raise InvalidInput(f"network_type {self.network_type!r} is not 'network' or 'bridge'",
                               reasons=[{"field": "network_type", "value": repr(self.network_type)}])
        for name in ("vcpus", "memory_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidInput(f"{name} {value!r} is not a positive integer",
                                   reasons=[{"field": name, "value": repr(value)}])
        for h in self.hostdevs:
            h.check()


def check_template_name(name: str) -> None:
    """Refuse a template name that is not a plain `*.xml.j2` file name."""
    if not name.endswith(".xml.j2") or any(bad in name for bad in ("/", "\\", "..")) or name != name.strip():
        raise InvalidInput(f"template {name!r} is not a plain file name ending in .xml.j2",
                           reasons=[{"field": "template", "value": name}])
    check_text("template", name)


class TemplateRenderer:
    """Renders the project's templates, or an admin's from `search_dirs`, with XML escaping everywhere."""

    def __init__(self, search_dirs: Sequence[Path] = ()) -> None:
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([TEMPLATE_DIR, *search_dirs]),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
            finalize=_xml_value,
        )

    def check_template(self, template: str) -> None:
        """InvalidInput naming the template unless it is a plain `*.xml.j2` name found in the template folders."""
        check_template_name(template)
        try:
            self.env.loader.get_source(self.env, template)  # type: ignore[union-attr]
        except jinja2.TemplateNotFound:
            raise InvalidInput(f"template {template!r} is not in the template folders",
                               reasons=[{"field": "template", "value": template}]) from None

    def _render(self, template: str, values: Mapping[str, Any]) -> str:
        check_template_name(template)
        try:
            return self.env.get_template(template).render(values)
        except jinja2.TemplateNotFound:
            raise InvalidInput(f"template {template!r} is not in the template folders",
                               reasons=[{"field": "template", "value": template}]) from None
        except jinja2.TemplateError as exc:
            raise InvalidInput(f"template {template!r} failed to render: {exc}",
                               reasons=[{"field": "template", "value": template}]) from None

    def render_domain(self, template: str, ctx: DomainContext) -> str:
        """Domain XML for `ctx` from `template`, validated against libvirt's domain schema."""
        ctx.check()
        values = {k: getattr(ctx, k) for k in ctx.__dataclass_fields__}
        xml = self._render(template, {**values, "metadata_ns": METADATA_NS})
        validate_domain(xml)
        return xml

    def render_mdev(
        self, parent: str, mdev_type: str, uuid: str, attrs: Sequence[tuple[str, str]] = ()
    ) -> str:
        """Node-device XML defining a persistent mdev of `mdev_type` with `uuid` under `parent`."""
        if not _NODEDEV_NAME.match(parent):
            raise InvalidInput(f"parent {parent!r} is not a node-device name like pci_0000_41_00_0",
                               reasons=[{"field": "parent", "value": repr(parent)}])
        if not _MDEV_TYPE.match(mdev_type):
            raise InvalidInput(f"mdev type {mdev_type!r} is not a type id like nvidia-558",
                               reasons=[{"field": "mdev_type", "value": repr(mdev_type)}])
        _check_uuid("uuid", uuid)
        for attr_name, attr_value in attrs:
            check_text("attr name", attr_name)
            check_text("attr value", attr_value)
        return self._render(MDEV_TEMPLATE, {"parent": parent, "mdev_type": mdev_type, "uuid": uuid,
                                            "attrs": list(attrs)})


@lru_cache(maxsize=1)
def _domain_schema() -> etree.RelaxNG:
    if not DOMAIN_SCHEMA.is_file():
        raise HostError(f"libvirt's domain schema {DOMAIN_SCHEMA} is missing; "
                        "install the Debian package libvirt0 (or libvirt-daemon)")
    return etree.RelaxNG(etree.parse(str(DOMAIN_SCHEMA), _parser()))


def parse_xml(xml: str) -> etree._Element:
    """Parse an XML document without network access or entity expansion; InvalidInput when malformed."""
    try:
        return etree.fromstring(xml.encode(), _parser())
    except etree.XMLSyntaxError as exc:
        raise InvalidInput(f"XML is not well-formed: {exc}") from None


def validate_domain(xml: str) -> None:
    """Refuse domain XML that libvirt's domain.rng does not accept."""
    schema = _domain_schema()
    doc = parse_xml(xml)
    if not schema.validate(doc):
        error = schema.error_log.last_error
        message = f"line {error.line}: {error.message}" if error is not None else "no detail"
        raise InvalidInput(f"rendered domain XML does not validate against libvirt's domain.rng: {message}")


def read_hostdevs(xml: str) -> tuple[str, ...]:
    """The host devices a domain's XML takes: mdev UUIDs and PCI addresses ("0000:41:00.4")."""
    return _hostdevs(parse_xml(xml))


def _hostdevs(doc: etree._Element) -> tuple[str, ...]:
    out: list[str] = []
    for source in doc.iterfind("devices/hostdev/source/address"):
        if source.get("uuid"):
            out.append(source.get("uuid", "").lower())
        elif source.get("bus") is not None:
            nums = [int(source.get(k) or "0", 0) for k in ("domain", "bus", "slot", "function")]
            out.append(f"{nums[0]:04x}:{nums[1]:02x}:{nums[2]:02x}.{nums[3]:x}")
    return tuple(out)


@dataclass(frozen=True)
class ClaimedDevice:
    """One device of a domain as its metadata records it: the claim's id, profile, backing, GPU and position,
    and what the domain's XML hands the guest for it (an mdev UUID or a PCI address)."""

    device_id: str
    profile: str
    backing: str
    gpu_pci: str
    start: int
    size: int
    host_ref: str


@dataclass(frozen=True)
class DomainClaim:
    """What a domain vgpu-ctl wrote says of its VM: enough to claim it again in a store that lost it."""

    vm_id: str
    tenant: str
    vcpus: int
    memory_mib: int
    devices: tuple[ClaimedDevice, ...]


def read_claim(xml: str) -> DomainClaim | None:
    """The VM and device positions recorded in a domain's metadata; None for a foreign domain or one written
    without positions (by a vgpu-ctl before they were recorded, or by a template that leaves them out)."""
    doc = parse_xml(xml)
    return _claim(doc, _hostdevs(doc))


def _claim(doc: etree._Element, refs: tuple[str, ...]) -> DomainClaim | None:
    vm = doc.find(f"metadata/{{{METADATA_NS}}}vm")
    memory, vcpus = doc.find("memory"), doc.findtext("vcpu")
    if vm is None or memory is None or vcpus is None:
        return None
    devices = []
    try:
        for i, d in enumerate(vm.iterfind(f"{{{METADATA_NS}}}device")):
            if d.get("gpu") is None or i >= len(refs):
                return None
            devices.append(ClaimedDevice(d.get("id", ""), d.get("profile", ""), d.get("backing", ""),
                                         d.get("gpu", ""), int(d.get("start", "")), int(d.get("size", "")),
                                         refs[i]))
        scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}.get(memory.get("unit", "KiB"), 0)
        memory_mib = int(int(memory.text or "0") * scale)
        return DomainClaim(vm.get("vm-id", ""), vm.get("tenant", ""), int(vcpus), memory_mib, tuple(devices))
    except ValueError:
        return None


def read_metadata(xml: str) -> dict[str, str]:
    """The controller's metadata in domain XML: tenant, vm_id, devices (comma-separated ids), or {}."""
    return _metadata(parse_xml(xml))


class DomainFacts(NamedTuple):
    """What a domain's XML tells the controller: its metadata, the host devices it takes, and its claim."""

    metadata: dict[str, str]
    hostdevs: tuple[str, ...]
    claim: DomainClaim | None


def read_domain(xml: str) -> DomainFacts:
    """`read_metadata`, `read_hostdevs` and `read_claim` of one domain's XML, parsed once (a host lists many)."""
    doc = parse_xml(xml)
    refs = _hostdevs(doc)
    return DomainFacts(_metadata(doc), refs, _claim(doc, refs))


def _metadata(doc: etree._Element) -> dict[str, str]:
    vm = doc.find(f"metadata/{{{METADATA_NS}}}vm")
    if vm is None:
        return {}
    devices = [d.get("id", "") for d in vm.iterfind(f"{{{METADATA_NS}}}device")]
    return {"tenant": vm.get("tenant", ""), "vm_id": vm.get("vm-id", ""), "devices": ",".join(devices)}
