"""A real `arle serve` subprocess for tests, and a tiny model directory to serve fast.

Imported as `served` (tests/ is on sys.path). The server binds 127.0.0.1 on a port the OS picks
(`--port 0`); the URL is read from its "listening" log line. Every wait is bounded by time, and
the process is always killed at the end.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from helpers import arle_env

from arle.engine.request import Delta, GenerateRequest, SamplingParams, Usage

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_tiny_model(root: Path, max_position_embeddings: int = 2048) -> Path:
    """A 2-layer random Llama with a byte-level tokenizer (259 tokens, vocab padded to 320) as a
    Hugging Face directory: loads in well under a second, generates hundreds of tokens/s."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "add_bos_token": False}))
    hidden, inter, layers, heads, kv_heads, vocab = 64, 128, 2, 4, 2, 320
    head_dim = hidden // heads
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    weights = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": rand(vocab, hidden, scale=0.25)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim, scale=hidden ** -0.5),
            p + "mlp.gate_proj.weight": rand(inter, hidden, scale=hidden ** -0.5),
            p + "mlp.up_proj.weight": rand(inter, hidden, scale=hidden ** -0.5),
            p + "mlp.down_proj.weight": rand(hidden, inter, scale=inter ** -0.5),
        })
    save_file(weights, str(root / "model.safetensors"))
    return root


class ServerProcess:
    """One `arle serve` child. `url` is set once it logged that it listens."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        full_env = arle_env(**(env or {}))
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arle", "serve", "--host", "127.0.0.1", "--port", "0",
             "--log-format", "json", *args],
            env=full_env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        self.url = ""

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
        return out

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ev in self.events():
                if ev.get("event") == "listening":
                    self.url = str(ev["url"])
                    return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"arle serve exited with {self.proc.returncode}:\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.05)
        raise TimeoutError(f"arle serve not ready after {timeout_s}s:\n"
                           + self.log_path.read_text(errors="replace")[-3000:])

    def stop(self, sig: int | None = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig` (None: it was sent already), wait for the exit (kill after `timeout_s`);
        the exit status."""
        if self.proc.poll() is None:
            if sig is not None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@contextmanager
def arle_server(args: list[str], log_path: Path, timeout_s: float = 120.0
                ) -> Iterator[ServerProcess]:
    server = ServerProcess(args, log_path)
    try:
        server.wait_ready(timeout_s)
        yield server
    finally:
        server.kill()


class OneTokenEngine:
    """Just enough of AsyncEngine for the app (`create_app`): every request answers one token.
    Tests override `generate` for other behaviours."""

    model_name, max_model_len = "fake", 64
    model_info: dict[str, Any] = {}  # noqa: RUF012
    tokenizer = types.SimpleNamespace(vocab_size=10, decode=lambda ids, **kw: "t")

    def default_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{k: v for k, v in overrides.items() if v is not None})

    def check_admission(self) -> None:
        pass

    def snapshot(self) -> dict[str, Any]:
        return {"running": 0, "waiting": 0, "kv_pages_total": 4, "kv_pages_free": 4,
                "kv_pages_cached": 0, "kv_pages_evictable": 0, "preemptions": 0}

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        yield Delta(req.request_id or "r", text="t", token_ids=[1], finish_reason="length",
                    usage=Usage(1, 1), trace={"route": req.route, "error": None})
