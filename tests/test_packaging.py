"""pyproject.toml lists packages by hand (kernels/ installs as arle_kernels): every package
folder must be in the list, or a non-editable install silently lacks it."""

from __future__ import annotations

import os
import subprocess
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



def _python_from_root(*args: str, site: Path | None = None) -> str:
    """`python ARGS` with the repository root as the working directory, so the root is
    sys.path[0] (as for `python -c`, `python -m pytest`); SITE is a sys.path entry after it."""
    env = {**os.environ, "PYTHONPATH": str(site) if site else ""}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def foreign_site(tmp_path: Path) -> Path:
    """A site folder with another distribution's top-level `kernels`, a submodule and metadata."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from kernels.impl import WHO\n")
    (pkg / "impl.py").write_text("WHO = 'foreign'\n")
    (tmp_path / "kernels-9.9.dist-info").mkdir()
    (tmp_path / "kernels-9.9.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 9.9\n")
    (tmp_path / "whoami.py").write_text(
        "import kernels, arle_kernels.gemv\nprint(kernels.WHO, kernels.__file__)\n")
    return tmp_path


def test_root_folder_never_shadows_another_kernels(foreign_site: Path) -> None:
    """From the root, `import kernels` is the other distribution's and ours is `arle_kernels`."""
    code = ("import kernels, arle_kernels, arle_kernels.gemv, importlib.metadata as md; "
            "print(kernels.WHO, kernels.__file__, arle_kernels.__file__, md.version('kernels'))")
    who, theirs, ours, version = _python_from_root("-c", code, site=foreign_site).split()
    assert (who, version) == ("foreign", "9.9")
    assert Path(theirs).parent == foreign_site / "kernels"
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    # `python -m` puts the working directory first too
    who, theirs = _python_from_root("-m", "whoami", site=foreign_site).split()
    assert who == "foreign" and Path(theirs).parent == foreign_site / "kernels"


def test_without_another_kernels_ours_stays_empty_under_that_name() -> None:
    """No other `kernels` on the path: the name is an empty module without a version, which
    transformers' availability check reads as 'not installed'; it sets nothing either."""
    code = ("import sys, os; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
            "os.environ.pop('TRITON_DEFAULT_FP_FUSION', None); import kernels; "
            "print(kernels.__file__, getattr(kernels, '__version__', None), "
            "'TRITON_DEFAULT_FP_FUSION' in os.environ)")
    ours, version, fp_fusion = _python_from_root("-c", code).split()
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert (version, fp_fusion) == ("None", "False")


def test_transformers_and_ours_import_from_the_root() -> None:
    """transformers, which imports the `kernels` distribution wherever one is installed, beside
    ours, from the root (as `python -m pytest` runs)."""
    pytest.importorskip("transformers")
    code = ("from transformers.models.qwen3_5 import modeling_qwen3_5; import arle_kernels.gemv, "
            "importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)")
    origin = _python_from_root("-c", code)
    assert origin == "None" or Path(origin).parent != ROOT / "kernels"
