"""How workers ride out faults: a lost broker connection, a lost message, a dead holder, a
stalled chain. One module per mechanism:

- :mod:`workers.recovery.redriving`: re-driving a pass from its last recorded step, by the stall
  rule (any broker) or by the proof that its message is lost (Redis and RabbitMQ brokers),
  claimed atomically and given up on after a few tries. Also what ``CritiqueClient.resume`` and
  ``wait`` call.
- :mod:`workers.recovery.census`: the proof on RabbitMQ: the workers' reports of what they hold
  and the queues' ready and consumer counts (a census), and the rule that proves a pass lost.
- :mod:`workers.recovery.sweeper`: the thread in every worker process that reports the messages
  it holds, restores those a dead worker held, sends the queue-drain probes and sweeps the
  pending passes (the :class:`Sweeper` bootstep starts it).
- :mod:`workers.recovery.transport`: kombu's Redis and Sentinel transports with the
  connection-loss guard, the reconnecting consumer, the threads pool that ends a request whose
  error escaped its task body, the view of a Redis broker's unacknowledged messages, and of a
  RabbitMQ broker's queue counts and this worker's consumer.
- :mod:`workers.recovery.base`: the settings, timing constants and stores they all share.

Every name other modules use is importable from here, and the dotted paths Celery is given
(``workers.recovery:RedisTransport``, ``:SentinelTransport``, ``:Consumer``, ``:ThreadPool``,
``:Sweeper``) resolve here. See docs/operations.md, "What survives what".
"""

from __future__ import annotations

from workers.recovery.base import (
    DEFAULT_SWEEP_S,
    LOST_GRACE_S,
    LOST_MARGIN_S,
    MAX_RESUMES,
    MAX_RESUMES_ENV,
    STALL_ENV,
    SWEEP_BATCH,
    SWEEP_ENV,
    RecoveryStores,
    Snapshot,
    default_stores,
    max_resumes,
    register,
    stall_after_s,
    stores_on,
    sweep_interval_s,
)
from workers.recovery.census import (
    Census,
    CensusLook,
    CensusStore,
    ConsumerReport,
    QueueCount,
    judge_census,
)
from workers.recovery.redriving import (
    FINISHED,
    DrainView,
    QueueCache,
    RedriveContext,
    drained_for_proof,
    is_stalled,
    judge,
    redrive,
    redrive_if_lost,
    redrive_if_lost_on_census,
    redrive_if_stalled,
)
from workers.recovery.sweeper import (
    Sweeper,
    SweeperThread,
    held_pass_ids,
    held_tags,
    orphans,
    probe,
    send_probes,
    sweep,
    take_census,
)
from workers.recovery.transport import (
    CONSUMING,
    AmqpBroker,
    Consumer,
    ConsumerState,
    HeldReport,
    RedisBroker,
    RedisTransport,
    SentinelTransport,
    ThreadPool,
    open_amqp,
    open_broker,
)

__all__ = [
    "CONSUMING",
    "DEFAULT_SWEEP_S",
    "FINISHED",
    "LOST_GRACE_S",
    "LOST_MARGIN_S",
    "MAX_RESUMES",
    "MAX_RESUMES_ENV",
    "STALL_ENV",
    "SWEEP_BATCH",
    "SWEEP_ENV",
    "AmqpBroker",
    "Census",
    "CensusLook",
    "CensusStore",
    "Consumer",
    "ConsumerReport",
    "ConsumerState",
    "DrainView",
    "HeldReport",
    "QueueCache",
    "QueueCount",
    "RecoveryStores",
    "RedisBroker",
    "RedisTransport",
    "RedriveContext",
    "SentinelTransport",
    "Snapshot",
    "Sweeper",
    "SweeperThread",
    "ThreadPool",
    "default_stores",
    "drained_for_proof",
    "held_pass_ids",
    "held_tags",
    "is_stalled",
    "judge",
    "judge_census",
    "max_resumes",
    "open_amqp",
    "open_broker",
    "orphans",
    "probe",
    "redrive",
    "redrive_if_lost",
    "redrive_if_lost_on_census",
    "redrive_if_stalled",
    "register",
    "send_probes",
    "stall_after_s",
    "stores_on",
    "sweep",
    "sweep_interval_s",
    "take_census",
]
