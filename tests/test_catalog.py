"""The shipped GPU catalog loads, holds the reference facts, and broken catalog files are refused clearly."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

# vgpu_ctl is not installed in the venv and pytest's default import mode puts only tests/ on sys.path:
# make the repository root importable when the tests are run as `.venv/bin/pytest tests/...`.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from vgpu_ctl.catalog import ProfileKind, load_catalog  # noqa: E402
from vgpu_ctl.catalog.loader import DATA_DIR, parse_model_file  # noqa: E402
from vgpu_ctl.errors import CatalogError  # noqa: E402

MODELS = {
    "A100-40GB", "A100-80GB", "A30", "A10", "A16", "L4", "L40S",
    "H100-80GB", "H100-NVL", "H200", "T4", "V100-16GB", "V100-32GB",
}
MIG_MODELS = {"A100-40GB", "A100-80GB", "A30", "H100-80GB", "H100-NVL", "H200"}


@pytest.fixture(autouse=True)
def _no_admin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VGPU_CTL_CATALOG_PATH", raising=False)


def test_all_models_load_one_file_each() -> None:
    cat = load_catalog()
    assert set(cat.models) == MODELS
    files = {p.stem for p in DATA_DIR.glob("*.yaml")}
    assert files == {m.lower() for m in MODELS}
    for name in MODELS:
        assert parse_model_file(DATA_DIR / f"{name.lower()}.yaml").model == name


def test_memory_axis() -> None:
    cat = load_catalog()
    expected = {"A100-40GB": 40, "A100-80GB": 80, "A30": 24, "A10": 24, "A16": 16, "L4": 24, "L40S": 48,
                "H100-80GB": 80, "H100-NVL": 94, "H200": 141, "T4": 16, "V100-16GB": 16, "V100-32GB": 32}
    assert {m: cat.model(m).axis_gb for m in MODELS} == expected


def test_mig_only_where_supported() -> None:
    cat = load_catalog()
    assert {m.model for m in cat.models.values() if m.mig is not None} == MIG_MODELS
    assert all(m.passthrough for m in cat.models.values())


def test_h100_3g_takes_four_memory_slices() -> None:
    p = load_catalog().profile("H100-80GB", "3g.40gb")
    assert p is not None
    assert p.kind == ProfileKind.MIG
    assert (p.compute_slices, p.memory_slices, p.size) == (3, 4, 4)
    assert p.placements == (0, 4)
    assert p.profile_id == 9
    seven = load_catalog().profile("H100-80GB", "7g.80gb")
    assert seven is not None and seven.memory_slices == 8


def test_mig_trap_on_every_8_slice_gpu() -> None:
    for m in load_catalog().models.values():
        if m.mig is None or m.mig.memory_slices != 8:
            continue
        by_g = {p.name.split(".")[0]: p for p in m.mig.profiles if p.compute_slices >= 3}
        assert by_g["3g"].memory_slices == 4 and by_g["3g"].starts == [0, 4], m.model
        assert by_g["4g"].memory_slices == 4 and by_g["4g"].starts == [0], m.model
        assert by_g["7g"].memory_slices == 8 and by_g["7g"].starts == [0], m.model


def test_a100_40gb_1g5gb_starts() -> None:
    p = load_catalog().profile("A100-40GB", "1g.5gb")
    assert p is not None
    assert p.placements == tuple(range(7))
    assert (p.profile_id, p.max_instances, p.framebuffer_mib) == (19, 7, 5120)


def test_a30_mig_geometry() -> None:
    mig = load_catalog().model("A30").mig
    assert mig is not None
    assert (mig.memory_slices, mig.compute_slices, mig.max_instances) == (4, 4, 4)
    assert all(not p.provenance.confirmed for p in mig.profiles)


def test_equal_size_types_fit_the_axis() -> None:
    for m in load_catalog().models.values():
        for t in m.vgpu_types:
            size = t.placement_size or t.framebuffer_mib // 1024
            assert size * t.max_equal <= m.axis_gb, (m.model, t.name)
            assert t.framebuffer_mib <= m.memory_mib, (m.model, t.name)
            assert t.name.startswith(m.vgpu_prefixes[0] + "-"), (m.model, t.name)


def test_mixed_placements_fit_and_do_not_overlap() -> None:
    for m in load_catalog().models.values():
        for t in m.vgpu_types:
            if not t.placement_ids:
                continue
            assert t.placement_size is not None
            assert len(t.placement_ids) == t.max_mixed
            assert t.max_mixed is not None and t.max_mixed <= t.max_equal
            ends = [p + t.placement_size for p in t.placement_ids]
            assert all(e <= nxt for e, nxt in zip(ends, t.placement_ids[1:], strict=False)), t.name
            assert ends[-1] <= m.axis_gb, t.name


def test_mig_profiles_fit() -> None:
    for m in load_catalog().models.values():
        if m.mig is None:
            continue
        for p in m.mig.profiles:
            assert p.framebuffer_mib <= m.memory_mib, p.name
            assert len(p.starts) >= p.max_instances or p.media_extensions, p.name
        for v in m.mig.vgpu_types:
            assert v.name.startswith(m.vgpu_prefixes[0] + "-"), v.name


def test_h200_mig_profiles_unconfirmed() -> None:
    cat = load_catalog()
    mig = cat.model("H200").mig
    assert mig is not None and not mig.provenance.confirmed
    infos = [p for p in cat.profiles("H200") if p.kind in (ProfileKind.MIG, ProfileKind.MIG_VGPU)]
    assert len(infos) == 14
    assert all(not p.confirmed and p.note for p in infos)
    # the A100 IDs are published: they stay confirmed
    a100 = cat.profile("A100-80GB", "3g.40gb")
    assert a100 is not None and a100.confirmed


def test_derived_mixed_maps_unconfirmed() -> None:
    cat = load_catalog()
    for model in ("L40S", "H200"):
        vgpu = [p for p in cat.profiles(model) if p.kind == ProfileKind.VGPU]
        assert vgpu and all(not p.confirmed for p in vgpu), model
    l40s_4c = cat.profile("L40S", "L40S-4C")
    assert l40s_4c is not None and (l40s_4c.max_instances, l40s_4c.max_mixed) == (12, 8)
    h100 = cat.profile("H100-80GB", "H100-8C")
    assert h100 is not None and h100.confirmed
    assert h100.mixed_placement_ids == (0, 12, 20, 32, 40, 52, 60, 72)


def test_t4_and_v100_have_no_mixed_mode() -> None:
    cat = load_catalog()
    for model in ("T4", "V100-16GB", "V100-32GB"):
        m = cat.model(model)
        assert not m.mixed_size
        for p in cat.profiles(model):
            assert p.mixed_placement_ids is None and p.max_mixed is None, p.name
    t4 = cat.profile("T4", "T4-4C")
    assert t4 is not None and t4.placements == (0, 4, 8, 12)


def test_h100_nvl_94gb_axis() -> None:
    cat = load_catalog()
    p = cat.profile("H100-NVL", "H100L-94C")
    assert p is not None and p.framebuffer_mib == 96246 and p.size == 94
    p = cat.profile("H100-NVL", "H100L-4C")
    assert p is not None and p.max_instances == 23 and p.max_mixed == 16


def test_by_pci_id() -> None:
    cat = load_catalog()
    a100 = cat.by_pci_id("0x20B5")
    assert a100 is not None and a100.model == "A100-80GB"
    for pci, model in [("0x20f1", "A100-40GB"), ("20b0", "A100-40GB"), ("0x2321", "H100-NVL"),
                       ("0x233b", "H200"), ("0x1df6", "V100-32GB"), ("0x26B9", "L40S")]:
        found = cat.by_pci_id(pci)
        assert found is not None and found.model == model, pci
    assert cat.by_pci_id("0xffff") is None
    assert cat.by_pci_id("nope") is None


def test_pci_ids_unique_across_models() -> None:
    ids = [pid for m in load_catalog().models.values() for pid in m.pci_device_ids]
    assert len(ids) == len(set(ids))


# --- broken files -----------------------------------------------------------------------------------------

GOOD: dict[str, object] = {
    "model": "TEST-8GB",
    "description": "test GPU",
    "memory_mib": 8192,
    "pci_device_ids": ["0xabcd"],
    "vgpu_prefixes": ["TST"],
    "mixed_size": True,
    "vgpu_types": [
        {"name": "TST-8C", "framebuffer_mib": 8192, "max_equal": 1, "max_mixed": 1,
         "placement_size": 8, "placement_ids": [0]},
        {"name": "TST-2C", "framebuffer_mib": 2048, "max_equal": 4, "max_mixed": 2,
         "placement_size": 2, "placement_ids": [0, 4]},
    ],
    "mig": {
        "memory_slices": 4, "compute_slices": 4, "max_instances": 4,
        "profiles": [
            {"name": "1g.2gb", "profile_id": 14, "nvml_index": 0, "compute_slices": 1, "memory_slices": 1,
             "max_instances": 4, "starts": [0, 1, 2, 3], "framebuffer_mib": 2048},
            {"name": "2g.4gb", "profile_id": 5, "nvml_index": 1, "compute_slices": 2, "memory_slices": 2,
             "max_instances": 2, "starts": [0, 2], "framebuffer_mib": 4096},
        ],
        "vgpu_types": [
            {"name": "TST-1-2C", "framebuffer_mib": 2048, "max_instances": 4, "mig_profile": "1g.2gb"},
        ],
    },
}


def _write(folder: Path, data: object, name: str = "test-8gb.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _copy() -> dict[str, Any]:
    out = yaml.safe_load(yaml.safe_dump(GOOD))
    assert isinstance(out, dict)
    return out


def test_good_test_file_parses(tmp_path: Path) -> None:
    spec = parse_model_file(_write(tmp_path, GOOD))
    assert spec.model == "TEST-8GB" and spec.axis_gb == 8


def _unknown_key(d: dict[str, Any]) -> None:
    d["vgpu_types"][1]["colour"] = "red"


def _negative_fb(d: dict[str, Any]) -> None:
    d["vgpu_types"][0]["framebuffer_mib"] = -8192


def _mig_past_slices(d: dict[str, Any]) -> None:
    d["mig"]["profiles"][1]["starts"] = [0, 2, 3]


def _placement_count(d: dict[str, Any]) -> None:
    d["vgpu_types"][1]["placement_ids"] = [0, 4, 6]


def _not_hex(d: dict[str, Any]) -> None:
    d["pci_device_ids"] = ["0xabcd", "0xzz12"]


def _top_unknown(d: dict[str, Any]) -> None:
    d["vendor"] = "nvidia"


def _unknown_mig_profile(d: dict[str, Any]) -> None:
    d["mig"]["vgpu_types"][0]["mig_profile"] = "3g.6gb"


def _equal_past_axis(d: dict[str, Any]) -> None:
    d["vgpu_types"][1]["max_equal"] = 5


@pytest.mark.parametrize(
    ("breaker", "field", "words"),
    [
        (_unknown_key, "vgpu_types[1] (TST-2C).colour", "Extra inputs are not permitted"),
        (_negative_fb, "vgpu_types[0] (TST-8C).framebuffer_mib", "greater than 0"),
        (_mig_past_slices, "mig", "start 3 + size 2 passes the 4 memory slices"),
        (_placement_count, "vgpu_types[1] (TST-2C)", "max_mixed is 2 but 3 placement_ids are listed"),
        (_not_hex, "pci_device_ids", "'0xzz12' is not hexadecimal"),
        (_top_unknown, "vendor", "Extra inputs are not permitted"),
        (_unknown_mig_profile, "mig", "unknown mig_profile '3g.6gb'"),
        # a whole-model check: pydantic gives an empty location, so the loader names no field
        (_equal_past_axis, None, "vGPU type TST-2C: 5 x 2 GB passes the 8 GB framebuffer"),
    ],
)
def test_broken_file_refused(
    tmp_path: Path, breaker: Callable[[dict[str, Any]], None], field: str | None, words: str
) -> None:
    data = _copy()
    breaker(data)
    path = _write(tmp_path, data)
    with pytest.raises(CatalogError) as info:
        parse_model_file(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "'TEST-8GB'" in msg
    if field is not None:
        assert f"field {field}:" in msg
    assert words in msg
    assert info.value.reasons and info.value.reasons[0]["file"] == str(path)
    assert info.value.code == "catalog"
    # the same file in an admin folder breaks the load with the same error
    with pytest.raises(CatalogError, match=r"test-8gb\.yaml"):
        load_catalog(extra_dirs=[tmp_path])


def test_bad_yaml_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model: X\nvgpu_types: [ {name: a\n")
    with pytest.raises(CatalogError) as info:
        parse_model_file(path)
    assert str(path) in str(info.value) and "not valid YAML" in str(info.value)


def test_non_mapping_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(CatalogError, match="expected a mapping"):
        parse_model_file(path)


def test_admin_folder_adds_a_model(tmp_path: Path) -> None:
    _write(tmp_path, GOOD)
    cat = load_catalog(extra_dirs=[tmp_path])
    assert set(cat.models) == MODELS | {"TEST-8GB"}
    found = cat.by_pci_id("0xABCD")
    assert found is not None and found.model == "TEST-8GB"
    mig_vgpu = cat.profile("TEST-8GB", "TST-1-2C")
    assert mig_vgpu is not None and mig_vgpu.kind == ProfileKind.MIG_VGPU
    assert mig_vgpu.placements == (0, 1, 2, 3)
    # the shipped catalog is not changed by it
    assert "TEST-8GB" not in load_catalog().models


def test_admin_folder_replaces_a_model(tmp_path: Path) -> None:
    data = _copy()
    data["model"] = "T4"
    _write(tmp_path, data, "t4.yaml")
    cat = load_catalog(extra_dirs=[tmp_path])
    assert cat.model("T4").description == "test GPU"
    assert len(cat.models) == len(MODELS)


def test_admin_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, GOOD)
    monkeypatch.setenv("VGPU_CTL_CATALOG_PATH", str(tmp_path))
    assert "TEST-8GB" in load_catalog().models


def test_missing_admin_folder(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="does not exist"):
        load_catalog(extra_dirs=[tmp_path / "nope"])


def test_unknown_model_names_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"known models: .*H200"):
        load_catalog().model("B200")
