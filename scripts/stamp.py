"""The date and commit every benchmark's JSON carries (scripts/perf_table.py reads them)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def commit() -> str | None:
    """$ARLE_COMMIT (a copy of the tree without .git, as on a GPU machine), else git's HEAD."""
    if os.environ.get("ARLE_COMMIT"):
        return os.environ["ARLE_COMMIT"]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent, check=False)
    return git.stdout.strip() or None


def cpu_model() -> str | None:
    """The host CPU's model name (Linux), which CPU figures depend on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    return next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), None)


def stamp() -> dict[str, str | None]:
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "commit": commit(), "cpu": cpu_model()}
