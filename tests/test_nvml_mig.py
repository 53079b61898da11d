"""NvmlMig against a fake pynvml that follows NVIDIA's MIG rules: discovery, explicit placements, refusals."""

from __future__ import annotations

import ctypes
import re
import sys
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from fake_pynvml import A30_24GB, H100_80GB, L40S, FakeGpu, FakeNvml  # noqa: E402

from vgpu_ctl.catalog import ProfileKind, load_catalog  # noqa: E402
from vgpu_ctl.errors import HostError, InvalidInput  # noqa: E402
from vgpu_ctl.hosts.nvml_mig import NvmlMig, normalize_bus_id  # noqa: E402
from vgpu_ctl.hosts.protocol import DeviceBacking, DeviceHandle, DeviceSpec, HostDevice  # noqa: E402

H100 = "0000:41:00.0"
A30 = "0000:c1:00.0"
P1G, P1G_ME, P1G2, P2G, P3G, P4G, P7G = 19, 20, 15, 14, 9, 5, 0  # H100-80GB profile ids


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def mig(fake: FakeNvml) -> NvmlMig:
    return NvmlMig(fake)


def raises(kind: type[Exception], text: str) -> Any:
    """pytest.raises matching `text` literally."""
    return pytest.raises(kind, match=re.escape(text))


def layout(mig: NvmlMig, gpu: str = H100) -> list[tuple[int, int, int]]:
    return [(g["profile_id"], g["start"], g["size"]) for g in mig.list_gis(gpu)]


def spec(profile_id: int, start: int, name: str = "3g.40gb", device_id: str = "dev-1") -> DeviceSpec:
    return DeviceSpec(device_id=device_id, gpu_pci=H100, backing=DeviceBacking.MIG, profile=name, start=start,
                      size=4, uuid="5b0a3f2e-9d1c-4c1e-8a4e-2f7f3c1d0001", mig_profile_id=profile_id)


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:C1:00.0") == "0000:c1:00.0"
    assert normalize_bus_id(b"0000:41:00.0") == "0000:41:00.0"
    assert normalize_bus_id("41:00.0") == "0000:41:00.0"
    with raises(InvalidInput, "not a PCI address"):
        normalize_bus_id("gpu0")


def test_gpus_lists_pci_identity_memory_and_mig_mode(fake: FakeNvml) -> None:
    fake.gpus.append(FakeGpu(L40S, "00000000:81:00.0", "GPU-l40s"))
    fake.gpus[1].mig_current = 0
    gpus = NvmlMig(fake).gpus()
    assert [(g["index"], g["pci_bus_id"], g["pci_device_id"]) for g in gpus] == [
        (0, H100, "0x2330"), (1, A30, "0x20b7"), (2, "0000:81:00.0", "0x26b9")]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["memory_mib"] == 81559
    assert gpus[0]["uuid"].startswith("GPU-")
    assert [(g["mig_current"], g["mig_pending"]) for g in gpus] == [(True, True), (False, True), (None, None)]
    assert load_catalog().by_pci_id(gpus[0]["pci_device_id"]) is not None
    assert fake.init_count == 0  # every nvmlInit was matched by nvmlShutdown


@pytest.mark.parametrize(("model", "gpu"), [("H100-80GB", H100), ("A30", A30)])
def test_profiles_and_placements_match_the_catalog(mig: NvmlMig, model: str, gpu: str) -> None:
    catalog = {p.profile_id: p for p in load_catalog().profiles(model)
               if p.kind is ProfileKind.MIG and p.profile_id is not None}
    found = {p["id"]: p for p in mig.gi_profiles(gpu)}
    assert set(found) == set(catalog)
    for pid, want in catalog.items():
        got = found[pid]
        assert got["name"] == want.name
        assert tuple(got["placements"]) == want.placements
        assert got["memory_slices"] == want.memory_slices
        assert got["slice_count"] == want.compute_slices
        assert got["instance_count"] == want.max_instances


