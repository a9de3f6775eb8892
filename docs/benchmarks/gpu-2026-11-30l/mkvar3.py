"""For the next session (not measured): variant trees of main at 0244947 that move the PDL
triggers once more.

    python3 mkvar3.py NAME AHEAD NORM_LATE

AHEAD (0-3): the TMA GEMV's late trigger (`_late_trigger`'s layers) fires AHEAD K chunks before
the end of its loop rather than after it, so the kernel after it (the norm) launches while
the last chunks stream and its launch is hidden (it cost the two norms +10-12 us a batch-8
step each in call 2). NORM_LATE (0/1): `add_rms_norm` on split sums (3+ rows, so a TMA GEMV
comes next) triggers after its store, so the GEMV after it is placed once the norm is done.
Checked without a GPU: the loop stays pipelined (the same TMA loads before it), the same
registers and shared memory (scripts/kernel_regs.py, sm_90a).
"""

import sys

from mkvar import edit, variant_tree


def make(name: str, ahead: int, norm_late: bool) -> None:
    dst = variant_tree(name)
    if ahead:
        edit(dst / "kernels/gemv.py", [("""    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = x_desc.load([0, k0])  # [M_PAD, BLOCK_K]
        w = w_desc.load([off_n, k0])
        acc = tl.dot(w, x.T, acc, input_precision=PRECISION)
        if GLU:
            w_up = w_desc.load([off_n + N, k0])
            acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PRECISION)
    if PDL and LATE:
        gdc_launch_dependents()
""", f"""    k_trig = k_lo + tl.maximum(tl.cdiv(k_hi - k_lo, BLOCK_K) - {ahead}, 0) * BLOCK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PDL and LATE:
            if k0 == k_trig:
                gdc_launch_dependents()
        x = x_desc.load([0, k0])  # [M_PAD, BLOCK_K]
        w = w_desc.load([off_n, k0])
        acc = tl.dot(w, x.T, acc, input_precision=PRECISION)
        if GLU:
            w_up = w_desc.load([off_n + N, k0])
            acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PRECISION)
""")])
    if norm_late:
        edit(dst / "kernels/fused.py", [
            ("""    `SplitSums` with that many slots (stride_s apart).\"\"\"
    if PDL:
        gdc_launch_dependents()""", """    `SplitSums` with that many slots (stride_s apart).\"\"\"
    if PDL and SLOTS == 0:
        gdc_launch_dependents()"""),
            ("""        inv_rms = _inv_rms(tl.sum(x * x, 0), n, eps)
        tl.store(y_row + offs, _scale_row(x, inv_rms, w, dtype), mask=mask)
    else:""", """        inv_rms = _inv_rms(tl.sum(x * x, 0), n, eps)
        tl.store(y_row + offs, _scale_row(x, inv_rms, w, dtype), mask=mask)
        if PDL and SLOTS > 0:
            gdc_launch_dependents()
    else:""")])


if __name__ == "__main__":
    make(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])))
