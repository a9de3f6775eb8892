"""Load a model from a Hugging Face directory or a GGUF file into a DecoderLM.

Both paths yield (HF tensor name, tensor) pairs into one weight-loading loop, so the model code
never knows where its weights came from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from arle.errors import ModelLoadError
from arle.logging import get_logger
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.parallel import load_whole
from arle.model.tokenizer import Tokenizer
from arle_kernels.ops import ops_for

log = get_logger("arle.model.loader")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    name: str
    dtype: torch.dtype
    device: torch.device
    num_bytes: int
    load_ms: float
    #: generation_config.json defaults (temperature, top_p, top_k, ...), if any
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # NOTE: fp32 on the CPU (bf16 matmuls there are slow and less exact), bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelLoadError(dtype, f"unknown dtype (choose from auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def load_model(path: str | Path, dtype: str = "auto",
               device: str | torch.device = "cpu") -> LoadedModel:
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    gen_defaults: dict[str, Any] = {}
    if path.is_dir():
        cfg_dict = _read_json(path / "config.json", required=True)
        config = ModelConfig.from_hf(cfg_dict, path / "config.json")
        tokenizer = Tokenizer.from_hf_dir(path)
        gen_defaults = _read_json(path / "generation_config.json", required=False)
        tensors = _iter_safetensors(_safetensors_files(path))  # checks files before allocating
    elif path.suffix == ".gguf" or _looks_like_gguf(path):
        from arle.model.gguf_io import read_gguf

        gguf = read_gguf(path)
        config = ModelConfig.from_hf(gguf.config, path)
        tokenizer = gguf.tokenizer
        tensors = ((name, t, path) for name, t in gguf.iter_tensors())
    else:
        raise ModelLoadError(path, "not a model directory (config.json + *.safetensors) "
                                   "or a .gguf file")
    with _default_dtype(torch_dtype), dev:
        model = DecoderLM(config)
    _load_weights(model, tensors, path, _HostToDevice(dev) if dev.type == "cuda" else None)
    model.ops = ops_for(dev)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=path,
                       name=path.stem if path.is_file() else path.name, dtype=torch_dtype,
                       device=dev, num_bytes=num_bytes,
                       load_ms=(time.perf_counter() - t0) * 1e3,
                       generation_defaults=gen_defaults)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _looks_like_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ModelLoadError(path, "missing (a model directory needs config.json)")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"unreadable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def _safetensors_files(root: Path) -> list[Path]:
    """The checkpoint's files, single or sharded (index json); all must exist."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, required=True).get("weight_map", {})
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(root, "no *.safetensors weights in the directory")
    for file in files:
        if not file.exists():
            raise ModelLoadError(file, "missing (listed in model.safetensors.index.json)")
    return files


def _iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Every tensor of the checkpoint, memory-mapped, one at a time."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name), file
        except SafetensorError as e:
            raise ModelLoadError(file, f"truncated or corrupt safetensors file ({e})") from None


class _HostToDevice:
    """Host tensors onto the GPU through two pinned staging buffers, in chunks: while the GPU
    copies one buffer in, torch's CPU threads fill the other from the checkpoint's memory map.

    Why: a plain `copy_` from the map is a pageable copy, which the driver stages on one
    thread, at a fraction of the bandwidth of pinned copies."""

    CHUNK = 64 << 20  # bytes a buffer holds

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers = [torch.empty(self.CHUNK, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy in
        self.turn = 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        src = tensor.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        for start in range(0, src.numel(), self.CHUNK):
            n = min(self.CHUNK, src.numel() - start)
            i, self.turn = self.turn, self.turn ^ 1
            done = self.copied[i]
            if done is not None:
                done.synchronize()  # NOTE: the buffer is refilled only once the GPU has read it
            self.buffers[i][:n].copy_(src[start:start + n])
            dst[start:start + n].copy_(self.buffers[i][:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self.copied[i] = done
        return out


def _load_weights(model: DecoderLM, tensors: Iterator[tuple[str, torch.Tensor, Path]],
                  origin: Path, to_device: _HostToDevice | None = None) -> None:
    """Each checkpoint tensor into its parameter (through its `weight_loader`), brought onto
    the parameter's device by `to_device` first where given (and converted there)."""
    targets = model.weight_targets()
    loaded: set[str] = set()
    skipped: dict[str, int] = {}
    for name, tensor, source in tensors:
        part = _unused_part(name)
        if part is not None:
            skipped[part] = skipped.get(part, 0) + 1
            continue
        name = name.replace("model.language_model.", "model.", 1)
        if name not in targets:
            if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            raise ModelLoadError(source, f"unexpected tensor {name!r} for "
                                         f"{model.config.architecture}")
        param, shard = targets[name]
        try:
            loader = getattr(param, "weight_loader", load_whole)
            if to_device is not None:
                tensor = to_device(tensor)
            loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise ModelLoadError(source, f"tensor {name!r}: {e}") from None
        loaded.add(name)
    if skipped:
        log.info("weights_not_used", **{k.replace(" ", "_"): v for k, v in skipped.items()})
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(origin, f"checkpoint lacks weights: {', '.join(missing[:3])}{more}")


#: Checkpoint name prefixes of parts a text model does not run, and what they are.
_UNUSED_PARTS = {"model.visual.": "vision tower", "mtp.": "multi-token prediction head"}


def _unused_part(name: str) -> str | None:
    """What a checkpoint tensor belongs to if text generation does not use it, else None."""
    return next((part for prefix, part in _UNUSED_PARTS.items() if name.startswith(prefix)),
                None)
