"""arle's kernels (imported as `arle_kernels`): each a plain-torch reference, and later a Triton
version beside it that its tests compare against the reference."""

import os

# NOTE: FMA contraction (a * b + c as one fma) in every kernel, as they were tuned, measured and
# their tests written. Triton 3.9 warns that its default turns it off from 3.10 (ptxas
# --fmad=false: more instructions in the instruction-bound kernels, other roundings). A
# TRITON_DEFAULT_FP_FUSION the user set still wins; compile workers inherit it.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
