"""Load a model from a Hugging Face directory or a GGUF file into a DecoderLM.

Both paths yield (HF tensor name, tensor) pairs into one weight-loading loop, so the model code
never knows where its weights came from.

Block-scaled FP8 checkpoints (`ModelConfig.quant`): each quantized linear's `X.weight`
(float8_e4m3fn) comes with `X.weight_scale_inv` (fp32 per block), in any order. On CUDA the
linears whose checkpoint weights all have scales stay FP8 (`fp8_weights`; the rest are
`unquantize`d); elsewhere every FP8 weight is dequantised at load to the compute dtype.

Integer checkpoints (GGUF's block formats; AWQ and GPTQ, `ModelConfig.int4`): on one rank,
their linears stay 4- or 8-bit on the CPU at --dtype auto, and AWQ's and GPTQ's stay 4-bit on
CUDA unless --dtype float32 (arle/model/int_weights.py); anywhere else they are dequantised at
load. `--quantization fp8`: a float checkpoint's linears are quantized as they load.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from arle.errors import ModelLoadError
from arle.logging import get_logger
from arle.model import int_weights
from arle.model.config import Int4Quant, ModelConfig, QuantConfig
from arle.model.decoder import DecoderLM, tp_problems
from arle.model.moe import unfuse_experts
from arle.model.parallel import FP8, SINGLE, HoldsFp8, TPGroup, fp8_weights, load_whole
from arle.model.tokenizer import Tokenizer
from arle_kernels.fp8_ref import fp8_dequant_ref, quantize_fp8_blocks
from arle_kernels.ops import ops_for
from arle_kernels.quant import Int4Groups

log = get_logger("arle.model.loader")

#: the block of GGUF's 4-bit formats, as int4 groups
GGUF_GROUP = 32

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
        return int_weights.weight_stats(self.model)[0]


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # NOTE: fp32 on the CPU (bf16 matmuls there are slow and less exact), bf16 on GPUs.
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelLoadError(dtype, f"unknown dtype (choose from auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def load_model(path: str | Path, dtype: str = "auto",
               device: str | torch.device = "cpu", tp: TPGroup = SINGLE,
               mtp: bool = False, quantization: str = "none") -> LoadedModel:
    """The model at `path` on `device`; with `tp` of size > 1, this rank's slice of it; with
    `mtp`, its multi-token prediction head too (`--speculative mtp`); quantization "fp8": a
    floating-point checkpoint's linears quantized as they load (`--quantization fp8`)."""
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    gen_defaults: dict[str, Any] = {}
    names: set[str] = set()
    tensors: Iterator[tuple[str, torch.Tensor | Int4Groups, Path]]
    #: checkpoint name -> what it stays as, where integer weights are kept (`_keeps_int`)
    kinds: dict[str, int_weights.Kind] = {}
    if path.is_dir():
        cfg_dict = _read_json(path / "config.json", required=True)
        config = ModelConfig.from_hf(cfg_dict, path / "config.json")
        if quantization == "fp8":
            config = _quantize_at_load(config, path, dev)
        tokenizer = Tokenizer.from_hf_dir(path)
        gen_defaults = _read_json(path / "generation_config.json", required=False)
        files = _safetensors_files(path)  # checks files before allocating
        if _kept_fp8(config, dev) is not None:
            names = _checkpoint_names(files)
        if config.int4 is not None:
            kinds = _int4_kinds(config.int4, files, _keeps_int(dtype, dev, tp), torch_dtype)
        tensors = _iter_safetensors(files)
    elif path.suffix == ".gguf" or _looks_like_gguf(path):
        from arle.model.gguf_io import read_gguf

        if quantization != "none":
            raise ModelLoadError(path, f"--quantization {quantization} takes a safetensors "
                                       "checkpoint in bf16, fp16 or fp32, not a GGUF file")
        gguf = read_gguf(path)
        config = ModelConfig.from_hf(gguf.config, path)
        tokenizer = gguf.tokenizer
        keep = _keeps_int(dtype, dev, tp, gguf=True)
        kinds = gguf.kinds() if keep else {}
        tensors = ((name, t, path) for name, t in gguf.iter_tensors(int4=keep))
    else:
        raise ModelLoadError(path, "not a model directory (config.json + *.safetensors) "
                                   "or a .gguf file")
    problems = tp_problems(config, tp.size)
    if problems:
        raise ModelLoadError(path, f"does not split over --tensor-parallel-size {tp.size}: "
                                   + "; ".join(problems))
    if mtp:
        config = _with_mtp(config, path, tp)
    kept = _kept_fp8(config, dev)
    fp8: AbstractContextManager[None] = (nullcontext() if kept is None
                                         else fp8_weights(kept.block))
    with _default_dtype(torch_dtype), dev, fp8:
        try:
            model = DecoderLM(config, tp)
        except ValueError as e:  # an FP8 block grid a TP slice cuts through
            raise ModelLoadError(path, str(e)) from None
    if kept is not None:
        _settle_fp8(model, names, kept, torch_dtype)
    group = config.int4.group if config.int4 is not None else GGUF_GROUP
    held = int_weights.hold(model, kinds, group, _w4_layout(dev)) if kinds else None
    errors = _load_weights(model, tensors, path,
                           _HostToDevice(dev) if dev.type == "cuda" else None)
    if held is not None:
        int_weights.pack(model, torch_dtype)
        _log_int_weights(held, errors)
        _return_freed_memory()
    model.ops = ops_for(dev)
    num_bytes = int_weights.weight_stats(model)[1]
    model.eval()
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=path,
                       name=path.stem if path.is_file() else path.name, dtype=torch_dtype,
                       device=dev, num_bytes=num_bytes,
                       load_ms=(time.perf_counter() - t0) * 1e3,
                       generation_defaults=gen_defaults)


