"""Rendering domain and mdev XML: schema-valid, accepted by libvirt, escaped, and refusing bad input."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import libvirt
import pytest
from hostfixtures import (
    MDEV_UUID,
    VM_UUID,
    domain_context,
    mdev_hostdev,
    pci_hostdev,
    vf_hostdev,
)
from lxml import etree

from vgpu_ctl import render
from vgpu_ctl.errors import HostError, InvalidInput
from vgpu_ctl.hosts.protocol import DeviceBacking
from vgpu_ctl.render import (
    METADATA_NS,
    DomainContext,
    HostdevContext,
    PciAddress,
    TemplateRenderer,
    read_metadata,
    validate_domain,
)

TEMPLATE = "domain.xml.j2"
NODEDEV_SCHEMA = Path("/usr/share/libvirt/schemas/nodedev.rng")


@pytest.fixture(scope="module")
def renderer() -> TemplateRenderer:
    return TemplateRenderer()


def _clear(c: Any) -> None:
    # test:///default keeps one state per process while any connection to it is open (other tests hold one).
    for dom in c.listAllDomains():
        if dom.isActive():
            dom.destroy()
        dom.undefine()


@pytest.fixture()
def conn() -> Iterator[Any]:
    c = libvirt.open("test:///default")
    _clear(c)
    yield c
    _clear(c)
    c.close()


def _define(conn: Any, xml: str) -> Any:
    """Define the XML through libvirt's real parser, start it, and hand back the domain."""
    dom = conn.defineXML(xml)
    dom.create()
    return dom


def _tags(xml: str) -> list[str]:
    return [el.tag for el in etree.fromstring(xml.encode()).iter() if isinstance(el.tag, str)]


