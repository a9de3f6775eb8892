"""Call 4: a variant tree of main at e50c537 (the TMA GEMV's late PDL trigger in every layer)
with the late trigger only where RULE holds.

    python3 mkvar2.py NAME RULE     (RULE: a Python expression in glu, n, k; e.g. "glu or k > n")

Writes NAME/ (kernels, scripts, arle) from HEAD, then edits kernels/gemv.py. Reformatted for
ruff after the session; the edits are the ones that ran.
"""

import sys

from mkvar import edit, variant_tree


def make(name: str, rule: str) -> None:
    edit(variant_tree(name) / "kernels/gemv.py", [
        ("PDL: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr = False):\n"
         "    \"\"\"`_gemv_mma_kernel`'s contract with the tiles",
         "PDL: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr = False,\n"
         "                     LATE: tl.constexpr = True):\n"
         "    \"\"\"`_gemv_mma_kernel`'s contract with the tiles"),
        ('''    NOTE: k_per_split is a multiple of BLOCK_K, so no chunk crosses into the next split."""
    pid_k''',
         '''    NOTE: k_per_split is a multiple of BLOCK_K, so no chunk crosses into the next split."""
    if PDL and not LATE:
        gdc_launch_dependents()
    pid_k'''),
        ('''    if PDL:
        gdc_launch_dependents()
    _store_transposed''',
         '''    if PDL and LATE:
        gdc_launch_dependents()
    _store_transposed'''),
        ('''    meta = meta | {"num_stages": _tma_stages(cfg, bool(meta["GLU"]), m_pad, x.element_size())}''',
         f'''    glu, n = bool(meta["GLU"]), weight.shape[0]
    meta = meta | {{"num_stages": _tma_stages(cfg, bool(meta["GLU"]), m_pad, x.element_size()),
                   "LATE": bool({rule})}}'''),
    ])


if __name__ == "__main__":
    make(sys.argv[1], sys.argv[2])
