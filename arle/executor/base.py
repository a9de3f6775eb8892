"""The executor protocol: run one planned step on a device, hand back an awaitable.

NOTE (overlap): `launch` returns at once. The engine schedules step N+1 while step N runs, so
`launch` must snapshot everything it needs from the plan (page tables change afterwards) and
must apply per-slot state changes in device order (the step function, not the caller's thread).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from arle.executor.plan import StepPlan

if TYPE_CHECKING:
    from arle.executor.paged import StatePool
from arle.sampling import TokenLogprob


@dataclass
class StepOutput:
    """Per sampling row, in row order: the sampled id and, if asked, its logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    #: seconds the device spent on the step (launch to result on the host)
    exec_s: float = 0.0
    #: per row that scores prompt tokens (`Row.score_targets`), in row order: their logprobs
    prompt_scores: list[list[TokenLogprob]] = field(default_factory=list)
    #: per row that chains MTP drafts (`Row.mtp_drafts`), in row order: the drafts
    drafts: list[list[int]] = field(default_factory=list)
    #: seconds the host KV tier's page copies took on the device (those this step waited
    #: for; CUDA: also the restores the step before ran beside itself)
    copy_s: float = 0.0


@dataclass(frozen=True)
class KVPoolInfo:
    num_pages: int
    page_size: int
    bytes: int
    dtype: str  # "float32", "bfloat16", ... (no "torch." prefix)
    #: the host tier's pages and their bytes (0: none), and its state snapshots and theirs
    #: (hybrid models)
    host_pages: int = 0
    host_bytes: int = 0
    host_snapshots: int = 0
    host_snapshot_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


class Executor(Protocol):
    kv_pool: KVPoolInfo
    num_slots: int
    #: how many recurrent-state snapshots the pool keeps for the prefix cache
    num_snapshots: int
    #: host-tier restores that no row of their step reads run beside that step
    #: (`StepPlan.kv_restores_overlap`)
    overlaps_restores: bool

    @property
    def state(self) -> StatePool | None:
        """A hybrid model's recurrent state pool (None: no Gated DeltaNet layers)."""

    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]: ...

    def close(self) -> None: ...
