"""The product's defences, each in plain code that never trusts its input.

This room holds what stands between hostile bytes and a verdict: :mod:`~.signing` (HMAC
signatures on broker messages and stored records, ``CRITIQUE_SECRET``), :mod:`~.message_checks`
(what a task message must look like before kombu or Celery reads it: the broker door's
checks), :mod:`~.posture` (which keys the fleet requires, so a sender is refused at the door),
:mod:`~.injection` (the prompt-injection scan), :mod:`~.pattern_text` (what pattern memory may
store: structure, never the worker's words), :mod:`~.redaction` (secrets out of error text),
:mod:`~.model_policy` (which models a submission may name, where the product's key may go) and
:mod:`~.sandbox` (the command critic's confinement). It builds only on the foundations
(``pipeline.errors``, ``models``, ``settings``), on :mod:`pipeline.text` and on one leaf (the
archive directory's path, which the sandbox hides); it must not import the loop, the critics,
the LLM calls, the store, the wiring, nor redis, celery, kombu or litellm
(``tests/unit/test_layering.py``). Each name is imported from its module: this package
re-exports nothing.
"""
