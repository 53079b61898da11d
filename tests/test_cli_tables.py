"""`vgpuctl profiles list` without rich or pydantic's catalog models: the plain table is rich's own output (with
its escape codes on a terminal), and the cached catalog is the catalog (and is dropped when a catalog file or the
loader changes)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from vgpu_ctl import user_cache
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.catalog.loader import CATALOG_PATH_ENV, DATA_DIR, _load
from vgpu_ctl.cli.catalog_cache import CACHE_NAME, listed_profiles
from vgpu_ctl.cli.table import PlainTable, output_mode, output_width
from vgpu_ctl.errors import CatalogError


def _profiles_table(wide: bool) -> PlainTable:
    t = PlainTable("model", "profile", "kind", "memory", "max", *(["placements"] if wide else []), "confirmed")
    for p in load_catalog().profiles():
        extra = [",".join(map(str, p.placements or ()))] if wide else []
        t.add_row(p.model, p.name, str(p.kind), f"{p.framebuffer_mib // 1024}GiB", str(p.max_instances), *extra,
                  "yes" if p.confirmed else "[yellow]UNCONFIRMED[/]")
    return t


def _rich(table: PlainTable, width: int, ansi: bool = False, colours: str = "standard") -> str:
    out = io.StringIO()
    Console(highlight=False, soft_wrap=True, width=width, file=out, force_terminal=ansi,
            color_system=colours if ansi else None).print(table.to_rich())
    return out.getvalue()


@pytest.mark.parametrize(("wide", "ansi"), [(False, False), (True, False), (False, True), (True, True)])
def test_a_plain_table_is_what_rich_prints_or_left_to_rich(wide: bool, ansi: bool) -> None:
    styled = PlainTable("a", "b", "c")
    for cells in (("x", "[red]no[/]", ""), ("[bold]longer[/]", "[green]y[/]", "[dim]z[/]"), ("", "", "[cyan]c[/]")):
        styled.add_row(*cells)
    fast = 0
    for t in (_profiles_table(wide), PlainTable("a", "b"), styled):
        for width in (*range(10, 200, 7), 1000):
            mine = t.render(width, ansi=ansi)
            if mine is not None:
                fast += 1
                for colours in ("standard", "256", "truecolor") if ansi else ("standard",):
                    assert mine == _rich(t, width, ansi, colours), (width, colours)
            else:  # only when it does not fit at its natural width
                assert width < max(len(line) for line in _rich(t, 1000).splitlines())
    assert fast > 30


@pytest.mark.parametrize("cell", ["[bold]a[/] b", "é", "a:smile:", " a", "[link=x]a[/]", "a\tb", "[blink]a[/]"])
def test_a_cell_rich_would_interpret_is_left_to_rich(cell: str) -> None:
    t = PlainTable("h", "i")
    t.add_row(cell, "x")
    assert t.render(200, ansi=True) is None
    t = PlainTable("h", "i")
    t.add_row("[yellow]UNCONFIRMED[/]", "x")
    assert t.render(200) == _rich(t, 200) and t.render(200, ansi=True) == _rich(t, 200, ansi=True)


def test_colours_and_width_are_decided_as_rich_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert output_mode() == "plain" and not Console().is_terminal
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert output_mode() == "ansi" and Console().is_terminal
    monkeypatch.setenv("NO_COLOR", "1")
    assert output_mode() is None  # rich's way without colours: left to rich
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    assert output_mode() == "plain" and not Console().is_terminal
    monkeypatch.setenv("COLUMNS", "133")
    assert output_width() == Console().width == 133


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "vgpu-ctl" / CACHE_NAME


def test_the_cached_catalog_lists_what_the_catalog_does(cache: Path) -> None:
    catalog = load_catalog()
    assert listed_profiles() == catalog.profiles() and cache.exists()
    assert os.stat(cache).st_mode & 0o777 == 0o600 and os.stat(cache.parent).st_mode & 0o777 == 0o700
    assert listed_profiles() == catalog.profiles()  # now from the cache
    for model in catalog.models:
        assert listed_profiles(model.lower()) == catalog.profiles(model)
    with pytest.raises(CatalogError, match="Z999"):
        listed_profiles("Z999")


def test_a_changed_catalog_file_or_loader_drops_the_cache(cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    listed_profiles()
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "a100-80gb.yaml").write_text((DATA_DIR / "a100-80gb.yaml").read_text().replace(
        "A100D-10C", "A100D-10X"))
    monkeypatch.setenv(CATALOG_PATH_ENV, str(extra))
    names = {p.name for p in listed_profiles("A100-80GB")}
    assert "A100D-10X" in names and "A100D-10C" not in names
    (extra / "a100-80gb.yaml").write_text("model: [broken")
    _load.cache_clear()  # the loader keeps what it read in this process; a new process reads the file again
    with pytest.raises(CatalogError, match=r"a100-80gb\.yaml"):
        listed_profiles()
    monkeypatch.delenv(CATALOG_PATH_ENV)
    stale = json.loads(cache.read_text())
    stale["data"]["A100-80GB"] = []
    cache.write_text(json.dumps({**stale, "digest": "another loader's"}))
    assert listed_profiles("A100-80GB") == load_catalog().profiles("A100-80GB")


def test_an_unwritable_cache_still_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no folder can be made there
    assert listed_profiles() == load_catalog().profiles()
    monkeypatch.setattr(user_cache, "cache_dir", lambda: None)
    assert listed_profiles() == load_catalog().profiles()


@pytest.mark.parametrize("columns", ["80", "120"])  # 80: a classic terminal, and rich's width off a terminal
def test_profiles_list_imports_neither_rich_nor_the_catalog_schema(tmp_path: Path, columns: str) -> None:
    code = ("import sys, io; from vgpu_ctl.cli.main import app; sys.argv = ['vgpuctl', 'profiles', 'list']\n"
            "out, sys.stdout = sys.stdout, io.StringIO()\n"
            "try: app()\nexcept SystemExit: pass\n"
            "table, sys.stdout = sys.stdout.getvalue(), out\n"
            "print([m for m in ('rich', 'yaml', 'vgpu_ctl.catalog.schema', 'sqlalchemy') if m in sys.modules],"
            " 'A100D-10C' in table and '┃ model' in table)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "COLUMNS": columns}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert "vgpu_ctl.catalog.schema" in first.stdout  # the first run fills the cache from the catalog files
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert again.stdout.strip() == "[] True"