def test_h100_real_hardware_placements(mig: NvmlMig) -> None:
    by_name = {p["name"]: p for p in mig.gi_profiles(H100)}
    assert (by_name["3g.40gb"]["placements"], by_name["3g.40gb"]["memory_slices"]) == ([0, 4], 4)
    assert (by_name["7g.80gb"]["placements"], by_name["7g.80gb"]["memory_slices"]) == ([0], 8)
    assert by_name["1g.20gb"]["nvml_index"] == 0x9 and by_name["1g.10gb+me"]["nvml_index"] == 0x7


def test_create_at_explicit_placement_with_a_full_compute_instance(mig: NvmlMig, fake: FakeNvml) -> None:
    gi_id = mig.create_gi(H100, P3G, 4)
    assert layout(mig) == [(P3G, 4, 4)]
    assert mig.list_gis(H100)[0]["id"] == gi_id
    gi = fake.gpus[0].gis[gi_id]
    assert [ci.slices for ci in gi.cis.values()] == [3]
    assert fake.calls == ["create_gi 00000000:41:00.0 3g.40gb@4",
                          f"create_ci 00000000:41:00.0 gi={gi_id} slices=3"]


@pytest.mark.parametrize("placements", [
    [(P3G, 4), (P2G, 2), (P1G, 0), (P1G, 1)],  # 3-2-1-1 (MIG guide example 2)
    [(P4G, 0), (P2G, 4), (P1G, 6)],  # 4g+2g+1g (captured A100 -lgi)
    [(P2G, 4), (P1G, 0), (P1G, 1), (P1G, 2), (P1G, 3), (P1G, 6)],  # 2-1-1-1-1-1 (example 3)
    [(P3G, 0), (P3G, 4)],  # 3g+3g (example 1)
    [(P4G, 0), (P3G, 4)],  # 4g+3g (R510+)
    [(P1G2, 0), (P1G2, 2), (P1G2, 4), (P1G2, 6)],  # 1g.20gb x4 fills the memory axis
    [(P7G, 0)],
])
def test_valid_layouts_are_created(mig: NvmlMig, placements: list[tuple[int, int]]) -> None:
    for pid, start in placements:
        mig.create_gi(H100, pid, start)
    sizes = {p["id"]: p["memory_slices"] for p in mig.gi_profiles(H100)}
    assert layout(mig) == sorted(((pid, s, sizes[pid]) for pid, s in placements), key=lambda t: t[1])


def test_overlap_is_refused_with_a_clear_message(mig: NvmlMig) -> None:
    mig.create_gi(H100, P3G, 0)
    with pytest.raises(HostError) as exc:
        mig.create_gi(H100, P4G, 0)
    assert str(exc.value) == ("MIG placement 4g.40gb@0 on 0000:41:00.0 overlaps an existing instance or "
                              "exceeds capacity")
    assert exc.value.reasons[0]["nvml_error"] == 23
    assert layout(mig) == [(P3G, 0, 4)]


def test_3g_3g_leaves_no_room_for_a_1g(mig: NvmlMig) -> None:
    mig.create_gi(H100, P3G, 0)
    mig.create_gi(H100, P3G, 4)
    for start in range(7):
        with raises(HostError, f"1g.10gb@{start} on 0000:41:00.0 overlaps an existing instance"):
            mig.create_gi(H100, P1G, start)
    assert len(layout(mig)) == 2


def test_start_not_allowed_for_the_profile_is_invalid_input(mig: NvmlMig, fake: FakeNvml) -> None:
    with raises(InvalidInput, "4g.40gb@4 on 0000:41:00.0 is not allowed: 4g.40gb can start at 0"):
        mig.create_gi(H100, P4G, 4)
    with raises(InvalidInput, "no MIG profile id 42; it offers: 1g.10gb (id 19)"):
        mig.create_gi(H100, 42, 0)
    assert fake.calls == []


def test_a_second_media_extension_instance_is_refused(mig: NvmlMig) -> None:
    mig.create_gi(H100, P1G_ME, 0)
    with raises(HostError, "1g.10gb+me@3 on 0000:41:00.0 overlaps"):
        mig.create_gi(H100, P1G_ME, 3)
    mig.create_gi(A30, 21, 0)  # 1g.6gb+me
    with raises(HostError, "2g.12gb+me@2 on 0000:c1:00.0 overlaps"):
        mig.create_gi(A30, 6, 2)


