"""LLM calls (DESIGN habit 6: the LLM is an injected completion callable).

Critics and revisers never import litellm: they take a :class:`Completer` — a callable from an
:class:`LLMRequest` to an :class:`LLMReply` — and the worker hands them the litellm-backed one.
Tests hand them a fake callable, or the real one pointed at a fake OpenAI-compatible server.

Error contract of every completer:

- a transient failure (timeout, 429, 5xx, connection error) is retried inside the completer,
  with exponential backoff and full jitter, at most ``max_retries`` times; when every try failed
  it raises :class:`~pipeline.errors.LLMTransientError` (callers fall back to the heuristic);
- a permanent failure (authentication, bad request, unknown model) raises
  :class:`~pipeline.errors.LLMPermanentError` at once, with a message that says what to fix.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field

from pipeline.models import Frozen, Usage

Purpose = Literal["critic", "repair", "adjudicate"]


class ChatMessage(Frozen):
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str


class LLMRequest(Frozen):
    """One chat completion to make."""

    model: str
    """A litellm model name, e.g. ``openai/gpt-4o-mini`` or ``anthropic/claude-3-5-haiku``."""
    messages: tuple[ChatMessage, ...]
    json_mode: bool = False
    """Ask for a JSON object reply (``response_format``) where the provider supports it."""
    max_tokens: int | None = None
    purpose: Purpose = "critic"
    """What the call is for (logged, and visible to a test's fake server)."""


class LLMReply(Frozen):
    """A completion's text and what it cost."""

    text: str
    usage: Usage = Field(default_factory=Usage)
    """Tokens in/out as the provider reported them, cost from litellm's offline cost map,
    ``calls`` = HTTP attempts made (retries included)."""
    model: str = ""
    retries: int = Field(0, ge=0)
    """Transient failures retried before this reply."""


class Completer(Protocol):
    """Makes one chat completion (retrying transient errors itself)."""

    def __call__(self, request: LLMRequest) -> LLMReply: ...
