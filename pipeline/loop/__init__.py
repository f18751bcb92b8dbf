"""The critique loop: its stages, the decisions between them, and the mechanisms they use.

This room holds what a pass does, in the order it does it: :mod:`~.stages` (the state types, the
four stages ``l0 → critic → decide → repair`` and the broker-free loop that only sequences them;
the Celery chain in ``workers/`` wires the same stages across workers), the decisions
(:mod:`~.convergence`: ``decide_round``, the one round decision; :mod:`~.gates`: may the manager
complete or delegate again), the mechanisms one stage each uses (:mod:`~.admission`,
:mod:`~.critique_cache`, :mod:`~.repair` and :mod:`~.repair_sizing`, :mod:`~.defect_diff`,
:mod:`~.pitfalls`: what a critique teaches pattern memory, the Known Pitfalls lines and
``lessons.md``) and :mod:`~.ab`, the A/B experiment that measures what the loop is worth. It may
use every other room (the contract, the critics, the LLM interface, the records, the store's
protocols and pure keys) but never a Redis implementation of the store, never
``pipeline.wiring`` (the composition root hands the loop its critic, reviser and stores), and
never redis, celery, kombu or litellm (``tests/unit/test_layering.py``): the whole loop runs in
a plain function without a broker. It is the top floor: no other room imports it (but for type
annotations, ``tests/unit/test_rooms.py``), so what it shares with a lower room (the prompts,
the token arithmetic, pattern memory's text rules, the run's score summary, the cache's stored
entry) lives in that room. Each name is imported from its module: this package re-exports
nothing.
"""
