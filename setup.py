"""Build hook: the top-level templates/ and inventory/demo.yaml (the sources of truth in the checkout) are
copied into the built package as vgpu_ctl/templates/ and vgpu_ctl/examples/, so a wheel carries them."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"templates": ("templates", "*.j2"), "examples": ("inventory", "demo.yaml")}


class BuildPy(build_py):  # type: ignore[misc]
    """build_py that also puts the shipped data files into the package."""

    def run(self) -> None:
        super().run()
        for target, (source, pattern) in SHIPPED.items():
            out = Path(self.build_lib) / "vgpu_ctl" / target
            out.mkdir(parents=True, exist_ok=True)
            for f in sorted((ROOT / source).glob(pattern)):
                shutil.copy2(f, out / f.name)


setup(cmdclass={"build_py": BuildPy})
