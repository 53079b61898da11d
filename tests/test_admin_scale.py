"""Admin commands built for fleet scale (issue 12): `status --gpus` a page at a time, the inventory parsed once
with libyaml and lines found only for an error, a re-apply that changes nothing, a store at head opened without
Alembic, and a CLI that starts without the controller. Timings are the benchmark's job (scripts/bench_admin.py),
never these tests'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from opsfixtures import DEMO, Store, cli, cli_json, clone, events_of, snapshot, template_store
from pydantic import BaseModel, ValidationError

from vgpu_ctl import InventoryError, load_catalog
from vgpu_ctl import inventory as inventory_mod
from vgpu_ctl.inventory import parse_inventory
from vgpu_ctl.store import migrate


@pytest.fixture
def store(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    return clone(template_store(tmp_path_factory), tmp_path / "state")


# -- status: a summary by default, GPU rows a page at a time -------------------------------------------------------

def test_status_default_is_a_summary_without_gpu_rows(store: Store) -> None:
    out = cli_json(store, "status")
    assert set(out) == {"summary", "pools", "tenants"}
    s = out["summary"]
    assert s["hosts"] == 3 and s["hosts_by_state"] == {"active": 3} and s["gpus"] == 9
    assert s["devices"] == 3 and s["in_use"] == 3  # acme's two VMs and globex's one, one device each
    assert sum(m["gpus"] for m in s["by_mode"].values()) == 9 and s["by_mode"]["mig"]["gpus"] == 3
    assert s["free_units"] < s["axis_units"]
    text = cli(store, "status")
    assert text.exit_code == 0 and "Fleet" in text.output and "--gpus" in text.output
    assert "0000:" not in text.output and "…/" not in text.output  # no GPU row


def test_gpu_pages_cover_the_fleet_once_in_order(store: Store) -> None:
    every = cli_json(store, "status", "--gpus", "--limit", "1000")["gpus"]
    assert len(every) == 9
    assert [(g["host"], g["pci"]) for g in every] == sorted((g["host"], g["pci"]) for g in every)
    pages = []
    for offset in (0, 4, 8):
        out = cli_json(store, "status", "--gpus", "--limit", "4", "--offset", str(offset))
        assert out["page"] == {"offset": offset, "limit": 4, "total": 9}
        pages += out["gpus"]
    assert pages == every
    assert cli_json(store, "status", "--offset", "9")["gpus"] == []  # --offset alone asks for rows too
    last = cli(store, "status", "--gpus", "--limit", "4", "--offset", "4")
    assert last.exit_code == 0 and "GPUs 5-8 of 9; next page: --offset 8" in last.output
    end = cli(store, "status", "--gpus", "--limit", "4", "--offset", "8")
    assert "GPUs 9-9 of 9" in end.output and "next page" not in end.output


def test_gpu_pages_follow_the_filters(store: Store) -> None:
    out = cli_json(store, "status", "--pool", "inference", "--gpus", "--limit", "2")
    assert out["page"]["total"] == 3 and len(out["gpus"]) == 2
    assert {g["pool"] for g in out["gpus"]} == {"inference"}
    assert out["summary"]["gpus"] == 3
    out = cli_json(store, "status", "--host", "kvm-l40s-01", "--gpus")
    assert out["page"]["total"] == 2 and out["summary"]["hosts"] == 1


@pytest.mark.parametrize("args,field", [(["--limit", "0"], "limit"), (["--limit", "-3"], "limit"),
                                        (["--limit", "1000001"], "limit"), (["--offset", "-1"], "offset")])
def test_bad_page_is_exit_2_naming_the_field_and_changes_nothing(store: Store, args: list[str],
                                                                  field: str) -> None:
    before, events = snapshot(store), events_of(store)
    res = cli(store, "status", "--gpus", *args, "--json")
    assert res.exit_code == 2, res.output
    err = json.loads(res.stdout)["error"]
    assert err["code"] == "invalid" and field in err["message"]
    assert err["reasons"][0]["field"] == field
    text = cli(store, "status", "--gpus", *args)
    assert text.exit_code == 2 and field in text.output
    assert snapshot(store) == before and events_of(store) == events


def test_limit_that_is_not_a_number_is_a_usage_error(store: Store) -> None:
    res = cli(store, "status", "--gpus", "--limit", "many")
    assert res.exit_code == 2 and "--limit" in res.output


def test_tenant_sees_no_summary_and_no_gpu_rows(store: Store) -> None:
    out = cli_json(store, "status", "--gpus", token=store.tokens["acme"])
    assert out["summary"] is None and out["gpus"] == [] and out["page"]["total"] == 0
    assert [t["name"] for t in out["tenants"]] == ["acme"]


# -- inventory files: libyaml, lines only on error ------------------------------------------------------------------

def test_the_c_loader_is_used_when_pyyaml_has_it() -> None:
    if not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML built without libyaml")
    assert issubclass(inventory_mod._LOADER, yaml.CSafeLoader)


@pytest.mark.parametrize("text", [
    "a: &x {b: 1}\nc: *x\n", "a: &x [1, *x]\n", "<<: {a: 1}\nb: 2\n", "? [1]\n: 2\n", "a: !foo 1\n",
    "a: 2020-01-01\nb: !!binary aGk=\n", "a: [1, 2.5, true, null, ~, .inf, 0x1f, '1', \"x\"]\n", "!!set {a, b}\n",
    "- !!str 1\n- {a: {b: [c, {d: e}]}}\n", "{}", "x", "=: [1]\n",
])
def test_the_plain_builder_gives_what_pyyaml_gives(text: str) -> None:
    def load(loader: type[yaml.SafeLoader]) -> object:
        try:
            return yaml.load(text, Loader=loader)
        except yaml.YAMLError as exc:
            return type(exc)

    ours, theirs = load(inventory_mod._LOADER), load(inventory_mod._BASE_LOADER)
    if isinstance(theirs, dict) and theirs.get("a") is not None and isinstance(theirs["a"], list) \
            and theirs["a"] and theirs["a"][-1] is theirs["a"]:  # the recursive list: same shape
        assert isinstance(ours, dict) and ours["a"][-1] is ours["a"]
        return
    assert ours == theirs
    if isinstance(theirs, dict) and "c" in theirs and theirs.get("a") is theirs.get("c"):
        assert isinstance(ours, dict) and ours["a"] is ours["c"]  # an alias is one shared object, as in PyYAML


# Plain scalars from characters that start YAML's implicit types and others, as keys and as values, in block
# and flow style: the loader's shortcut past PyYAML's resolver must give PyYAML's own result (or its error).
_TOKENS = ["true", "False", "yes", "No", "ON", "off", "y", "n", "null", "Null", "~", "", "0", "-1", "+2", "1_000",
           "0x1f", "0o17", "017", "1:20", "3.5", "-.5", "1e3", ".inf", "-.Inf", ".nan", "2001-12-14", "=", "<<",
           "A100-80GB", "vgpu-equal", "name", "nvidia-35", "t", "f", "o"]
_SCALAR = st.one_of(st.sampled_from(_TOKENS), st.text(alphabet="aZnNyYtTfFoOeslu~0129.+-_:<=!&* x", max_size=8),
                    st.builds(str.__add__, st.sampled_from(_TOKENS), st.sampled_from(_TOKENS)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_SCALAR, _SCALAR), min_size=1, max_size=6), st.booleans())
def test_the_loader_resolves_plain_scalars_as_pyyaml_does(pairs: list[tuple[str, str]], flow: bool) -> None:
    if flow:
        text = "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}\n"
    else:
        text = "".join(f"{k}: [{v}, '{v}']\n" for k, v in pairs)
    test_the_plain_builder_gives_what_pyyaml_gives(text)
    test_the_plain_builder_gives_what_pyyaml_gives(f"- {pairs[0][1]}\n- {pairs[0][0]}\n")


def _declarations() -> list[type[BaseModel]]:
    return [m for m in vars(inventory_mod).values()
            if isinstance(m, type) and issubclass(m, inventory_mod._Strict) and m is not inventory_mod._Strict]


@pytest.mark.parametrize("model,field", [(m, f) for m in _declarations() for f, info in m.model_fields.items()
                                         if info.annotation in (int, float)])
def test_every_number_of_an_inventory_refuses_yaml_booleans(model: type[BaseModel], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        model.model_validate({field: True})
    assert any(e["loc"] == (field,) and "expected a number, got true" in e["msg"] for e in err.value.errors())


BROKEN_SYNTAX = """pools:
  - name: p1
