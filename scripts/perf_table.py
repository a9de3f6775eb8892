#!/usr/bin/env python3
"""Write docs/performance.md's figures, and README.md's table of a few, from docs/results/.

    python scripts/perf_table.py            # rewrite the parts between each page's markers
    python scripts/perf_table.py --check    # exit 1 if either page differs from that
    python scripts/perf_table.py --provenance h200/hf_qwen3-4b.json 2026-11-30 cc9f46a

Every figure is declared once, below: SOURCES says which command wrote each file of
docs/results/, FIGURES which value of which file each table cell shows (a dotted path into the
JSON; `name[key=value]` picks the one list item with that key). A file's date and commit are its
own "date" and "commit". Files whose writer records neither (check_gpu_parity.py's,
bench_hf.py's) take them from docs/results/provenance.json, whose entry also holds the file's
sha256: a new file with an old entry is an error, never an old date. `--provenance` writes one.

To update the figures: replace the files (same names), then run this script. Standard library
only: it must run where torch is not installed.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
PROVENANCE = RESULTS / "provenance.json"
BEGIN = "<!-- figures:begin (scripts/perf_table.py writes this part) -->"
END = "<!-- figures:end -->"
README_BEGIN = "<!-- perf:begin (scripts/perf_table.py writes this table) -->"
README_END = "<!-- perf:end -->"

#: issue 5's targets on the H200 (Qwen3-4B), for "What bounds the open targets"
TARGET_FLOOR_RATIO = 1.15
TARGET_C8_TOK_S = 2500.0
TARGET_C8_TPOT_MS = 3.0


@dataclass(frozen=True)
class Field:
    """One value of one file: `fmt` formats it (after `scale`)."""

    file: str  # under docs/results/
    path: str
    fmt: str
    scale: float = 1.0


@dataclass(frozen=True)
class Quotient:
    """num / den * scale: a value computed from two fields (a floor from bytes and bandwidth)."""

    num: Field
    den: Field
    fmt: str
    scale: float = 1.0


Value = Field | Quotient


@dataclass(frozen=True)
class Figure:
    """One table row. The ratio column is arle's first value over the baseline's first.
    `readme`: the row's workload in README.md's table (empty: not there)."""

    machine: str
    workload: str
    model: str
    arle: tuple[Value, ...]
    baseline_name: str = ""
    baseline: tuple[Value, ...] = ()
    sep: str = ", "
    readme: str = ""


@dataclass(frozen=True)
class Source:
    file: str  # under docs/results/
    command: str


@dataclass(frozen=True)
class Machine:
    key: str  # the folder under docs/results/
    title: str
    short: str  # README.md's hardware column
    about: tuple[Field, ...]  # a line of versions under the title
    setup: tuple[str, ...]  # commands to run once before the sources' commands


_SPEC_FILE = "cpu/speculative_smollm2.json"
MACHINES = (
    Machine("h200", "One NVIDIA H200", "1 H200",
            (Field("h200/decode_qwen3-4b.json", "torch", "torch {}"),
             Field("h200/hf_qwen3-4b.json", "environment.transformers", "transformers {}")),
            ("# each JSON records its commit: git's HEAD, or $ARLE_COMMIT in a copy without .git",
             "for m in qwen3-4b qwen3-8b qwen3-0.6b qwen3.5-4b qwen3-30b-a3b-fp8; do",
             "  python3 scripts/make_random_model.py $m /tmp/models/$m  # random weights",
             "done",
             "python3 scripts/make_random_model.py qwen3-30b-a3b-fp8 "
             "/tmp/models/qwen3-30b-a3b-fp8-L4 --layers 4",
             "python3 scripts/make_random_model.py qwen3-30b-a3b /tmp/models/qwen3-30b-a3b-L4 "
             "--layers 4",
             "GGUF=$(python3 -c 'from arle.model.default import default_model_path as p; "
             "print(p())')")),
    Machine("h100", "One NVIDIA H100 (80 GB HBM3): this wave's tree", "1 H100",
            (Field("h100/decode_qwen3-4b.json", "torch", "torch {}"),
             Field("h100/decode_qwen3-4b.json", "gpu", "{}")),
            ("# `bash scripts/gpu_session.sh PHASE...` runs these (and makes the models) under "
             "timeouts;",
             "# its phases: moe30d quant decode ceilings moe30 spec kvtier context scale "
             "structured smol parity paritymoe q35",
             "for m in qwen3-4b qwen3-4b-awq qwen3.5-4b qwen3-30b-a3b-fp8; do",
             "  python3 scripts/make_random_model.py $m /tmp/models/$m  # random weights",
             "done",
             "python3 scripts/make_random_model.py qwen3-30b-a3b /tmp/models/qwen3-30b-a3b-L4 "
             "--layers 4",
             "GGUF=$(python3 -c 'from arle.model.default import default_model_path as p; "
             "print(p())')")),
    Machine("cpu", "The 2-core CPU machine", "2-core CPU",
            (Field("cpu/bench_cpu.json", "machine.cpus", "{} CPUs"),
             Field("cpu/bench_cpu.json", "machine.cpu_capability", "{}"),
             Field("cpu/bench_cpu.json", "machine.torch", "torch {}"),
             Field("cpu/bench_cpu.json", "machine.torch_threads", "{} threads"),
             Field("cpu/bench_cpu.json", "dtype", "--dtype {} (integer weights kept)"),
             Field(_SPEC_FILE, "cpu", "the speculation figures on {}")),
            ()),
)

_SERVE = "python3 scripts/bench_gpu.py serve /tmp/models/qwen3-4b"
SOURCES = (
    Source("h200/ceilings.json", "python3 scripts/bench_gpu.py ceilings "
           "--out docs/results/h200/ceilings.json"),
    Source("h200/decode_qwen3-4b.json", "python3 scripts/bench_gpu.py decode /tmp/models/qwen3-4b "
           "--out docs/results/h200/decode_qwen3-4b.json"),
    Source("h200/decode_qwen3-8b.json", "python3 scripts/bench_gpu.py decode /tmp/models/qwen3-8b "
           "--out docs/results/h200/decode_qwen3-8b.json"),
    Source("h200/prefill_qwen3-4b.json", "python3 scripts/bench_gpu.py prefill "
           "/tmp/models/qwen3-4b --out docs/results/h200/prefill_qwen3-4b.json"),
    Source("h200/parity_qwen3-4b.json", "python3 scripts/check_gpu_parity.py "
           "/tmp/models/qwen3-4b --prompts 2 --len 512 "
           "--out docs/results/h200/parity_qwen3-4b.json"),
    Source("h200/parity_smollm2.json", "python3 scripts/check_gpu_parity.py \"$GGUF\" "
           "--out docs/results/h200/parity_smollm2.json"),
    Source("h200/serve_qwen3-4b.json", "rm -rf ~/.triton/cache  # time to ready from a cold "
           f"Triton cache\n{_SERVE} --out docs/results/h200/serve_qwen3-4b.json"),
    Source("h200/serve_qwen3-4b_default.json", f"{_SERVE} --concurrency 1 8 --num-prompts 32 "
           "--out docs/results/h200/serve_qwen3-4b_default.json"),
    Source("h200/serve_qwen3-4b_disable-overlap.json", f"{_SERVE} --concurrency 1 8 "
           "--num-prompts 32 --serve-args=\"--disable-overlap\" "
           "--out docs/results/h200/serve_qwen3-4b_disable-overlap.json"),
    Source("h200/serve_qwen3-4b_disable-cuda-graph.json", f"{_SERVE} --concurrency 1 8 "
           "--num-prompts 32 --serve-args=\"--disable-cuda-graph\" "
           "--out docs/results/h200/serve_qwen3-4b_disable-cuda-graph.json"),
    Source("h200/hf_qwen3-4b.json", "python3 scripts/bench_hf.py /tmp/models/qwen3-4b --batch 1 8 "
           "--modes eager static --repeats 1 --out docs/results/h200/hf_qwen3-4b.json"),
    Source("h200/offline_qwen3-0.6b.json", "python3 scripts/bench_gpu.py offline "
           "/tmp/models/qwen3-0.6b --out docs/results/h200/offline_qwen3-0.6b.json"),
    Source("h200/serve_smollm2.json", "python3 scripts/bench_gpu.py serve \"$GGUF\" "
           "--concurrency 1 8 64 --num-prompts 64 --out docs/results/h200/serve_smollm2.json"),
    Source("h200/ceilings_qwen3.5.json", "python3 scripts/bench_gpu.py ceilings "
           "--out docs/results/h200/ceilings_qwen3.5.json"),
    Source("h200/ceilings_moe.json", "python3 scripts/bench_gpu.py ceilings "
           "--out docs/results/h200/ceilings_moe.json"),
    Source("h200/decode_qwen3.5-4b.json", "python3 scripts/bench_gpu.py decode "
           "/tmp/models/qwen3.5-4b --out docs/results/h200/decode_qwen3.5-4b.json"),
    Source("h200/serve_qwen3.5-4b.json", "rm -rf ~/.triton/cache  # time to ready from a cold "
           "Triton cache\npython3 scripts/bench_gpu.py serve /tmp/models/qwen3.5-4b "
           "--concurrency 1 8 --num-prompts 32 --out docs/results/h200/serve_qwen3.5-4b.json"),
    Source("h200/serve_qwen3.5-4b_warm.json", "python3 scripts/bench_gpu.py serve "
           "/tmp/models/qwen3.5-4b --concurrency 8 --num-prompts 16 "
           "--out docs/results/h200/serve_qwen3.5-4b_warm.json"),
    Source("h200/chat_qwen3.5-4b_on.json", "python3 scripts/bench_gpu.py chat "
           "/tmp/models/qwen3.5-4b --input-len 100 --output-len 200 --cache-modes on "
           "--out docs/results/h200/chat_qwen3.5-4b_on.json"),
    Source("h200/chat_qwen3.5-4b_off.json", "python3 scripts/bench_gpu.py chat "
           "/tmp/models/qwen3.5-4b --input-len 100 --output-len 200 --cache-modes off "
           "--out docs/results/h200/chat_qwen3.5-4b_off.json"),
    Source("h200/parity_qwen3.5-4b.json", "python3 scripts/check_gpu_parity.py "
           "/tmp/models/qwen3.5-4b --prompts 2 --len 512 "
           "--out docs/results/h200/parity_qwen3.5-4b.json"),
    Source("h200/hf_qwen3.5-4b.json", "python3 scripts/bench_hf.py /tmp/models/qwen3.5-4b "
           "--batch 1 --modes eager --repeats 1 --output-len 32 "
           "--out docs/results/h200/hf_qwen3.5-4b.json"),
    Source("h200/hf_qwen3.5-4b_fla.json", "# flash-linear-attention 0.6.0 (+ fla-core, einops) "
           "importable\npython3 scripts/bench_hf.py /tmp/models/qwen3.5-4b --batch 1 --modes eager "
           "--repeats 1 --output-len 32 --out docs/results/h200/hf_qwen3.5-4b_fla.json"),
    Source("h200/decode_qwen3-30b-a3b-fp8.json", "python3 scripts/bench_gpu.py decode "
           "/tmp/models/qwen3-30b-a3b-fp8 --out docs/results/h200/decode_qwen3-30b-a3b-fp8.json"),
    Source("h200/hf_qwen3-30b-a3b-fp8.json", "python3 scripts/bench_hf.py "
           "/tmp/models/qwen3-30b-a3b-fp8 --batch 1 8 --modes eager --repeats 1 --output-len 32 "
           "--out docs/results/h200/hf_qwen3-30b-a3b-fp8.json"),
    Source("h200/serve_qwen3-30b-a3b-fp8.json", "rm -rf ~/.triton/cache\n"
           "python3 scripts/bench_gpu.py serve /tmp/models/qwen3-30b-a3b-fp8 --concurrency 1 8 64 "
           "--serve-args=\"--kv-cache-dtype fp8_e4m3\" "
           "--out docs/results/h200/serve_qwen3-30b-a3b-fp8.json"),
    Source("h200/serve_qwen3-30b-a3b-fp8_bf16kv.json", "python3 scripts/bench_gpu.py serve "
           "/tmp/models/qwen3-30b-a3b-fp8 --concurrency 8 "
           "--out docs/results/h200/serve_qwen3-30b-a3b-fp8_bf16kv.json"),
    Source("h200/kernels_fp8.json", "python3 scripts/bench_kernels.py fp8 "
           "--out docs/results/h200/kernels_fp8.json"),
    Source("h200/kernels_moe.json", "python3 scripts/bench_kernels.py moe "
           "--out docs/results/h200/kernels_moe.json"),
    Source("h200/kernels_deltanet.json", "python3 scripts/bench_kernels.py deltanet --batches 1 8 "
           "--sweep --prefill 512 --out docs/results/h200/kernels_deltanet.json"),
    Source("h200/parity_qwen3-30b-a3b-L4.json", "python3 scripts/check_gpu_parity.py "
           "/tmp/models/qwen3-30b-a3b-L4 --prompts 2 --len 512 "
           "--out docs/results/h200/parity_qwen3-30b-a3b-L4.json"),
    Source("h200/parity_qwen3-30b-a3b-fp8-L4.json", "python3 scripts/check_gpu_parity.py "
           "/tmp/models/qwen3-30b-a3b-fp8-L4 --prompts 2 --len 512 "
           "--out docs/results/h200/parity_qwen3-30b-a3b-fp8-L4.json"),
    *(Source(f"h100/{name}.json", f"python3 scripts/bench_gpu.py {cmd} "
             f"--out docs/results/h100/{name}.json") for name, cmd in (
        ("ceilings", "ceilings"), ("ceilings_qwen3.5", "ceilings"),
        ("decode_qwen3-4b", "decode /tmp/models/qwen3-4b"),
        ("decode_qwen3-4b-awq", "decode /tmp/models/qwen3-4b-awq"),
        ("decode_qwen3-30b-a3b-fp8", "decode /tmp/models/qwen3-30b-a3b-fp8"),
        ("decode_qwen3.5-4b", "decode /tmp/models/qwen3.5-4b"),
        ("context_qwen3-4b", "context /tmp/models/qwen3-4b --output-len 64"),
        ("context_qwen3.5-4b", "context /tmp/models/qwen3.5-4b --output-len 64"),
        ("serve_qwen3-30b-a3b-fp8", "serve /tmp/models/qwen3-30b-a3b-fp8 --concurrency 8 "
                                    "--serve-args=\"--kv-cache-dtype fp8_e4m3\""),
        ("serve_qwen3-4b_scale", "serve /tmp/models/qwen3-4b --concurrency 1 8 64 256 "
                                 "--num-prompts 64"),
        ("serve_qwen3.5-4b", "serve /tmp/models/qwen3.5-4b --concurrency 1 8 --num-prompts 32"),
        ("serve_qwen3.5-4b_warm", "serve /tmp/models/qwen3.5-4b --concurrency 8 "
                                  "--num-prompts 16"),
        ("serve_smollm2", "serve \"$GGUF\" --concurrency 1 8 64 --num-prompts 64"))),
    *(Source(f"h100/speculative_cost_{m}.json", "python3 scripts/bench_speculative.py --model "
             f"/tmp/models/{m} --device cuda --parts cost --cost-k 1 2 3 4 --batch 1 8 "
             f"--eager-verify --out docs/results/h100/speculative_cost_{m}.json")
      for m in ("qwen3-4b", "qwen3.5-4b")),
    Source("h100/speculative_cost_qwen3-30b-a3b-fp8.json", "python3 scripts/bench_speculative.py "
           "--model /tmp/models/qwen3-30b-a3b-fp8 --device cuda --parts cost --cost-k 1 2 3 4 "
           "--batch 1 8 --kv-cache-tokens 8192 "
           "--out docs/results/h100/speculative_cost_qwen3-30b-a3b-fp8.json"),
    Source("h100/decode_qwen3-4b_fp8.json", "python3 scripts/bench_gpu.py decode "
           "/tmp/models/qwen3-4b --quantization fp8 --out docs/results/h100/decode_qwen3-4b_fp8.json "
           "(its kernels_gate_up: `python3 scripts/bench_kernels.py fp8 --rows 1 2 --shapes "
           "4b_gate_up` at 1438d25)"),
    Source("h100/kernels_moe.json", "python3 scripts/bench_kernels.py moe --tokens 1 2 4 8 16 32 64 "
           "--weights fp8 --out docs/results/h100/kernels_moe.json (its one_token: "
           "`python3 scripts/bench_kernels.py moe1` at 222eaf3)"),
    Source("h100/kernels_w4.json", "python3 scripts/bench_kernels.py w4 --rows 1 2 --shapes "
           "qkv o_proj down gate_up --tiles 4,1024,4,0,1 4,2048,4,0,1 "
           "--out docs/results/h100/kernels_w4.json (rows 4 and 8: "
           "`--rows 1 2 4 8 --shapes o_proj qkv down --tiles 1,1024,1 1,2048,2 2,2048,2` at "
           "12ba687, each such row tagged with its commit)"),
    Source("h100/speculative_smollm2.json", "python3 scripts/bench_speculative.py --device cuda "
           "--parts tasks --out docs/results/h100/speculative_smollm2.json"),
    Source("h100/kv_tier_qwen3-4b.json", "python3 scripts/bench_kv_tier.py --model "
           "/tmp/models/qwen3-4b --device cuda --conversations 16 --turns 4 --doc-tokens 2048 "
           "--pool-share 0.25 --host-gb 16 --out docs/results/h100/kv_tier_qwen3-4b.json"),
    Source("h100/structured_qwen3-4b.json", "python3 scripts/bench_structured.py --model "
           "/tmp/models/qwen3-4b --device cuda --batch 1 8 --rounds 2 "
           "--out docs/results/h100/structured_qwen3-4b.json"),
    *(Source(f"h100/parity_{name}.json", f"python3 scripts/check_gpu_parity.py {model}{args} "
             f"--out docs/results/h100/parity_{name}.json") for name, model, args in (
        ("qwen3-4b", "/tmp/models/qwen3-4b", " --prompts 2 --len 512"),
        ("qwen3-30b-a3b-L4", "/tmp/models/qwen3-30b-a3b-L4", " --prompts 2 --len 512"))),
    Source("cpu/bench_cpu.json", "pip install llama-cpp-python && python3 scripts/bench_cpu.py "
           "--rounds 5 --contexts 128,512,2048,6144 --out docs/results/cpu/bench_cpu.json"),
    Source("cpu/speculative_smollm2.json", "python3 scripts/bench_speculative.py --rounds 2 "
           "--out docs/results/cpu/speculative_smollm2.json"),
    Source("cpu/kv_tier_smollm2.json", "python3 scripts/bench_kv_tier.py --conversations 16 "
           "--turns 4 --doc-tokens 512 --pool-share 0.25 --host-gb 1 "
           "--out docs/results/cpu/kv_tier_smollm2.json"),
    Source("cpu/cpu_bounds.json", "python3 scripts/bench_cpu_bounds.py "
           "--contexts 512,2048,6144 --out docs/results/cpu/cpu_bounds.json"),
    Source("cpu/kv_tier_qwen3.5.json",
           "python3 scripts/make_random_model.py tiny-qwen3.5 /tmp/models/tiny-qwen3.5 && "
           "python3 scripts/bench_kv_tier.py --model /tmp/models/tiny-qwen3.5 --conversations 16 "
           "--turns 4 --doc-tokens 512 --pool-share 0.25 --host-gb 1 "
           "--out docs/results/cpu/kv_tier_qwen3.5.json"),
    Source("cpu/bench_cpu_qwen3.5.json",
           "python3 scripts/make_random_model.py tiny-qwen3.5 /tmp/models/tiny-qwen3.5 && "
           "python3 scripts/bench_cpu.py --model /tmp/models/tiny-qwen3.5 --rounds 5 "
           "--out docs/results/cpu/bench_cpu_qwen3.5.json"),
)

_Q4 = "Qwen3-4B"
_SMOL = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
_DEC4, _DEC8 = "h200/decode_qwen3-4b.json", "h200/decode_qwen3-8b.json"
_CEIL = "h200/ceilings.json"
_S4, _SD = "h200/serve_qwen3-4b.json", "h200/serve_qwen3-4b_default.json"
_NO_OVERLAP = "h200/serve_qwen3-4b_disable-overlap.json"
_NO_GRAPH = "h200/serve_qwen3-4b_disable-cuda-graph.json"
_HF = "h200/hf_qwen3-4b.json"
_CPU = "cpu/bench_cpu.json"
_CPU_BOUNDS = "cpu/cpu_bounds.json"
_CPU_Q35 = "cpu/bench_cpu_qwen3.5.json"
_SPEC = _SPEC_FILE
_SPEC_OFF = "speculation off, the same requests in the same run"


#: bench_speculative.py's tasks: (key, what it asks)
_SPEC_TASKS = (("edit", "rewrite a 300-token code block with one change"),
               ("quote", "quote the sentences of a document that give numbers"),
               ("chat", "a short story (plain chat)"))


def _spec_tasks(machine: str, file: str, how: str, fmt: str) -> list[Figure]:
    """n-gram speculation on each task against off, in the same run (`how`: its flags)."""
    return [Figure(machine, f"n-gram speculation ({how}), batch 1, greedy, {what}: decode "
                   "tok/s, tokens per verify step", _SMOL,
                   (Field(file, f"tasks.{task}.ngram.decode_tok_s", f"{fmt} tok/s"),
                    Field(file, f"tasks.{task}.ngram.tokens_per_verify", "{:.2f} tokens/verify")),
                   _SPEC_OFF, (Field(file, f"tasks.{task}.off.decode_tok_s", f"{fmt} tok/s"),))
            for task, what in _SPEC_TASKS]


_TIER = "cpu/kv_tier_smollm2.json"
_TIER_Q35 = "cpu/kv_tier_qwen3.5.json"
_TIER_WORK = ("16 conversations x 4 turns, each a 512-token document + 32-token turns, 4 at a "
              "time, the device KV pool a quarter of their tokens")


def _kv_tier(what: str, key: str, fmt: str, file: str = _TIER, model: str = _SMOL) -> Figure:
    return Figure("cpu", f"host KV tier (`--kv-host-cache-gb 1`), {_TIER_WORK}: {what}", model,
                  (Field(file, f"results.host_tier.{key}", fmt),),
                  "the same pool without the tier, the same requests",
                  (Field(file, f"results.off.{key}", fmt),))


def _spec_cost(batch: int, k: int) -> Figure:
    c = f"cost.{batch}"
    return Figure("cpu", f"a verify step with {k} drafts, all rejected, batch {batch}: "
                  "device time per step", _SMOL,
                  (Field(_SPEC, f"{c}.k{k}_ms_per_step", "{:.2f} ms"),),
                  "a decode step of the same requests",
                  (Field(_SPEC, f"{c}.k0_ms_per_step", "{:.2f} ms"),))
_TINY_Q35 = "tiny random Qwen3.5 (4 layers: 3 Gated DeltaNet, 1 gated attention; hidden 256)"
_Q35, _MOE = "Qwen3.5-4B", "Qwen3-30B-A3B-FP8 (block FP8)"
_MOE_L4 = "Qwen3-30B-A3B-FP8, its first 4 layers"
#: each decode file's ceilings, measured in the same call
_CEILINGS_OF = {"h200/decode_qwen3.5-4b.json": "h200/ceilings_qwen3.5.json",
                "h200/decode_qwen3-30b-a3b-fp8.json": "h200/ceilings_moe.json"}
_DEC35, _DECM = "h200/decode_qwen3.5-4b.json", "h200/decode_qwen3-30b-a3b-fp8.json"
_S35, _S35W = "h200/serve_qwen3.5-4b.json", "h200/serve_qwen3.5-4b_warm.json"
_SM = "h200/serve_qwen3-30b-a3b-fp8.json"
_SMB = "h200/serve_qwen3-30b-a3b-fp8_bf16kv.json"
_HFM = "h200/hf_qwen3-30b-a3b-fp8.json"
#: transformers' FP8 kernels come from the Hub, which the GPU machine cannot reach
_HFM_HOW = "transformers `generate`, its FP8 weights dequantized to bf16 as it loads"
_KFP8, _KMOE = "h200/kernels_fp8.json", "h200/kernels_moe.json"
_KGDN = "h200/kernels_deltanet.json"
_PM = "h200/parity_qwen3-30b-a3b-fp8-L4.json"
_PMB = "h200/parity_qwen3-30b-a3b-L4.json"
_MOE_BF16_L4 = "Qwen3-30B-A3B (bf16), its first 4 layers"


#: bench_cpu.py's engines: (summary key, the baseline's name)
_CPU_BASES = (("transformers", "transformers `generate` (the GGUF dequantized to fp32)"),
              ("arle_fp32", "arle `--dtype float32` (every weight dequantized)"),
              ("llama_cpp", "llama.cpp (llama-cpp-python; repacked AMX weights off: they "
                            "crash on this CPU)"))
_CPU_WORK = (("decode_tok_s", "decode, batch 1, 32-token prompt + 128 tokens: tok/s", "{:.1f}"),
             ("decode_batch_tok_s", "decode, batch 8 (8 distinct 32-token prompts + 128 tokens "
              "each): tok/s", "{:.0f}"),
             ("prefill_tok_s", "prefill, one 512-token prompt: tok/s", "{:.0f}"))


def _cpu_figures() -> list[Figure]:
    """The default model on the CPU: arle (integer weights) against each baseline engine of
    the same run, as the context grows, its memory and its floor."""
    figs = [Figure("cpu", what, _SMOL, (Field(_CPU, f"summary.arle.{key}", f"{fmt} tok/s"),),
                   name, (Field(_CPU, f"summary.{base}.{key}", f"{fmt} tok/s"),),
                   readme="the default model, decode, batch 1"
                   if (key, base) == ("decode_tok_s", "transformers") else "")
            for key, what, fmt in _CPU_WORK for base, name in _CPU_BASES
            if (key, base) != ("decode_batch_tok_s", "llama_cpp")]
    figs += [Figure("cpu", f"batch 1, a {n}-token prompt + 128 tokens: decode, prefill tok/s",
                    _SMOL, _contexts("arle", n), _CPU_BASES[1][1], _contexts("arle_fp32", n))
             for n in (128, 512, 2048, 6144)]
    figs += [Figure("cpu", "resident memory after start-up (VmRSS)", _SMOL,
                    (Field(_CPU, "summary.arle.rss_mb", "{:.0f} MB"),), _CPU_BASES[1][1],
                    (Field(_CPU, "summary.arle_fp32.rss_mb", "{:.0f} MB"),)),
             Figure("cpu", "decode, batch 1: tok/s", _SMOL,
                    (Field(_CPU, "summary.arle.decode_tok_s", "{:.1f} tok/s"),),
                    "weight-read floor (weights / `x.sum()` bandwidth)",
                    (Field(_CPU, "summary.decode_floor.floor_decode_tok_s", "{:.1f} tok/s"),))]
    return figs


def _contexts(engine: str, n: int) -> tuple[Field, Field]:
    c = f"summary.{engine}.contexts.{n}"
    return (Field(_CPU, f"{c}.decode_tok_s", "{:.1f} tok/s"),
            Field(_CPU, f"{c}.prefill_tok_s", "{:.0f} tok/s"))


def _floor(decode: str) -> Quotient:
    """A decode step's floor: the weights' bytes / the read bandwidth of `x.sum()`, in ms."""
    return Quotient(Field(decode, "weight_bytes", ""), Field(_CEIL, "read_TBps", ""),
                    "{:.3f} ms", 1e-9)


def _step_floor(decode: str, batch: int, ceilings: str | None = None) -> Quotient:
    """A decode step's floor from the bytes it must move (`floor_bytes`: the experts the batch
    touches, a hybrid model's state) / the read bandwidth measured on the same machine
    (`ceilings`; default: the file `_CEILINGS_OF` gives), in ms."""
    return Quotient(Field(decode, f"floor_bytes.batch{batch}.total", ""),
                    Field(ceilings or _CEILINGS_OF[decode], "read_TBps", ""), "{:.3f} ms", 1e-9)


def _parity(file: str, name: str) -> tuple[Field, ...]:
    s = f"summary.{name}"
    return (Field(file, f"{s}.rel", "rel {:.4f}"), Field(file, f"{s}.kl_mean", "KL {:.2e}"),
            Field(file, f"{s}.top1", "top-1 {:.1%}"))


def _serve(file: str, c: int) -> tuple[Field, ...]:
    r = f"runs.{c}"
    return (Field(file, f"{r}.output_throughput", "{:.0f} tok/s"),
            Field(file, f"{r}.mean_tpot_ms", "TPOT {:.3f} ms"),
            Field(file, f"{r}.mean_ttft_ms", "TTFT {:.1f} ms"))


def _tok_s(file: str, c: int) -> tuple[Field]:
    return (Field(file, f"runs.{c}.output_throughput", "{:.0f} tok/s"),)


_RANDOM = "512 in / 128 out"


#: Qwen3-4B's FP8 gate_up sweep (`kernels_gate_up` in its decode JSON): the fused tile chosen
#: at one row (`fp8_glu_config`), the unfused weight's tile, and that GEMV then silu_and_mul
_GLU_ROWS = ("gemv_glu/2x512x2", "gemv_glu/4x512x4", "gemv+silu/4x512x4")


def _h100_decode(what: str, model: str, name: str, batch: int, floor: str,
                 ceilings: str = "h100/ceilings.json") -> Figure:
    """An H100 decode step at a batch size (its graph's replay: the device time of one step)
    against its floor."""
    f = f"h100/decode_{name}.json"
    return Figure("h100", f"decode, batch {batch}: one step's graph replay{what}", model,
                  (Field(f, f"graph_replay_bs{batch}_ms", "{:.3f} ms"),
                   Field(f, f"batch{batch}.mean_tpot_ms", "TPOT {:.3f} ms")), floor,
                  (_step_floor(f, batch, ceilings),))


def _h100_context(model: str, name: str) -> list[Figure]:
    f = f"h100/context_{name}.json"
    ns = (1024, 8192, 32768)
    return [Figure("h100", f"batch 1, a 1k / 8k / 32k-token prompt: {what}", model,
                   tuple(Field(f, f"runs.{n}.{key}", fmt) for n in ns), sep=" / ")
            for what, key, fmt in (("prefill time (TTFT)", "ttft_ms", "{:.1f} ms"),
                                   ("TPOT after it", "tpot_ms", "{:.3f} ms"))]


def _h100_spec_cost(model: str, name: str, batch: int) -> Figure:
    f, c = f"h100/speculative_cost_{name}.json", f"cost.{batch}"
    return Figure("h100", f"a verify step with K = 1 / 2 / 3 / 4 drafts, all rejected, batch "
                  f"{batch}, CUDA graphs: ms per step", model,
                  tuple(Field(f, f"{c}.k{k}_ms_per_step", "{:.2f}") for k in (1, 2, 3, 4)),
                  "a decode step of the same requests",
                  (Field(f, f"{c}.k0_ms_per_step", "{:.2f} ms"),), sep=" / ")


def _h100_figures() -> list[Figure]:
    """This wave's tree on an H100: every figure the GPU run issue asks for that one session's
    device time allowed."""
    sc, sm = "h100/serve_qwen3-4b_scale.json", "h100/serve_qwen3-30b-a3b-fp8.json"
    tier, st = "h100/kv_tier_qwen3-4b.json", "h100/structured_qwen3-4b.json"
    s35 = "h100/serve_qwen3.5-4b.json"
    c35 = "h100/ceilings_qwen3.5.json"
    kw, m1, f8 = "h100/kernels_w4.json", "h100/kernels_moe.json", "h100/decode_qwen3-4b_fp8.json"
    return [
        _h100_decode("", _Q4, "qwen3-4b", 1, "weight-read floor"),
        _h100_decode("", _Q4, "qwen3-4b", 8, "weight-read floor"),
        _h100_decode(", `--quantization fp8` (128x128 block FP8 at load)", _Q4,
                     "qwen3-4b_fp8", 1, "its weight-read floor"),
        _h100_decode(", `--quantization fp8`", _Q4, "qwen3-4b_fp8", 8, "its weight-read floor"),
        Figure("h100", "the FP8 gate_up with silu(gate) * up in its GEMV's epilogue alone, 1 "
               "row, 2 gate rows a program on 2 warps, in a CUDA graph over weights past L2, us",
               f"{_Q4}'s gate_up (`--quantization fp8`)",
               (Field(f8, f"kernels_gate_up.results[M=1,name={_GLU_ROWS[0]}].us", "{:.1f}"),),
               "the GEMV, then `silu_and_mul`",
               (Field(f8, f"kernels_gate_up.results[M=1,name={_GLU_ROWS[2]}].us", "{:.1f} us"),)),
        _h100_decode(", 4-bit AWQ (group 128)", "Qwen3-4B-AWQ layout", "qwen3-4b-awq", 1,
                     "its weight-read floor"),
        _h100_decode(", 4-bit AWQ", "Qwen3-4B-AWQ layout", "qwen3-4b-awq", 8,
                     "its weight-read floor"),
        *(Figure("h100", f"the W4A16 GEMV (group 128) alone, 1 row, its chosen tile, in a CUDA "
                 f"graph over weights past L2: qkv / o_proj / down, {unit}", "Qwen3-4B's shapes",
                 tuple(Field(kw, f"results[shape={s},M=1,kind=gemv,chosen=True].{key}", fmt)
                       for s in ("qkv", "o_proj", "down")), sep=" / ")
          for unit, key, fmt in (("us", "us", "{:.1f}"),
                                 ("GB/s of words, scales and zeros", "GBps", "{:.0f}"))),
        _h100_decode("", _MOE, "qwen3-30b-a3b-fp8", 1, "floor (weights read, 8 of 128 experts)"),
        Figure("h100", "one token's MoE GEMV alone, 8 pairs, in a CUDA graph over 8 routings: "
               "down into split-sum slots (8 rows of a pair's expert a program, 2 warps) / "
               "gate_up, us", "Qwen3-30B-A3B-FP8's experts",
               tuple(Field(m1, f"one_token.results[name={n}].us", "{:.1f}")
                     for n in ("down_slots/8x256x2", "gate_up/1x2048x1")),
               "down as before: the 8 pairs summed in one program a column",
               (Field(m1, "one_token.results[name=down_sum/1x256x1].us", "{:.1f} us"),),
               sep=" / "),
        _h100_decode("", _MOE, "qwen3-30b-a3b-fp8", 8, "floor (the experts 8 tokens touch)"),
        _h100_decode("", _Q35, "qwen3.5-4b", 1, "floor (weights + recurrent state)", c35),
        _h100_decode("", _Q35, "qwen3.5-4b", 8, "floor (weights + 8 states)", c35),
        *_h100_context(_Q4, "qwen3-4b"), *_h100_context(_Q35, "qwen3.5-4b"),
        Figure("h100", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1 / 8 / 64 / 256: output "
               "tok/s", _Q4, tuple(Field(sc, f"runs.{c}.output_throughput", "{:.0f}")
                                   for c in (1, 8, 64, 256)), sep=" / "),
        Figure("h100", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1 / 8 / 64 / 256: TPOT",
               _Q4, tuple(Field(sc, f"runs.{c}.mean_tpot_ms", "{:.2f} ms")
                          for c in (1, 8, 64, 256)), sep=" / "),
        *(Figure("h100", f"`arle serve --kv-cache-dtype fp8_e4m3` + `arle bench`, {_RANDOM}, "
                 f"c = {c}", _MOE, _serve(sm, c)) for c in (8,)),
        Figure("h100", "`arle serve`: time to ready, cold Triton cache", _MOE,
               (Field(sm, "time_to_ready_s", "{:.2f} s"),)),
        *(Figure("h100", f"`arle serve` + `arle bench`, {_RANDOM}, c = {c}", _Q35,
                 _serve(s35, c)) for c in (1, 8)),
        Figure("h100", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1 / 8 / 64: output tok/s",
               _SMOL, tuple(Field("h100/serve_smollm2.json", f"runs.{c}.output_throughput",
                                  "{:.0f}") for c in (1, 8, 64)), sep=" / "),
        *(_h100_spec_cost(m, n, b) for m, n in ((_Q4, "qwen3-4b"), (_Q35, "qwen3.5-4b"),
                                                (_MOE, "qwen3-30b-a3b-fp8"))
          for b in (1, 8)),
        *_spec_tasks("h100", "h100/speculative_smollm2.json", "K = 4", "{:.0f}"),
        Figure("h100", "host KV tier (`--kv-host-cache-gb 16`), 16 conversations x 4 turns of a "
               "2048-token document + 32-token turns, 4 at a time, the device pool a quarter of "
               "their tokens: mean TTFT of the returning turns, prompt tokens prefilled", _Q4,
               (Field(tier, "results.host_tier.mean_ttft_ms_returning", "{:.1f} ms"),
                Field(tier, "results.host_tier.prefill_tokens_computed", "{:.0f} tokens")),
               "the same pool without the tier",
               (Field(tier, "results.off.mean_ttft_ms_returning", "{:.1f} ms"),
                Field(tier, "results.off.prefill_tokens_computed", "{:.0f} tokens"))),
        *(Figure("h100", f"constrained decoding (a JSON schema), batch {b}: ms per step", _Q4,
                 (Field(st, f"batches.{b}.constrained_ms_per_step", "{:.3f} ms"),),
                 "the same requests unconstrained",
                 (Field(st, f"batches.{b}.unconstrained_ms_per_step", "{:.3f} ms"),))
          for b in (1, 8)),
        *(Figure("h100", "logits against transformers fp32, " + how, model,
                 _parity(f"h100/parity_{n}.json", "arle_bf16_vs_transformers_fp32"),
                 "transformers bf16", _parity(f"h100/parity_{n}.json",
                                              "transformers_bf16_vs_fp32"))
          for how, model, n in (("2 x 512 random tokens", _Q4, "qwen3-4b"),
                                ("2 x 512 random tokens", _MOE_BF16_L4, "qwen3-30b-a3b-L4"))),
    ]


FIGURES = (
    Figure("h200", "decode, batch 1: TPOT", _Q4,
           (Field(_DEC4, "batch1.mean_tpot_ms", "{:.3f} ms"),), "weight-read floor",
           (_floor(_DEC4),), readme="Qwen3-4B decode, batch 1: time per token"),
    Figure("h200", "decode, batch 1: TPOT", "Qwen3-8B",
           (Field(_DEC8, "batch1.mean_tpot_ms", "{:.3f} ms"),), "weight-read floor",
           (_floor(_DEC8),)),
    Figure("h200", f"{_RANDOM}, batch 1: output tok/s (arle: `arle serve`, c = 1)", _Q4,
           _tok_s(_SD, 1), "transformers `generate`, static cache, compiled",
           (Field(_HF, "results[mode=static,batch=1].output_tok_s", "{:.1f} tok/s"),)),
    Figure("h200", f"{_RANDOM}, batch 8: output tok/s (arle: `arle serve`, c = 8)", _Q4,
           _tok_s(_SD, 8), "transformers `generate`, static cache, compiled",
           (Field(_HF, "results[mode=static,batch=8].output_tok_s", "{:.1f} tok/s"),),
           readme=f"Qwen3-4B, {_RANDOM}, 8 at a time"),
    Figure("h200", "logits against transformers fp32, 2 x 512 random tokens", _Q4,
           _parity("h200/parity_qwen3-4b.json", "arle_bf16_vs_transformers_fp32"),
           "transformers bf16",
           _parity("h200/parity_qwen3-4b.json", "transformers_bf16_vs_fp32")),
    Figure("h200", "logits against transformers fp32, 7 English prompts", _SMOL,
           _parity("h200/parity_smollm2.json", "arle_bf16_vs_transformers_fp32"),
           "transformers bf16",
           _parity("h200/parity_smollm2.json", "transformers_bf16_vs_fp32"),
           readme="the default model's logits against transformers fp32"),
    Figure("h200", "prefill, one 4096-token prompt: TTFT", _Q4,
           (Field("h200/prefill_qwen3-4b.json", "ttft_ms", "{:.1f} ms"),
            Field("h200/prefill_qwen3-4b.json", "achieved_TFLOPs", "{:.0f} TFLOP/s")),
           "GEMM-rate floor (FLOPs / bf16 GEMM rate)",
           (Quotient(Field("h200/prefill_qwen3-4b.json", "flops", ""),
                     Field(_CEIL, "bf16_gemm_TFLOPs", ""), "{:.1f} ms", 1e-9),)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1", _Q4, _serve(_S4, 1)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 8", _Q4, _serve(_S4, 8)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 64", _Q4, _serve(_S4, 64)),
    Figure("h200", "`arle serve`: time to ready, cold Triton cache", _Q4,
           (Field(_S4, "time_to_ready_s", "{:.2f} s"),)),
    Figure("h200", f"overlapped scheduling, {_RANDOM}, c = 1", _Q4, _tok_s(_SD, 1),
           "`--disable-overlap`", _tok_s(_NO_OVERLAP, 1)),
    Figure("h200", f"overlapped scheduling, {_RANDOM}, c = 8", _Q4, _tok_s(_SD, 8),
           "`--disable-overlap`", _tok_s(_NO_OVERLAP, 8)),
    Figure("h200", f"CUDA graphs, {_RANDOM}, c = 1", _Q4, _tok_s(_SD, 1),
           "`--disable-cuda-graph`", _tok_s(_NO_GRAPH, 1)),
    Figure("h200", f"CUDA graphs, {_RANDOM}, c = 8", _Q4, _tok_s(_SD, 8),
           "`--disable-cuda-graph`", _tok_s(_NO_GRAPH, 8)),
    Figure("h200", "offline, 256 requests of 100-1024 in / 100-1024 out", "Qwen3-0.6B",
           (Field("h200/offline_qwen3-0.6b.json", "output_tok_s", "{:.0f} tok/s"),)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1 / 8 / 64: output tok/s",
           _SMOL, (Field("h200/serve_smollm2.json", "runs.1.output_throughput", "{:.0f}"),
                   Field("h200/serve_smollm2.json", "runs.8.output_throughput", "{:.0f}"),
                   Field("h200/serve_smollm2.json", "runs.64.output_throughput", "{:.0f}")),
           sep=" / "),
    Figure("h200", "`arle serve`: time to ready", _SMOL,
           (Field("h200/serve_smollm2.json", "time_to_ready_s", "{:.2f} s"),)),
    Figure("h200", "decode, batch 1: TPOT", _Q35,
           (Field(_DEC35, "batch1.mean_tpot_ms", "{:.3f} ms"),),
           "floor (weights + recurrent state read and written)", (_step_floor(_DEC35, 1),),
           readme="Qwen3.5-4B decode, batch 1: time per token"),
    Figure("h200", "decode, batch 8: TPOT", _Q35,
           (Field(_DEC35, "batch8.mean_tpot_ms", "{:.3f} ms"),),
           "floor (weights + 8 states read and written)", (_step_floor(_DEC35, 8),)),
    Figure("h200", "decode, batch 1, 512-token prompt: ms per token", _Q35,
           (Field(_DEC35, "batch1.mean_tpot_ms", "{:.2f} ms"),),
           "transformers `generate` with fla's kernels",
           (Field("h200/hf_qwen3.5-4b_fla.json", "results[batch=1].decode_ms_per_token",
                  "{:.1f} ms"),)),
    Figure("h200", "decode, batch 1, 512-token prompt: ms per token", _Q35,
           (Field(_DEC35, "batch1.mean_tpot_ms", "{:.2f} ms"),),
           "transformers `generate`, torch path",
           (Field("h200/hf_qwen3.5-4b.json", "results[batch=1].decode_ms_per_token",
                  "{:.1f} ms"),)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 1", _Q35, _serve(_S35, 1)),
    Figure("h200", f"`arle serve` + `arle bench`, {_RANDOM}, c = 8", _Q35, _serve(_S35, 8)),
    Figure("h200", "first request after `/ready` (1 prompt token, 1 new): latency at the "
           "client / TTFT in the server's trace", _Q35,
           (Field(_S35W, "first_request.latency_ms", "{:.1f} ms"),
            Field(_S35W, "first_request.server_ttft_ms", "{:.1f} ms")), sep=" / "),
    Figure("h200", "`arle serve`: time to ready, warm / cold Triton cache", _Q35,
           (Field(_S35W, "time_to_ready_s", "{:.2f} s"),
            Field(_S35, "time_to_ready_s", "{:.2f} s")), sep=" / "),
    Figure("h200", "chat, 8 turns of ~100 words + 200 new tokens: mean TTFT", _Q35,
           (Field("h200/chat_qwen3.5-4b_on.json", "cache_on.mean_ttft_ms", "{:.1f} ms"),
            Field("h200/chat_qwen3.5-4b_on.json", "cache_on.reused_share",
                  "{:.1%} of prompt tokens reused")),
           "prefix cache off",
           (Field("h200/chat_qwen3.5-4b_off.json", "cache_off.mean_ttft_ms", "{:.1f} ms"),)),
    Figure("h200", "logits against transformers fp32, 2 x 512 random tokens", _Q35,
           _parity("h200/parity_qwen3.5-4b.json", "arle_bf16_vs_transformers_fp32"),
           "transformers bf16",
           _parity("h200/parity_qwen3.5-4b.json", "transformers_bf16_vs_fp32")),
    Figure("h200", "decode, batch 1: TPOT", _MOE,
           (Field(_DECM, "batch1.mean_tpot_ms", "{:.3f} ms"),),
           "floor (weights read, 8 of 128 experts)", (_step_floor(_DECM, 1),),
           readme="Qwen3-30B-A3B-FP8 decode, batch 1: time per token"),
    Figure("h200", "decode, batch 8: TPOT", _MOE,
           (Field(_DECM, "batch8.mean_tpot_ms", "{:.3f} ms"),),
           "floor (the experts 8 tokens touch)", (_step_floor(_DECM, 8),)),
    Figure("h200", "decode, batch 1, 512-token prompt: ms per token", _MOE,
           (Field(_DECM, "batch1.mean_tpot_ms", "{:.2f} ms"),), _HFM_HOW,
           (Field(_HFM, "results[batch=1].decode_ms_per_token", "{:.1f} ms"),)),
    Figure("h200", "decode, batch 8, 512-token prompts: ms per step", _MOE,
           (Field(_DECM, "batch8.mean_tpot_ms", "{:.2f} ms"),), _HFM_HOW,
           (Field(_HFM, "results[batch=8].decode_ms_per_token", "{:.1f} ms"),)),
    Figure("h200", f"`arle serve --kv-cache-dtype fp8_e4m3` + `arle bench`, {_RANDOM}, c = 1",
           _MOE, _serve(_SM, 1)),
    Figure("h200", f"`arle serve --kv-cache-dtype fp8_e4m3` + `arle bench`, {_RANDOM}, c = 8",
           _MOE, _serve(_SM, 8)),
    Figure("h200", f"`arle serve --kv-cache-dtype fp8_e4m3` + `arle bench`, {_RANDOM}, c = 64",
           _MOE, _serve(_SM, 64)),
    Figure("h200", f"`arle serve` (bf16 KV) + `arle bench`, {_RANDOM}, c = 8", _MOE,
           _serve(_SMB, 8)),
    Figure("h200", "`arle serve`: time to ready, cold / warm Triton cache", _MOE,
           (Field(_SM, "time_to_ready_s", "{:.2f} s"), Field(_SMB, "time_to_ready_s", "{:.2f} s")),
           sep=" / "),
    Figure("h200", "logits against transformers fp32, 2 x 512 random tokens", _MOE_BF16_L4,
           _parity(_PMB, "arle_bf16_vs_transformers_fp32"), "transformers bf16",
           _parity(_PMB, "transformers_bf16_vs_fp32")),
    Figure("h200", "logits (W8A8 prefill) against transformers fp32 on the dequantized weights",
           _MOE_L4, _parity(_PM, "arle_bf16_vs_transformers_fp32"), "transformers bf16",
           _parity(_PM, "transformers_bf16_vs_fp32")),
    Figure("h200", "logits (W8A16 decode) against transformers fp32 on the dequantized weights",
           _MOE_L4, _parity(_PM, "arle_decode_vs_transformers_fp32"), "transformers bf16",
           _parity(_PM, "transformers_bf16_vs_fp32")),
    *_h100_figures(),
    *_cpu_figures(),
    *_spec_tasks("cpu", _SPEC, "`--speculative ngram`, K = 8: 7 drafts a row, whole blocks of 4", "{:.1f}"),
    _spec_cost(1, 4), _spec_cost(1, 8), _spec_cost(8, 8),
    _kv_tier("mean TTFT of the returning turns", "mean_ttft_ms_returning", "{:.0f} ms"),
    _kv_tier("prompt tokens prefilled", "prefill_tokens_computed", "{:.0f} tokens"),
    # a hybrid model: a host hit needs the state snapshot at its end, which moves down too
    _kv_tier("mean TTFT of the returning turns", "mean_ttft_ms_returning", "{:.0f} ms",
             _TIER_Q35, _TINY_Q35),
    _kv_tier("prompt tokens prefilled", "prefill_tokens_computed", "{:.0f} tokens", _TIER_Q35,
             _TINY_Q35),
    Figure("cpu", "decode, batch 1, 32-token prompt + 128 tokens: tok/s", _TINY_Q35,
           (Field(_CPU_Q35, "summary.arle.decode_tok_s", "{:.1f} tok/s"),),
           "transformers `generate`",
           (Field(_CPU_Q35, "summary.transformers.decode_tok_s", "{:.1f} tok/s"),)),
    Figure("cpu", "prefill, one 512-token prompt: tok/s", _TINY_Q35,
           (Field(_CPU_Q35, "summary.arle.prefill_tok_s", "{:.0f} tok/s"),),
           "transformers `generate`",
           (Field(_CPU_Q35, "summary.transformers.prefill_tok_s", "{:.0f} tok/s"),)),
)


class Results:
    """docs/results/'s files, read once, with each one's date and commit."""

    def __init__(self, root: Path = RESULTS) -> None:
        self.root = root
        self.files: dict[str, Any] = {}
        self.provenance: dict[str, dict[str, str]] = (
            json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {})

    def load(self, name: str) -> Any:
        if name not in self.files:
            path = self.root / name
            if not path.is_file():
                raise SystemExit(f"perf_table: docs/results/{name} is missing "
                                 f"(written by: {_command(name)})")
            self.files[name] = json.loads(path.read_text())
        return self.files[name]

    def stamp(self, name: str) -> tuple[str, str]:
        """(date, commit) of a file: its own, else its provenance entry if the hash matches."""
        data = self.load(name)
        if "date" in data and "commit" in data:
            return str(data["date"])[:10], str(data["commit"] or "unknown")
        entry = self.provenance.get(name)
        if entry is None or entry.get("sha256") != sha256(self.root / name):
            raise SystemExit(
                f"perf_table: docs/results/{name} records no date or commit, and "
                f"docs/results/provenance.json has no entry for this file's contents; add one: "
                f"python scripts/perf_table.py --provenance {name} YYYY-MM-DD COMMIT")
        return entry["date"], entry["commit"]

    def field_stamp(self, field: Field) -> tuple[str, str]:
        """(date, commit) of a field: those of the record it reads where that record (a
        top-level key, e.g. kernels_moe.json's one_token) carries its own, else its file's."""
        head = self.load(field.file).get(re.split(r"[.\[]", field.path, maxsplit=1)[0])
        if isinstance(head, dict) and "date" in head and "commit" in head:
            return str(head["date"])[:10], str(head["commit"])
        return self.stamp(field.file)

    def get(self, field: Field) -> Any:
        value: Any = self.load(field.file)
        for part in field.path.split("."):
            value = _step(value, part, field)
        return value

    def value(self, v: Value) -> float:
        if isinstance(v, Quotient):
            return float(self.get(v.num)) / float(self.get(v.den)) * v.scale
        return float(self.get(v)) * v.scale

    def show(self, v: Value) -> str:
        if isinstance(v, Field) and v.scale == 1 and not isinstance(self.get(v), float):
            return v.fmt.format(self.get(v))  # a string, or an int as it is
        return v.fmt.format(self.value(v))


def _step(value: Any, part: str, field: Field) -> Any:
    m = re.fullmatch(r"([\w.-]*?)(?:\[(.+)\])?", part)
    if m is None:
        raise SystemExit(f"perf_table: bad path {field.path!r}")
    key, select = m.groups()
    try:
        if key:
            value = value[key]
        if select:
            want = dict(kv.split("=", 1) for kv in select.split(","))
            hits = [x for x in value if all(str(x.get(k)) == w for k, w in want.items())]
            if len(hits) != 1:
                raise KeyError(f"{len(hits)} items match [{select}]")
            value = hits[0]
    except (KeyError, TypeError) as e:
        raise SystemExit(f"perf_table: docs/results/{field.file} has no {field.path!r} "
                         f"({e})") from None
    return value


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _command(name: str) -> str:
    return next((s.command for s in SOURCES if s.file == name), "no command declared")


def _files(v: Value) -> list[str]:
    return [f.file for f in _fields(v)]


def _fields(v: Value) -> list[Field]:
    return [v.num, v.den] if isinstance(v, Quotient) else [v]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def machine_section(res: Results, machine: Machine) -> list[str]:
    about = ", ".join(res.show(f) for f in machine.about)
    lines = [f"## {machine.title}", "", f"{about}.", "",
             "| workload | model | arle | baseline | arle / baseline | date | commit "
             "| data |", "|---|---|---|---|---|---|---|---|"]
    used: list[str] = []
    for fig in (f for f in FIGURES if f.machine == machine.key):
        files: list[str] = []
        for v in (*fig.arle, *fig.baseline):
            files += [f for f in _files(v) if f not in files]
        used += [f for f in files if f not in used]
        stamps = [res.field_stamp(f) for v in (*fig.arle, *fig.baseline) for f in _fields(v)]
        dates = " / ".join(dict.fromkeys(d for d, _ in stamps))
        commits = " / ".join(dict.fromkeys(c for _, c in stamps))
        arle, base, ratio = _cells(res, fig)
        data = ", ".join(f"[{Path(f).name}](results/{f})" for f in files)
        lines.append("| " + " | ".join(_cell(c) for c in (
            fig.workload, fig.model, arle, base, ratio, dates, commits, data)) + " |")
    lines += ["", "Commands, from the repository root (the data column's files and the ones the "
              "bounds below cite):", "", "```sh", *machine.setup]
    for name in (s.file for s in SOURCES if s.file in used or s.file.startswith(machine.key)):
        lines += [f"# {Path(name).name}", _command(name)]
    return [*lines, "```", ""]


def bounds_section(res: Results) -> list[str]:
    """The two open targets on the H200, in figures from the same files as the table."""
    dec = res.load(_DEC4)
    floor = res.value(_floor(_DEC4))
    tpot = float(dec["batch1"]["mean_tpot_ms"])
    crit = dec["kernels_bs1"]["critical"]
    linear = sum(k["critical_us"] for k in crit if "gemv" in k["label"]) / 1e3
    rest = sum(k["critical_us"] for k in crit if "gemv" not in k["label"]) / 1e3
    target = TARGET_FLOOR_RATIO * floor
    c8 = res.load(_S4)["runs"]["8"]
    need = c8["total_output_tokens"] / TARGET_C8_TOK_S
    gap = c8["duration"] - need
    return [
        "## What bounds the open targets", "",
        f"**Batch-1 decode, Qwen3-4B** ([decode_qwen3-4b.json](results/{_DEC4})): TPOT "
        f"{tpot:.3f} ms, {tpot / floor:.2f}x the {floor:.3f} ms weight-read floor; the target is "
        f"{TARGET_FLOOR_RATIO:.2f}x, {target:.3f} ms. On the step's critical path "
        f"(`kernels_bs1.critical`, one profiled graph replay) the linear layers take "
        f"{linear:.3f} ms, {linear / floor:.2f}x the floor on their own; attention, norms, rope "
        f"and the embedding take {rest:.3f} ms, where {TARGET_FLOOR_RATIO:.2f}x would leave them "
        f"{target - linear:.3f} ms.", "",
        f"**`arle serve` at concurrency 8, Qwen3-4B** ([serve_qwen3-4b.json](results/{_S4})): "
        f"{c8['output_throughput']:.0f} tok/s against a target of {TARGET_C8_TOK_S:.0f}, TPOT "
        f"{c8['mean_tpot_ms']:.3f} ms against {TARGET_C8_TPOT_MS:.0f} ms. The server ran "
        f"{c8['server_steps']} steps in {c8['duration']:.3f} s with the GPU busy "
        f"{c8['server_device_busy']:.1%} of it, so the host side does not bound it. "
        f"{TARGET_C8_TOK_S:.0f} tok/s needs the run in {need:.3f} s: {gap * 1e3:.0f} ms less, "
        f"~{gap / c8['server_steps'] * 1e6:.0f} us off each step; a batch-8 decode step's graph "
        f"replays in {dec['graph_replay_bs8_ms']:.3f} ms.", "", *_new_model_bounds(res),
        *_h100_bounds(res),
        *_cpu_bounds(res)]


def _cpu_bounds(res: Results) -> list[str]:
    """The default model's CPU decode against issue 52's goals (3x arle's fp32 path, half of
    llama.cpp's), with where a token's time goes (bench_cpu.json's profile)."""
    cpu = res.load(_CPU)
    s, prof = cpu["summary"], cpu["raw"]["arle"]["profile"]
    top = prof["top"]

    def ms(*names: str) -> float:
        return sum(t["self_ms_per_token"] for t in top if any(n in t["op"] for n in names))

    int4, int8 = ms("int4pack_mm"), ms("int8pack_mm")
    calls = sum(t["calls_per_token"] for t in top if "pack_mm" in t["op"])
    rest = prof["self_ms_per_token"] - int4 - int8
    d = s["arle"]["decode_tok_s"]
    return [
        f"**Batch-1 decode, {_SMOL}, the CPU** ([{Path(_CPU).name}](results/{_CPU})): "
        f"{d:.1f} tok/s, {d / s['arle_fp32']['decode_tok_s']:.2f}x arle's fp32 path and "
        f"{d / s['llama_cpp']['decode_tok_s']:.2f}x llama.cpp's in the same run; the goals are "
        f"3x and 0.5x. A token's ops take {prof['self_ms_per_token']:.1f} ms of CPU time in "
        f"{prof['calls_per_token']:.0f} calls (torch.profiler, `raw.arle.profile`): the int4 "
        f"matmuls {int4:.1f} ms and the int8 lm_head {int8:.1f} ms ({calls:.0f} calls), the "
        f"other {rest:.1f} ms in the {prof['calls_per_token'] - calls:.0f} others, a few "
        f"microseconds of dispatch each (norms, rotary, the cache write, attention, dtype "
        f"casts around the bf16 kernels). The int4 kernel streams a large matrix at ~15 GB/s "
        f"on 2 threads but the model's small ones (0.2-0.9 MB) slower: a fixed cost a call. "
        f"What would close it: fewer, fused ops per layer (`torch.compile` of a layer's MLP "
        f"half came out level, after an 18 s compile) and a cheaper call into the packed "
        f"kernel.", "", *_cpu_step_bound(res, s), *_cpu_attention_bound(res, s)]


def _cpu_step_bound(res: Results, s: Any) -> list[str]:
    """A replayed CPU decode step with and without its integer matmuls (cpu_bounds.json)."""
    st = res.load(_CPU_BOUNDS)["step"]
    inside = st["step_ms"] - st["without_int_ms"]
    # the step time 3x arle's fp32 decode asks (bench_cpu.json's rates)
    goal = st["step_ms"] * s["arle"]["decode_tok_s"] / (3 * s["arle_fp32"]["decode_tok_s"])
    return [
        f"**One batch-1 decode step, replayed** ([{Path(_CPU_BOUNDS).name}]"
        f"(results/{_CPU_BOUNDS})):"
        f" {st['step_ms']:.1f} ms; {st['without_int_ms']:.1f} ms of it with its "
        f"{st['int_calls']} integer matmuls replaced by empty outputs (norms, rotary, the cache "
        f"write, attention, the glue), so the matmuls and their casts cost {inside:.1f} ms "
        f"inside the step, where the same calls back to back take {st['int_alone_ms']:.1f} ms "
        f"({inside / st['int_alone_ms']:.2f}x). 3x arle's fp32 path needs about "
        f"{goal:.1f} ms a step: the matmuls alone plus the rest already "
        f"come to {st['int_alone_ms'] + st['without_int_ms']:.1f} ms.", ""]


def _cpu_attention_bound(res: Results, s: Any) -> list[str]:
    """Why CPU decode slows with the context: attention's read rate (cpu_bounds.json)."""
    att = res.load(_CPU_BOUNDS)["attention"]
    n = max(att, key=int)
    a = att[n]
    return [
        f"**Batch-1 decode at long contexts, the CPU** ([{Path(_CPU_BOUNDS).name}]"
        f"(results/{_CPU_BOUNDS})): at {int(n):,} tokens a step reads "
        f"{a['arle']['bytes'] / 1e6:.0f} MB of fp32 K/V for its 30 layers; arle's attention "
        f"takes {a['arle']['ms']:.1f} ms of it, {a['arle']['gb_s']:.1f} GB/s, where a plain read "
        f"of the same bytes (`sum`) runs at {a['read']['gb_s']:.1f} GB/s "
        f"({a['read']['ms']:.1f} ms); decode there is "
        f"{s['arle']['contexts'][n]['decode_tok_s']:.1f} tok/s. The products are GEMMs with 3 "
        f"columns (the query heads of a KV head); one GEMM over all heads (9 columns, "
        f"{a['one_gemm']['gb_s']:.1f} GB/s) reads no faster: torch's CPU GEMM at so few columns "
        f"streams at under half the read rate on 2 threads. What would close it: a product that streams K and V once at "
        f"read bandwidth (a fused dot-softmax-dot, which torch's CPU ops do not offer), or "
        f"fewer bytes (bf16 or FP8 K/V: on the CPU those take a gathering path today).", ""]


def _kernel_ms(decode: Any, batch: int, *names: str) -> float:
    """ms per step of the profiled graph replay's kernels whose name holds one of `names`."""
    return sum(k["us"] for k in decode[f"kernels_bs{batch}"]["top"]
               if any(n in k["name"] for n in names)) / 1e3


def _kernel_row(res: Results, file: str, **match: object) -> dict[str, Any]:
    """The chosen row of a `bench_kernels.py` file whose fields equal `match`."""
    rows = res.load(file)["results"]
    return next(r for r in rows if r.get("chosen") and all(r.get(k) == v
                                                           for k, v in match.items()))


def _new_model_bounds(res: Results) -> list[str]:
    """Issue 41's open targets: Qwen3-30B-A3B-FP8's decode and serving, Qwen3.5-4B's c = 8,
    each with what its profile says bounds it; and the first request's, met."""
    moe, q35 = res.load(_DECM), res.load(_DEC35)
    read = float(res.load(_CEILINGS_OF[_DECM])["read_TBps"])
    fl = moe["floor_bytes"]["batch1"]
    floor1 = res.value(_step_floor(_DECM, 1))
    tpot1 = float(moe["batch1"]["mean_tpot_ms"])
    c8 = res.load(_SM)["runs"]["8"]
    floor8 = res.value(_step_floor(_DECM, 8))
    q8 = res.load(_S35)["runs"]["8"]
    qfloor8 = res.value(_step_floor(_DEC35, 8))
    first = res.load(_S35W)["first_request"]["latency_ms"]
    qkv = _kernel_row(res, _KFP8, shape="qkv", M=1)
    cublas = next(r for r in res.load(_KFP8)["results"]
                  if r["shape"] == "qkv" and r["M"] == 1 and r["kind"] == "cublas_bf16")
    one = _kernel_row(res, _KMOE, op="experts", fp8=True, T=1)
    eight = _kernel_row(res, _KMOE, op="experts", fp8=True, T=8)
    gdn8 = next(r for r in res.load(_KGDN)["results"] if r["case"] == "  BV 32, 4 warps"
                and r["rows"] == 8)
    experts_floor = fl["experts_touched"] / read * 1e-9
    gdn_layers = next(k["per_step"] for k in q35["kernels_bs8"]["top"]
                      if k["name"] == "_recurrent_kernel")
    gdn_floor_us = (q35["floor_bytes"]["batch8"]["state_read_write"] / gdn_layers
                    / float(res.load(_CEILINGS_OF[_DEC35])["read_TBps"]) * 1e-6)
    return [
        f"**Batch-1 decode, {_MOE}** ([{Path(_DECM).name}](results/{_DECM})): TPOT "
        f"{tpot1:.3f} ms, {tpot1 / floor1:.2f}x its {floor1:.3f} ms floor; the target is 1.5x. "
        f"In one profiled replay the expert GEMVs (gate_up, then down with the top-8 sum) take "
        f"{_kernel_ms(moe, 1, '_moe_gemv'):.2f} ms against {experts_floor:.2f} ms for the 8 "
        f"experts' bytes, the other GEMVs (FP8 attention, bf16 routers and lm_head) "
        f"{sum(k['us'] for k in moe['kernels_bs1']['top'] if k['name'] == '_gemv_kernel') / 1e3:.2f}"
        f" ms against "
        f"{fl['dense'] / read * 1e-9:.2f} ms, the router's top-8 "
        f"{_kernel_ms(moe, 1, '_route'):.2f} ms. Both kinds of GEMV stream FP8 at 1.5-1.6 "
        f"TB/s ([{Path(_KFP8).name}](results/{_KFP8}): qkv at one row {qkv['us']:.1f} us, "
        f"{qkv['GBps'] / 1e3:.2f} TB/s, where cuBLAS reads twice the bytes in bf16 at "
        f"{cublas['GBps'] / 1e3:.2f} TB/s; [{Path(_KMOE).name}](results/{_KMOE}): one token's "
        f"experts {one['us']:.1f} us a layer): at {moe['commit']}, dequantising in registers "
        f"(per weight an e4m3 to fp32 conversion, the scale, a rounding to bf16 and back) "
        f"bounded them, not the loads. The FMA GEMVs now multiply the exact FP8 values and "
        f"scale each 16-weight run's sum (`run_sums` in kernels/gemv.py): one conversion and "
        f"one FMA a weight. What would close the rest: FP8 tensor-core dots on activations "
        f"quantised per token (W8A8, as the prefill runs), or the conversion done with integer "
        f"operations (an e4m3 byte shifted into a bf16's exponent and mantissa is its value "
        f"times 2^-120, which the block scale can take).", "",
        f"**`arle serve` at concurrency 8, {_MOE}** ([{Path(_SM).name}](results/{_SM})): "
        f"{c8['output_throughput']:.0f} tok/s against a target of 1500 (the SGLang run the target "
        f"was set against: 137 tok/s), TPOT "
        f"{c8['mean_tpot_ms']:.2f} ms against 4.5, TTFT {c8['mean_ttft_ms']:.0f} ms against 100. "
        f"A batch-8 step replays in {moe['graph_replay_bs8_ms']:.2f} ms against a "
        f"{floor8:.2f} ms floor (8 tokens touch ~{moe['floor_bytes']['batch8']['experts_touched'] / moe['floor_bytes']['batch8']['experts_all']:.0%} "
        f"of the experts); the grouped expert GEMM takes {_kernel_ms(moe, 8, '_moe_mma'):.2f} ms "
        f"of it ({eight['us']:.0f} us a layer, {eight['GBps'] / 1e3:.1f} TB/s of the touched "
        f"experts' bytes: 16-row tiles for ~1 row an expert). What would close it: the dense "
        f"GEMV's swap-AB tiles (the expert's rows on the MMA's wide side) for the grouped GEMM "
        f"at few rows an expert.", "",
        f"**`arle serve` at concurrency 8, {_Q35}** ([{Path(_S35).name}](results/{_S35})): "
        f"{q8['output_throughput']:.0f} tok/s against a target of 2000, TPOT "
        f"{q8['mean_tpot_ms']:.2f} ms. A batch-8 step replays in "
        f"{q35['graph_replay_bs8_ms']:.2f} ms against a {qfloor8:.2f} ms floor: the bf16 GEMVs "
        f"take {_kernel_ms(q35, 8, '_gemv'):.2f} ms and the Gated DeltaNet recurrence "
        f"{_kernel_ms(q35, 8, '_recurrent'):.2f} ms of it ({gdn8['us']:.1f} us a layer alone, "
        f"[{Path(_KGDN).name}](results/{_KGDN}); 8 rows' states read and written at the read "
        f"bandwidth: {gdn_floor_us:.1f} us).", "",
        f"**First request after `/ready`, {_Q35}** ([{Path(_S35W).name}](results/{_S35W})): "
        f"{first:.1f} ms for one prompt token and one new token, within the 15 ms target; "
        f"the same engine's batch-1 step is {float(q35['batch1']['mean_tpot_ms']):.2f} ms.", ""]


def _swap_ab(kernels: Any) -> str:
    """What the swapped MoE products gave against the W8A16 grouped GEMM (one kernels_moe.json
    of FP8 experts at several token counts)."""
    def us(t: int, kind: str, swap: bool, tile: list[int] | None = None) -> float:
        return next(r["us"] for r in kernels["results"] if r["op"] == "experts"
                    and r["T"] == t and r["kind"] == kind and r.get("swap") == swap
                    and (tile is None or r["tile"] == tile))

    w8a8 = [128, 128, 8, 3]
    pairs = ", ".join(f"{t} tokens {us(t, 'w8a8', True, w8a8):.0f} us against "
                      f"{us(t, 'mma', False):.0f}" for t in (4, 8, 16, 64))
    return (f"Since these runs (commit {kernels['commit']} measured it, "
            f"[kernels_moe.json](results/h100/kernels_moe.json)), 3-64 tokens take the swapped "
            f"W8A8 product (an expert's rows on wgmma's wide side, FP8 x FP8, activations "
            f"quantised per token and 128 columns as the checkpoint's dynamic scheme has it): "
            f"{pairs} for the W8A16 GEMM, routing and top-k sum included. Swapped W8A16 (the "
            f"dequantised tile as wgmma's register operand) was slower still "
            f"({us(8, 'mma', True, [128, 128, 8, 3]):.0f} us at 8 tokens). The batch-8 step "
            f"and the serving figure above run it, with the routing and the align in one "
            f"program from 2 to 16 tokens and the top-k sum left to the next norm; the "
            f"activations are quantised in a pass of their own (inside the expert kernel it "
            f"measured slower: commit c7c0461). By its shape, a program streams only 48-256 KB "
            f"(a 64- or 128-row tile of one expert), so each pays a pipeline's ramp.")


def _w4_us(res: Results, shape: str, m: int, kind: str, **match: object) -> float:
    """One timing of kernels_w4.json: `shape` at m rows, this kind, the fields in `match`."""
    return next(r["us"] for r in res.load("h100/kernels_w4.json")["results"]
                if r["shape"] == shape and r["M"] == m and r["kind"] == kind
                and all(r[k] == v for k, v in match.items()))


def _w4_gemm_vs_gemv(res: Results) -> str:
    """The W4 GEMM (16 x 64 tiles, K split) against the GEMV's chosen tile at 8 rows, per
    long-K shape of kernels_w4.json."""
    return "; ".join(f"{s} at 8 rows {_w4_us(res, s, 8, 'gemm', tile=[16, 64, 4, 0]):.0f} us "
                     f"against {_w4_us(res, s, 8, 'gemv', chosen=True):.0f}"
                     for s in ("o_proj", "down"))


def _glu_us(res: Results) -> str:
    """The fused FP8 gate_up alone at one row, in its tile and the unfused weight's, and the
    GEMV then its activation."""
    us = [res.get(Field("h100/decode_qwen3-4b_fp8.json",
                        f"kernels_gate_up.results[M=1,name={n}].us", "")) for n in _GLU_ROWS]
    return (f"{us[0]:.1f} us with 2 gate rows a program on 2 warps, {us[1]:.1f} in the "
            f"unfused weight's tile, {us[2]:.1f} for that GEMV then `silu_and_mul`")


def _w4_chosen(res: Results) -> str:
    """The 4-bit GEMV's chosen tile at one and two rows, per shape of kernels_w4.json."""
    return ", ".join(f"{s} {_w4_us(res, s, 1, 'gemv', chosen=True):.1f} / "
                     f"{_w4_us(res, s, 2, 'gemv', chosen=True):.1f} us"
                     for s in ("qkv", "o_proj", "down", "gate_up"))


#: decode attention's launches in a layer (kernels/fused.py's, kernels/decode_attention.py's)
_ATTENTION_KERNELS = ("_qk_norm_rope_store_kv_kernel", "_decode_split_kernel", "_merge_kernel")


def _crit(decode: Any, kernel: str) -> list[float]:
    """Critical-path us a step of each launch of `kernel` in a decode JSON's profiled batch-1
    layer (`kernels_bs1.critical`, in layer order; the launches before the first layer too)."""
    return [float(k["critical_us"]) for k in decode["kernels_bs1"]["critical"]
            if k["label"].split()[-1] == kernel]


def _crit_ms(decode: Any, kernel: str) -> float:
    """Every launch of `kernel`: its critical-path ms a step."""
    return sum(_crit(decode, kernel)) / 1e3


def _h100_bounds(res: Results) -> list[str]:
    """This wave's goals (issues 51 and 53, set for the H200) against the H100 run: each
    figure over its floor on the card it ran on, and what its profile says bounds it."""
    def dec(name: str) -> Any:
        return res.load(f"h100/decode_{name}.json")

    def floor(name: str, batch: int = 1) -> float:
        return res.value(_step_floor(f"h100/decode_{name}.json", batch, "h100/ceilings.json"))

    read = float(res.load("h100/ceilings.json")["read_TBps"])
    moe, fp8, awq = dec("qwen3-30b-a3b-fp8"), dec("qwen3-4b_fp8"), dec("qwen3-4b-awq")
    moe_layers = int(next(k["per_step"] for k in moe["kernels_bs1"]["critical"]
                          if k["label"].endswith("_route_kernel")))  # one routing a layer
    moe_launches = sum(not k["label"].startswith("pre") for k in moe["kernels_bs1"]["critical"])
    moe_small = 1e3 * sum(_crit_ms(moe, k) for k in (*_ATTENTION_KERNELS, "_rms_norm_kernel",
                                                       "_route_kernel"))
    f_gemv = _crit_ms(fp8, "_gemv_kernel")
    one_token = res.load("h100/kernels_moe.json")["one_token"]["results"]
    up = next(r for r in one_token if r["op"] == "gate_up" and r["chosen"])
    up_best = max(r["GBps"] for r in one_token if r["op"] == "gate_up")
    m1, f1, a1 = (d["graph_replay_bs1_ms"] for d in (moe, fp8, awq))
    c8 = res.load("h100/serve_qwen3-30b-a3b-fp8.json")["runs"]["8"]
    w4 = _kernel_ms(awq, 1, "_gemv_w4")
    ctx4, ctx35 = (res.load(f"h100/context_{n}.json")["runs"] for n in ("qwen3-4b", "qwen3.5-4b"))
    spec = res.load("h100/speculative_smollm2.json")["tasks"]
    scale = res.load("h100/serve_qwen3-4b_scale.json")["runs"]
    c64, c256 = scale["64"], scale["256"]
    cost = res.load("h100/speculative_cost_qwen3-4b.json")["cost"]
    vc = {b: [cost[str(b)][f"k{k}_vs_decode"] for k in (1, 2, 3, 4)] for b in (1, 8)}
    ve = [cost[str(b)][f"eager_k{k}_vs_decode"] for b in (1, 8) for k in (1, 2, 3, 4)]
    moe_cost = res.load("h100/speculative_cost_qwen3-30b-a3b-fp8.json")["cost"]["1"]
    vm = [moe_cost[f"k{k}_vs_decode"] for k in (1, 2, 3, 4)]
    return [
        f"**This wave's goals, on the H100.** They were set for an H200 (4.18 TB/s); this card "
        f"reads {read:.2f} TB/s, so each figure stands against its floor here. The kernel times "
        f"below are from one profiled graph replay (`kernels_bs1`), which the profiler "
        f"stretches: they give shares, the replay gives the time.", "",
        f"- {_MOE}, batch 1: a step replays in {m1:.3f} ms, {m1 / floor('qwen3-30b-a3b-fp8'):.2f}x"
        f" its floor; the goal is 1.5x: not met. On the profiled step's critical path (its "
        f"busy times overlap under PDL) the expert GEMVs take "
        f"{_crit_ms(moe, '_moe_gemv_kernel'):.2f} ms, the other FP8 and bf16 GEMVs (lm_head "
        f"too) {_crit_ms(moe, '_gemv_kernel'):.2f} ms, attention "
        f"{sum(_crit_ms(moe, k) for k in _ATTENTION_KERNELS):.2f} ms, routing "
        f"{_crit_ms(moe, '_route_kernel'):.2f} ms, the norms "
        f"{_crit_ms(moe, '_rms_norm_kernel'):.2f} ms. At one token the down projection writes "
        f"each pair's weighted row to a split-sum slot that the next norm sums, 8 rows of the "
        f"pair's expert a program, and the routing, gate_up and down are chained by PDL (down "
        f"loads its first chunk of W while gate_up runs). What bounds it: gate_up "
        f"({_crit(moe, '_moe_gemv_kernel')[0] / moe_layers:.1f} us a layer) streams at "
        f"{up['GBps'] / 1e3:.2f} TB/s alone in its tile, at most {up_best / 1e3:.2f} in any tile "
        f"swept ({up['us']:.1f} us against {up['us'] * up['GBps'] / read / 1e3:.1f} at the read "
        f"rate, `one_token` in [kernels_moe.json](results/h100/kernels_moe.json)); each of the "
        f"{moe_layers} layers "
        f"pays {moe_launches} launches, and at batch 1 the launches that read little (attention's three, "
        f"the two norms, the routing) take {moe_small / moe_layers:.1f} us a layer on the "
        f"critical path. What would close it: fewer launches a layer (the rope and the K/V "
        f"store inside decode attention, a norm inside the next GEMV), and FP8 tensor-core "
        f"dots at one row (activations quantised per token, as the prefill runs).",
        f"- {_MOE}, `arle serve` c = 8: {c8['output_throughput']:.0f} tok/s; the goal is 1,500: "
        f"not met. The grouped expert GEMM takes {_kernel_ms(moe, 8, '_moe_mma'):.2f} ms of a "
        f"{moe['graph_replay_bs8_ms']:.2f} ms batch-8 step (its floor "
        f"{floor('qwen3-30b-a3b-fp8', 8):.2f} ms). "
        f"{_swap_ab(res.load('h100/kernels_moe.json'))}",
        f"- {_Q4} under `--quantization fp8`, batch 1: {f1:.3f} ms, {f1 / floor('qwen3-4b_fp8'):.2f}"
        f"x its floor (bf16: {dec('qwen3-4b')['graph_replay_bs1_ms'] / floor('qwen3-4b'):.2f}x); "
        f"the 1.2 ms goal is below this card's floor ({floor('qwen3-4b_fp8'):.2f} ms), and on an "
        f"H200 the same ratio would give "
        f"{f1 / floor('qwen3-4b_fp8') * fp8['floor_bytes']['batch1']['total'] / 4.18e9:.2f} ms: "
        f"not met. An MLP's gate_up takes silu(gate) * up in its GEMV's epilogue at 1-2 rows "
        f"(no [M, 2N] round trip, one launch less a layer; alone at one row, Qwen3-4B's "
        f"gate_up took {_glu_us(res)}): {f1:.3f} ms at {fp8['commit']} against "
        f"{fp8['baseline_same_call']['graph_replay_bs1_ms']:.3f} in the same call at "
        f"{fp8['baseline_same_call']['commit']}, whose fused gate_up ran the unfused weight's "
        f"tile (`baseline_same_call` in its JSON). What bounds it: its GEMVs take {f_gemv:.2f} ms "
        f"of the profiled step, {f_gemv / floor('qwen3-4b_fp8'):.2f}x the floor on their own: "
        f"an FP8 weight costs a conversion (e4m3 pairs to f16, then f32) and an FMA where a bf16 "
        f"weight costs a shift and an FMA for twice the bytes; the rest, "
        f"{fp8['graph_replay_bs1_ms'] - f_gemv:.2f} ms, is attention (the rope and the K/V "
        f"store too) and the norms at batch 1, a few microseconds of latency a launch. What "
        f"would close it: FP8 "
        f"tensor-core dots at one row (W8A8, the weight's rows on wgmma's wide side) and fewer "
        f"launches a layer.",
        f"- {_Q4} as 4-bit AWQ, batch 1: {a1:.3f} ms, {a1 / floor('qwen3-4b-awq'):.1f}x its floor "
        f"(bf16: {dec('qwen3-4b')['graph_replay_bs1_ms']:.3f} ms); the goal is 0.8 ms: not met. "
        f"The W4 GEMV is {w4 / _kernel_ms(awq, 1, ''):.0%} of the profiled step. ncu put its "
        f"bound on instructions and latency, not DRAM (Qwen3-4B's qkv, one row: 12 instructions "
        f"a weight, DRAM 22% busy): Triton moved x through shared memory every chunk. Now x's "
        f"pointers are broadcast over the program's rows of W, so x loads straight into the "
        f"words' registers; bf16 x becomes fp32 by integer ops that also add the nibble's power "
        f"of two to its exponent; a thread takes two rows of W on one x (a row and one further "
        f"on, or gate_up's gate and up rows). The GEMV alone at one / two rows: "
        f"{_w4_chosen(res)}. What bounds it now (ncu, qkv, one row): 7 "
        f"instructions a weight, and 43% of the warps' samples wait on global loads with 21 "
        f"warps an SM (76 registers): too few bytes in flight, 32 of words a thread a chunk. "
        f"What would close it: two adjacent runs a lane (more in flight without running past a "
        f"short K), fewer registers, and K split where W has few rows (o_proj, down: 2560).",
        f"- 4-bit AWQ at batch 8: {awq['graph_replay_bs8_ms']:.2f} ms a step (bf16: "
        f"{dec('qwen3-4b')['graph_replay_bs8_ms']:.2f}). From 3 rows every linear layer "
        f"takes the tensor-core GEMM (nibbles made 16-bit floats by their bits, each group's "
        f"scale and zero after the dot, K split to fill the GPU), which beat the FMA GEMV of "
        f"commit 12ba687 (x's conversion and its FMAs paid per row) at 4 and 8 rows "
        f"({_w4_gemm_vs_gemv(res)}); the GEMV now takes 1-2 rows only. From 16 rows the "
        f"weight is dequantized to bf16 and cuBLAS multiplies ({awq['graph_replay_bs32_ms']:.2f} ms at 32 rows); prefill of 512 tokens "
        f"takes {awq['batch1']['mean_ttft_ms']:.1f} ms (bf16: "
        f"{dec('qwen3-4b')['batch1']['mean_ttft_ms']:.1f}).",
        f"- Speculation never slower than off: at batch 1, n-gram on the default model decodes "
        f"{min(t['speedup'] for t in spec.values()):.2f}-{max(t['speedup'] for t in spec.values()):.2f}"
        f"x as fast as off (plain chat the least). A verify step of K = 1-4 drafts costs "
        f"{min(vc[1]):.2f}-{max(vc[1]):.2f}x a decode step at batch 1 and "
        f"{min(vc[8]):.2f}-{max(vc[8]):.2f}x at batch 8 on {_Q4}, in CUDA graphs (eager: "
        f"{min(ve):.0f}-{max(ve):.0f}x); on {_MOE} {min(vm):.2f}-{max(vm):.2f}x at batch 1, "
        f"where the smallest extend graph's 32 tokens route to experts, padding too, so a MoE "
        f"model drafts only while its rows keep more than 2 drafts (`MOE_RULES`).",
        f"- Serving {_Q4} at c = 64 / 256: {c64['output_throughput']:.0f} / "
        f"{c256['output_throughput']:.0f} tok/s, {c64['duration'] / c64['server_steps'] * 1e3:.0f}"
        f" / {c256['duration'] / c256['server_steps'] * 1e3:.0f} ms a step on average. Mixed "
        f"steps of up to 256 rows (a prefill chunk beside the running requests' decode rows) "
        f"replay extend graphs; a graph of t tokens takes min(t, 256) rows, so small steps keep "
        f"a small lm_head.",
        f"- Context: batch-1 TPOT from 1k to 32k tokens grows {ctx4['1024']['tpot_ms']:.2f} to "
        f"{ctx4['32768']['tpot_ms']:.2f} ms on {_Q4} (its KV is read every step) and stays "
        f"{ctx35['1024']['tpot_ms']:.2f} to {ctx35['32768']['tpot_ms']:.2f} ms on {_Q35} (24 of "
        f"its 32 layers keep a fixed-size recurrent state, not a KV cache).", ""]


def _cells(res: Results, fig: Figure) -> tuple[str, str, str]:
    """(arle, baseline, ratio) as table cells."""
    arle = fig.sep.join(res.show(v) for v in fig.arle)
    if not fig.baseline:
        return arle, "—", "—"
    base = f"{fig.baseline_name}: " + fig.sep.join(res.show(v) for v in fig.baseline)
    return arle, base, f"{res.value(fig.arle[0]) / res.value(fig.baseline[0]):.2f}x"


def render(res: Results) -> str:
    lines = [BEGIN, ""]
    for machine in MACHINES:
        lines += machine_section(res, machine)
    lines += bounds_section(res)
    return "\n".join([*lines, END])


def render_readme(res: Results) -> str:
    """README.md's table: the figures marked `readme`, with no dates (docs/performance.md's)."""
    short = {m.key: m.short for m in MACHINES}
    lines = [README_BEGIN, "| workload | hardware | arle | baseline | arle / baseline |",
             "|---|---|---|---|---|"]
    for fig in (f for f in FIGURES if f.readme):
        lines.append("| " + " | ".join(_cell(c) for c in (
            fig.readme, short[fig.machine], *_cells(res, fig))) + " |")
    return "\n".join([*lines, README_END])


def updated(doc: str, block: str, begin: str = BEGIN, end_mark: str = END) -> str:
    start, end = doc.find(begin), doc.find(end_mark)
    if start < 0 or end < start:
        raise SystemExit(f"perf_table: no markers {begin!r} ... {end_mark!r}")
    return doc[:start] + block + doc[end + len(end_mark):]


def undeclared(root: Path = RESULTS) -> list[str]:
    """JSON files in docs/results/ that no source declares (provenance.json aside)."""
    declared = {s.file for s in SOURCES} | {PROVENANCE.name}
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.json")
                  if p.relative_to(root).as_posix() not in declared)


def add_provenance(name: str, date: str, commit: str) -> None:
    if not re.fullmatch(r"\d{4}-\d\d-\d\d", date):
        raise SystemExit("perf_table: the date is YYYY-MM-DD")
    entries = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    entries[name] = {"date": date, "commit": commit, "sha256": sha256(RESULTS / name)}
    PROVENANCE.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="exit 1 if docs/performance.md or README.md is not what this writes")
    p.add_argument("--provenance", nargs=3, metavar=("FILE", "DATE", "COMMIT"),
                   help="record the date and commit of a file under docs/results/ that lacks them")
    args = p.parse_args(argv)
    if args.provenance:
        add_provenance(*args.provenance)
    res = Results()
    extra = undeclared()
    if extra:
        print(f"perf_table: not declared in SOURCES: {', '.join(extra)}", file=sys.stderr)
        return 1
    # NOTE: an entry whose file changed is reported where the file is used (Results.stamp)
    stale = [n for n in res.provenance if not (RESULTS / n).is_file()
             or ("date" in res.load(n) and "commit" in res.load(n))]
    if stale:
        print(f"perf_table: provenance.json entries for files that are gone or carry their own "
              f"date and commit: {', '.join(stale)}", file=sys.stderr)
        return 1
    pages = ((DOC, updated(DOC.read_text(), render(res))),
             (README, updated(README.read_text(), render_readme(res), README_BEGIN, README_END)))
    stale_pages = [(path, new) for path, new in pages if new != path.read_text()]
    for path, new in stale_pages:
        name = path.relative_to(ROOT).as_posix()
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(
                path.read_text().splitlines(keepends=True), new.splitlines(keepends=True),
                name, "what scripts/perf_table.py writes"))
            print(f"perf_table: {name} is out of date: run python3 scripts/perf_table.py",
                  file=sys.stderr)
        else:
            path.write_text(new)
            print(f"wrote {name}")
    return 1 if args.check and stale_pages else 0


if __name__ == "__main__":
    sys.exit(main())
