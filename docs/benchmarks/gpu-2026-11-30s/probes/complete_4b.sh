#!/usr/bin/env bash
# Device probe (a record, as it ran): `arle complete` on a random Qwen3-4B, one running request
# (the default now) against the server's 256 (every decode graph, the extend graphs), each
# twice after a first run that fills Triton's cache; then `arle chat` piped, two turns.
set -u
OUT=${OUT:-/tmp/out}
bash scripts/gpu_session.sh >/dev/null 2>&1
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=/tmp/site:$PWD
unset PYTHONDONTWRITEBYTECODE
m=/tmp/models/qwen3-4b
rm -rf ~/.triton/cache  # the first run fills it
python3 scripts/make_random_model.py qwen3-4b $m >/dev/null 2>&1
for run in prime one r256 one_2 r256_2; do
  case $run in r256*) flags=(--max-running-requests 256) ;; *) flags=() ;; esac
  t0=$(date +%s.%N)
  python3 -m arle complete --model $m --raw "The history of the bicycle" --max-tokens 32 \
    --ignore-eos --log-format json "${flags[@]}" >/dev/null 2>"$OUT/complete_$run.log"
  echo "complete_$run rc=$? wall_s=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")"
done
t0=$(date +%s.%N)
printf 'Hello\nAnd again\n' | python3 -m arle chat --model $m --max-tokens 16 \
  --log-format json >/dev/null 2>"$OUT/chat.log"
echo "chat rc=$? wall_s=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")"
