"""Call 1: variant trees of main's kernels with other K splits (and TMA stages) for the TMA
GEMV's shapes at 3..32 rows, Qwen3-4B's o_proj (2560 x 4096), down (2560 x 9728), qkv (6144 x
2560).

    python3 mkvar.py NAME N:K:SPLIT:STAGES...

Writes NAME/ (kernels, scripts, arle) from HEAD, then edits `_tma_config` in kernels/gemv.py so
that each named shape gets that split and stage count.
"""

import importlib.util
import pathlib
import sys

# the nineteenth session's script makes the tree (NAME/ under the checkout: kernels, scripts and
# arle as HEAD has them)
_spec = importlib.util.spec_from_file_location(
    "mkvar_30l", pathlib.Path(__file__).resolve().parents[1] / "gpu-2026-11-30l" / "mkvar.py")
assert _spec is not None and _spec.loader is not None
_mkvar_30l = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mkvar_30l)
variant_tree = _mkvar_30l.variant_tree


def make(name: str, specs: list[str]) -> None:
    table = {}
    for spec in specs:
        n, k, split, stages = map(int, spec.split(":"))
        table[(n, k)] = (split, stages)
    path = variant_tree(name) / "kernels/gemv.py"
    s = path.read_text()
    old = """    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6 if glu else 4,
                      split_k=split, mma=True, tma=True)"""
    new = f"""    stages = 6 if glu else 4
    if not glu and (n, k) in {table!r}:
        split, stages = {table!r}[(n, k)]
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=stages,
                      split_k=split, mma=True, tma=True)"""
    assert s.count(old) == 1
    path.write_text(s.replace(old, new))


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2:])
