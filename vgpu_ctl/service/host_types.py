"""What each host calls each profile: discovered on the host, kept per GPU in the store, used to provision.

`inventory apply` of a libvirt host and `host discover --write` record the mdev type ids, vendor-VFIO type ids
and NVML MIG profile ids a GPU offers; a profile the declared mode needs but the host lacks is a finding
with what to do, reported then, instead of a failure when a VM is provisioned. Such profiles are kept per GPU
(`gpu.lacked_types`, with what to do) and out of its fit mask (`gpu.lacks`), so placement never picks that GPU
for them; a refusal they cause says which profile, host and GPU, and the finding's advice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vgpu_ctl.catalog import Catalog, ProfileKind
from vgpu_ctl.core.geometry import fit_mask
from vgpu_ctl.errors import NotFound, VgpuCtlError
from vgpu_ctl.hosts.discovery import DiscoveredGpu, Discovery, discover_host
from vgpu_ctl.service.allocation import occupancy_of
from vgpu_ctl.service.fit_masks import lacks_bits
from vgpu_ctl.service.ports import STORE, Tx
from vgpu_ctl.store.host_types import KINDS, TypedGpu, TypeIds
from vgpu_ctl.store.hosts import HostRow

if TYPE_CHECKING:
    from vgpu_ctl.service.controller import Controller

Change = dict[str, Any]


def discover_hosts(ctl: Controller, hosts: Iterable[Any]) -> dict[str, Discovery | str]:
    """Discovery of each libvirt host (rows or declarations with name, uri, driver, vgpu_backing); the error
    text for a host that could not be read."""
    out: dict[str, Discovery | str] = {}
    for h in hosts:
        if h.driver != "libvirt" or h.uri.startswith("simulated:"):
            continue
        try:
            out[h.name] = discover_host(h.uri, ctl.catalog, h.name, ctl.hosts.side(h))
        except VgpuCtlError as exc:
            out[h.name] = exc.message
    return out


def stored_ids(conn: Tx, gpu_id: int) -> TypeIds:
    """The ids recorded for a GPU, by kind and profile."""
    return STORE.host_types.type_ids(conn, (gpu_id,))[gpu_id]


def _found_ids(catalog: Catalog, model: str, g: DiscoveredGpu) -> TypeIds:
    """A discovered GPU's ids, for the catalog's profiles of `model` only."""
    names = {p.name for p in catalog.profiles(model)}
    return {"mdev": {p: t for p, t in g.types.items() if p in names},
            "vfio": {p: str(t) for p, t in g.vfio_types.items() if p in names},
            "mig": {p: str(t) for p, t in g.mig_profiles.items() if p in names}}


def _needed(catalog: Catalog, gpu: Any, backing: str) -> dict[str, list[str]]:
    """The profiles a GPU's declared mode needs ids for, by kind."""
    profiles = catalog.profiles(gpu.model)
    if gpu.mode in ("vgpu-equal", "vgpu-mixed"):
        names = [p.name for p in profiles if p.kind is ProfileKind.VGPU
                 and (gpu.pinned_type is None or p.name == gpu.pinned_type)]
        return {backing: names}
    if gpu.mode == "mig":
        return {"mig": [p.name for p in profiles if p.kind is ProfileKind.MIG],
                backing: [p.name for p in profiles if p.kind is ProfileKind.MIG_VGPU]}
    return {}


def _advice(kind: str, gpu: Any, g: DiscoveredGpu, found: TypeIds, driver: str | None) -> str:
    version = f" (driver {driver})" if driver else ""
    if kind == "mig":
        if not g.nvml_seen:
            return ("NVML did not report this GPU: the NVIDIA host driver is not loaded there, or the GPU is "
                    "bound to another driver; see `vgpuctl host check`")
        return (f"NVML offers no GPU-instance profile of these: MIG mode is off (an admin enables it with "
                f"`nvidia-smi -i {gpu.pci_address} -mig 1` and a GPU reset; vgpu-ctl never changes it) or the "
                f"host driver{version} does not offer them")
    if not found[kind]:
        if kind == "vfio":
            return ("no VF of this GPU offers vendor-VFIO vGPU types: enable the VFs "
                    f"(`/usr/lib/nvidia/sriov-manage -e {gpu.pci_address}`, again after each reboot) on a vGPU 17+ "
                    "host driver with kernel >= 6.8, or declare the host `vgpu_backing: mdev`")
        return ("the host offers no mdev vGPU types on this GPU: load the NVIDIA vGPU host driver (vGPU "
                f"manager); on SR-IOV GPUs enable the VFs first (`/usr/lib/nvidia/sriov-manage -e "
                f"{gpu.pci_address}`); hosts with vGPU 17+ on kernel >= 6.8 use vendor-specific VFIO: declare "
                "`vgpu_backing: vfio`")
    return (f"the host driver{version} offers other types on this GPU but not these: it may be too old or too "
            "new for them, or the GPU is in the other mode (time-sliced types need MIG off, MIG-backed types "
            "MIG on)")