def _keeps_int(dtype: str, device: torch.device, tp: TPGroup, gguf: bool = False) -> bool:
    """Whether a quantized checkpoint's integer weights stay integer, on one rank: on the CPU
    unless a --dtype asks for floats (`--dtype float32`: the dequantized weights, for parity
    work); on CUDA AWQ's and GPTQ's 4-bit weights (W4A16: fp16 or bf16 activations), not a
    GGUF file's."""
    if tp.size != 1:
        return False
    if device.type == "cuda":
        return not gguf and dtype != "float32"
    return dtype == "auto" and device.type == "cpu"


def _w4_layout(device: torch.device) -> bool:
    """Whether kept 4-bit weights take the W4A16 kernels' layout (CUDA), not torch's CPU one."""
    return device.type == "cuda"


def _int4_kinds(quant: Int4Quant, files: list[Path], keep: bool, dtype: torch.dtype
                ) -> dict[str, int_weights.Kind]:
    """A 4-bit checkpoint's linears that stay int4 (none where `keep` is not: they load
    dequantized to `dtype`, as the log says)."""
    if not keep:
        log.info("int4_weights_dequantized", method=quant.method,
                 dtype=str(dtype).removeprefix("torch."),
                 why="int4 stays int4 on one rank: on the CPU at --dtype auto, on CUDA "
                     "unless --dtype float32")
        return {}
    return int_weights.int4_checkpoint_names(_checkpoint_names(files))


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): staging the integer
    weights frees about as much as they hold, and glibc keeps freed heap memory resident."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _log_int_weights(held: dict[str, int], errors: dict[str, list[float]]) -> None:
    """What stayed integer, and what that costs where the conversion is not exact."""
    error = {f"{kind}_rel_error": {"mean": f"{sum(e) / len(e):.1e}", "max": f"{max(e):.1e}"}
             for kind, e in errors.items() if e}
    log.info("int_weights_kept", modules=held, **error,
             exact=("no: int4 scales and zeros held in bf16, int8 requantized per row "
                    "(docs/performance.md)" if error else "yes"))


