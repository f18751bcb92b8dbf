"""Run state behind small protocols: pattern memory, the repair-budget semaphore, the trace.

The protocols are in :mod:`pipeline.store.base`; :mod:`pipeline.store.memory` holds in-process
implementations (the broker-free runner and unit tests); the Redis implementations come with the
distributed shape and honour the same protocols. Each name is imported from its module (this
package re-exports nothing).
"""
