"""arle.logging: JSON and console lines on stderr only, stdlib routing, reconfiguration."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from helpers import arle_env

from arle.logging import configure_logging, get_logger

ROOT = Path(__file__).resolve().parents[1]

# Emits one event of each kind; only info and above of ours, warning and above of stdlib show.
SCRIPT = textwrap.dedent("""
    import logging, sys
    from arle.logging import configure_logging, get_logger
    configure_logging({fmt!r})
    log = get_logger("arle.test")
    log.debug("hidden_debug")
    log.info("request_trace", prompt_tokens=3, ttft_ms=1.5, route="cli.complete", text="é\\n")
    logging.getLogger("somelib").info("hidden_lib_info")
    logging.getLogger("somelib").warning("lib says %s", 42)
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("boom")
""")


def _run(fmt: str | None, env_format: str | None = None) -> subprocess.CompletedProcess[str]:
    env = arle_env()
    if env_format:
        env["ARLE_LOG_FORMAT"] = env_format
    return subprocess.run([sys.executable, "-c", SCRIPT.format(fmt=fmt)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)


def _json_lines(stderr: str) -> list[dict]:
    lines = stderr.splitlines()
    assert lines, "no log lines"
    return [json.loads(line) for line in lines]  # each line must be one JSON object


@pytest.mark.parametrize(("fmt", "env_format"), [("json", None), (None, "json")])
def test_json_lines_on_stderr(fmt: str | None, env_format: str | None) -> None:
    proc = _run(fmt, env_format)
    assert proc.stdout == ""
    events = _json_lines(proc.stderr)
    assert [e["event"] for e in events] == ["request_trace", "lib says 42", "boom"]
    for e in events:
        assert e["level"] in ("info", "warning", "error")
        ts = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00"))
        assert ts.utcoffset() == timedelta(0)
    trace, lib, boom = events
    assert trace["level"] == "info"
    assert trace["prompt_tokens"] == 3 and trace["ttft_ms"] == 1.5
    assert trace["text"] == "é\n" and trace["logger"] == "arle.test"
    assert lib["level"] == "warning" and lib["logger"] == "somelib"
    assert boom["level"] == "error" and "ZeroDivisionError" in boom["exception"]


def test_console_lines_on_stderr_without_color_when_piped() -> None:
    proc = _run("console")
    assert proc.stdout == ""
    assert "request_trace" in proc.stderr and "lib says 42" in proc.stderr
    assert "hidden" not in proc.stderr
    assert "\x1b[" not in proc.stderr  # stderr is a pipe here: no color codes
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stderr.splitlines()[0])


def test_reconfigure_is_idempotent_and_applies_to_existing_loggers(
        capsys: pytest.CaptureFixture[str]) -> None:
    log = get_logger("arle.test")
    configure_logging("json")
    configure_logging("json")
    ours = [h for h in logging.getLogger().handlers if type(h).__name__ == "_StderrHandler"]
    assert len(ours) == 1
    logging.getLogger("somelib").warning("once")
    log.info("first")
    log.debug("not_yet")
    configure_logging("json", level="debug")
    log.debug("now_shown")
    out, err = capsys.readouterr()
    assert out == ""
    assert [e["event"] for e in _json_lines(err)] == ["once", "first", "now_shown"]
    configure_logging("console")  # leave the default for other tests


def test_level_filters_and_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("json", level="warning")
    get_logger("x").info("dropped")
    get_logger("x").warning("kept")
    assert [e["event"] for e in _json_lines(capsys.readouterr().err)] == ["kept"]
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log level"):
        configure_logging("json", level="loud")
    configure_logging("console")


def test_console_tracebacks_show_no_locals(capsys: pytest.CaptureFixture[str]) -> None:
    """What a frame held (a request body) stays out of a logged traceback unless --debug."""
    from arle.logging import configure_logging, get_logger

    def fail(body: bytes) -> None:
        raise ValueError("boom")

    secret = "-".join(["LOCAL", "SECRET", "BODY"])  # the joined text is in no source line
    for level, shown in (("info", False), ("debug", True)):
        configure_logging("console", level)
        try:
            fail(secret.encode())
        except ValueError:
            get_logger("test").error("failed", exc_info=True)
        err = capsys.readouterr().err
        assert "boom" in err
        assert (secret in err) == shown, err[-2000:]
    configure_logging("console", "info")
