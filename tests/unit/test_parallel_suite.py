"""How the suite runs under pytest-xdist (``-n 3``): which tests share a process, and which
databases each process takes of a shared Redis (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import _shared_db
from tests.conftest import _xdist_scope as _scope


def test_a_files_tests_share_one_scope_and_files_do_not() -> None:
    """Two tests of one file are one unit of work (its module worker starts once); two files
    are two."""
    a = _scope("tests/integration/test_cancel.py::test_one")
    assert a == _scope("tests/integration/test_cancel.py::TestX::test_two[p-1]")
    assert a != _scope("tests/integration/test_passes.py::test_one")


def test_every_fault_test_is_in_one_scope() -> None:
    """tests/faults runs in one process, one test after another, whatever its file."""
    assert _scope("tests/faults/test_rabbitmq.py::test_a") == _scope(
        "tests/faults/test_sentinel.py::test_b[kill]"
    )
    assert _scope("tests/faults/test_rabbitmq.py::test_a") != _scope(
        "tests/hostile/test_faults_like.py::test_a"
    )


def test_each_xdist_worker_takes_its_own_pair_of_shared_databases() -> None:
    """gw0 keeps N (its workers N-1), gw1 N+2, gw2 N+4: no two processes flush the same one."""
    url = "redis://127.0.0.1:6379/7"
    assert [_shared_db(url, k) for k in range(3)] == [
        "redis://127.0.0.1:6379/7",
        "redis://127.0.0.1:6379/9",
        "redis://127.0.0.1:6379/11",
    ]


def test_from_database_0_no_two_xdist_workers_share_a_database() -> None:
    """Database 0's workers use 1, so gw1 takes 3 (workers 2), gw2 5 (workers 4)."""
    from tests.support.workers import url_db, worker_db

    dbs = [url_db(_shared_db("redis://127.0.0.1:6379/0", k)) for k in range(3)]
    assert dbs == [0, 3, 5]
    pairs = [{db, worker_db(db)} for db in dbs if db is not None]
    assert len(set().union(*pairs)) == 6


def test_a_shared_url_without_room_or_without_a_database_is_a_usage_error() -> None:
    """Database 15 is the last of a default Redis; a URL with no /N names none to move."""
    with pytest.raises(pytest.UsageError, match="would need database 17"):
        _shared_db("redis://127.0.0.1:6379/13", 2)
    with pytest.raises(pytest.UsageError, match="must end in /N"):
        _shared_db("redis://127.0.0.1:6379", 1)