def _with_mtp(config: ModelConfig, path: Path, tp: TPGroup) -> ModelConfig:
    """The config with its multi-token prediction head run; refused where there is none."""
    if not config.mtp_layers:
        raise ModelLoadError(path, "--speculative mtp needs a multi-token prediction head "
                                   "(config: mtp_num_hidden_layers), and this model has none; "
                                   "--speculative ngram works with any model")
    if tp.size > 1:
        raise ModelLoadError(path, "--speculative mtp runs on one device for now; with "
                                   "--tensor-parallel-size, use --speculative ngram")
    return replace(config, with_mtp=True)


def check_tensor_parallel(path: str | Path, tp: int) -> None:
    """Raise ModelLoadError, naming what does not divide, if the model at `path` does not
    split over `tp` ranks (read from its config only: before any rank starts)."""
    path = Path(path).expanduser()
    if path.is_dir():
        config = ModelConfig.from_hf(_read_json(path / "config.json", required=True),
                                     path / "config.json")
    elif path.exists():
        from arle.model.gguf_io import read_gguf

        config = ModelConfig.from_hf(read_gguf(path).config, path)
    else:
        raise ModelLoadError(path, "no such file or directory")
    problems = tp_problems(config, tp)
    if problems:
        raise ModelLoadError(path, f"does not split over --tensor-parallel-size {tp}: "
                                   + "; ".join(problems))


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


def _keeps_fp8(device: torch.device, block: tuple[int, int]) -> bool:
    """Whether FP8 weights in `block`s stay FP8 on `device` (its kernels read them); else
    dequantised. NOTE: the FP8 kernels step along K in powers of two (>= 16, a tensor-core
    dot's) inside one scale block: the releases' 128 x 128 blocks are such."""
    bk = block[1]
    return device.type == "cuda" and bk >= 16 and bk & (bk - 1) == 0


def _kept_fp8(config: ModelConfig, device: torch.device) -> QuantConfig | None:
    """The checkpoint's FP8 format if its weights stay FP8 on `device`, else None."""
    quant = config.quant
    return quant if quant is not None and _keeps_fp8(device, quant.block) else None


#: What `--quantization fp8` leaves unquantized, as Qwen's -FP8 releases do (norms and
#: embeddings are no linears): the MoE router gates (lm_head is no FP8-capable linear)
AT_LOAD_NOT_CONVERTED = ("mlp.gate", "mlp.shared_expert_gate")


def _quantize_at_load(config: ModelConfig, path: Path, device: torch.device) -> ModelConfig:
    """`--quantization fp8`: the config of a floating-point checkpoint whose linears quantize
    to 128 x 128 block FP8 as they load; refused where the weights are stored quantized
    already in another format, or where no FP8 kernels run them."""
    if config.quant is not None:
        log.info("fp8_checkpoint", note="--quantization fp8: the checkpoint is FP8 already")
        return config
    if config.int4 is not None:
        raise ModelLoadError(path, f"--quantization fp8 takes a bf16, fp16 or fp32 checkpoint; "
                                   f"this one is {config.int4.method.upper()} 4-bit")
    block = (128, 128)
    if not _keeps_fp8(device, block):
        raise ModelLoadError(path, "--quantization fp8 runs FP8 kernels, which need a CUDA "
                                   f"device (here: {device.type}); drop the flag")
    return replace(config, quant=QuantConfig("fp8", block, AT_LOAD_NOT_CONVERTED, at_load=True))


def _checkpoint_names(files: list[Path]) -> set[str]:
    """Every tensor name of the checkpoint (as `_load_weights` sees them), from the headers."""
    from safetensors import SafetensorError, safe_open

    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(_hf_name(n) for n in f.keys())  # noqa: SIM118
        except SafetensorError as e:
            raise ModelLoadError(file, f"truncated or corrupt safetensors file ({e})") from None
    return names


