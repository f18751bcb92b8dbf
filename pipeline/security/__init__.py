"""The product's defences, each in plain code that never trusts its input.

This room holds what stands between hostile bytes and a verdict: :mod:`~.signing` (HMAC
signatures on broker messages and stored records, ``CRITIQUE_SECRET``), :mod:`~.message_checks`
(what a task message must look like before kombu or Celery reads it: the broker door's
checks), :mod:`~.posture` (which keys the fleet requires, so a sender is refused at the door),
:mod:`~.injection` (the prompt-injection scan), :mod:`~.redaction` (secrets out of error text)
and :mod:`~.sandbox` (the command critic's confinement). It builds only on the foundations
(``pipeline.errors``, ``models``, ``settings``), on :mod:`pipeline.text` and on two leaves
(the model policy's key list, the archive directory's path); it must not import the loop,
the critics, the store, the wiring, nor redis, celery, kombu or litellm
(``tests/unit/test_layering.py``). Each name is imported from its module: this package
re-exports nothing.
"""
