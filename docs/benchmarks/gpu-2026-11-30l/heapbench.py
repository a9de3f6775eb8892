"""Does compiling Triton kernels in-process (cold cache) slow the host-side Python after it?

    TRITON_CACHE_DIR=DIR PYTHONPATH=SITE:REPO python heapbench.py

SITE holds arle_kernels (a link to kernels/); REPO is the repository root. Needs triton 3.6 and
orjson; no GPU (kernels are compiled for sm_90a through scripts/kernel_regs.py's machinery).
Times a small dict / object / orjson loop before and after compiling a decode step's kernels
(Qwen3-4B, 1/2/8/32 rows), then after gc.collect(); gc.freeze() as `arle serve` does. Run it
with an empty DIR (cold), then again with the same DIR (warm). Reformatted for ruff after the
session; the measurement is the one that ran.
"""

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "scripts"), str(REPO)]


class Obj:
    __slots__ = ("a", "b", "c")

    def __init__(self, a: int, b: str, c: list[int]) -> None:
        self.a, self.b, self.c = a, b, c


def work(n: int = 20000) -> int:
    out = []
    for i in range(n):
        d = {"id": i, "text": f"tok{i}", "lp": [i * 0.5, i * 0.25], "o": Obj(i, str(i), [i])}
        out.append(orjson.dumps({"id": d["id"], "text": d["text"], "lp": d["lp"]}))
        if len(out) > 512:
            out.clear()
    return len(out)


def measure(tag: str, reps: int = 15) -> None:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        work()
        ts.append(time.perf_counter() - t0)
    print(json.dumps({"tag": tag, "min_ms": round(min(ts) * 1e3, 2),
                      "median_ms": round(statistics.median(ts) * 1e3, 2)}), flush=True)


def compile_step() -> None:
    sys.argv = ["x"]
    import kernel_regs as kr
    from make_random_model import CONFIGS

    from arle.model.config import ModelConfig

    cfg = ModelConfig.from_hf(CONFIGS["qwen3-4b"], "qwen3-4b")
    t0, n = time.perf_counter(), 0
    for batch in (1, 2, 8, 32):
        with kr.caught_launches() as launches:
            for call in kr.decode_step(cfg, batch, 4096):
                call()
        for launch in launches:
            src = kr.ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
            kr.triton.compile(src, target=kr.TARGET, options=launch.options)
            n += 1
    print(json.dumps({"compiled": n, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    measure("before_1")
    measure("before_2")
    compile_step()
    measure("after_compile")
    gc.collect()
    gc.freeze()
    print(json.dumps({"frozen": gc.get_freeze_count()}))
    measure("after_freeze_1")
    measure("after_freeze_2")