def record_discovery(conn: Tx, catalog: Catalog, d: Discovery) -> list[Change]:
    """Store what host `d.name` calls each profile of its GPUs in the store; the changes and the findings."""
    label = d.name
    host = STORE.hosts.host_named(conn, d.name)
    if host is None:
        return []
    changes: list[Change] = []
    by_pci = {g.pci: g for g in d.gpus}
    backing = "vfio" if host.vgpu_backing == "vfio" else "mdev"
    for gpu in STORE.host_types.discovered_gpus(conn, host.id):
        name = f"{label}/{gpu.pci_address}"
        g = by_pci.get(gpu.pci_address)
        if g is None or g.model != gpu.model:
            what = "no NVIDIA GPU there" if g is None else f"a {g.model or 'model the catalog lacks'}"
            todo = "fix the inventory's pci/model (see `vgpuctl host discover`)"
            changes.append(_finding("gpu-mismatch", name, f"declared a {gpu.model}, the host has {what}", todo))
            STORE.host_types.replace_type_ids(conn, gpu.id, {k: {} for k in KINDS})
            _keep_out(conn, catalog, gpu, {n: f"host {label}: {todo}" for names in
                                           _needed(catalog, gpu, backing).values() for n in names})
            continue
        found = _found_ids(catalog, gpu.model, g)
        old = stored_ids(conn, gpu.id)
        if old != found:
            STORE.host_types.replace_type_ids(conn, gpu.id, found)
            changes.append({"action": "record", "kind": "type-ids", "name": name,
                            "fields": {k: len(v) for k, v in found.items() if v or old[k]}})
        if gpu.mode == "mig" and g.nvml_seen and g.mig_current is False:
            changes.append(_finding("wrong-mode", name, "declared mode mig, but MIG mode is off on the GPU",
                                    f"an admin enables it: `nvidia-smi -i {gpu.pci_address} -mig 1`, then a GPU "
                                    "reset (vgpu-ctl never changes MIG mode)"))
        elif gpu.mode in ("vgpu-equal", "vgpu-mixed") and g.mig_current:
            changes.append(_finding("wrong-mode", name, f"declared mode {gpu.mode}, but MIG mode is on",
                                    f"time-sliced vGPU types need MIG off (`nvidia-smi -i {gpu.pci_address} "
                                    "-mig 0`), or declare the GPU `mode: mig`"))
        lacked: dict[str, str] = {}
        for kind, names in _needed(catalog, gpu, backing).items():
            missing = [n for n in names if n not in found[kind]]
            if missing:
                todo = _advice(kind, gpu, g, found, d.driver_version)
                changes.append(_finding(f"missing-{kind}-types", name,
                                        f"{gpu.model} in mode {gpu.mode}: the host has no {kind} id for "
                                        f"{', '.join(missing)}", todo))
                lacked.update({n: f"host {label} has no {kind} type id for {n} on {gpu.pci_address}: {todo}"
                               for n in missing if kind != "vfio" or _shown_before_instance(catalog, gpu, n)})
        _keep_out(conn, catalog, gpu, {**_unfilled(catalog, gpu, lacked), **lacked})
    return changes


def _shown_before_instance(catalog: Catalog, gpu: Any, profile: str) -> bool:
    """False for a MIG-backed type on a vendor-VFIO VF: it shows there only once a GPU instance of its profile
    exists, so its absence at discovery says nothing."""
    p = catalog.profile(gpu.model, profile)
    return p is None or p.kind is not ProfileKind.MIG_VGPU


