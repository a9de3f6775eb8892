"""arle's kernels (imported as `arle_kernels`): each op's Triton version (`<name>.py`, the CUDA
executor's) beside its plain-torch reference (`<name>_ref.py`, the CPU executor's, which never
loads Triton), which the kernel's tests compare it against."""

import importlib.machinery
import importlib.util
import os
import sys


def _yield_name_to_distribution(name: str) -> None:
    """Load the other distribution's top-level package `name` in this module's place, if one is on
    sys.path once this folder's parent (the repository root) is left out."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        return  # NOTE: stays an empty module: no version, no names, so nothing takes it for that one
    module = importlib.util.module_from_spec(spec)
    # NOTE: the import system returns whatever sys.modules holds once this file has run.
    sys.modules[name] = module
    spec.loader.exec_module(module)


# NOTE: this folder is the package `arle_kernels` (pyproject's package-dir). With the repository
# root on sys.path (`python -m pytest`, `python -c`, a script that adds it) it is also importable
# by its folder name, `kernels`, and would shadow the PyPI distribution of that name, which
# transformers imports. Under that name it hands over and does nothing of its own.
if __name__ != "arle_kernels":
    _yield_name_to_distribution(__name__)
else:
    # NOTE: FMA contraction (a * b + c as one fma) in every kernel, as they were tuned, measured and
    # their tests written. Triton 3.9 warns that its default turns it off from 3.10 (ptxas
    # --fmad=false: more instructions in the instruction-bound kernels, other roundings). A
    # TRITON_DEFAULT_FP_FUSION the user set still wins; compile workers inherit it.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
