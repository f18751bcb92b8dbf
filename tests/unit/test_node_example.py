"""docs/entry.md's Node manager is the shipped file: the page's copy of
docs/examples/node/submit.js and of its sample submission are the files themselves (the
integration tests run the files, tests/integration/test_entry.py)."""

from __future__ import annotations

import json
import re

from pipeline.models import Submission
from pipeline.store.urls import DEFAULT_REDIS_URL
from tests.support.entry import NODE_EXAMPLE as EXAMPLE
from tests.support.entry import docs_node_block


def test_the_docs_script_is_the_shipped_file() -> None:
    """The ```js block of docs/entry.md's Node section is docs/examples/node/submit.js, byte
    for byte."""
    assert docs_node_block("js") == (EXAMPLE / "submit.js").read_text(encoding="utf-8")


def test_the_docs_sample_is_the_shipped_submission() -> None:
    """The ```json block of the Node section is submission.json, a valid Submission holding
    the unfinished TODO report."""
    shipped = (EXAMPLE / "submission.json").read_text(encoding="utf-8")
    assert docs_node_block("json") == shipped
    sub = Submission.model_validate(json.loads(shipped))
    assert sub.output == "# Q3 report\n\nTODO: fill in the numbers."


def test_the_script_reads_redis_url_with_the_python_default() -> None:
    """submit.js reads REDIS_URL with the Python side's default and needs nothing but Node's
    standard library (crypto, fs, net)."""
    code = (EXAMPLE / "submit.js").read_text(encoding="utf-8")
    assert f"const DEFAULT_REDIS_URL = '{DEFAULT_REDIS_URL}';" in code
    assert "env.REDIS_URL || DEFAULT_REDIS_URL" in code
    assert "require('net')" in code and not re.search(r"require\('(?!crypto|fs|net)", code)
