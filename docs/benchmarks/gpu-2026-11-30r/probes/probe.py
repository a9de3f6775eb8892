# ruff: noqa  (the probe as it ran on the device; a record, not maintained code)
"""Device probe (not committed): where a start-up's time goes, phase by phase.
python3 var_prof/probe.py MODE MODEL   MODE: key | time | prof (cProfile of the build pass)
| full (cProfile of the whole start-up)"""
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from dataclasses import replace

mode = sys.argv[1]
T0 = time.perf_counter()
if mode == "key":
    from triton.runtime.cache import triton_key
    t = time.perf_counter(); triton_key(); print("triton_key_s", round(time.perf_counter() - t, 3))
    sys.exit(0)
sys.path.insert(0, "scripts")
import bench_gpu  # noqa: E402
import arle.executor.cuda as C  # noqa: E402
import arle.model.loader as L  # noqa: E402
import arle.engine.async_engine as AE  # noqa: E402

marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, round(time.perf_counter() - T0, 3)))


def timed(obj, name):
    orig = getattr(obj, name)

    def wrapper(*a, **k):
        mark(name + ">")
        try:
            return orig(*a, **k)
        finally:
            mark(name + "<")
    setattr(obj, name, wrapper)


for n in ("_capture", "_capture_extend", "_build_eager_variants", "_build_sampler_variants",
          "_scratch_cache", "_profile_step", "_make_graph_buffers", "_peak_memory"):
    timed(C.CUDAExecutor, n)
timed(AE, "load_model") if hasattr(AE, "load_model") else None
timed(L, "load_model")
timed(C.KVCache, "allocate")
orig_build = C.CUDAExecutor._build_ahead
orig_init = C.CUDAExecutor.__init__
timed(C.CUDAExecutor, "__init__")
prof = cProfile.Profile()
passes_s: list[list] = []


def build_ahead(self, *passes):
    def wrap(i, p):
        def run():
            t = time.perf_counter(); p(); passes_s.append([i, round(time.perf_counter() - t, 4)])
        return run
    mark("build>")
    if mode == "prof":
        prof.enable()
    out = orig_build(self, *[wrap(i, p) for i, p in enumerate(passes)])
    if mode == "prof":
        prof.disable()
    mark("build<")
    return out


C.CUDAExecutor._build_ahead = build_ahead
args = bench_gpu.main.__code__  # noqa: F841
from arle.diagnostics import run_warmup  # noqa: E402
import argparse  # noqa: E402

ns = argparse.Namespace(model=sys.argv[2], disable_overlap=False, disable_cuda_graph=False,
                        kv_cache_dtype="auto", max_batched_tokens=None)
cfg = replace(bench_gpu._engine_config(ns), serving=True)
if mode == "full":
    prof.enable()
mark("warmup>")
report = asyncio.run(run_warmup(cfg))
mark("warmup<")
if mode == "full":
    prof.disable()
print(json.dumps({"total_s": round(time.perf_counter() - T0, 3), "ok": report["ok"],
                  "marks": marks, "passes_s": passes_s,
                  "built": (report.get("model") or {}).get("kernels_built_ahead")}))
if mode in ("prof", "full"):
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(60)
        print(s.getvalue())