def _unfilled(catalog: Catalog, gpu: Any, lacked: Mapping[str, str]) -> dict[str, str]:
    """Bare MIG profiles a KVM guest can't get on this GPU because the MIG-backed type that fills their
    instance is lacked there (see provision.kvm_mig_type), with what to do."""
    from vgpu_ctl.service.provision import kvm_mig_type
    out = {}
    for p in catalog.profiles(gpu.model):
        filling = kvm_mig_type(catalog, gpu.model, p.name) if p.kind is ProfileKind.MIG else None
        if filling is not None and filling.name in lacked:
            out[p.name] = f"a KVM guest gets {p.name} through {filling.name}, and {lacked[filling.name]}"
    return out


def _keep_out(conn: Tx, catalog: Catalog, gpu: TypedGpu, lacked: Mapping[str, str]) -> None:
    """Record the profiles a GPU's host lacks type ids for (with what to do) and take them out of its fit mask,
    so placement never picks the GPU for them (see service.fit_masks); the GPU's version moves on, so a claim
    planned on the old mask retries."""
    lacks = lacks_bits(catalog, gpu.model, gpu.mode, lacked)
    stored = gpu.lacked_types or {}
    if lacks == gpu.lacks and dict(lacked) == stored:
        return
    fits = fit_mask(occupancy_of(catalog, gpu._asdict())) & ~lacks
    STORE.host_types.set_lacked(conn, gpu.id, lacks, dict(sorted(lacked.items())) or None, fits)


def _finding(kind: str, name: str, detail: str, todo: str) -> Change:
    return {"action": "report", "kind": kind, "name": name, "fields": {"detail": detail, "do": todo}}


def lacking(conn: Tx, pool_id: int, profiles: Iterable[str], limit: int = 10) -> list[dict[str, str]]:
    """The pool's GPUs whose host has no type id for one of the profiles, in GPU order, at most `limit`: host,
    GPU, profile and what to do (as the discovery that found it said), for a refusal they caused."""
    wanted = set(profiles)
    out: list[dict[str, str]] = []
    for r in STORE.host_types.lacking_gpus(conn, pool_id):
        for p in sorted(wanted & set(r.lacked_types)):
            out.append({"host": r.host, "gpu": r.pci_address, "profile": p, "do": r.lacked_types[p]})
            if len(out) >= limit:
                return out
    return out


def describe_lacking(items: Sequence[Mapping[str, str]], total: int, shown: int = 3) -> str:
    """What `lacking` found, in an admin's words for a refusal ('; host kvm1 has no mdev type id for ...: what
    to do'), the first `shown` of `total` GPUs and how many more."""
    text = "".join(f"; {x['do']}" for x in items[:shown])
    more = total - min(len(items), shown)
    return text + (f"; and {more} more GPU{'' if more == 1 else 's'} alike" if more > 0 else "")


def record_unreachable(name: str, error: str) -> Change:
    """The finding for a declared libvirt host discovery could not read."""
    return _finding("host-unreachable", name, error, "the type ids stay as recorded before; fix the host or its "
                    "URI and apply again (`vgpuctl host check` says what is missing)")


def record_all(conn: Tx, catalog: Catalog, found: Mapping[str, Discovery | str]) -> list[Change]:
    """record_discovery for each host discovered, a finding for each that could not be read."""
    changes: list[Change] = []
    for name, d in found.items():
        if isinstance(d, str):
            changes.append(record_unreachable(name, d))
        else:
            changes.extend(record_discovery(conn, catalog, d))
    return changes


def host_row(ctl: Controller, name: str) -> HostRow:
    """The store's row of host `name` (name, uri, driver, vgpu_backing); NotFound naming the known hosts."""
    with ctl.read() as conn:
        row = STORE.hosts.host_named(conn, name)
        if row is None:
            known = ", ".join(STORE.hosts.host_names(conn))
            raise NotFound(f"host {name!r} not found (known: {known or 'none'}); give a libvirt URI to check a "
                           "host that is not in the store", reasons=[{"field": "host", "value": name}])
    return row


def record_discovered(ctl: Controller, d: Discovery) -> list[Change]:
    """Store a discovery's type ids if its host is in the store (`host discover --write`); the changes."""
    with ctl.tx() as conn:
        return record_discovery(conn, ctl.catalog, d)
