"""One rank of a tensor-parallel model check (run by tests/test_tensor_parallel.py).

`python tests/tp_rank.py MODEL OUT RANK SIZE PORT`: joins a gloo group of SIZE ranks (none for
SIZE 1), loads this rank's slice of MODEL, runs two steps through the CPU executor's pieces
(a prefill of two prompts, then one new token each, as extend rows), gathers the full logits of
every token on rank 0 and saves them to OUT (rank 0 only).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from arle.executor.cpu import CPUExecutor
from arle.executor.paged import StepInputs, step_views
from arle.executor.plan import NewSlot, Row, StepPlan
from arle.executor.step import attention_backend
from arle.model.loader import load_model
from arle.model.parallel import SINGLE, TPGroup
from arle.sampling import SamplingParams

PAGE = 16
PROMPTS = [[(7 * i + 3) % 250 for i in range(21)], [(5 * i + 11) % 250 for i in range(9)]]
NEXT = [17, 42]


def step_logits(model_dir: str, tp: TPGroup = SINGLE) -> list[torch.Tensor | None]:
    """Both steps' full logits [tokens, vocab] (None on ranks > 0)."""
    loaded = load_model(model_dir, "float32", "cpu", tp)
    model = loaded.model
    ex = CPUExecutor(model, num_pages=16, page_size=PAGE, num_slots=3,
                     kv_dtype=torch.float32, max_positions=128)
    params = SamplingParams(temperature=0.0)
    pages = [[1, 2], [3]]
    first = [Row(slot=i, start=0, num_tokens=len(p), input_ids=p, sample=True,
                 sample_offset=0, pages=pages[i], params=params)
             for i, p in enumerate(PROMPTS)]
    second = [Row(slot=i, start=len(p), num_tokens=1, input_ids=[NEXT[i]], sample=True,
                  sample_offset=1, pages=pages[i], params=params)
              for i, p in enumerate(PROMPTS)]
    new = [NewSlot(i, p, len(p), params) for i, p in enumerate(PROMPTS)]
    logits = []
    for plan in (StepPlan(0, first, new), StepPlan(1, second)):
        inputs = StepInputs.of(plan, PAGE)
        inputs.start_states(ex.state)
        meta = torch.tensor(inputs.packed.meta, dtype=torch.int32)
        step, _ = step_views(inputs.packed, meta, num_splits=1)
        hidden = model(step.input_ids, attention_backend(ex.dev, step))
        inputs.save_states(ex.state)
        logits.append(tp.gather_columns(model.logits(hidden), model.config.vocab_size))
    return logits


def main() -> None:
    model_dir, out, rank, size, port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    torch.set_num_threads(1)
    tp = SINGLE
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=60))
        tp = TPGroup(rank, size)
    logits = step_logits(model_dir, tp)
    if rank == 0:
        torch.save(logits, out)
    if size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
