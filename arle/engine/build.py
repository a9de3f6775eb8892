"""Building an engine: the device, the model (one rank's slice, with tensor parallelism), the
executor sized for it, and the engine around them. Three entry points, each the one below it
plus a step: `create_engine` (async: on the thread that will run the steps), `build_engine`
(loads the model), `engine_from_loaded` (a model already loaded: tests, tools).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine, state_pool_info
from arle.engine.speculative import spec_config
from arle.errors import ArleError
from arle.executor.base import Executor
from arle.logging import get_logger
from arle.model.default import resolve_model_path
from arle.model.loader import LoadedModel, check_tensor_parallel, load_model, resolve_dtype
from arle.threads import torch_thread

if TYPE_CHECKING:
    from arle.executor.distributed import RankExecutor, TPRanks
    from arle.model.parallel import TPGroup

log = get_logger("arle.engine")


async def create_engine(config: EngineConfig) -> AsyncEngine:
    """Load the model (on the thread that will run its steps) and build the engine."""
    return await asyncio.wrap_future(torch_thread().submit(build_engine, config))


def build_engine(config: EngineConfig) -> AsyncEngine:
    """The engine `config` describes, its model loaded from disk (on this thread)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = _device(config.device)
    if device.startswith("cuda"):
        from arle_kernels.jit import start_cache_key

        start_cache_key()  # beside the weights' load (see there)
    if config.tensor_parallel_size > 1:
        if config.speculative == "mtp":
            raise ArleError("--speculative mtp runs on one device for now; with "
                            "--tensor-parallel-size, use --speculative ngram")
        return _build_group(config, device)
    loaded = load_model(resolve_model_path(config.model), config.dtype, device,
                        mtp=config.speculative == "mtp", quantization=config.quantization)
    return engine_from_loaded(config, loaded)


def engine_from_loaded(config: EngineConfig, loaded: LoadedModel,
                       ranks: TPRanks | None = None) -> AsyncEngine:
    """Size the KV pool, build the executor and the engine around a loaded model (rank 0's
    slice of it, with `ranks`: the other ranks of its TP group)."""
    config = config.for_device(loaded.device.type)
    if (config.speculative == "mtp") != (loaded.model.mtp is not None):
        raise ArleError("--speculative mtp needs the model loaded with its MTP head "
                        "(load_model(..., mtp=True)), and only then")
    log.info("model_loaded", model=loaded.name, path=str(loaded.path),
             architecture=loaded.config.architecture, parameters=loaded.num_parameters,
             dtype=_dtype_name(loaded.dtype), bytes=loaded.num_bytes,
             device=str(loaded.device), ms=round(loaded.load_ms, 1))
    executor = _make_executor(config, loaded)
    pool = executor.kv_pool
    log.info("kv_pool", tokens=pool.num_tokens, pages=pool.num_pages,
             page_size=pool.page_size, bytes=pool.bytes, dtype=pool.dtype)
    if (states := state_pool_info(executor)) is not None:
        log.info("state_pool", **states)
    info = _model_info(loaded, executor)
    if ranks is not None:
        member = cast("RankExecutor", executor)  # the CPU and CUDA executors are
        member.ranks = ranks
        ranks.gather_infos(member.rank_info())
        info["tensor_parallel_size"] = ranks.tp.size
        info["ranks"] = ranks.infos
        log.info("tensor_parallel_ranks", ranks=ranks.infos)
    return AsyncEngine(config, loaded.tokenizer, executor, loaded.name, _max_len(config, loaded),
                       loaded.generation_defaults, info, moe=loaded.config.moe is not None)