hosts:
  - name: h1
    uri: "simulated:///h1"
    vcpus: 8
    memory_mib: 1024
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB
"""

BAD_FIELD = """pools:
  - name: p1
hosts:
  - name: h1
    uri: "simulated:///h1"
    driver: simulated
    vcpus: 8
    memory_mib: 1024
    gpus:
      - {pci: "0000:41:00.0", model: A100-80GB, pool: p1}
      - {pci: "0000:61:00.0", model: A100-80GB, pool: p1, colour: red}
"""

UNKNOWN_POOL = BAD_FIELD.replace(", colour: red", "").replace("61:00.0\", model: A100-80GB, pool: p1",
                                                              "61:00.0\", model: A100-80GB, pool: p9")


@pytest.mark.parametrize("loader", ["default", "pure-python"])
def test_errors_name_their_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader: str) -> None:
    if loader == "pure-python":
        monkeypatch.setattr(inventory_mod, "_LOADER", yaml.SafeLoader)
    catalog = load_catalog()
    cases = [(BROKEN_SYNTAX, ":10: not valid YAML"),  # libyaml and PyYAML both point past the open brace
             (BAD_FIELD, ":11: field hosts[0].gpus[1].colour: unknown key 'colour'"),
             (UNKNOWN_POOL, ":11: field hosts[0].gpus[1].pool: unknown pool 'p9'")]
    for i, (text, expected) in enumerate(cases):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(text)
        with pytest.raises(InventoryError) as exc:
            parse_inventory(path, catalog)
        assert f"{path}{expected}" in exc.value.message, exc.value.message


def test_a_good_file_is_never_composed_for_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compose(*args: object, **kwargs: object) -> None:
        raise AssertionError("composed a file that has no error")

    monkeypatch.setattr(inventory_mod.yaml, "compose", no_compose)
    inv = parse_inventory(DEMO, load_catalog())
    assert len(inv.hosts) == 3 and sum(len(h.gpus) for h in inv.hosts) == 9


def _no_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed YAML the cache holds")

    monkeypatch.setattr(inventory_mod.yaml, "load", refuse)


def test_a_second_parse_of_the_same_file_reads_the_cache_not_yaml(tmp_path: Path, user_cache_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_bytes(DEMO.read_bytes())
    catalog = load_catalog()
    first = parse_inventory(path, catalog)
    cached = user_cache_dir / "vgpu-ctl" / inventory_mod.PARSED_CACHE
    assert cached.stat().st_mode & 0o777 == 0o600 and cached.parent.stat().st_mode & 0o777 == 0o700
    with monkeypatch.context() as m:
        _no_yaml(m)
        assert parse_inventory(path, catalog) == first
    path.write_text(DEMO.read_text().replace("vcpus: 128", "vcpus: 96", 1))  # an edit: parsed afresh
    with monkeypatch.context() as m:
        _no_yaml(m)
        with pytest.raises(AssertionError, match="parsed YAML"):
            parse_inventory(path, catalog)
    edited = parse_inventory(path, catalog)
    assert edited != first and sorted(h.vcpus for h in edited.hosts) != sorted(h.vcpus for h in first.hosts)


def test_a_cached_file_with_an_error_still_names_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_FIELD)
    catalog = load_catalog()
    for cached in (False, True):
        with monkeypatch.context() as m:
            if cached:
                _no_yaml(m)
            with pytest.raises(InventoryError) as exc:
                parse_inventory(path, catalog)
        assert f"{path}:11: field hosts[0].gpus[1].colour: unknown key 'colour'" in exc.value.message


@pytest.mark.parametrize("junk", [b"", b"{", b"[]", b'{"digest": 1}', b'{"data": {"hosts": []}}'])
def test_a_broken_or_foreign_cache_file_is_ignored(tmp_path: Path, user_cache_dir: Path, junk: bytes) -> None:
    catalog = load_catalog()
    expected = parse_inventory(DEMO, catalog)
    (user_cache_dir / "vgpu-ctl" / inventory_mod.PARSED_CACHE).write_bytes(junk)
    assert parse_inventory(DEMO, catalog) == expected


@pytest.mark.parametrize("loose", ["folder", "file"])
def test_a_cache_others_could_write_is_not_read(user_cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                loose: str) -> None:
    catalog = load_catalog()
    expected = parse_inventory(DEMO, catalog)
    folder = user_cache_dir / "vgpu-ctl"
    (folder if loose == "folder" else folder / inventory_mod.PARSED_CACHE).chmod(0o777 if loose == "folder"
                                                                               else 0o666)
    with monkeypatch.context() as m:
        _no_yaml(m)
        with pytest.raises(AssertionError, match="parsed YAML"):  # not trusted: parsed afresh
            parse_inventory(DEMO, catalog)
    assert parse_inventory(DEMO, catalog) == expected  # written again, and the folder made private again
    assert folder.stat().st_mode & 0o777 == 0o700
    with monkeypatch.context() as m:
        _no_yaml(m)
        assert parse_inventory(DEMO, catalog) == expected


def test_what_json_cannot_hold_is_not_cached(tmp_path: Path, user_cache_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "dated.yaml"
    path.write_text(DEMO.read_text() + "\nlabels_since: 2020-01-01\n")  # a date: JSON would hand back a string
    with pytest.raises(InventoryError):
        parse_inventory(path, load_catalog())
    assert not (user_cache_dir / "vgpu-ctl" / inventory_mod.PARSED_CACHE).exists()


# -- inventory apply: a second apply of the same file changes nothing -----------------------------------------------

def test_reapply_unchanged_reports_no_changes_and_writes_nothing(store: Store) -> None:
    before, events = snapshot(store), events_of(store)
    out = cli_json(store, "inventory", "apply", str(DEMO))
    assert out["changes"] == [] and out["kept"] == []
    res = cli(store, "inventory", "apply", str(DEMO))
    assert res.exit_code == 0 and res.output.strip() == "no changes"
    assert snapshot(store) == before and events_of(store) == events  # no row written, no event recorded


def test_first_apply_adds_every_gpu_in_file_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vgpu_ctl import Controller
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "state"))
    with Controller(f"sqlite:///{tmp_path / 's.db'}", state_path=tmp_path / "state") as ctl:
        changes = ctl.apply_inventory(DEMO)
        declared = parse_inventory(DEMO, ctl.catalog)
        gpus = [c["name"] for c in changes if c["kind"] == "gpu"]
        assert gpus == [f"{h.name}/{g.pci}" for h in declared.hosts for g in h.gpus]
        shown = {f"{h['name']}/{g['pci']}": g for h in ctl.inventory()["hosts"] for g in h["gpus"]}
        assert set(shown) == set(gpus)
        assert all(g["free_units"] == g["axis_units"] for g in shown.values())
        assert ctl.apply_inventory(DEMO) == []


# -- start-up: no controller for --help, no Alembic for a store at head ----------------------------------------------

def test_cli_and_package_import_nothing_heavy() -> None:
    code = ("import sys, vgpu_ctl.cli.main; heavy = [m for m in ('vgpu_ctl.service.controller', 'sqlalchemy', "
            "'sqlmodel', 'alembic', 'libvirt', 'jinja2', 'rich', 'yaml', 'pydantic') if m in sys.modules]; "
            "print(heavy); "
            "from vgpu_ctl import Controller, __version__; print(Controller.__name__, bool(__version__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "Controller True"]


def test_every_public_name_resolves() -> None:
    import vgpu_ctl
    for name in vgpu_ctl.__all__:
        assert getattr(vgpu_ctl, name) is not None
    assert set(vgpu_ctl.__all__) <= set(dir(vgpu_ctl))
    with pytest.raises(AttributeError):
        vgpu_ctl.NoSuchName  # noqa: B018


def test_head_from_the_files_is_alembics_head(store: Store) -> None:
    from alembic.script import ScriptDirectory
    assert migrate._file_head() == ScriptDirectory.from_config(migrate.alembic_config()).get_current_head()
    ctl = store.ctl()
    try:
        assert migrate.at_head(ctl.engine)
        with ctl.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0001'")
        assert not migrate.at_head(ctl.engine)
    finally:
        ctl.close()


def test_store_at_head_opens_without_running_alembic(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import alembic.command

    def no_upgrade(*args: object, **kwargs: object) -> None:
        raise AssertionError("Alembic ran on a store at head")

    monkeypatch.setattr(alembic.command, "upgrade", no_upgrade)
    ctl = store.ctl()
    ctl.close()
    ctl = store.as_tenant("acme")  # a tenant's open checks the revision the same way
    ctl.close()


# -- the same on both stores (SQLite and PostgreSQL) ----------------------------------------------------------------

def test_summary_pages_and_doctor_on_each_store(ctl: Any) -> None:
    from vgpu_ctl.ops.doctor import diagnose
    from vgpu_ctl.ops.status import fleet_status
    ctl.create_tenant("acme")
    ctl.request_vm("acme", "a1", [("A100D-10C", 1)], vcpus=2, memory_mib=2048, pool="inference")
    out = fleet_status(ctl, gpus=False)
    assert "gpus" not in out and out["summary"]["gpus"] == 9 and out["summary"]["devices"] == 1
    assert out["summary"]["in_use"] == 1 and out["summary"]["hosts_by_state"] == {"active": 3}
    every = fleet_status(ctl)["gpus"]
    pages = [g for off in (0, 5) for g in fleet_status(ctl, limit=5, offset=off)["gpus"]]
    assert pages == every and len(every) == 9
    fits = {p["name"]: p["fits"] for p in out["pools"]}
    assert fits["inference"]["A100D-10C"] == 7
    assert all(r.ok for r in diagnose(ctl)), [r.to_dict() for r in diagnose(ctl) if not r.ok]
    assert ctl.apply_inventory(DEMO) == []
