"""What code a result measured: recorded into every benchmark artifact, and named in its results block."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's short commit, `+changes` when tracked files under src/ differ from it; in a source
    snapshot made by `git archive` (no .git), the commit its COMMIT file names."""
    if not (ROOT / ".git").exists() and (ROOT / "COMMIT").exists():
        return (ROOT / "COMMIT").read_text().strip()

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "src") else "")
