"""Tensor parallelism on the CPU (gloo): the model split over 2 ranks computes what 1 rank does,
the engine drives it unchanged, and the ranks start, stop and fail together.

Each rank runs one torch thread (2-core CI machines); the models are the tiny random ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import tp_rank
from conftest import assert_all_pages_back, cancel_mid_stream, run, run_many, tokens_of
from helpers import arle_env, require_smollm2_gguf, with_oracle
from model_dirs import hf_config, write_model_dir, write_qwen3_5_dir
from served import ServerProcess

from arle.config import EngineConfig
from arle.engine.build import create_engine
from arle.engine.request import GenerateRequest
from arle.errors import ModelLoadError
from arle.executor.distributed import TPRanks
from arle.model.config import ModelConfig
from arle.model.decoder import tp_problems
from arle.model.loader import check_tensor_parallel
from arle.model.parallel import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    fp8_weights,
)

MODELS = ("qwen3", "moe", "qwen3_5")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    write_model_dir(root / "qwen3", hf_config("Qwen3ForCausalLM"))
    write_model_dir(root / "moe", hf_config("Qwen3MoeForCausalLM"))
    write_qwen3_5_dir(root / "qwen3_5")
    return {name: root / name for name in MODELS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(mark: str = "") -> dict[str, str]:
    # NOTE: these are the CPU (gloo) tests: with no GPU in sight `--device auto` is the CPU on a
    # GPU machine too, whose one card could not hold 2 ranks
    env = arle_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if mark:
        env["ARLE_TP_TEST_MARK"] = mark  # found in the environ of every process it started
    return env


def _marked_tp2_server(model: Path, tmp_path: Path) -> tuple[ServerProcess, str]:
    """`arle serve --tp 2` of `model` (started, not ready yet), every process of it marked
    (see `_processes_marked`)."""
    mark = uuid.uuid4().hex
    server = ServerProcess(["--model", str(model), "--tp", "2", "--threads", "1"],
                           tmp_path / "serve.log", env={"ARLE_TP_TEST_MARK": mark,
                                                        "OMP_NUM_THREADS": "1",
                                                        "CUDA_VISIBLE_DEVICES": ""})
    return server, mark


def _assert_all_marked_gone(mark: str, within_s: float = 5.0) -> None:
    """Every process carrying `mark` exits within `within_s`."""
    deadline = time.monotonic() + within_s
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_marked(mark) == []


def _processes_marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (a test's children and theirs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if f"ARLE_TP_TEST_MARK={mark}".encode() in environ and state != "Z":
                pids.append(int(entry.name))
    return pids


def _rank_logits(model: Path, out: Path, size: int) -> list[torch.Tensor]:
    port = _free_port()
    script = str(Path(__file__).with_name("tp_rank.py"))
    procs = [subprocess.Popen([sys.executable, script, str(model), str(out), str(r), str(size),
                               str(port)], env=_env()) for r in range(size)]
    for p in procs:
        assert p.wait(120) == 0
    logits: list[torch.Tensor] = torch.load(out)
    return logits


@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_compute_the_logits_of_one(model_dirs: dict[str, Path], tmp_path: Path,
                                             name: str) -> None:
    """fp32 logits of every token within 1e-5. Qwen3.5: within 1e-5 of the logits' scale
    (max |logit| ~10; measured 4.6e-5): the all-reduce adds the partial sums in another order,
    and five layers of recurrent state (fp32 whatever the model dtype) carry that rounding on
    (in float64 weights the gap is 3.9e-6: rounding, not a different computation)."""
    one = tp_rank.step_logits(str(model_dirs[name]))  # one rank, in this process
    two = _rank_logits(model_dirs[name], tmp_path / "two.pt", 2)
    for a, b in zip(one, two, strict=True):  # the prefill's tokens, then one token each
        assert a is not None
        assert a.shape == b.shape and a.shape[1] == 384
        scale = a.abs().max().item() if name == "qwen3_5" else 1.0
        assert (a - b).abs().max().item() <= 1e-5 * scale
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _complete(model: Path, tp: int, mark: str = "") -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "arle", "complete", "The quick brown fox", "--model", str(model),
         "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--threads", "1",
         "--tp", str(tp), "--json", "--dtype", "float32"],
        env=_env(mark), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr == ""  # a clean exit: nothing from any rank at shutdown
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_close_ends_the_rank_watcher_first() -> None:
    """Rank 0's close() returns once its watcher thread has ended: a watcher still ending at
    interpreter shutdown would free the process groups on its thread and abort the process
    ('terminate called without an active exception', rc 134)."""
    ranks = TPRanks(TPGroup(0, 2), control=None)  # no group: close's messages fail quietly
    ranks.watch([])
    assert "arle-tp-watch" in {t.name for t in threading.enumerate()}
    ranks.close()
    assert "arle-tp-watch" not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("name", MODELS)
def test_arle_complete_tp2_gives_the_greedy_tokens_of_tp1(model_dirs: dict[str, Path],
                                                          name: str) -> None:
    mark = uuid.uuid4().hex
    two = _complete(model_dirs[name], 2, mark)
    one = _complete(model_dirs[name], 1)
    assert two["usage"]["completion_tokens"] == 16
    assert two["text"] == one["text"]
    assert _processes_marked(mark) == []  # rank 1 exited with rank 0


def test_under_torchrun_the_ranks_join_its_group(model_dirs: dict[str, Path]) -> None:
    """`torchrun --nproc-per-node 2 -m arle complete --tp 2`: rank 0 answers (env://
    rendezvous), rank 1 serves it and exits 0, the answer is one rank's."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "arle", "complete", "The quick brown fox",
         "--model", str(model_dirs["qwen3"]), "--max-tokens", "16", "--temperature", "0",
         "--ignore-eos", "--threads", "1", "--tp", "2", "--json"],
        env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    answers = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1  # rank 0's
    assert answers[0]["text"] == _complete(model_dirs["qwen3"], 1)["text"]


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", num_attention_heads=6,
                                        num_key_value_heads=3, intermediate_size=288))
    with pytest.raises(ModelLoadError, match="num_attention_heads 6 does not divide by 4"):
        check_tensor_parallel(tmp_path, 4)
    check_tensor_parallel(tmp_path, 3)  # 2 heads each, one KV head each
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()), "cfg")
    assert tp_problems(cfg, 2) == ["num_key_value_heads 3 neither divides by 2 nor divides it"]
    assert tp_problems(cfg, 6) == []  # one head a rank, each KV head held by two ranks
    out = subprocess.run([sys.executable, "-m", "arle", "complete", "hi", "--model",
                          str(tmp_path), "--tp", "4"], env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "--tensor-parallel-size 4" in out.stderr and "Traceback" not in out.stderr


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    """4 ranks, 2 KV heads: ranks 0, 1 hold KV head 0; ranks 2, 3 head 1; q split 4 ways."""
    d = 2
    full = torch.arange(8 * d * 3, dtype=torch.float32).reshape(-1, 3)  # 4 q heads, 2 k, 2 v
    q, k, v = full[:4 * d], full[4 * d:6 * d], full[6 * d:]
    for rank in range(4):
        lin = MergedColumnParallelLinear(3, {"q": 4 * d, "k": 2 * d, "v": 2 * d},
                                         tp=TPGroup(rank, 4), replicas={"k": 2, "v": 2})
        for key, part in (("q", q), ("k", k), ("v", v)):
            lin.load_shard(lin.weight, part, key)
        head = rank // 2
        assert torch.equal(lin.weight, torch.cat([q[rank * d:(rank + 1) * d],
                                                  k[head * d:(head + 1) * d],
                                                  v[head * d:(head + 1) * d]]))


def test_vocab_parallel_embedding_pads_the_last_range() -> None:
    table = torch.randn(10, 4)
    parts = []
    for rank in range(3):
        emb = VocabParallelEmbedding(10, 4, TPGroup(rank, 3))
        emb.load_rows(emb.weight, table)
        parts.append(emb.weight.data)
    assert [p.shape[0] for p in parts] == [4, 4, 4]
    assert torch.equal(torch.cat(parts)[:10], table)
    assert torch.count_nonzero(parts[2][2:]) == 0  # the padding past the vocabulary


def test_an_fp8_row_split_off_the_block_grid_is_refused() -> None:
    with fp8_weights((128, 128)), pytest.raises(ValueError, match="128-column blocks"):
        RowParallelLinear(384, 64, tp=TPGroup(0, 2))  # 192 columns a rank
    with fp8_weights((128, 128)):
        RowParallelLinear(512, 64, tp=TPGroup(1, 2))  # 256: two blocks a rank


async def test_cancellation_and_preemption_under_tp(model_dirs: dict[str, Path]) -> None:
    """A pool too small for every request at once: the newest are preempted and recomputed,
    and give the tokens one rank gives; a request cancelled mid-stream returns its pages;
    rank 0's cache (the one page table every rank's pool follows) ends with every page back."""
    base = EngineConfig(model=str(model_dirs["qwen3_5"]), num_threads=1, device="cpu",
                        kv_cache_tokens=96, max_running_requests=4, state_snapshots=0)
    prompts = [[(11 * i + 7 * j) % 250 for j in range(20 + 3 * i)] for i in range(4)]
    results = {}
    for tp in (1, 2):
        engine = await create_engine(replace(base, tensor_parallel_size=tp))
        try:
            out = await run_many(engine, prompts, max_tokens=24, temperature=0.0,
                                 ignore_eos=True)
            results[tp] = [tokens_of(d) for d in out]
            assert engine.scheduler.num_preemptions > 0
            assert_all_pages_back(engine)

            req = GenerateRequest(prompt=prompts[0], params=engine.default_params(
                max_tokens=200, temperature=0.0))
            await cancel_mid_stream(engine, req)
            await asyncio.sleep(0.2)  # the cancelled request's in-flight steps drain
            assert_all_pages_back(engine)
            assert engine.model_info.get("tensor_parallel_size", 1) == tp
        finally:
            await engine.close()
    assert results[2] == results[1]


async def test_speculative_decoding_under_tp(model_dirs: dict[str, Path]) -> None:
    """Qwen3.5 at TP=2 with verify rows (drafts right and wrong, each rank keeping its heads'
    states per position): the greedy tokens one rank gives without speculation."""
    base = EngineConfig(model=str(model_dirs["qwen3_5"]), num_threads=1, device="cpu",
                        kv_cache_tokens=1024, max_running_requests=4)
    prompts = [[(7 * i + 5 * j) % 250 for j in range(18 + 5 * i)] for i in range(3)]
    off = await create_engine(base)
    try:
        want = [tokens_of(d) for d in await run_many(off, prompts, max_tokens=20,
                                                     temperature=0.0, ignore_eos=True)]
    finally:
        await off.close()
    engine = await create_engine(replace(base, tensor_parallel_size=2, speculative="ngram",
                                         num_speculative_tokens=3))
    try:
        with_oracle(engine, prompts, want)
        got = await run_many(engine, prompts, max_tokens=20, temperature=0.0, ignore_eos=True)
        assert [tokens_of(d) for d in got] == want
        assert engine.stats["spec_accepted_tokens"] > 0
        assert_all_pages_back(engine)
    finally:
        await engine.close()


async def test_a_prefix_hit_restores_every_ranks_state(model_dirs: dict[str, Path]) -> None:
    """Qwen3.5 at TP=2: a prompt that extends an earlier one reuses its pages and the state
    snapshot at their end (each rank's heads of it), and answers as TP=1 does without any
    reuse."""
    turn1 = [(13 * j + 5) % 250 for j in range(64)]
    base = EngineConfig(model=str(model_dirs["qwen3_5"]), num_threads=1, device="cpu",
                        kv_cache_tokens=1024, max_running_requests=2)
    engine = await create_engine(replace(base, tensor_parallel_size=2))
    try:
        # one token: the 64 prompt tokens computed, a snapshot at their page boundary
        await run(engine, turn1, max_tokens=1, ignore_eos=True)
        turn2 = turn1 + [(3 * j + 1) % 250 for j in range(30)]
        hit = await run(engine, turn2, max_tokens=12, ignore_eos=True)
        assert hit[-1].trace is not None
        prefix = hit[-1].trace["prefix"]
        assert prefix["state_restored"] and prefix["matched_tokens"] == 64, prefix
    finally:
        await engine.close()
    cold = await create_engine(replace(base, enable_prefix_cache=False))
    try:
        assert tokens_of(await run(cold, turn2, max_tokens=12, ignore_eos=True)) == \
            tokens_of(hit)
    finally:
        await cold.close()


def test_serve_tp2_answers_and_dies_cleanly_with_a_rank(model_dirs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """`arle serve --tp 2` answers; killing rank 1 mid-stream ends the server with a clear
    error within seconds, and no process of it is left."""
    server, mark = _marked_tp2_server(model_dirs["qwen3"], tmp_path)
    try:
        url = server.wait_ready()
        body = {"model": "qwen3", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        start = next(e for e in server.events() if e.get("event") == "tensor_parallel_start")
        (rank1,) = start["pids"]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**body, "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            t0 = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            # the stream ends (an error event or a dropped connection), not hangs
            with pytest.raises(Exception):  # noqa: B017 - either way is an end
                for line in lines:
                    if "error" in line:
                        raise RuntimeError(line)
        server.proc.wait(15)
        assert time.monotonic() - t0 < 10
        assert server.proc.returncode == 1
        log = server.log_path.read_text(errors="replace")
        assert f"tensor-parallel rank 1 (pid {rank1}) died (signal 9)" in log
        _assert_all_marked_gone(mark)
    finally:
        server.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_stop_every_rank(model_dirs: dict[str, Path], tmp_path: Path,
                                            sig: int) -> None:
    server, mark = _marked_tp2_server(model_dirs["qwen3"], tmp_path)
    try:
        server.wait_ready()
        assert len(_processes_marked(mark)) == 2
        t0 = time.monotonic()
        code = server.stop(sig, timeout_s=20)
        assert code == 0 and time.monotonic() - t0 < 10
        assert _processes_marked(mark) == []
        assert "Traceback" not in server.log_path.read_text(errors="replace")
    finally:
        server.kill()


def test_arle_warmup_reports_each_ranks_memory(model_dirs: dict[str, Path]) -> None:
    """Each rank holds about half the weights (norms and routers whole on both) and a KV pool
    of its one KV head per layer at the same pages."""
    from arle.model.loader import load_model

    whole = load_model(model_dirs["moe"]).num_bytes
    out = subprocess.run([sys.executable, "-m", "arle", "warmup", "--json", "-m",
                          str(model_dirs["moe"]), "--tp", "2", "--threads", "1",
                          "--kv-cache-tokens", "256"],
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    ranks = report["memory"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert 0.45 * whole < r["weights_bytes"] < 0.6 * whole
        assert r["kv_pages"] == report["memory"]["kv_pool"]["pages"] == 16
        # 3 layers x K and V x 16 pages x 16 tokens x 1 KV head x 32 dims x 4 bytes
        assert r["kv_bytes"] == 3 * 2 * 16 * 16 * 1 * 32 * 4


def test_killing_rank_0_leaves_no_rank_behind(model_dirs: dict[str, Path],
                                              tmp_path: Path) -> None:
    server, mark = _marked_tp2_server(model_dirs["qwen3"], tmp_path)
    try:
        server.wait_ready()
        assert len(_processes_marked(mark)) == 2
        server.proc.kill()
        server.proc.wait(10)
        _assert_all_marked_gone(mark)
    finally:
        server.kill()


@pytest.mark.slow
def test_the_default_gguf_model_splits_over_3_not_2() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, Q4_1 GGUF, dequantised at load: --dtype float32 on
    every rank count, as TP dequantizes): refused at --tp 2 with what does not divide, and at
    --tp 3 the greedy answer of one rank."""
    path = require_smollm2_gguf()
    with pytest.raises(ModelLoadError, match="num_attention_heads 9 does not divide by 2"):
        check_tensor_parallel(path, 2)
    answers = [_complete(path, tp) for tp in (1, 3)]
    assert answers[0]["text"] == answers[1]["text"]


def _listening(pids: list[int]) -> list[str]:
    """The local addresses ("host:port") of the TCP sockets `pids` listen on."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                found.append(_address(local))
    return found


def _address(hex_local: str) -> str:
    """/proc/net/tcp{,6}'s "ADDR:PORT" (hex, each 32-bit word little-endian) as text."""
    addr, port = hex_local.split(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    return f"{ipaddress.ip_address(raw)}:{int(port, 16)}"


def test_a_tp2_server_listens_on_loopback_only(model_dirs: dict[str, Path],
                                               tmp_path: Path) -> None:
    """Every port `arle serve --tp 2` opens (the HTTP port, the ranks' store, gloo's) is on
    loopback: nobody else on the network can reach the group's store."""
    server, mark = _marked_tp2_server(model_dirs["qwen3"], tmp_path)
    try:
        server.wait_ready()
        listening = _listening(_processes_marked(mark))
    finally:
        server.stop()
    assert len(listening) >= 2, listening  # the HTTP port and the store at least
    outside = [a for a in listening
               if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]
    assert not outside, listening


async def test_a_host_tier_hit_is_a_hit_on_every_rank(model_dirs: dict[str, Path]) -> None:
    """Qwen3.5 at TP=2 with a host KV tier and a device pool of 6 pages: a first prompt's pages
    move to the host (each rank its own heads of them, and its own state snapshot) while
    others run, come back for the prompt that extends it, and the answer is TP=1's without
    any reuse."""
    turn1 = [(13 * j + 5) % 250 for j in range(64)]
    base = EngineConfig(model=str(model_dirs["qwen3_5"]), num_threads=1, device="cpu",
                        kv_cache_tokens=96, max_running_requests=1, kv_host_cache_gb=0.01,
                        state_snapshots=8)
    engine = await create_engine(replace(base, tensor_parallel_size=2))
    try:
        await run(engine, turn1, max_tokens=1, ignore_eos=True)
        for i in range(2):  # other prompts push turn1's pages out of the device pool
            await run(engine, [(7 * j + i) % 250 for j in range(80)], max_tokens=1,
                      ignore_eos=True)
        turn2 = turn1 + [(3 * j + 1) % 250 for j in range(20)]
        hit = await run(engine, turn2, max_tokens=8, ignore_eos=True)
        assert hit[-1].trace is not None
        prefix = hit[-1].trace["prefix"]
        assert prefix["host_hit_tokens"] > 0 and prefix["state_restored"], prefix
        # its state snapshot moved down with its pages: each rank starts from its own copy
        assert engine.cache.stats["host_snapshot_hits"] == 1
        assert_all_pages_back(engine)
    finally:
        await engine.close()
    cold = await create_engine(replace(base, enable_prefix_cache=False, kv_host_cache_gb=0))
    try:
        assert tokens_of(await run(cold, turn2, max_tokens=8, ignore_eos=True)) == \
            tokens_of(hit)
    finally:
        await cold.close()