def _device(device: str) -> str:
    """`--device`: auto is the GPU where torch sees one; cuda where it sees none is refused."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ArleError("--device cuda: no CUDA GPU is visible to torch "
                        f"(torch {torch.__version__}); use --device cpu")
    return device


def _model_info(loaded: LoadedModel, executor: Executor) -> dict[str, Any]:
    """The model and what start-up measured (`/v1/models`, `arle warmup`)."""
    cfg = loaded.config
    return {"architecture": cfg.architecture, "vocab_size": cfg.vocab_size,
            "parameters": loaded.num_parameters,
            "dtype": _dtype_name(loaded.dtype), "bytes": loaded.num_bytes,
            "context": cfg.max_position_embeddings, "path": str(loaded.path),
            "load_ms": round(loaded.load_ms, 1), "device": str(loaded.device),
            **getattr(executor, "startup_info", {})}


def _build_group(config: EngineConfig, device: str) -> AsyncEngine:
    """Tensor parallel: start the other ranks, then load rank 0's slice and build the engine
    around it (arle/executor/distributed.py)."""
    from arle.executor.distributed import start_ranks

    n = config.tensor_parallel_size
    path = resolve_model_path(config.model)
    check_tensor_parallel(path, n)  # before any rank starts
    if device.startswith("cuda") and torch.cuda.device_count() < n:
        raise ArleError(f"--tensor-parallel-size {n} needs {n} GPUs; torch sees "
                        f"{torch.cuda.device_count()}")
    config = replace(config, model=str(path))
    ranks = start_ranks(n, device.split(":")[0], functools.partial(_rank_executor, config,
                                                                    device))
    if ranks is None:  # a torchrun rank > 0: it served until rank 0 stopped the group
        raise SystemExit(0)
    try:
        loaded = load_model(path, config.dtype, _rank_device(device, 0), ranks.tp,
                            quantization=config.quantization)
        return engine_from_loaded(config, loaded, ranks)
    except BaseException:
        ranks.abort()
        raise


def _rank_device(device: str, local_rank: int) -> str:
    """A TP rank's device: its GPU on this host, or the CPU."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def _rank_executor(config: EngineConfig, device: str, tp: TPGroup, local_rank: int) -> Any:
    """A TP rank > 0's executor (in its own process): its slice of the model, sized as rank
    0's (the same config: the same pages and slots)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    dev = _rank_device(device, local_rank)
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
    loaded = load_model(config.model or "", config.dtype, dev, tp,
                        quantization=config.quantization)
    return _make_executor(config.for_device(loaded.device.type), loaded)


def _make_executor(config: EngineConfig, loaded: LoadedModel) -> Executor:
    """The executor of a loaded model (`config` filled in for its device)."""
    assert config.max_running_requests is not None
    num_slots = config.max_running_requests + 1
    max_len = _max_len(config, loaded)
    if loaded.device.type == "cuda":
        return _cuda_executor(config, loaded, max_len, num_slots)
    return _cpu_executor(config, loaded, max_len, num_slots)


def _cpu_executor(config: EngineConfig, loaded: LoadedModel, max_len: int,
                  num_slots: int) -> Executor:
    from arle.executor.cpu import CPUExecutor

    if config.kv_cache_dtype not in ("auto", _dtype_name(loaded.dtype)):
        raise ArleError(f"--kv-cache-dtype {config.kv_cache_dtype} needs --device cuda "
                        "(the CPU cache is in the model dtype)")
    # NOTE: this rank's share of the KV heads (one rank: the model's)
    bytes_per_token = loaded.model.rank_config.kv_bytes_per_token(
        torch.finfo(loaded.dtype).bits // 8)
    tokens = config.kv_cache_tokens or int(config.kv_cache_memory_gb * 2**30 / bytes_per_token)
    return CPUExecutor(loaded.model, max(tokens // config.page_size, 2), config.page_size,
                       num_slots=num_slots, kv_dtype=loaded.dtype, max_positions=max_len + 1,
                       seed=config.seed, num_snapshots=_num_snapshots(config),
                       spec=_spec_states(config), governed=config.num_threads is None,
                       host_kv_bytes=_host_kv_bytes(config))


def _cuda_executor(config: EngineConfig, loaded: LoadedModel, max_len: int,
                   num_slots: int) -> Executor:
    from arle.executor.cuda import FP8_KV, CUDAExecutor, CUDAExecutorConfig
    from arle.executor.cuda_graphs import EXTEND_GRAPH_TOKENS

    name = config.kv_cache_dtype
    kv_dtype = (loaded.dtype if name == "auto" else FP8_KV if name == "fp8_e4m3"
                else resolve_dtype(name, loaded.device))
    assert config.max_batched_tokens is not None and config.max_running_requests is not None
    graph_bs = (config.cuda_graph_max_bs or config.max_running_requests
                if config.cuda_graph else 0)
    # NOTE: with one running request a prefill step comes once a request, not beside every
    # arrival: its graphs would cost more start-up than their replays save; but with
    # speculation its verify steps come every step: one graph of the smallest size takes them
    extend_tokens = (CUDAExecutorConfig.extend_graph_max_tokens
                     if config.max_running_requests > 1
                     else EXTEND_GRAPH_TOKENS[0] if config.speculative != "off" else 0)
    return CUDAExecutor(loaded.model, CUDAExecutorConfig(
        page_size=config.page_size, num_slots=num_slots,
        max_batched_tokens=config.max_batched_tokens, max_model_len=max_len,
        kv_dtype=kv_dtype, mem_fraction_static=config.mem_fraction_static,
        kv_cache_tokens=config.kv_cache_tokens, cuda_graph_max_bs=graph_bs,
        extend_graph_max_tokens=extend_tokens, seed=config.seed,
        num_snapshots=_num_snapshots(config), spec=_spec_states(config),
        host_kv_bytes=_host_kv_bytes(config)))


def _host_kv_bytes(config: EngineConfig) -> int:
    """The host KV tier's bytes (`--kv-host-cache-gb`; none without the prefix cache)."""
    return int(config.kv_host_cache_gb * 2**30) if config.enable_prefix_cache else 0


def _num_snapshots(config: EngineConfig) -> int:
    """A hybrid model's state snapshots: `--state-snapshots`, else one per running request."""
    if config.state_snapshots is not None:
        return config.state_snapshots
    assert config.max_running_requests is not None
    return config.max_running_requests


def _spec_states(config: EngineConfig) -> tuple[int, int]:
    """The verify rows, and positions each, whose recurrent states a step keeps (a hybrid
    model's speculative decoding; `StatePool.for_model`)."""
    spec = spec_config(config)
    return (spec.max_rows, spec.num_tokens + 1) if spec is not None else (0, 0)


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _max_len(config: EngineConfig, loaded: LoadedModel) -> int:
    cfg = loaded.config
    return min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
