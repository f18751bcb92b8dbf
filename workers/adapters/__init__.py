"""Doors for the managers people write today: each a thin translation onto
:class:`workers.client.CritiqueClient` (its public API only), its framework imported only in its
own module (an optional extra), and the verdict → framework mapping written once
(:mod:`workers.adapters.verdicts`).

- :mod:`workers.adapters.awp`: AWP's delegation loop (``awp-agents``), its ``CritiqueEngine``
  served by the fleet (``critique awp run …`` or :func:`workers.adapters.awp.install`).
"""
