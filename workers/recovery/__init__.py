"""How workers ride out faults: a lost broker connection, a lost message, a dead holder, a
stalled chain. One module per mechanism, each name imported from its own module (this package
re-exports nothing):

- :mod:`workers.recovery.redriving`: re-driving a pass from its last recorded step, by the stall
  rule (any broker) or by the one rule that proves its message lost, on the broker's evidence
  (Redis: its ``unacked`` hash; RabbitMQ: a census), claimed atomically and given up on after a
  few tries. Also what ``CritiqueClient.resume`` calls
  (a client's ``wait`` only waits).
- :mod:`workers.recovery.census`: the evidence on RabbitMQ: the workers' reports of what they
  hold and the queues' ready and consumer counts (a census), and how it judges a pass.
- :mod:`workers.recovery.sweeper`: the thread in every worker process that reports the messages
  it holds, restores those a dead worker held, sends the queue-drain probes and sweeps the
  pending passes (the :class:`~workers.recovery.sweeper.Sweeper` bootstep starts it).
- :mod:`workers.recovery.transport`: kombu's Redis and Sentinel transports with the
  connection-loss guard, the reconnecting consumer, the threads pool that ends a request whose
  error escaped its task body, the view of a Redis broker's unacknowledged messages, and of a
  RabbitMQ broker's queue counts and this worker's consumer.
- :mod:`workers.recovery.base`: the settings, timing constants and stores they all share.

The dotted paths Celery is given name the mechanism modules:
``workers.recovery.transport:RedisTransport``, ``:SentinelTransport``, ``:Consumer`` and
``:ThreadPool``, and ``workers.recovery.sweeper:Sweeper``. See docs/operations.md, "What
survives what".
"""
