#!/usr/bin/env bash
# Call C: decode A/B of one-change variants of 0aebbbd (the checkout): var_pf1 / var_pf2 (the
# FMA GEMV asks L2 for its next 1 / 2 chunks of W before the PDL wait), var_glu64 (the 1-row
# gate_up + SiLU·up capped at 64 registers); each twice.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/logC.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/logC.txt 2>&1
log model
dec() {  # tree tag
  ln -sfn $PWD/$1/kernels /tmp/site/arle_kernels
  (cd $1 && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$2 timeout 90 python3 scripts/bench_gpu.py \
     decode /tmp/models/qwen3-4b --out $RES/decode_$2.json >>$RES/dec.log 2>&1)
  log "decode $2 rc=$?"
  tar -cf $OUT/results.tar -C $RES .
}
dec . base; dec var_pf1 pf1; dec var_pf2 pf2; dec var_glu64 glu64
dec . base_r2; dec var_pf1 pf1_r2; dec var_pf2 pf2_r2; dec var_glu64 glu64_r2
ln -sfn $PWD/kernels /tmp/site/arle_kernels
log "session done"
tar -cf $OUT/results.tar -C $RES .
