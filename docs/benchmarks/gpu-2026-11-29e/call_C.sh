#!/usr/bin/env bash
# Call 3: decode A/B (head 7fa6389, base f3e13f3, three one-change variants), then the head's
# offline, serve and GPU tests.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/log3.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/log3.txt 2>&1
log model
dec() {  # tree tag
  ln -sfn $PWD/$1/kernels /tmp/site/arle_kernels
  (cd $1 && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$2 timeout 90 python3 scripts/bench_gpu.py \
     decode /tmp/models/qwen3-4b --out $RES/decode_$2.json >>$RES/dec.log 2>&1)
  log "decode $2 rc=$?"
}
dec . 7fa6389; dec base_f3e f3e13f3; dec var_norm4 var_norm4; dec var_merge var_merge
dec var_dec4w var_dec4w
ln -sfn $PWD/kernels /tmp/site/arle_kernels
tar -cf $OUT/results.tar -C $RES .
ARLE_COMMIT=7fa6389 bash scripts/gpu_session.sh offline serve tests >/dev/null 2>&1
log "session done"
tar -cf $OUT/results.tar -C $RES .
