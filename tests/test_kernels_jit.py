"""jit_varying: the per-step arguments it names reach Triton, and a name that is no argument
fails at once (Triton itself would ignore it silently)."""

from __future__ import annotations

import pytest

from arle_kernels import decode_attention, extend_attention
from arle_kernels.jit import jit_varying


def test_unknown_argument_name_fails() -> None:
    with pytest.raises(TypeError, match="no argument stride_typo"):
        @jit_varying("n", "stride_typo")
        def _kernel(x_ptr, n):  # type: ignore[no-untyped-def]
            pass


@pytest.mark.parametrize("kernel, names", [
    (decode_attention._decode_split_kernel, {"num_splits", "stride_pt", "page_table_ptr"}),
    (decode_attention._merge_kernel, {"num_splits", "stride_lh"}),
    (extend_attention._extend_kernel, {"stride_pt", "seq_lens_ptr"}),
])
def test_kernels_do_not_specialise_per_step_arguments(kernel: object, names: set[str]) -> None:
    """The kernels' step-varying arguments are marked on the JIT function itself (under the
    interpreter too), so one compiled variant serves every step."""
    marked = set(getattr(kernel, "do_not_specialize", []))
    assert names <= {n if isinstance(n, str) else kernel.arg_names[n]  # type: ignore[attr-defined]
                     for n in marked}
