"""Run state behind small protocols: pattern memory, the repair-budget semaphore, the trace.

The protocols are in :mod:`pipeline.store.base`; the Redis implementations (their Lua scripts)
are each rule's one source; :mod:`pipeline.store.memory` holds in-process versions of only what
the broker-free ``critique loop`` calls, checked against the Redis ones by the same cases
(tests/integration/test_store_protocols.py); :mod:`pipeline.store.lru` is the bounded map behind
a worker's per-configuration caches. Each name is imported from its module (this package
re-exports nothing).
"""
