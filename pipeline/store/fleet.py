"""The fleet's posture in Redis (:mod:`pipeline.security.posture`): one hash, one field per worker.

``<prefix>:fleet:posture`` (:data:`pipeline.store.keys.FLEET_POSTURE`) maps each worker's node
name to its :class:`~pipeline.security.posture.WorkerPosture` as JSON. Every worker writes its own
field on each sweeper tick (:mod:`workers.recovery.sweeper`) and removes it as it stops, drops the
fields of workers gone quiet, and keeps the hash alive as long as the freshest record: a fleet with
no live worker leaves no posture, and clients proceed as they did before postures existed. A reader
keeps only the records that parse and are still current; one key, read alone (one cluster slot).
"""

from __future__ import annotations

import json
import logging

from pipeline.security.posture import WorkerPosture
from pipeline.store import keys
from pipeline.store.redis_common import StoreClient, resolve_prefix, store_errors, text

log = logging.getLogger(__name__)


class RedisFleetPosture:
    """Publish this worker's posture; read the fleet's."""

    def __init__(self, client: StoreClient, *, prefix: str | None = None) -> None:
        self._r = client
        self._key = keys.shared_key(keys.FLEET_POSTURE, resolve_prefix(prefix))

    def publish(self, posture: WorkerPosture) -> None:
        """Write ``posture`` under its worker, drop records no longer current, and keep the
        hash as long as the freshest one (two round trips)."""
        with store_errors(self._r):
            pipe = self._r.pipeline(transaction=False)
            pipe.hset(self._key, posture.worker, posture.model_dump_json())
            pipe.hgetall(self._key)
            _, raw = pipe.execute()
            now = posture.seen
            stale, keep_s = [], posture.fresh_s
            for field, value in raw.items():
                got = _parse(value)
                if got is None or not got.live(now):
                    stale.append(text(field))
                else:
                    keep_s = max(keep_s, got.seen + got.fresh_s - now)
            pipe = self._r.pipeline(transaction=False)
            if stale:
                pipe.hdel(self._key, *stale)
            pipe.pexpire(self._key, max(1, int(keep_s * 1000)))
            pipe.execute()

    def withdraw(self, worker: str) -> None:
        """Remove ``worker``'s record (it stops: it requires nothing any more)."""
        with store_errors(self._r):
            self._r.hdel(self._key, worker)

    def read(self, now: float) -> list[WorkerPosture]:
        """The postures still current at ``now``, ordered by worker."""
        with store_errors(self._r):
            raw = self._r.hgetall(self._key)
        got = (_parse(value) for value in raw.values())
        return sorted((p for p in got if p is not None and p.live(now)), key=lambda p: p.worker)


def _parse(raw: bytes | str) -> WorkerPosture | None:
    """A stored posture, or None (logged) for one that does not parse."""
    try:
        return WorkerPosture.model_validate(json.loads(raw))
    except ValueError as exc:
        log.warning("ignoring a malformed fleet posture record: %s", str(exc)[:200])
        return None
