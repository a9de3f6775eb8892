"""Tensor parallelism over torch.distributed: N ranks, one per device; rank 0 runs the engine.

Start-up (`start_ranks`): rank 0 (the arle process) starts ranks 1..N-1 as child processes
(`python -m arle.executor.distributed`, their spec pickled on stdin), or, under torchrun, joins
torchrun's group (env:// rendezvous); every rank loads its slice of the checkpoint and builds
the same executor on its device (`build`, given by the engine), and rank 0 gathers each rank's
memory plan (`TPRanks.infos`).

Each step: rank 0's executor flattens the plan as always (`StepInputs.of`, on the event loop)
and, on its step thread, broadcasts it to the other ranks (`TPRanks.send`: one pickled message,
two gloo broadcasts) before running it; every rank runs the same step on its shards (the model's
all-reduces after row-parallel layers, the lm_head's gather to rank 0); rank 0 samples and
broadcasts the sampled ids, which every rank writes into its token buffer (the next step's
decode rows read them there). The loop's overlap is untouched: step N+1 is planned while step N
runs, and the steps reach the other ranks in launch order.

Groups: the model's collectives run on the default group (NCCL on GPUs, gloo on CPUs), with a
timeout (`COLLECTIVE_TIMEOUT_S`: a hung rank fails the step); the step messages on a gloo group
of their own that waits as long as the server idles.

Failure: a rank that dies, or a step that fails on any rank (its peers would wait in a
collective it never reaches), ends every rank: rank 0 says which rank and why on stderr, kills
its children and exits 1 (`TPRanks.fail`). Children die with rank 0: they read their stdin until
EOF (rank 0's end of the pipe closes when it exits, however it exits) and ask the kernel for
SIGKILL on the parent's death (Linux). They ignore SIGINT: Ctrl-C reaches the whole process
group, and rank 0 stops them in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from arle import env
from arle.errors import ArleError
from arle.executor.paged import StepInputs
from arle.executor.sampler import SampleOutput
from arle.logging import configure_logging, get_logger, logging_settings
from arle.model.parallel import TPGroup

log = get_logger("arle.executor.distributed")

#: A collective that waits longer than this fails its step (and so every rank): a hung rank.
COLLECTIVE_TIMEOUT_S = 60.0
#: The step messages' group waits while the server idles: as good as forever.
_IDLE_TIMEOUT = timedelta(days=365 * 10)
#: After a rank fails, rank 0 lets the failed step's requests get their error for this long.
_EXIT_GRACE_S = 1.0
_STEP, _STOP = 1, 0
_T = TypeVar("_T")


def peer_inputs(inputs: StepInputs) -> StepInputs:
    """What the other ranks run of a step: not the sampling rows' parameters, the new
    requests' token lists nor the grammar rows' matchers (only rank 0's sampler reads them)."""
    return replace(inputs, sampling=None, want_logprobs=[], new_slots=[], grammars=[])


def rank_memory(tp: TPGroup, device: torch.device | str, model: torch.nn.Module, kv_pages: int,
                kv_bytes: int, state_bytes: int) -> dict[str, Any]:
    """One rank's memory as `arle warmup` reports it: weights, KV pool, recurrent state pool."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rank": tp.rank, "device": str(device), "weights_bytes": weights,
            "kv_pages": kv_pages, "kv_bytes": kv_bytes, "state_bytes": state_bytes}


def sample_on_first_rank(tp: TPGroup, logits: torch.Tensor, vocab: int, slots: torch.Tensor,
                         token_buffer: torch.Tensor,
                         sample: Callable[[torch.Tensor], SampleOutput]) -> SampleOutput | None:
    """A TP step's sampling: the ranks' vocabulary ranges of the logits gathered on rank 0,
    which samples (`sample(full logits)`, as one rank would); the ids broadcast, and every
    other rank writes them into its token buffer (the next step's decode rows read them).
    None on ranks > 0. The same on both executors; on CUDA all of it queued on the stream."""
    full = tp.gather_columns(logits, vocab)
    if full is None:
        ids = tp.broadcast(torch.empty(slots.shape[0], dtype=torch.int64, device=logits.device))
        token_buffer[slots] = ids.to(token_buffer.dtype)
        return None
    out = sample(full)
    tp.broadcast(out.token_ids.to(torch.int64))
    return out


class RankExecutor(Protocol):
    """What every rank's executor offers the group: one step as rank 0 sent it, run on the
    calling thread (queued, on CUDA), and its memory plan."""

    ranks: TPRanks | None

    def run_step(self, message: Any) -> object: ...

    def rank_info(self) -> dict[str, Any]: ...


#: (tp, local rank: the device index on this host) -> the rank's executor
Build = Callable[[TPGroup, int], RankExecutor]


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank process needs to join the group and build its executor (pickled)."""

    rank: int
    size: int
    local_rank: int
    #: rank 0's store: (host, port); None: torchrun's (env://)
    address: tuple[str, int] | None
    backend: str
    build: Build
    #: rank 0's log format and level
    log: tuple[str, int] = ("console", 20)


class TPRanks:
    """This process's place in the group, and on rank 0 the other ranks' processes."""

    def __init__(self, tp: TPGroup, control: Any) -> None:
        self.tp = tp
        self.control = control  # the step messages' gloo group
        #: ranks 1..N-1 when rank 0 started them (none under torchrun, none on the others)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.infos: list[dict[str, Any]] = []
        self._closing = False
        self._failed = threading.Event()
        self._watcher: threading.Thread | None = None

    def watch(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Rank 0: its child ranks, watched from a thread of their own (`_watch`)."""
        self.procs = procs
        self._watcher = threading.Thread(target=self._watch, name="arle-tp-watch", daemon=True)
        self._watcher.start()

    # ---- every step ---------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Rank 0: a step to the other ranks (what their `run_step` takes)."""
        self._send(_STEP, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        """Ranks > 0: the next step, or None when rank 0 stops the group."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        kind, nbytes = header.tolist()
        if kind == _STOP:
            return None
        payload = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())

    def _send(self, kind: int, data: bytes) -> None:
        dist.broadcast(torch.tensor([kind, len(data)], dtype=torch.int64), src=0,
                       group=self.control)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0,
                           group=self.control)

    def run(self, message: object, step: Callable[[], _T]) -> _T:
        """Rank 0: `message` to the other ranks, then `step` (this rank's part). NOTE: any
        error ends every rank: the others may wait in a collective this rank never reaches."""
        try:
            self.send(message)
            return step()
        except BaseException as e:
            # a peer's death shows here first as a broken connection: name the dead rank
            self.fail(self._dead_rank(0.5) or f"a tensor-parallel step failed on rank 0: {e!r}")
            raise

    # ---- start and stop -----------------------------------------------------------------
    def gather_infos(self, info: dict[str, Any]) -> None:
        """Every rank's memory plan to rank 0 (`infos`, in rank order)."""
        out: list[Any] = [None] * self.tp.size if self.tp.rank == 0 else []
        dist.gather_object(info, out if self.tp.rank == 0 else None, dst=0, group=self.control)
        self.infos = out

    def close(self) -> None:
        """Rank 0, after the last step: stop the other ranks and wait for them (killed if they
        do not exit within seconds), then leave the group."""
        if self._closing:
            return
        self._stop_watching()
        if not self._failed.is_set():
            with contextlib.suppress(Exception):
                self._send(_STOP, b"")
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def abort(self) -> None:
        """Rank 0, when start-up fails: the other ranks killed, the group left."""
        self._stop_watching()
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.kill()
            p.wait()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _stop_watching(self) -> None:
        """NOTE: the watcher ends before the group is left. Its thread holds this object (its
        target is a bound method); were it the last holder, the process groups would be freed
        on that thread, and a C++ destructor that meets interpreter shutdown there aborts the
        process ('terminate called without an active exception')."""
        self._closing = True
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """Which child rank exited, and how (waiting up to `wait_s` for one to); None: none."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    return f"tensor-parallel rank {rank} (pid {p.pid}) died ({how})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """Rank 0: a child rank that exits while the group runs fails the group."""
        while not self._closing and not self._failed.is_set():
            dead = self._dead_rank()
            if dead is not None and not self._closing:
                self.fail(dead)
                return
            time.sleep(0.1)

    def fail(self, reason: str) -> None:
        """End every rank: the reason on stderr, the children killed, rank 0 exits 1 once the
        failed step's requests had a moment to get their error."""
        if self._failed.is_set() or self._closing:
            return
        self._failed.set()
        log.error("tensor_parallel_failed", reason=reason)
        sys.stderr.write(f"error: {reason}; stopping all ranks\n")
        sys.stderr.flush()
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.kill()
        threading.Timer(_EXIT_GRACE_S, _exit_now).start()


def _exit_now() -> None:
    sys.stderr.flush()
    os._exit(1)


def _listen(host: str, port: int) -> socket.socket:
    """The group's store's listening socket, on `host` only. NOTE: given a host, torch's
    TCPStore still listens on every interface; from a socket bound here it listens on this
    one address, so a single-host group is reachable from this machine alone."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise ArleError(f"tensor parallel: cannot listen on {host}:{port} for the ranks' "
                        f"store: {e.strerror or e}") from None


def _join(rank: int, size: int, address: tuple[str, int] | None, backend: str,
          listener: socket.socket | None = None) -> TPRanks:
    """Join the group through rank 0's store at `address` (rank 0 serves it from `listener`;
    None: torchrun's store, env://): the default group for the model's collectives, a gloo
    group for the step messages."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if address is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size,
                                timeout=timeout)
    else:
        store = dist.TCPStore(address[0], address[1], size, rank == 0, timeout=timeout,
                              master_listen_fd=listener.fileno() if listener else None)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TPRanks(TPGroup(rank, size), control)


def start_ranks(size: int, device_type: str, build: Build) -> TPRanks | None:
    """Rank 0's side of the start-up: start ranks 1..size-1 (or join torchrun's group) and
    join. Returns None in a torchrun rank > 0, after it served as a worker until rank 0
    stopped the group (the caller then exits)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    torchrun = env.torchrun_rank()
    if torchrun is not None:
        rank, world, local = torchrun
        if world != size:
            raise ArleError(f"--tensor-parallel-size {size} but torchrun started {world} ranks "
                            "(WORLD_SIZE): give the same number")
        # NOTE: the store is torchrun's (its agent serves it where --master-addr says); arle
        # opens no port of its own
        if rank != 0:
            run_worker(WorkerSpec(rank, size, local, None, backend, build))
            return None
        return _join(0, size, None, backend)
    # NOTE: one host: every port of the group on loopback (NCCL's bootstrap too, unless the
    # user named its interface)
    env.nccl_on_loopback()
    listener = _listen("127.0.0.1", 0)
    address = ("127.0.0.1", int(listener.getsockname()[1]))
    procs = []
    for rank in range(1, size):
        p = subprocess.Popen([sys.executable, "-m", "arle.executor.distributed"],
                             stdin=subprocess.PIPE)
        data = pickle.dumps(WorkerSpec(rank, size, rank, address, backend, build,
                                       logging_settings()))
        assert p.stdin is not None
        p.stdin.write(struct.pack("<Q", len(data)) + data)
        p.stdin.flush()  # NOTE: the pipe stays open: its EOF tells the child rank 0 is gone
        procs.append(p)
    log.info("tensor_parallel_start", ranks=size, backend=backend,
             pids=[p.pid for p in procs])
    try:
        ranks = _join(0, size, address, backend, listener)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    ranks.watch(procs)
    return ranks


def run_worker(spec: WorkerSpec) -> None:
    """A rank > 0: join, build the executor, run rank 0's steps until it stops the group."""
    ranks = _join(spec.rank, spec.size, spec.address, spec.backend)
    executor = spec.build(ranks.tp, spec.local_rank)
    ranks.gather_infos(executor.rank_info())
    while (inputs := ranks.recv()) is not None:
        executor.run_step(inputs)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """Exit when rank 0 does: SIGKILL from the kernel (Linux), and EOF on stdin (anywhere)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    stdin = sys.stdin.buffer

    def watch() -> None:
        while stdin.read(4096):
            pass
        os._exit(1)  # NOTE: no cleanup: rank 0 is gone, nothing here is worth waiting for

    threading.Thread(target=watch, name="arle-tp-parent", daemon=True).start()


def _main() -> None:
    """A rank process started by `start_ranks`: its spec on stdin, then the worker loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 stops us on Ctrl-C
    stdin = sys.stdin.buffer
    (n,) = struct.unpack("<Q", stdin.read(8))
    spec: WorkerSpec = pickle.loads(stdin.read(n))
    configure_logging(spec.log[0], spec.log[1])  # type: ignore[arg-type]
    if os.getppid() == 1:
        os._exit(1)
    _die_with_parent()
    try:
        run_worker(spec)
    except BaseException as e:
        sys.stderr.write(f"error: tensor-parallel rank {spec.rank}: {e!r}\n")
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    _main()
