"""Run state behind small protocols: pattern memory, the repair-budget semaphore, the trace.

``memory`` holds in-process implementations (the broker-free runner and unit tests); the Redis
implementations come with the distributed shape and honour the same protocols.
"""

from pipeline.store.base import BudgetLedger, PatternStore, TraceSink
from pipeline.store.memory import MemoryBudgetLedger, MemoryPatternStore, MemoryTraceSink

__all__ = [
    "BudgetLedger",
    "MemoryBudgetLedger",
    "MemoryPatternStore",
    "MemoryTraceSink",
    "PatternStore",
    "TraceSink",
]
