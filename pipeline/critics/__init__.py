"""Critics (one protocol, several implementations) and the revisers that pair with them.

The token-free critics are re-exported here. The LLM critics are not: import them from
:mod:`pipeline.critics.llm` (with their prompts in :mod:`pipeline.critics.llm_prompts` and
reply parsing in :mod:`pipeline.critics.llm_reply`), so that importing this package never
loads the model-calling code.
"""

from pipeline.critics.base import Critic, Refusal, Reviser, RevisionResult, merge_l0
from pipeline.critics.heuristic import HeuristicCritic, HeuristicReviser
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
    "HeuristicCritic",
    "HeuristicReviser",
    "Paper",
    "Refusal",
    "Reviser",
    "RevisionResult",
    "RubricCritic",
    "make_deterministic_pair",
    "merge_l0",
    "parse_paper",
    "score_paper",
]
