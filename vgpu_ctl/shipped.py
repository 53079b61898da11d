"""Files shipped with vgpu-ctl: the domain and mdev templates and the demo inventory.

In a checkout they live at the top level (`templates/`, `inventory/demo.yaml`, the sources of truth); a built
wheel carries copies inside the package (`vgpu_ctl/templates/`, `vgpu_ctl/examples/`, see setup.py).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


def _first(*candidates: Path) -> Path:
    return next((p for p in candidates if p.exists()), candidates[-1])


def template_dir() -> Path:
    """The folder of the project's Jinja2 templates."""
    return _first(_PACKAGE / "templates", _CHECKOUT / "templates")


def demo_inventory() -> Path:
    """The demo fleet's inventory file (simulated hosts)."""
    return _first(_PACKAGE / "examples" / "demo.yaml", _CHECKOUT / "inventory" / "demo.yaml")