def _hf_name(name: str) -> str:
    """A checkpoint name as the model's weight targets spell it (text weights of the
    multimodal checkpoints sit under `model.language_model.`)."""
    return name.replace("model.language_model.", "model.", 1)


def _not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """`modules_to_not_convert` as transformers reads it: a pattern matches a module name from
    its start up to a dot boundary (as a regex), or as a suffix."""
    return any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p)
               for p in patterns)


def _settle_fp8(model: DecoderLM, checkpoint: set[str], quant: QuantConfig,
                dtype: torch.dtype) -> None:
    """Of the modules built with FP8 weights, keep those whose checkpoint weights all come
    with `weight_scale_inv` (and are not in `modules_to_not_convert`); the rest hold `dtype`."""
    names_of = model.checkpoint_names()
    kept = 0
    for module in model.modules():
        if not isinstance(module, HoldsFp8) or not (weights := module.quantized_weights()):
            continue
        names = [n for w in weights for n in names_of.get(id(w), [])]
        stored = quant.at_load or all(n in checkpoint and f"{n}_scale_inv" in checkpoint
                                      for n in names)
        if names and stored and not any(
                _not_converted(n.removesuffix(".weight"), quant.modules_to_not_convert)
                for n in names):
            kept += 1
        else:
            module.unquantize(dtype)
    log.info("fp8_weights_quantized_at_load" if quant.at_load else "fp8_weights_kept",
             modules=kept, block=list(quant.block))


def _checkpoint_tensors(tensors: Iterator[tuple[str, torch.Tensor, Path]],
                        skipped: dict[str, int], mtp: bool = False
                        ) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """The tensors the text model loads, named as its weight targets: unused parts counted in
    `skipped` (the MTP head is used with `mtp`), experts stacked in one tensor split into one
    tensor per expert."""
    for name, tensor, source in tensors:
        part = None if mtp and name.startswith("mtp.") else _unused_part(name)
        if part is not None:
            skipped[part] = skipped.get(part, 0) + 1
            continue
        name = _hf_name(name)
        try:
            split = unfuse_experts(name, tensor)
        except ValueError as e:
            raise ModelLoadError(source, str(e)) from None
        if split is None:
            yield name, tensor, source
        else:
            for one, t in split:
                yield one, t, source


