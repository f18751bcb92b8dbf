"""A module whose import is visible: it creates the file ``$HOSTILE_SIDEEFFECT_MARKER`` names.

The trust-boundary tests name it as an ``output_contract.extra`` check or a ``repairer`` in a
submission; the worker must refuse without importing it, so the marker never appears. Its
callables work (a check that finds nothing, a repairer that returns the output unchanged), so
an import that does happen is not masked by a load error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MARKER_ENV = "HOSTILE_SIDEEFFECT_MARKER"

_marker = os.environ.get(MARKER_ENV)
if _marker:
    Path(_marker).write_text(f"imported by pid {os.getpid()}\n", encoding="utf-8")


def check(doc: Any) -> list[Any]:
    """An extension check that never fails (its import is the side effect)."""
    return []


def repair(submission: Any, output: Any, envelope: Any, **_: Any) -> Any:
    """A repairer that returns the output unchanged (its import is the side effect)."""
    return output
