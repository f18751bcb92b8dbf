"""Doors for the managers people write today: each a thin translation onto the public API of
:class:`workers.client.CritiqueClient` or :class:`workers.aclient.AsyncCritiqueClient`, its
framework imported only in its own module (an optional extra of the same name), and what they
share written once in :mod:`workers.adapters.verdicts` (the verdict → framework mapping, outputs
to submissions and back, the mode's configuration, one asyncio client per event loop).

- :mod:`workers.adapters.awp`: AWP's delegation loop (``awp-agents``), its ``CritiqueEngine``
  served by the fleet (``critique awp run …`` or :func:`workers.adapters.awp.install`).
- :mod:`workers.adapters.langgraph`: :class:`~workers.adapters.langgraph.CritiqueNode`, the
  critique fan-in of a LangGraph ``Send`` fan-out.
- :mod:`workers.adapters.openai_agents`: output and tool output guardrails for the OpenAI
  Agents SDK (:class:`~workers.adapters.openai_agents.CritiqueGuardrails`).
- :mod:`workers.adapters.pydantic_ai`: a Pydantic AI output validator
  (:class:`~workers.adapters.pydantic_ai.CritiqueValidator`).
- :mod:`workers.adapters.mcp_server`: the fleet's tools as an MCP server (``critique mcp``).
"""
