"""Calls 1-2: a variant tree of main's kernels (run at 44baa1b): the fused gate_up's TMA stages
and where the TMA GEMV lets the next kernel launch (PDL).

    python3 mkvar.py NAME GATE_UP_STAGES LATE [STAGES_AT_16_ROWS]

LATE: "" (first thing, as main was), "glu", "glu,down" or "all": the layers whose TMA GEMV
triggers its dependents after the K loop. STAGES_AT_16_ROWS: a cap on the fused gate_up's
stages at M_PAD 16 (0: none). Writes NAME/ (kernels, scripts, arle) from HEAD, then edits
kernels/gemv.py. Reformatted for ruff after the session; the edits are the ones that ran.
"""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path("/work/main")


def variant_tree(name: str) -> pathlib.Path:
    """NAME/ under the checkout: kernels, scripts and arle as HEAD has them."""
    dst = ROOT / name
    subprocess.run(f"rm -rf {dst} && mkdir -p {dst} && git -C {ROOT} archive HEAD kernels "
                   f"scripts arle | tar -x -C {dst}", shell=True, check=True)
    return dst


def edit(path: pathlib.Path, pairs: list[tuple[str, str]]) -> None:
    """Replace each old text (found exactly once) by its new one."""
    s = path.read_text()
    for old, new in pairs:
        assert s.count(old) == 1, (path, old[:60], s.count(old))
        s = s.replace(old, new)
    path.write_text(s)


def make(name: str, stages: int, late: str, glu16: int) -> None:
    layers = late.split(",") if late else []
    edit(variant_tree(name) / "kernels/gemv.py", [
        ("""                     PDL: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr = False):
    \"\"\"`_gemv_mma_kernel`'s contract with the tiles""",
         """                     PDL: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr = False,
                     LATE: tl.constexpr = False):
    \"\"\"`_gemv_mma_kernel`'s contract with the tiles"""),
        ("""    NOTE: k_per_split is a multiple of BLOCK_K, so no chunk crosses into the next split.\"\"\"
    if PDL:
        gdc_launch_dependents()""",
         """    NOTE: k_per_split is a multiple of BLOCK_K, so no chunk crosses into the next split.\"\"\"
    if PDL and not LATE:
        gdc_launch_dependents()"""),
        ("""            acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PRECISION)
    _store_transposed(""",
         """            acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PRECISION)
    if PDL and LATE:
        gdc_launch_dependents()
    _store_transposed("""),
        ("    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6 if glu else 4,",
         f"    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages={stages} if glu "
         "else 4,"),
        ("""    meta = meta | {"num_stages": stages}
    n = dst.shape[-1]""",
         f"""    late = {layers!r}
    if {glu16} and meta["GLU"] and m_pad == 16:
        stages = min(stages, {glu16})
    is_down = k > 2 * weight.shape[0]
    meta = meta | {{"num_stages": stages, "LATE": "all" in late
                   or (bool(meta["GLU"]) and "glu" in late) or (is_down and "down" in late)}}
    n = dst.shape[-1]"""),
    ])


if __name__ == "__main__":
    make(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
