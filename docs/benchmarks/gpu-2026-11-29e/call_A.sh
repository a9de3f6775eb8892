#!/usr/bin/env bash
# Call 1: GPU tests of the new attention/rope kernels, decode A/B (base f3e13f3 vs new), FMA sweep.
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
T0=$SECONDS
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/log.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
ln -sfn $PWD/kernels /tmp/site/arle_kernels
log start
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >>$RES/log.txt 2>&1
log model
timeout 170 python3 -m pytest -q -p no:cacheprovider -k "not interpreter" -rfE \
  tests/test_kernels_decode_attention.py tests/test_kernels_fused.py tests/test_cuda.py \
  >$RES/pytest.txt 2>&1; log "tests rc=$?"; tail -3 $RES/pytest.txt >> $RES/log.txt
tar -cf $OUT/results.tar -C $RES .
ARLE_COMMIT=new timeout 120 python3 scripts/bench_gpu.py decode /tmp/models/qwen3-4b \
  --out $RES/decode_new.json >>$RES/log.txt 2>&1; log "decode new rc=$?"
tar -cf $OUT/results.tar -C $RES .
ln -sfn $PWD/base_f3e/kernels /tmp/site/arle_kernels
(cd base_f3e && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=f3e13f3 timeout 120 python3 \
  scripts/bench_gpu.py decode /tmp/models/qwen3-4b --out $RES/decode_base.json >>$RES/log.txt 2>&1)
log "decode base rc=$?"
ln -sfn $PWD/kernels /tmp/site/arle_kernels
tar -cf $OUT/results.tar -C $RES .
timeout $((570 - (SECONDS - T0))) python3 -c "
import json
from arle_kernels.gemv import sweep_fma, BENCH_SHAPES
rows = []
for name in ('o_proj', 'qkv', 'down'):
    rows += sweep_fma({name: BENCH_SHAPES[name]})
    json.dump(rows, open('$RES/sweep_fma.json', 'w'), indent=0)
" >>$RES/log.txt 2>&1; log "sweep rc=$?"
tar -cf $OUT/results.tar -C $RES .
