"""`arle serve` against clients that hold connections: idle sockets past the connection cap,
heads and bodies dripped a byte at a time. `/health` keeps answering within a second, the
slow connections are closed at their deadlines, and the cap is logged once. Real `arle serve`
subprocesses on the tiny random model."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import ServerProcess, arle_server

pytestmark = pytest.mark.slow

CAP = 200
HEAD_S = 1.0
BODY_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with arle_server(["--model", str(tiny_dir), "--kv-cache-tokens", "4096",
                      "--max-connections", str(CAP), "--head-timeout", str(HEAD_S),
                      "--body-timeout", str(BODY_S)], log) as s:
        yield s


def _addr(server: ServerProcess) -> tuple[str, int]:
    return "127.0.0.1", int(server.url.rsplit(":", 1)[1])


def _health_s(server: ServerProcess) -> float:
    t0 = time.perf_counter()
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _closed_after(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closes `sock` (reading what it sent), at most limit_s."""
    t0 = time.perf_counter()
    sock.settimeout(limit_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"still open after {limit_s} s")
    except ConnectionResetError:
        pass
    return time.perf_counter() - t0, got


def test_idle_sockets_past_the_cap_do_not_lock_out_health(server: ServerProcess) -> None:
    """Five times the cap of sockets that send nothing: the oldest idle ones are closed to
    make room, /health answers within a second throughout, and the cap is logged once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 6 * CAP:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8 * CAP), hard))
    idle = [socket.create_connection(_addr(server)) for _ in range(5 * CAP)]
    try:
        worst = max(_health_s(server) for _ in range(5))
        assert worst < 1.0, worst
        time.sleep(0.2)
        open_now = sum(1 for s in idle if not _peer_closed(s))
        assert open_now <= CAP, open_now
    finally:
        for s in idle:
            s.close()
    events = [e for e in server.events() if e.get("event") == "connection_cap_reached"]
    assert len(events) == 1, events
    assert events[0]["max_connections"] == CAP


def _peer_closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_a_dripped_head_gets_408_at_its_deadline(server: ServerProcess) -> None:
    """Slowloris: a head sent a byte every 0.2 s is cut at --head-timeout with a 408, while
    /health answers."""
    socks = [socket.create_connection(_addr(server)) for _ in range(20)]
    stop = threading.Event()

    def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 100:
            if stop.is_set():
                return
            for s in socks:
                with contextlib.suppress(OSError):
                    s.send(bytes([byte]))
            time.sleep(0.2)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        assert _health_s(server) < 1.0
        waited, got = _closed_after(socks[0], HEAD_S + 3)
        assert waited <= HEAD_S + 1, waited
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"--head-timeout" in got
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_a_silent_connection_is_closed_without_an_answer(server: ServerProcess) -> None:
    sock = socket.create_connection(_addr(server))
    try:
        waited, got = _closed_after(sock, HEAD_S + 3)
    finally:
        sock.close()
    assert got == b"" and waited <= HEAD_S + 1, (waited, got)


def test_a_body_that_never_ends_is_cut_at_its_deadline(server: ServerProcess) -> None:
    """A chunked body that never sends its last chunk: the connection ends at --body-timeout,
    no answer counted as the server's error, and the server goes on."""
    sock = socket.create_connection(_addr(server))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\n{\"pro\r\n")
        waited, got = _closed_after(sock, BODY_S + 3)
    finally:
        sock.close()
    assert waited <= BODY_S + 1, waited
    assert b" 500 " not in got.split(b"\r\n", 1)[0], got[:200]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200, r.text
    metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'status="500"' not in metrics


def test_a_client_leaving_mid_body_is_no_server_error(server: ServerProcess) -> None:
    """A client that closes its socket halfway through the body: no 500 counted, and nothing it
    sent in any log line."""
    secret = "MIDBODY-SECRET-PROMPT"
    body = ('{"prompt": "' + secret + '", "max_tokens": 2}').encode()
    for _ in range(3):
        sock = socket.create_connection(_addr(server))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body) * 2).encode() + b"\r\n\r\n" + body)
        time.sleep(0.1)
        sock.close()
    time.sleep(0.3)
    metrics = httpx.get(server.url + "/metrics", timeout=5).text
    assert 'status="500"' not in metrics
    assert secret not in server.log_path.read_text(errors="replace")


def test_console_logs_of_serve_show_each_request_trace(tiny_dir: Path, tmp_path: Path) -> None:
    """`arle serve` with its default console logs prints one request_trace line per request,
    as docs/server.md says (the answer-printing commands keep theirs to warnings)."""
    import re

    from served import ServerProcess

    server = ServerProcess(["--model", str(tiny_dir), "--kv-cache-tokens", "4096",
                            "--log-format", "console"], tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline and server.proc.poll() is None:
            found = re.search(r"listening on (http://\S+)", server.log_path.read_text())
            url = found[1] if found else None
            time.sleep(0.05)
        assert url is not None, server.log_path.read_text()[-2000:]

        def traces() -> list[str]:
            return [ln for ln in server.log_path.read_text().splitlines()
                    if "request_trace" in ln]

        before = len(traces())  # the start-up warm-up's own requests
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        time.sleep(0.3)
        lines = traces()[before:]
        assert len(lines) == 1 and "completion_tokens=2" in lines[0], lines
    finally:
        server.stop()
