"""Where a bench's figures come from: the checkout's commit (the benches print it in their
header, with the versions they measured)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def git_commit() -> str:
    """``git rev-parse --short HEAD``, ``+dirty`` when tracked files differ from it, else
    ``unknown`` (not a git checkout, or no git)."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
