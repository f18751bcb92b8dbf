"""The compiled scanner, ``pipeline.text._fastscan`` (``_fastscan.c``), when it was built.

``pip install -e .`` builds it where a C compiler is found; without it the Layer-0 scan and
simhash take their pure-Python paths, with the same results (``tests/unit/test_scan_property.py``
compares the two). :data:`FASTSCAN` is the module, or None when it is not built."""

from __future__ import annotations

from types import ModuleType

FASTSCAN: ModuleType | None
try:
    from pipeline.text import _fastscan as FASTSCAN
except ImportError:  # not built: the pure-Python paths serve
    FASTSCAN = None