def test_seven_1g_fill_the_gpu(mig: NvmlMig) -> None:
    for start in range(7):
        mig.create_gi(H100, P1G, start)
    with raises(HostError, "1g.20gb@6 on 0000:41:00.0 overlaps"):
        mig.create_gi(H100, P1G2, 6)  # slot 7 is free but no profile fits there alone
    assert len(layout(mig)) == 7


def test_a30_four_slices(mig: NvmlMig) -> None:
    mig.create_gi(A30, 5, 0)
    mig.create_gi(A30, 5, 2)
    assert layout(mig, A30) == [(5, 0, 2), (5, 2, 2)]
    with raises(HostError, "1g.6gb@3 on 0000:c1:00.0 overlaps"):
        mig.create_gi(A30, 14, 3)


def test_destroy_removes_compute_instances_then_the_instance(mig: NvmlMig, fake: FakeNvml) -> None:
    gi_id = mig.create_gi(H100, P2G, 2)
    fake.calls.clear()
    mig.destroy_gi(H100, gi_id)
    assert layout(mig) == []
    assert fake.calls == [f"destroy_ci gi={gi_id} ci=0", f"destroy_gi 00000000:41:00.0 {gi_id}"]
    mig.destroy_gi(H100, gi_id)  # absent is fine
    mig.create_gi(H100, P4G, 0)  # the slices are free again


def test_destroy_in_use_is_refused(mig: NvmlMig, fake: FakeNvml) -> None:
    gi_id = mig.create_gi(H100, P3G, 0)
    fake.gpus[0].gis[gi_id].processes = 1
    with raises(HostError, f"destroy MIG instance {gi_id} on 0000:41:00.0: instance in use by "
                           "processes or compute instances"):
        mig.destroy_gi(H100, gi_id)
    assert layout(mig) == [(P3G, 0, 4)]


def test_destroy_with_compute_instances_is_refused_by_nvml(fake: FakeNvml) -> None:
    mig = NvmlMig(fake)
    gi_id = mig.create_gi(H100, P1G, 0)
    fake.nvmlInit()
    try:
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        array = (fake.c_nvmlGpuInstance_t * 7)()
        count = ctypes.c_uint()
        fake.nvmlDeviceGetGpuInstances(handle, P1G, array, ctypes.byref(count))
        with pytest.raises(fake.NVMLError_InUse):
            fake.nvmlGpuInstanceDestroy(array[0])
    finally:
        fake.nvmlShutdown()
    assert mig.list_gis(H100)[0]["id"] == gi_id


def test_no_permission_says_needs_root(mig: NvmlMig, fake: FakeNvml) -> None:
    fake.root = False
    with raises(HostError, "create MIG instance 3g.40gb@0 on 0000:41:00.0: needs root"):
        mig.create_gi(H100, P3G, 0)
    assert layout(mig) == []


def test_mig_disabled_tells_the_admin(mig: NvmlMig, fake: FakeNvml) -> None:
    fake.gpus[0].mig_current = fake.gpus[0].mig_pending = 0
    with raises(HostError, "MIG mode is not enabled on GPU 0000:41:00.0; an admin must enable it: "
                           "nvidia-smi -i 0000:41:00.0 -mig 1; vgpu-ctl never changes MIG mode"):
        mig.create_gi(H100, P3G, 0)
    fake.gpus[0].mig_pending = 1
    with raises(HostError, "it is pending: reset the GPU"):
        mig.create(spec(P3G, 0))
    assert mig.list_gis(H100) == []
    assert [d.gpu_pci for d in mig.list_devices()] == []


