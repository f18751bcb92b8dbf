"""Critics (one protocol, several implementations) and the revisers that pair with them."""

from pipeline.critics.base import Critic, Refusal, Reviser, RevisionResult, merge_l0
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
from pipeline.critics.llm import (
    EnvelopeParseError,
    LLMCritic,
    LLMReviser,
    PairedCritic,
    build_critic_messages,
    detect_injection,
    parse_envelope,
)
from pipeline.critics.rubric import (
    DeterministicReviser,
    Paper,
    RubricCritic,
    make_deterministic_pair,
    parse_paper,
    score_paper,
)

__all__ = [
    "Critic",
    "DeterministicReviser",
    "EnvelopeParseError",
    "HeuristicCritic",
    "HeuristicReviser",
    "LLMCritic",
    "LLMReviser",
    "PairedCritic",
    "Paper",
    "Refusal",
    "Reviser",
    "RevisionResult",
    "RubricCritic",
    "build_critic_messages",
    "detect_injection",
    "make_deterministic_pair",
    "merge_l0",
    "parse_envelope",
    "parse_paper",
    "score_paper",
]
