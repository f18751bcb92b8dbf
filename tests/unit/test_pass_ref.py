"""PassRef: a submission pass's identity and its two string forms in the run's hashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.models import PassRef, check_identifier


def test_both_string_forms_and_the_round_trip() -> None:
    ref = PassRef("run-1", 3, "w-1", "abc123")
    assert ref.field == "3:w-1" == PassRef.field_of(3, "w-1")
    assert ref.member == "3:w-1:abc123" == PassRef.member_of(ref.field, "abc123")
    assert PassRef.parse("run-1", ref.member) == ref


@pytest.mark.parametrize(
    "member",
    ["", "3", "3:w", "3:w:p:x", "x:w:p", "-1:w:p", ":w:p", "²:w:p", "1.0:w:p"],
)
def test_the_parser_refuses_what_no_pass_member_is(member: str) -> None:
    assert PassRef.parse("run-1", member) is None


def test_identifiers_hold_no_colon() -> None:
    with pytest.raises(ValueError):
        check_identifier("w:1", "worker_id")


@given(
    iteration=st.integers(min_value=0),
    worker_id=st.text(),
    pass_id=st.text(),
)
def test_a_ref_never_parses_back_as_another(iteration: int, worker_id: str, pass_id: str) -> None:
    ref = PassRef("run-1", iteration, worker_id, pass_id)
    assert PassRef.parse("run-1", ref.member) in (ref, None)
    if ":" in worker_id or ":" in pass_id:
        assert PassRef.parse("run-1", ref.member) is None
