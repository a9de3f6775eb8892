#!/usr/bin/env bash
# Call E: decode A/B of two halves of call D's change against the base 0aebbbd: the working
# tree "lse" (an empty split writes only lse = -inf: no q load, no output) and var_merge (the
# merge reads only the splits that hold tokens, from seq_lens); twice each. Then the GPU tests
# of the working tree.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/logE.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/logE.txt 2>&1
log model
dec() {  # tree tag
  ln -sfn $PWD/$1/kernels /tmp/site/arle_kernels
  (cd $1 && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$2 timeout 90 python3 scripts/bench_gpu.py \
     decode /tmp/models/qwen3-4b --out $RES/decode_$2.json >>$RES/dec.log 2>&1)
  log "decode $2 rc=$?"
  tar -cf $OUT/results.tar -C $RES .
}
dec . lse; dec base_0ae base; dec var_merge merge; dec . lse_r2; dec base_0ae base_r2
dec var_merge merge_r2
ln -sfn $PWD/kernels /tmp/site/arle_kernels
ARLE_COMMIT=lse bash scripts/gpu_session.sh tests >/dev/null 2>&1
log "session done"
tar -cf $OUT/results.tar -C $RES .
