#!/usr/bin/env python3
"""Read-only probe of this host's NVIDIA GPUs through NVML, compared with the vgpu-ctl catalog; prints JSON.

Usage: python scripts/gpu_probe.py [CATALOG_DIR ...]
It only reads (no Set*, Create* or Destroy* call): safe on a production host. Exits 2 when NVML cannot start.
"""

from __future__ import annotations

import json
import sys
from ctypes import byref, c_uint
from pathlib import Path
from typing import Any

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vgpu_ctl.catalog import Catalog, ProfileKind, load_catalog

RECORDED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _recorded(exc: pynvml.NVMLError) -> dict[str, str]:
    """An NVML error that says "not here" rather than "broken", as it goes in the output."""
    if exc.value not in RECORDED:
        raise exc
    return {"error": str(exc)}


def placements(handle: Any, profile_id: int) -> list[dict[str, int]] | dict[str, str]:
    """The possible placements of a GPU-instance profile (start, size), or the error NVML gave."""
    count = c_uint()
    try:
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, byref(count))
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, byref(count))
    except pynvml.NVMLError as exc:
        return _recorded(exc)
    return [{"start": p.start, "size": p.size} for p in array[: count.value]]


def gi_profiles(handle: Any) -> list[dict[str, Any]]:
    """Every GPU-instance profile index NVML knows, with its info and placements, or the error it gave."""
    out: list[dict[str, Any]] = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError as exc:
            out.append({"index": index, **_recorded(exc)})
            continue
        out.append({
            "index": index, "id": info.id, "name": _text(info.name), "sliceCount": info.sliceCount,
            "instanceCount": info.instanceCount, "memorySizeMB": info.memorySizeMB,
            "multiprocessorCount": info.multiprocessorCount, "placements": placements(handle, info.id),
        })
    return out


def probe_gpu(index: int) -> dict[str, Any]:
    """What NVML says about GPU `index`."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    pci = pynvml.nvmlDeviceGetPciInfo(handle)
    bus_id = _text(pci.busId).lower()
    gpu: dict[str, Any] = {
        "index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "pci_bus_id": bus_id[4:] if len(bus_id) == 16 else bus_id,
        "pci_device_id": f"0x{pci.pciDeviceId >> 16:04x}",
        "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20),
    }
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        gpu["mig_mode"] = {"current": current, "pending": pending}
    except pynvml.NVMLError as exc:
        gpu["mig_mode"] = _recorded(exc)
    gpu["gi_profiles"] = gi_profiles(handle)
    return gpu


def compare(gpu: dict[str, Any], catalog: Catalog) -> dict[str, Any]:
    """Where NVML and the catalog agree and disagree about one GPU's model and MIG profiles."""
    model = catalog.by_pci_id(gpu["pci_device_id"])
    result: dict[str, Any] = {"gpu": gpu["pci_bus_id"], "model": model.model if model else None,
                              "matches": [], "mismatches": []}
    if model is None:
        result["mismatches"].append(f"PCI device id {gpu['pci_device_id']} is not in the catalog")
        return result
    catalog_mig = {p.name: p for p in catalog.profiles(model.model) if p.kind is ProfileKind.MIG}
    seen: set[str] = set()
    for found in (p for p in gpu["gi_profiles"] if "name" in p):
        name = found["name"].removeprefix("MIG ")
        seen.add(name)
        known = catalog_mig.get(name)
        if known is None:
            result["mismatches"].append(f"MIG profile {name} (id {found['id']}) is not in the catalog")
            continue
        checks: dict[str, tuple[Any, Any]] = {"profile_id": (known.profile_id, found["id"]),
                  "max count": (known.max_instances, found["instanceCount"])}
        if isinstance(found["placements"], list):
            checks["starts"] = (list(known.placements or ()), [p["start"] for p in found["placements"]])
        for what, (want, got) in checks.items():
            line = f"{name}: {what} catalog {want}, NVML {got}"
            result["matches" if want == got else "mismatches"].append(line)
    if seen:
        result["mismatches"].extend(f"MIG profile {n} is in the catalog, NVML does not list it"
                                    for n in sorted(set(catalog_mig) - seen))
    return result


def main(argv: list[str]) -> int:
    """Probe every GPU, compare with the catalog, print the JSON report."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"gpu_probe: NVML cannot start ({exc}): no NVIDIA GPU or driver on this host", file=sys.stderr)
        return 2
    try:
        gpus = [probe_gpu(i) for i in range(pynvml.nvmlDeviceGetCount())]
        report = {"driver_version": _text(pynvml.nvmlSystemGetDriverVersion()), "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()
    catalog = load_catalog([Path(a) for a in argv])
    report["comparison"] = [compare(g, catalog) for g in gpus]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
