#!/usr/bin/env bash
# Call 2: decode A/B (new, base, one-change variants), GPU tests, serve.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/log2.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/log2.txt 2>&1
log model
dec() {  # tree tag
  ln -sfn $PWD/$1/kernels /tmp/site/arle_kernels
  (cd $1 && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$2 timeout 90 python3 scripts/bench_gpu.py \
     decode /tmp/models/qwen3-4b --out $RES/decode_$2.json >>$RES/dec.log 2>&1)
  log "decode $2 rc=$?"
}
dec . 04948d1; dec base_f3e f3e13f3; dec var_gemv var_gemv; dec var_attn var_attn
dec var_rope var_rope; dec . 04948d1_run2
ln -sfn $PWD/kernels /tmp/site/arle_kernels
tar -cf $OUT/results.tar -C $RES .
ARLE_COMMIT=04948d1 bash scripts/gpu_session.sh tests serve >/dev/null 2>&1
log "session done"
tar -cf $OUT/results.tar -C $RES .
