"""Step ids are built and taken apart by one pair of functions (``pipeline.store.keys``)."""

from __future__ import annotations

import pytest

from pipeline.models import PassRef
from pipeline.store import keys
from pipeline.store.runs import completion_member


def test_a_step_id_parses_back_to_its_parts() -> None:
    """parse_step_id(step_id(...)) gives back the pass, round, attempt and stage it was built of."""
    member = PassRef("r1", 3, "w-1", "abc123").member
    step = keys.step_id(member, 2, 1, "critic")
    assert step == "3:w-1:abc123:2:1:critic"
    assert keys.parse_step_id(step) == keys.StepId(member, 2, 1, "critic")


@pytest.mark.parametrize(
    "step",
    [
        completion_member("req-1"),  # a completion gate's step: outside any pass
        "3:w-1:abc123:2:critic",  # a part missing
        "3:w-1:abc123:two:1:critic",  # a round that is no number
        "3:w-1:abc123:2:1:critic:extra",
    ],
)
def test_other_step_ids_are_none(step: str) -> None:
    """A completion gate's step id and malformed ones are not a pass's step: None."""
    assert keys.parse_step_id(step) is None