def test_fake_refuses_creates_without_mig_mode(fake: FakeNvml) -> None:
    fake.gpus[0].mig_current = 0
    fake.nvmlInit()
    try:
        placement = fake.c_nvmlGpuInstancePlacement_t(0, 4)
        with pytest.raises(fake.NVMLError_NotSupported):
            fake.nvmlDeviceCreateGpuInstanceWithPlacement(fake.nvmlDeviceGetHandleByIndex(0), P3G,
                                                          ctypes.byref(placement))
        with pytest.raises(TypeError, match="byref"):
            fake.nvmlDeviceCreateGpuInstanceWithPlacement(fake.nvmlDeviceGetHandleByIndex(0), P3G, placement)
    finally:
        fake.nvmlShutdown()


def test_gpu_without_mig(fake: FakeNvml) -> None:
    fake.gpus.append(FakeGpu(L40S, "00000000:81:00.0", "GPU-l40s"))
    mig = NvmlMig(fake)
    with raises(HostError, "GPU 0000:81:00.0: MIG not supported on this GPU"):
        mig.create_gi("0000:81:00.0", P3G, 0)
    assert mig.gi_profiles("0000:81:00.0") == []
    assert mig.list_gis("0000:81:00.0") == []


def test_driver_not_loaded_and_unknown_gpu(fake: FakeNvml) -> None:
    with raises(HostError, "GPU 0000:99:00.0 not found by NVML"):
        NvmlMig(fake).list_gis("0000:99:00.0")
    fake.driver_loaded = False
    with raises(HostError, "list GPUs on this host: NVIDIA driver not loaded"):
        NvmlMig(fake).gpus()


def test_device_backend_create_is_idempotent(mig: NvmlMig, fake: FakeNvml) -> None:
    handle = mig.create(spec(P3G, 4))
    assert handle == DeviceHandle(backing=DeviceBacking.MIG, gpu_instance_id=handle.gpu_instance_id)
    assert mig.create(spec(P3G, 4)) == handle
    assert sum(c.startswith("create_gi") for c in fake.calls) == 1
    assert layout(mig) == [(P3G, 4, 4)]


def test_create_adds_the_missing_compute_instance_to_an_existing_gi(mig: NvmlMig, fake: FakeNvml) -> None:
    gi_id = mig.create_gi(H100, P3G, 0)
    fake.gpus[0].gis[gi_id].cis.clear()  # a crash between the GI and its CI
    assert mig.create(spec(P3G, 0)).gpu_instance_id == gi_id
    assert [ci.slices for ci in fake.gpus[0].gis[gi_id].cis.values()] == [3]


def test_device_backend_remove_and_list(mig: NvmlMig) -> None:
    mig.create(spec(P3G, 4))
    mig.create(spec(P2G, 0, "2g.20gb", "dev-2"))
    mig.create_gi(A30, 0, 0)
    devices = mig.list_devices()
    assert [(d.gpu_pci, d.profile) for d in devices] == [
        (H100, "2g.20gb"), (H100, "3g.40gb"), (A30, "4g.24gb")]
    assert all(isinstance(d, HostDevice) and d.backing is DeviceBacking.MIG and d.gpu_instance_id is not None
               for d in devices)
    mig.remove(spec(P3G, 4))
    assert layout(mig) == [(P2G, 0, 2)]
    mig.remove(spec(P3G, 4))  # absent is fine
    mig.remove(spec(P2G, 4))  # nothing of that profile at that start
    assert layout(mig) == [(P2G, 0, 2)]


def test_spec_without_profile_id_is_invalid(mig: NvmlMig) -> None:
    bad = DeviceSpec(device_id="d", gpu_pci=H100, backing=DeviceBacking.MIG, profile="3g.40gb", start=0,
                     size=4, uuid="u")
    with raises(InvalidInput, "needs mig_profile_id"):
        mig.create(bad)


def test_default_binding_is_pynvml() -> None:
    import pynvml

    assert NvmlMig()._nvml is pynvml
    assert H100_80GB.memory_slices == 8 and A30_24GB.memory_slices == 4


def test_a_host_without_the_nvidia_driver_lists_no_instances_but_refuses_creates(fake: FakeNvml) -> None:
    fake.driver_loaded = False
    mig = NvmlMig(fake)
    assert mig.list_devices() == []
    with raises(HostError, "NVIDIA driver not loaded (NVML unavailable)"):
        mig.create(spec(P3G, 0))
