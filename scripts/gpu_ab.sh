#!/usr/bin/env bash
# Decode A/B on the device: each TREE:TAG runs `bench_gpu.py decode` on a random Qwen3-4B, in
# turn, within one call (the way docs/benchmarks compares a change against its base).
#   bash scripts/gpu_ab.sh [--serve C | --offline | --startup] [--cold] [--then "PHASE..."] \
#     TREE:TAG...
# (the options in any order, before the trees)
# TREE is a folder with kernels/ scripts/ arle/: "." for the checkout, else e.g.
#   git archive REV kernels scripts arle | tar -x -C var_x   (then patch it; pass it in `carry`)
# Give each tree twice, interleaved: machines drift, and two runs of one tree in one call agree
# to about 1 us. Writes decode_TAG.json and ab_log.txt into $OUT/results.tar (rewritten after
# each run: a call cut short still returns what finished). --then: gpu_session.sh phases for
# the checkout afterwards (ARLE_COMMIT names it). --serve C: `bench_gpu.py serve` at concurrency
# C, or at each of "C1 C2" on one server (64 prompts, 512 in / 128 out) instead of decode, into
# serve_TAG.json. --offline: `bench_gpu.py offline` on a random Qwen3-0.6B (256 requests, 3
# runs) into offline_TAG.json. --startup: `bench_gpu.py startup` (start-up's phases and kernel
# builds) into startup_TAG.json.
# --cold: an empty Triton cache before each run (a server's first start, or a container's).
set -u
OUT=${OUT:-/tmp/out}; RES=/tmp/res; mkdir -p $RES $OUT
phases="" serve="" offline="" cold="" startup=""
while [ $# -gt 0 ]; do  # the options, in any order, before the trees
  case $1 in
    --serve) serve=$2; shift 2 ;;
    --offline) offline=1; shift ;;
    --startup) startup=1; shift ;;
    --cold) cold=1; shift ;;
    --then) phases=$2; shift 2 ;;
    --*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
T0=$SECONDS
export PYTHONPYCACHEPREFIX=/tmp/pycache  # bytecode kept between runs: see gpu_session.sh
unset PYTHONDONTWRITEBYTECODE
log() { echo "== $((SECONDS - T0)) s: $*" | tee -a $RES/ab_log.txt; }
bash scripts/gpu_session.sh >/dev/null 2>&1  # installs the wheels into /tmp/site
model=qwen3-4b; [ -n "$offline" ] && model=qwen3-0.6b
python3 scripts/make_random_model.py $model /tmp/models/$model >>$RES/ab_log.txt 2>&1
log model
run() {  # phase tree tag timeout args...: bench_gpu.py PHASE with the tree's arle and kernels
  local phase=$1 tree=$2 tag=$3 t=$4; shift 4
  ln -sfn "$PWD/$tree/kernels" /tmp/site/arle_kernels  # the tree's kernels as arle_kernels
  [ -n "$cold" ] && rm -rf ~/.triton/cache
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD ARLE_COMMIT=$tag timeout "$t" python3 \
     scripts/bench_gpu.py "$phase" /tmp/models/$model --out "$RES/${phase}_$tag.json" "$@" \
     >>"$RES/ab_$phase.log" 2>&1)
  log "$phase $tag rc=$?"
  tar -cf $OUT/results.tar -C $RES .
}
for spec in "$@"; do
  if [ -n "$serve" ]; then
    # shellcheck disable=SC2086  # --serve "8 32": one server, each concurrency in turn
    run serve "${spec%%:*}" "${spec#*:}" 150 --concurrency $serve --num-prompts 64
  elif [ -n "$startup" ]; then
    run startup "${spec%%:*}" "${spec#*:}" 150
  elif [ -n "$offline" ]; then
    run offline "${spec%%:*}" "${spec#*:}" 150
  else
    run decode "${spec%%:*}" "${spec#*:}" 90
  fi
done
ln -sfn "$PWD/kernels" /tmp/site/arle_kernels
# shellcheck disable=SC2086  # phases are words
[ -n "$phases" ] && bash scripts/gpu_session.sh $phases >/dev/null 2>&1
log done
tar -cf $OUT/results.tar -C $RES .
