"""The wheel carries what the controller needs at run time: built from the checkout, installed into a fresh
venv (dependencies from this venv, not the checkout), it renders domains and runs the demo path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the checkout's files as a fresh clone has them (no stale build/ folder)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--no-cache-dir", "-q", "-w", str(out)], check=True, cwd=out, timeout=300)
    (whl,) = out.glob("vgpu_ctl-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel; this venv's site-packages (the dependencies) added after its own, with
    no path to the checkout (the editable install's hook is not run there)."""
    env_dir = tmp_path_factory.mktemp("venv") / "v"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, timeout=300)
    return env_dir


def test_the_wheel_holds_templates_demo_inventory_and_migrations(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in sorted((ROOT / "templates").glob("*.j2")):
        assert f"vgpu_ctl/templates/{f.name}" in names
    assert "vgpu_ctl/examples/demo.yaml" in names
    assert "vgpu_ctl/store/migrations/versions/0004_host_type_ids.py" in names
    assert "vgpu_ctl/catalog/data/h100-80gb.yaml" in names


def test_the_installed_wheel_runs_the_demo_path(installed: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_CTL_", "PYTHONPATH"))}
    env["VGPU_CTL_STATE_DIR"] = str(tmp_path / "state")
    script = r"""
import vgpu_ctl, vgpu_ctl.render, vgpu_ctl.shipped
from pathlib import Path
from vgpu_ctl import Controller
assert "site-packages" in vgpu_ctl.__file__, vgpu_ctl.__file__
print("templates", vgpu_ctl.render.TEMPLATE_DIR)
ctl = Controller()
ctl.apply_inventory(vgpu_ctl.shipped.demo_inventory())
ctl.create_tenant("acme")
vm = ctl.request_vm("acme", "job1", [("H100-3-40C", 1)], vcpus=8, memory_mib=32768)
print("vm", vm.state, vm.host)
xml = ctl.vm_xml(vm.id)
assert "<hostdev mode='subsystem' type='mdev'" in xml or 'type="mdev"' in xml, xml
ctl.close()
"""
    run = subprocess.run([str(installed / "bin" / "python"), "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"templates {installed}" in run.stdout and "/site-packages/vgpu_ctl/templates" in run.stdout
    assert "vm running kvm-h100-01" in run.stdout
    cli = subprocess.run([str(installed / "bin" / "python"), "-m", "vgpu_ctl.cli.main", "vm", "list", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and '"job1"' in cli.stdout, cli.stderr
