"""The plan's HTML report: self-contained, and rendered by headless Chromium without script errors."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import DEMO, REPO

DEMAND = REPO / "inventory" / "demo-demand.yaml"


def _report(tmp_path: Path, *args: str) -> Path:
    from vgpu_ctl.cli.main import app
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, [*args, "--demand", str(DEMAND), "--fleet", str(DEMO), "--report", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_report_is_self_contained(tmp_path: Path) -> None:
    html = _report(tmp_path, "plan").read_text()
    assert html.startswith("<!DOCTYPE html>")
    # No network: nothing loaded from elsewhere.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html
    for chart in ("Allocation by pool and model", "Stranded capacity by cause", "GPU-by-GPU occupancy"):
        assert chart in html
    assert html.count("<svg") == 2


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.parametrize("command", [["plan"], ["advise", "carving"]])
def test_report_renders_in_headless_chromium(tmp_path: Path, command: list[str]) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian package 'chromium'; scripts/bootstrap.sh --dev installs it)")
    page = _report(tmp_path, *command)
    done = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    # The page's script writes the marker after drawing every GPU of the map; a script error writes report-error.
    marker = re.search(r'<p id="report-rendered" data-gpus="(\d+)"', dom)
    assert marker is not None, dom[-2000:]
    assert int(marker.group(1)) == 9  # the demo fleet's GPUs
    assert dom.count('class="gpu"') == 9
    assert 'id="report-error"' not in dom
    assert "Uncaught" not in done.stderr, done.stderr[-2000:]
    if command[0] == "advise":
        assert 'id="advice"' in dom
