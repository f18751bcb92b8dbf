"""Fixtures for the hostile-input suite: a real worker and Redis, attacked as a client would.

A module that declares ``WORKER = HOSTILE_WORKER`` (``tests.support.hostile``) gets one worker
process (threads pool) from the ``worker`` fixture, on the workers' database, started with
``CRITIQUE_SECRET`` set as every deploy sets it (:func:`hostile_env`), and this process's client
pointed at the same database with the same secret. Tests attack through the client, the CLI, or
raw broker messages (``send_raw``), then assert the refusal, its message, and that the worker is
still alive and an honest submission sent afterwards still gets its result
(``assert_still_serving``, which :func:`still_serving` runs after every test that used the
worker).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.fakes.openai_server import FakeOpenAIServer
from tests.support.hostile import SECRET, assert_still_serving, llm_worker_env
from tests.support.provider_keys import Listener
from tests.support.workers import WorkerProcess, client_on, worker_db_url


@pytest.fixture(scope="module")
def hostile_url(redis_url: str) -> str:
    """The workers' database (the one below the test database)."""
    return worker_db_url(redis_url)


@pytest.fixture
def r(hostile_url: str) -> Iterator[redis.Redis]:
    """A raw client of the workers' Redis, as a manager's (or an attacker's) own connection."""
    client = redis.Redis.from_url(hostile_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def hostile_env(hostile_url: str) -> Iterator[dict[str, str]]:
    """This process's client pointed at the workers' database, with the deploy secret."""
    with client_on(
        hostile_url,
        CRITIQUE_SECRET=SECRET,
        CRITIQUE_LLM_API_KEY="sk-worker-secret-key",
        CRITIQUE_STALL_S="600",
        # The signing tests read finished passes' step records (the messages workers sent on).
        CRITIQUE_STEPS_GRACE_S="600",
    ) as env:
        yield env


@pytest.fixture(scope="module")
def module_llm() -> Iterator[FakeOpenAIServer]:
    """One fake OpenAI-compatible server for a whole module: its worker reads the LLM endpoint
    from its environment once, when it starts (tests reset it, and set its answers)."""
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture(scope="module")
def llm_env(
    hostile_env: dict[str, str], module_llm: FakeOpenAIServer, request: pytest.FixtureRequest
) -> Iterator[dict[str, str]]:
    """The environment of a module's worker (``WorkerSpec(..., env_fixture="llm_env")``) whose
    LLM transport the operator's environment sets: :func:`module_llm`'s address and short
    timeouts, with the module's ``LLM_MODELS`` as allowed_models (there and in this process's
    client)."""
    with llm_worker_env(hostile_env, module_llm.api_base, request.module.LLM_MODELS) as env:
        yield env


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    """The local server an attacker would aim a submission's model at."""
    with FakeOpenAIServer() as server:
        yield Listener(server)


@pytest.fixture(autouse=True)
def still_serving(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the module's worker: the worker is alive and an honest
    submission sent after the attack still gets its accepted result."""
    worker: WorkerProcess | None = (
        request.getfixturevalue("worker") if "worker" in request.fixturenames else None
    )
    yield
    if worker is not None:
        assert_still_serving(worker)
