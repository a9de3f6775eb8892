#!/usr/bin/env bash
# Call B: decode A/B of the folded norm + residual epilogue (working tree "new"; var_nreg:
# new + maxnreg 72 for the 1-row gate_up) against the base 0aebbbd, twice each; then parity
# and the GPU tests of the working tree.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/logB.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/logB.txt 2>&1
log model
dec() {  # tree tag
  ln -sfn $PWD/$1/kernels /tmp/site/arle_kernels
  (cd $1 && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$2 timeout 90 python3 scripts/bench_gpu.py \
     decode /tmp/models/qwen3-4b --out $RES/decode_$2.json >>$RES/dec.log 2>&1)
  log "decode $2 rc=$?"
}
dec . new; dec base_0ae base; dec var_nreg var_nreg; dec . new_r2; dec base_0ae base_r2
dec var_nreg var_nreg_r2
ln -sfn $PWD/kernels /tmp/site/arle_kernels
tar -cf $OUT/results.tar -C $RES .
ARLE_COMMIT=new bash scripts/gpu_session.sh parity tests >/dev/null 2>&1
log "session done"
tar -cf $OUT/results.tar -C $RES .