CASES = {
    "mdev": domain_context([mdev_hostdev()]),
    "mdev-display": domain_context([mdev_hostdev(display=True, ramfb=True)], compute_only=False),
    "vfio-vf": domain_context([vf_hostdev()]),
    "passthrough": domain_context([pci_hostdev()]),
    "several": domain_context([mdev_hostdev("a"), vf_hostdev("b"), pci_hostdev("c")]),
    "no-gpu-bridge": domain_context([], network="br0", network_type="bridge", compute_only=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_domains_validate_and_libvirt_accepts_them(
    renderer: TemplateRenderer, conn: Any, case: str
) -> None:
    ctx = CASES[case]
    xml = renderer.render_domain(TEMPLATE, ctx)
    validate_domain(xml)
    dom = _define(conn, xml)
    assert dom.name() == ctx.name and dom.UUIDString() == ctx.uuid and dom.isActive()
    back = etree.fromstring(dom.XMLDesc(0).encode())
    assert back.get("type") == "kvm"
    assert back.find("os/type").get("machine") == "q35"
    assert back.findtext("vcpu") == "4" and back.findtext("memory") == str(8192 * 1024)
    assert back.find("devices/disk/backingStore/source").get("file") == ctx.disk_base_image
    assert back.find("devices/serial[@type='pty']") is not None
    assert back.find("devices/console[@type='pty']") is not None
    assert len(back.findall("devices/hostdev")) == len(ctx.hostdevs)
    assert (back.find("devices/video/model[@type='none']") is not None) == ctx.compute_only
    displayed = any(h.display for h in ctx.hostdevs)
    assert (back.find("devices/graphics[@type='vnc']") is not None) == displayed


def test_hostdev_forms(renderer: TemplateRenderer) -> None:
    xml = renderer.render_domain(TEMPLATE, CASES["several"])
    doc = etree.fromstring(xml.encode())
    mdev, vf, gpu = doc.findall("devices/hostdev")
    assert dict(mdev.attrib) == {"mode": "subsystem", "type": "mdev", "managed": "no", "model": "vfio-pci",
                                 "display": "off"}
    assert mdev.find("source/address").get("uuid") == MDEV_UUID
    assert (vf.get("type"), vf.get("managed")) == ("pci", "no")
    assert dict(vf.find("source/address").attrib) == {"domain": "0x0000", "bus": "0x41", "slot": "0x00",
                                                      "function": "0x4"}
    assert (gpu.get("type"), gpu.get("managed")) == ("pci", "yes")
    assert gpu.find("source/address").get("bus") == "0x42"
    display = etree.fromstring(renderer.render_domain(TEMPLATE, CASES["mdev-display"]).encode())
    hostdev = display.find("devices/hostdev")
    assert (hostdev.get("display"), hostdev.get("ramfb")) == ("on", "on")
    assert display.find("devices/graphics").get("listen") == "127.0.0.1"
    bridge = etree.fromstring(renderer.render_domain(TEMPLATE, CASES["no-gpu-bridge"]).encode())
    assert bridge.find("devices/interface[@type='bridge']/source").get("bridge") == "br0"


def test_metadata_is_read_back(renderer: TemplateRenderer, conn: Any) -> None:
    dom = _define(conn, renderer.render_domain(TEMPLATE, CASES["several"]))
    expected = {"tenant": "acme", "vm_id": "42", "devices": "a,b,c"}
    assert read_metadata(dom.XMLDesc(0)) == expected
    element = etree.fromstring(dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS).encode())
    assert [(d.get("id"), d.get("profile")) for d in element] == [
        ("a", "A100D-10C"), ("b", "L40S-12C"), ("c", "A100-80GB")]


def test_a_domain_without_vgpus_has_no_hostdevs_and_its_metadata_reads_back(renderer: TemplateRenderer,
                                                                             conn: Any) -> None:
    xml = renderer.render_domain(TEMPLATE, domain_context([]))
    validate_domain(xml)
    dom = _define(conn, xml)
    back = dom.XMLDesc(0)
    assert etree.fromstring(back.encode()).findall("devices/hostdev") == []
    assert read_metadata(back) == {"tenant": "acme", "vm_id": "42", "devices": ""}
    claim = render.read_claim(back)
    assert claim is not None and (claim.vm_id, claim.vcpus, claim.memory_mib, claim.devices) == ("42", 4, 8192, ())


def test_a_domain_read_at_once_says_what_each_reader_says(renderer: TemplateRenderer, conn: Any) -> None:
    foreign = conn.defineXML("<domain type='test'><name>foreign</name><memory>1024</memory>"
                             "<os><type>hvm</type></os></domain>").XMLDesc(0)
    positioned = replace(mdev_hostdev("d1"), gpu_pci="0000:41:00.0", start=10, size=10)
    placed = renderer.render_domain(TEMPLATE, domain_context([positioned]))
    for xml in (renderer.render_domain(TEMPLATE, CASES["several"]), placed, foreign):
        facts = render.read_domain(xml)
        assert facts == (read_metadata(xml), render.read_hostdevs(xml), render.read_claim(xml))
    one = render.read_domain(placed)
    assert one.metadata["devices"] == "d1" and one.hostdevs == (MDEV_UUID,)
    assert one.claim is not None
    assert [(d.host_ref, d.gpu_pci, d.start, d.size) for d in one.claim.devices] == [
        (MDEV_UUID, "0000:41:00.0", 10, 10)]
    assert render.read_domain(foreign) == ({}, (), None)


def test_foreign_domain_has_no_metadata(conn: Any) -> None:
    foreign = conn.defineXML("<domain type='test'><name>foreign</name><memory>1024</memory>"
                             "<os><type>hvm</type></os></domain>")
    assert read_metadata(foreign.XMLDesc(0)) == {}


PAYLOADS = ["<evil/>", "a&b", "it's \"quoted\"", "x]]>y", "<![CDATA[z]]>", "&amp;&lt;", "</name><evil>"]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_is_escaped(renderer: TemplateRenderer, conn: Any, payload: str) -> None:
    plain = renderer.render_domain(TEMPLATE, CASES["several"])
    hostdevs = [replace(h, device_id=f"{h.device_id}{payload}", profile=payload)
                for h in CASES["several"].hostdevs]
    ctx = replace(CASES["several"], name=f"vm{payload.replace('/', '')}", tenant=payload, vm_id=payload,
                  hostdevs=hostdevs, network=f"net{payload}", disk_overlay=f"/var/lib/d{payload}.qcow2")
    xml = renderer.render_domain(TEMPLATE, ctx)
    assert _tags(xml) == _tags(plain)
    doc = etree.fromstring(xml.encode())
    assert doc.findtext("name") == ctx.name
    assert doc.find("devices/interface/source").get("network") == ctx.network
    assert doc.find("devices/disk/source").get("file") == ctx.disk_overlay
    assert read_metadata(xml) == {"tenant": payload, "vm_id": payload,
                                  "devices": ",".join(h.device_id for h in hostdevs)}
    dom = _define(conn, xml)
    assert dom.name() == ctx.name
    assert read_metadata(dom.XMLDesc(0))["tenant"] == payload


@pytest.mark.parametrize("field", ["name", "tenant", "vm_id", "disk_base_image", "disk_overlay", "network"])
@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x7f", "\x85", "\ufffe"])
def test_control_characters_are_refused(renderer: TemplateRenderer, field: str, char: str) -> None:
    ctx = replace(CASES["mdev"], **{field: f"a{char}b"})
    with pytest.raises(InvalidInput) as err:
        renderer.render_domain(TEMPLATE, ctx)
    assert err.value.message.startswith(f"{field} ")
    assert err.value.reasons == [{"field": field, "value": repr(f"a{char}b")}]


@pytest.mark.parametrize("field", ["device_id", "profile"])
def test_control_characters_in_devices_are_refused(renderer: TemplateRenderer, field: str) -> None:
    ctx = domain_context([replace(mdev_hostdev(), **{field: "x\x01"})])
    with pytest.raises(InvalidInput, match=f"^{field} "):
        renderer.render_domain(TEMPLATE, ctx)


@pytest.mark.parametrize("name", ["a/b", "", " "])
def test_names_libvirt_refuses_are_refused(renderer: TemplateRenderer, name: str) -> None:
    with pytest.raises(InvalidInput, match=r"^name "):
        renderer.render_domain(TEMPLATE, replace(CASES["mdev"], name=name))


def test_tab_and_newline_are_carried(renderer: TemplateRenderer) -> None:
    xml = renderer.render_domain(TEMPLATE, replace(CASES["mdev"], vm_id="a\tb", tenant="c\nd"))
    assert read_metadata(xml) == {"tenant": "c\nd", "vm_id": "a\tb", "devices": "dev-1"}


@pytest.mark.parametrize("name", ["../domain.xml.j2", "sub/domain.xml.j2", "sub\\domain.xml.j2", "domain.txt",
                                  "", "/etc/passwd", "..xml.j2", "domain.xml.j2\x00"])
def test_bad_template_names_are_refused(renderer: TemplateRenderer, name: str) -> None:
    with pytest.raises(InvalidInput) as err:
        renderer.render_domain(name, CASES["mdev"])
    assert err.value.reasons[0]["field"] == "template"
    assert repr(name)[1:-1] in err.value.message or name in err.value.message


def test_unknown_template_is_refused(renderer: TemplateRenderer) -> None:
    with pytest.raises(InvalidInput, match="not in the template folders"):
        renderer.render_domain("nope.xml.j2", CASES["mdev"])


def test_admin_templates(tmp_path: Path) -> None:
    (tmp_path / "tiny.xml.j2").write_text(
        "<domain type='kvm'><name>{{ name }}</name><memory unit='MiB'>{{ memory_mib }}</memory>"
        "<os><type arch='x86_64' machine='q35'>hvm</type></os></domain>")
    (tmp_path / "typo.xml.j2").write_text("<domain type='kvm'><name>{{ nmae }}</name></domain>")
    (tmp_path / "invalid.xml.j2").write_text("<domain type='kvm'><name>{{ name }}</name><bogus/></domain>")
    renderer = TemplateRenderer([tmp_path])
    assert "<name>vm-1</name>" in renderer.render_domain("tiny.xml.j2", CASES["mdev"])
    with pytest.raises(InvalidInput, match="nmae"):
        renderer.render_domain("typo.xml.j2", CASES["mdev"])
    with pytest.raises(InvalidInput, match=r"does not validate against libvirt's domain\.rng"):
        renderer.render_domain("invalid.xml.j2", CASES["mdev"])


def test_project_templates_come_first(tmp_path: Path) -> None:
    (tmp_path / TEMPLATE).write_text("<domain/>")
    assert "<hostdev" in TemplateRenderer([tmp_path]).render_domain(TEMPLATE, CASES["mdev"])


def test_validate_domain_reports_the_schema_message() -> None:
    with pytest.raises(InvalidInput, match=r"does not validate against libvirt's domain\.rng: line 1"):
        validate_domain("<domain type='kvm'><name>x</name><bogus/></domain>")
    with pytest.raises(InvalidInput, match="not well-formed"):
        validate_domain("<domain")


def test_entities_are_not_expanded() -> None:
    xml = ("<!DOCTYPE d [<!ENTITY x SYSTEM 'file:///etc/hostname'>]>"
           "<domain type='kvm'><name>&x;</name></domain>")
    with pytest.raises(InvalidInput):
        validate_domain(xml)


def test_missing_schema_is_a_host_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(render, "DOMAIN_SCHEMA", tmp_path / "domain.rng")
    render._domain_schema.cache_clear()
    try:
        with pytest.raises(HostError, match="libvirt0"):
            validate_domain("<domain/>")
    finally:
        monkeypatch.undo()
        render._domain_schema.cache_clear()


@pytest.mark.parametrize("hostdev, message", [
    (HostdevContext("d", "A100D-10C", DeviceBacking.MDEV, None, None), "needs its uuid"),
    (HostdevContext("d", "A100D-10C", DeviceBacking.MDEV, "not-a-uuid", None), "not a UUID"),
    (HostdevContext("d", "L40S-12C", DeviceBacking.VFIO_VF, None, None), "needs its PCI address"),
    (HostdevContext("d", "3g.40gb", DeviceBacking.MIG, None, None), "bare MIG instance"),
    (HostdevContext("d", "A100D-10C", DeviceBacking.MDEV, MDEV_UUID, None, ramfb=True), "ramfb needs"),
    (HostdevContext("d", "A100-80GB", DeviceBacking.PCI, None, PciAddress(0, 0x41, 0, 0), display=True),
     "mdev vGPUs only"),
])
def test_impossible_devices_are_refused(
    renderer: TemplateRenderer, hostdev: HostdevContext, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        renderer.render_domain(TEMPLATE, domain_context([hostdev]))


@pytest.mark.parametrize("changes", [{"vcpus": 0}, {"memory_mib": -1}, {"vcpus": True}, {"uuid": "x"},
                                     {"network_type": "direct"}])
def test_bad_numbers_and_choices_are_refused(renderer: TemplateRenderer, changes: dict[str, Any]) -> None:
    ctx: DomainContext = replace(CASES["mdev"], **changes)
    with pytest.raises(InvalidInput):
        renderer.render_domain(TEMPLATE, ctx)


def test_pci_address() -> None:
    addr = PciAddress.parse("0000:41:00.4")
    assert addr == PciAddress(0, 0x41, 0, 4)
    assert str(addr) == "0000:41:00.4" and addr.nodedev_name == "pci_0000_41_00_4"
    assert str(PciAddress.parse("0000:C1:1F.7")) == "0000:c1:1f.7"
    for bad in ["41:00.0", "0000:41:00.8", "0000:41:20.0", "0000:41:00", "0000:41:00.0 ", "zzzz:41:00.0"]:
        with pytest.raises(InvalidInput):
            PciAddress.parse(bad)


def test_mdev_xml(renderer: TemplateRenderer) -> None:
    xml = renderer.render_mdev("pci_0000_41_00_0", "nvidia-558", MDEV_UUID, [("vgpu-placement-id", "10")])
    assert xml == (
        "<device>\n"
        "  <parent>pci_0000_41_00_0</parent>\n"
        "  <capability type='mdev'>\n"
        "    <type id='nvidia-558'/>\n"
        f"    <uuid>{MDEV_UUID}</uuid>\n"
        "    <attr name='vgpu-placement-id' value='10'/>\n"
        "  </capability>\n"
        "</device>\n"
    )
    plain = renderer.render_mdev("pci_0000_41_00_0", "nvidia-558", MDEV_UUID)
    assert "<attr" not in plain
    schema = etree.RelaxNG(etree.parse(str(NODEDEV_SCHEMA)))
    for doc in (xml, plain):  # nodedev.rng describes libvirt's output, which adds the <name> input ignores
        named = doc.replace("<device>", "<device><name>x</name>", 1)
        assert schema.validate(etree.fromstring(named.encode()))


def test_mdev_attr_values_are_escaped(renderer: TemplateRenderer) -> None:
    xml = renderer.render_mdev("pci_0000_41_00_0", "nvidia-558", MDEV_UUID, [("k'", "<v/>&")])
    attr = etree.fromstring(xml.encode()).find("capability/attr")
    assert (attr.get("name"), attr.get("value")) == ("k'", "<v/>&")


@pytest.mark.parametrize("args", [
    ("pci_0000_41_00_0/..", "nvidia-558", MDEV_UUID), ("pci_0000_41_00_0", "nvidia 558", MDEV_UUID),
    ("pci_0000_41_00_0", "nvidia-558", "nope"), ("<p>", "nvidia-558", MDEV_UUID),
])
def test_bad_mdev_input_is_refused(renderer: TemplateRenderer, args: tuple[str, str, str]) -> None:
    with pytest.raises(InvalidInput):
        renderer.render_mdev(*args)


def test_vm_uuid_is_the_domain_uuid(renderer: TemplateRenderer) -> None:
    assert f"<uuid>{VM_UUID}</uuid>" in renderer.render_domain(TEMPLATE, CASES["mdev"])
