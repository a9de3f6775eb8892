"""The docs stay small and true: docs/performance.md's figures are what scripts/perf_table.py
renders from docs/results/, every relative link leads to a file, README.md stays short."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 170
DOCS_MAX_PAGES = 8
DOCS_MAX_FILES = 64  # the raw JSON of two GPU machines and the CPU
DOCS_MAX_BYTES = 2 << 20


def _perf_table(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "scripts" / "perf_table.py"), *args],
                          cwd=root, capture_output=True, text=True, timeout=60)


def test_performance_page_matches_its_data() -> None:
    proc = _perf_table(ROOT, "--check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def test_perf_table_imports_nothing_heavy() -> None:
    code = ("import sys; sys.path.insert(0, 'scripts'); import perf_table; "
            "heavy = {'torch', 'numpy', 'transformers', 'arle'} & set(sys.modules); "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _copy(tmp_path: Path) -> Path:
    """A repository of the script and the pages it writes, to change their data."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "perf_table.py", tmp_path / "scripts")
    shutil.copy(ROOT / "README.md", tmp_path)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "performance.md", tmp_path / "docs")
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    return tmp_path


def test_a_new_figure_file_changes_the_page(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    path = root / "docs" / "results" / "h200" / "decode_qwen3-4b.json"
    data = json.loads(path.read_text())
    data["batch1"]["mean_tpot_ms"] = 2.0
    data["commit"] = "abc1234"
    path.write_text(json.dumps(data))
    assert _perf_table(root, "--check").returncode == 1
    assert _perf_table(root).returncode == 0
    page = (root / "docs" / "performance.md").read_text()
    assert "| 2.000 ms |" in page and "abc1234" in page
    assert "| 2.000 ms |" in (root / "README.md").read_text()
    assert _perf_table(root, "--check").returncode == 0


def test_a_file_without_date_needs_its_own_provenance(tmp_path: Path) -> None:
    """A replaced file that records no date or commit is refused until it has an entry; the
    entry then dates its row."""
    root = _copy(tmp_path)
    name = "h200/parity_smollm2.json"
    path = root / "docs" / "results" / name
    data = json.loads(path.read_text())
    assert "date" not in data and "commit" not in data  # written before the scripts stamped
    data["summary"]["arle_bf16_vs_transformers_fp32"]["rel"] = 0.1234
    path.write_text(json.dumps(data))
    proc = _perf_table(root)
    assert proc.returncode == 1 and f"--provenance {name}" in proc.stderr
    assert _perf_table(root, "--provenance", name, "2027-01-02", "def5678").returncode == 0
    page = (root / "docs" / "performance.md").read_text()
    row = next(line for line in page.splitlines() if "English prompts" in line)
    assert "rel 0.1234" in row and "def5678" in row and "2027-01-02" in row


def test_undeclared_results_are_refused(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "docs" / "results" / "h200" / "stray.json").write_text("{}")
    proc = _perf_table(root, "--check")
    assert proc.returncode == 1 and "stray.json" in proc.stderr


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES


def _links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # code blocks hold no links
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_relative_links_lead_to_files() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in _links(page.read_text()):
            if re.match(r"[a-z]+:", link) or link.startswith("#"):
                continue
            if not (page.parent / link.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert not broken


def test_docs_folder_stays_small() -> None:
    """Few pages, and the figures' raw data bounded (a file per measured run)."""
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    pages = [p for p in files if "results" not in p.relative_to(ROOT / "docs").parts]
    assert len(pages) <= DOCS_MAX_PAGES
    assert len(files) - len(pages) < DOCS_MAX_FILES
    assert sum(p.stat().st_size for p in files) < DOCS_MAX_BYTES
