"""The deterministic rubric critic (five dimensions) and its append-style reviser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import RubricConfig
from pipeline.critics.rubric import (
    DeterministicReviser,
    RubricCritic,
    make_deterministic_pair,
    parse_paper,
    score_paper,
)
from pipeline.errors import ConfigError, SubmissionError
from pipeline.models import Submission, Usage

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "paper_draft.json"


def _paper(**kw: Any) -> dict[str, Any]:
    paper: dict[str, Any] = {
        "title": "Graph Kernels",
        "abstract": "An abstract.",
        "originality_tag": "low",
        "sections": [],
    }
    paper.update(kw)
    return paper


def _section(pass_id: str, title: str, body: str, figs: int = 0, cites: int = 0) -> dict[str, Any]:
    return {
        "id": pass_id,
        "title": title,
        "body": body,
        "figure_refs": [f"f{i}" for i in range(figs)],
        "cites": [f"c{i}" for i in range(cites)],
    }


def _sub(output: dict[str, Any] | str) -> Submission:
    return Submission(run_id="run-1", worker_id="w1", task="Write the paper.", output=output)


def test_reference_values_of_each_dimension() -> None:
    """clarity 3+len/50, novelty by tag, evidence 2+2f+1.5c, method/related 9 with a body."""
    paper = _paper(
        originality_tag="high",
        sections=[
            _section("a", "Methods and Data", "x" * 100, figs=1, cites=2),
            _section("b", "  related   WORK ", "y" * 300, figs=1),
        ],
    )
    assert score_paper(parse_paper(paper)) == {
        "clarity": 7.0,
        "novelty": 9.0,
        "evidence": 9.0,
        "methodology": 9.0,
        "related_work": 9.0,
    }


def test_low_values_and_clamping() -> None:
    """Empty method body scores 4, no related work 4, medium tag 6; clarity/evidence cap at 10."""
    paper = _paper(
        originality_tag="medium",
        sections=[
            _section("m", "Method", "   "),
            _section("r", "Results", "z" * 1000, figs=3, cites=3),
        ],
    )
    scores = score_paper(parse_paper(paper))
    assert scores == {
        "clarity": 10.0,
        "novelty": 6.0,
        "evidence": 10.0,
        "methodology": 4.0,
        "related_work": 4.0,
    }
    assert score_paper(parse_paper(_paper()))["clarity"] == 3.0


def test_envelope_scores_suggestions_and_defects() -> None:
    """Each dimension below target gives one suggestion and one rubric warning defect."""
    draft = json.loads(FIXTURE.read_text())
    critic = RubricCritic()
    env = critic.critique(_sub(draft), draft, pitfalls="", round=1)
    assert set(env.scores) == {"clarity", "novelty", "evidence", "methodology", "related_work"}
    assert env.score == pytest.approx(sum(env.scores.values()) / 50)
    assert {s.dimension for s in env.suggestions} == set(env.scores)
    assert all(
        (d.severity, d.source, d.category) == ("warning", "rubric", "incomplete")
        for d in env.defects
    )
    assert len(env.defects) == 5
    assert env.critic == "rubric"
    assert env.usage == Usage()  # token-free: the text it read is not usage


def test_dimensions_at_target_give_no_suggestion() -> None:
    """A dimension at or above target is not suggested (target is inclusive)."""
    paper = _paper(originality_tag="high", sections=[_section("a", "Intro", "x" * 250)])
    env = RubricCritic(RubricConfig(target_score=8.0)).critique(
        _sub(paper), paper, pitfalls="", round=1
    )
    assert env.scores["clarity"] == 8.0
    assert {s.dimension for s in env.suggestions} == {"evidence", "methodology", "related_work"}


def test_weights_change_the_score() -> None:
    """Score is the weighted mean / 10 with the configured weights."""
    paper = _paper(originality_tag="high")
    rubric = RubricConfig(weights={"novelty": 3.0})
    env = RubricCritic(rubric).critique(_sub(paper), paper, pitfalls="", round=1)
    # clarity 3, novelty 9 (×3), evidence 2, methodology 4, related_work 4 → 40 / 7
    assert env.score == pytest.approx(40 / 7 / 10, abs=1e-6)


def test_reviser_raises_every_suggested_dimension_and_keeps_other_keys() -> None:
    """Applying the suggestions raises each suggested dimension; unknown keys stay as they were."""
    draft = json.loads(FIXTURE.read_text())
    draft["venue"] = "ACL"
    draft["sections"][0]["notes"] = "keep me"
    critic, reviser = make_deterministic_pair()
    sub = _sub(draft)
    env = critic.critique(sub, draft, pitfalls="", round=1)
    result = reviser.revise(sub, draft, env, pitfalls="", attempts=())
    assert result.suggestions_applied == 5
    revised = result.output
    assert isinstance(revised, dict)
    before, after = env.scores, score_paper(parse_paper(revised))
    assert all(after[d] > before[d] for d in before)
    assert revised["venue"] == "ACL"
    assert revised["sections"][0]["notes"] == "keep me"
    assert revised["title"] == draft["title"]
    assert draft["originality_tag"] == "low"  # the input is not mutated
    assert result.usage == Usage()  # token-free: the text it wrote is not usage


def test_reviser_fills_an_empty_method_body_instead_of_adding_a_section() -> None:
    """A Method section with an empty body gets a body; no second Method section appears."""
    paper = _paper(sections=[_section("m", "Methodology", "")])
    critic, reviser = make_deterministic_pair()
    env = critic.critique(_sub(paper), paper, pitfalls="", round=1)
    revised = reviser.revise(_sub(paper), paper, env, pitfalls="", attempts=()).output
    assert isinstance(revised, dict)
    methods = [s for s in revised["sections"] if s["title"].lower().startswith("method")]
    assert len(methods) == 1 and methods[0]["body"]


def test_json_string_output_is_accepted() -> None:
    """The critic and reviser accept the paper as a JSON string too."""
    text = FIXTURE.read_text()
    critic, reviser = make_deterministic_pair()
    env = critic.critique(_sub(text), text, pitfalls="", round=1)
    assert env.scores["novelty"] == 3.0
    assert isinstance(reviser.revise(_sub(text), text, env, pitfalls="", attempts=()).output, dict)


@pytest.mark.parametrize(
    ("output", "fragment"),
    [
        ("not json at all", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"title": "t"}, "sections"),
        ({"title": "t", "sections": [], "originality_tag": "huge"}, "originality_tag"),
        ({"title": "t", "sections": [{"title": "no id"}]}, "sections.0.id"),
    ],
)
def test_not_a_paper_is_a_clear_submission_error(output: Any, fragment: str) -> None:
    """Outputs that are not papers raise SubmissionError naming what is wrong."""
    with pytest.raises(SubmissionError, match="not a paper") as info:
        RubricCritic().critique(_sub("x"), output, pitfalls="", round=1)
    assert fragment in str(info.value)


def test_unknown_dimension_is_a_config_error() -> None:
    """The deterministic critic refuses dimensions it cannot score."""
    with pytest.raises(ConfigError, match="style"):
        RubricCritic(RubricConfig(dimensions=("clarity", "style")))


def test_reviser_ignores_suggestions_without_a_known_target() -> None:
    """A suggestion for a section id that does not exist changes nothing."""
    paper = _paper(sections=[_section("a", "Intro", "short")])
    env = RubricCritic().critique(_sub(paper), paper, pitfalls="", round=1)
    bogus = env.model_copy(
        update={
            "suggestions": tuple(
                s.model_copy(update={"target_section": "nope"})
                for s in env.suggestions
                if s.dimension == "clarity"
            )
        }
    )
    result = DeterministicReviser().revise(_sub(paper), paper, bogus, pitfalls="", attempts=())
    assert result.suggestions_applied == 0
    assert result.output == paper
