"""pyproject.toml lists packages by hand (kernels/ installs as arle_kernels): every package
folder must be in the list, or a non-editable install silently lacks it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_every_package_is_listed() -> None:
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "arle").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml packages: {sorted(found - listed)}"
    assert cfg["package-dir"]["arle_kernels"] == "kernels" and "arle_kernels" in listed
