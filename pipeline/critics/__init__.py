"""Critics (one protocol, several implementations) and the revisers that pair with them."""

from pipeline.critics.base import Critic, Reviser, RevisionResult, merge_l0
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
    "Reviser",
    "RevisionResult",
    "RubricCritic",
    "make_deterministic_pair",
    "merge_l0",
    "parse_paper",
    "score_paper",
]