def _dequantize_fp8(tensors: Iterator[tuple[str, torch.Tensor, Path]],
                    targets: dict[str, tuple[torch.nn.Parameter, str | int | None]],
                    block: tuple[int, int], origin: Path
                    ) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """FP8 weights whose parameter is not FP8, each with its `weight_scale_inv` (met in either
    order), as the dequantised weight in the parameter's dtype; every other tensor as it is."""
    weights: dict[str, tuple[torch.Tensor, Path]] = {}
    scales: dict[str, torch.Tensor] = {}
    count = 0
    dtype: torch.dtype | None = None
    for name, tensor, source in tensors:
        if name.endswith(".weight_scale_inv") and name not in targets:
            name = name.removesuffix("_scale_inv")
            scales[name] = tensor
        elif tensor.dtype == FP8 and (name not in targets or targets[name][0].dtype != FP8):
            weights[name] = (tensor, source)
        else:
            yield name, tensor, source
            continue
        if name in weights and name in scales:
            (weight, source), scale = weights.pop(name), scales.pop(name)
            n, k = weight.shape[-2:]
            bn, bk = block
            if weight.dim() != 2 or scale.shape != (-(-n // bn), -(-k // bk)):
                raise ModelLoadError(source, f"{name}_scale_inv: shape {tuple(scale.shape)} is "
                                             f"not the {block} block grid of {name} "
                                             f"{tuple(weight.shape)}")
            dtype = targets[name][0].dtype if name in targets else torch.float32
            yield name, fp8_dequant_ref(weight, scale, block, dtype), source
            count += 1
    if weights:
        name, (_, source) = next(iter(weights.items()))
        raise ModelLoadError(source, f"FP8 tensor {name!r} has no {name}_scale_inv")
    if scales:
        raise ModelLoadError(origin, f"scale {next(iter(scales))}_scale_inv has no FP8 weight")
    if count:
        log.info("fp8_weights_dequantized", tensors=count, block=list(block),
                 dtype=str(dtype).removeprefix("torch."))


def _load_weights(model: DecoderLM, tensors: Iterator[tuple[str, Any, Path]],
                  origin: Path, to_device: _HostToDevice | None = None
                  ) -> dict[str, list[float]]:
    """Each checkpoint tensor into its parameter (through its `weight_loader`), brought onto
    the parameter's device by `to_device` first where given (and converted there).
    -> the relative error of each integer weight's conversion, by kind (`load_into`)."""
    errors: dict[str, list[float]] = {}
    targets = model.weight_targets()
    loaded: set[str] = set()
    skipped: dict[str, int] = {}
    tensors = _checkpoint_tensors(tensors, skipped, model.config.with_mtp)
    quant, int4 = model.config.quant, model.config.int4
    if quant is not None:
        tensors = _dequantize_fp8(tensors, targets, quant.block, origin)
    if int4 is not None:
        tensors = int_weights.int4_checkpoint_tensors(tensors, int4, origin)
    for name, tensor, source in tensors:
        if name not in targets:
            if name.endswith("rotary_emb.inv_freq") or (
                    name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            raise ModelLoadError(source, f"unexpected tensor {name!r} for "
                                         f"{model.config.architecture}")
        param, shard = targets[name]
        at_load = param.dtype == FP8 and quant is not None and quant.at_load
        if param.dtype == FP8 and tensor.dtype != FP8 and not at_load:
            raise ModelLoadError(source, f"tensor {name!r} is {tensor.dtype}, not FP8 beside "
                                         "its weight_scale_inv")
        try:
            loader = getattr(param, "weight_loader", load_whole)
            if to_device is not None:
                if isinstance(tensor, Int4Groups) and getattr(param, "staged", None) is None:
                    tensor = tensor.dequantize(param.dtype)  # not kept 4-bit here
                tensor = (Int4Groups(to_device(tensor.q), to_device(tensor.scale),
                                     to_device(tensor.zero), tensor.group)
                          if isinstance(tensor, Int4Groups) else to_device(tensor))
            if at_load:
                assert quant is not None
                tensor = _quantize_at(name, tensor, targets, quant.block)
                loaded.add(f"{name}_scale_inv")
            kind_error = int_weights.load_into(param, tensor, loader, shard)
            if kind_error is not None:
                errors.setdefault(kind_error[0], []).append(kind_error[1])
        except ValueError as e:
            raise ModelLoadError(source, f"tensor {name!r}: {e}") from None
        loaded.add(name)
    if skipped:
        log.info("weights_not_used", **{k.replace(" ", "_"): v for k, v in skipped.items()})
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(origin, f"checkpoint lacks weights: {', '.join(missing[:3])}{more}")
    return errors


def _quantize_at(name: str, tensor: torch.Tensor,
                 targets: dict[str, tuple[torch.nn.Parameter, str | int | None]],
                 block: tuple[int, int]) -> torch.Tensor:
    """`--quantization fp8`: a float weight as FP8 in `block`s, its scales loaded into
    `name`_scale_inv's parameter (as a checkpoint's would be) -> the FP8 weight."""
    q, scale = quantize_fp8_blocks(tensor, block)
    param, shard = targets[f"{name}_scale_inv"]
    getattr(param, "weight_loader", load_whole)(param, scale, shard)
    return q


#: Checkpoint name prefixes of parts a text model does not run, and what they are.
_UNUSED_PARTS = {"model.visual.": "vision tower", "mtp.": "multi-token prediction head"}


def _unused_part(name: str) -> str | None:
    """What a checkpoint tensor belongs to if text generation does not use it, else None."""
    return next((part for prefix, part in _UNUSED_PARTS.items() if name.startswith(prefix)),
                None)
