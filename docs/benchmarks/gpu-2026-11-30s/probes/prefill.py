# ruff: noqa  (the probe as it ran on the device; a record, not maintained code)
"""Where a prefill step's time goes (Qwen3-4B): cuBLAS's GEMMs at prefill row counts, and the
kernels of the extend graphs of 512 and 1024 tokens.

    PYTHONPATH=/tmp/site:$PWD python3 prefill.py MODEL_DIR OUT.json
"""
import asyncio
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path.cwd() / "scripts"))
from bench_gpu import _kernel_breakdown  # noqa: E402

SHAPES = {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
          "down": (2560, 9728)}
ROWS = (256, 512, 520, 640, 1024, 2048, 4096)


def bench(fn):
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def gemms():
    out = {}
    dev = torch.device("cuda")
    w = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02
         for k, (n, kk) in SHAPES.items()}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for m in ROWS:
            row = {}
            tot_ms = 0.0
            for k, (n, kk) in SHAPES.items():
                x = torch.randn(m, kk, device=dev, dtype=torch.bfloat16)
                ms = bench(lambda: F.linear(x, w[k]))
                tot_ms += ms
                row[k] = {"us": round(ms * 1e3, 1), "tflops": round(2 * m * n * kk / ms / 1e9, 1)}
            flop = sum(2 * m * n * kk for n, kk in SHAPES.values())
            row["layer_us"] = round(tot_ms * 1e3, 1)
            row["layer_tflops"] = round(flop / tot_ms / 1e9, 1)
            out[f"{lib}_{m}"] = row
            print(lib, m, row, flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


async def graphs(model):
    from arle.config import EngineConfig
    from arle.engine.async_engine import AsyncEngine

    engine = await AsyncEngine.create(EngineConfig(model=model, device="cuda", dtype="bfloat16",
                                                   serving=True))
    ex = engine.executor
    out = {}
    with torch.cuda.stream(ex.stream):
        for t in (512, 1024):
            g = ex.extend_graphs.graphs[t]
            out[str(t)] = {"replay_ms": bench(g.replay), "kernels": _kernel_breakdown(g.replay, 10)}
            out[str(t)]["kernels"].pop("critical", None)
    await engine.close()
    return out


if __name__ == "__main__":
    res = {"gemm": gemms()}
    res["extend"] = asyncio.run(graphs(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
