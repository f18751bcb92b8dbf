"""The worker harness moved to :mod:`tests.support.workers`; this name stays for the callers
outside tests/ (bench/) and for branches written before the move."""

from tests.support.workers import (
    ACCEPTING_CRITIQUE,
    ROOT,
    WorkerProcess,
    client_on,
    worker_db_url,
    worker_env,
)

__all__ = [
    "ACCEPTING_CRITIQUE",
    "ROOT",
    "WorkerProcess",
    "client_on",
    "worker_db_url",
    "worker_env",
]
