"""Model calls: the completion interface, its litellm implementation, provider keys, tokens.

This room holds what talks to a model, behind one injected callable: :mod:`~.completion` (the
``Completer`` protocol, the request and reply values, and ``LiteLLMCompleter``, the only
completer that reaches litellm), :mod:`~.providers` (provider API keys, and how litellm is
loaded: inside a function, never at module level) and :mod:`~.tokens` (token estimates for
sizing, and the canonical text of an output). It builds on the foundations (``pipeline.config``,
``errors``, ``models``, ``settings``) and on :mod:`pipeline.security` (the model policy and
redaction); it must not import the critics, the loop, the store or the wiring, and nothing here
imports litellm, redis, celery or kombu at module level (``tests/unit/test_layering.py``), so
a process that never calls a model never loads litellm. Each name is imported from its module:
this package re-exports nothing.
"""
