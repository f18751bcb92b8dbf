"""Results are stored packed (zlib) once sealed: what packs, what stays plain, and what a
forged packed record (garbage, a decompression bomb) reads as."""

from __future__ import annotations

import base64
import json
import zlib

from pipeline.models import CritiqueEnvelope, CritiqueResult
from pipeline.store.base import encode_event
from pipeline.store.packing import PACK_MIN, UNPACK_MAX, pack_event, pack_record, unpack

RECORD = json.dumps({"run_id": "r1", "output": "Sales rose 4% in Q3. " * 40, "sig": "x" * 70})


def test_a_long_record_packs_smaller_and_unpacks_to_the_same_json() -> None:
    """Bytes for a binary client, shorter than the JSON, and back to the same text."""
    packed = pack_record(RECORD)
    assert isinstance(packed, bytes) and len(packed) < len(RECORD) / 3
    assert unpack(packed) == RECORD


def test_a_text_client_gets_a_prefixed_base64_form_that_unpacks() -> None:
    """A client that decodes replies stores ``z:`` + base64 (still shorter than the JSON)."""
    packed = pack_record(RECORD, binary=False)
    assert isinstance(packed, str) and packed.startswith("z:") and len(packed) < len(RECORD)
    assert unpack(packed) == RECORD
    assert unpack(packed.encode()) == RECORD  # read back through a binary client


def test_a_short_record_is_stored_as_it_is() -> None:
    """Under PACK_MIN bytes zlib would not pay: the JSON itself, read back unchanged."""
    short = json.dumps({"a": 1})
    assert len(short) < PACK_MIN and pack_record(short) == short
    assert unpack(short) == short and unpack(short.encode()) == short


def test_plain_json_written_by_an_older_version_reads_as_it_is() -> None:
    """Unpacked records (bytes or text) pass through: nothing stored before packing is lost."""
    assert unpack(RECORD.encode()) == RECORD and unpack(RECORD) == RECORD


def test_garbage_that_claims_to_be_packed_is_unreadable_not_an_error() -> None:
    """Bytes that are not a zlib stream, a truncated stream and bad base64 read as None."""
    assert unpack(b"\x78\x9cnot zlib at all") is None
    assert unpack(zlib.compress(RECORD.encode())[:-6]) is None
    assert unpack("z:***not base64***") is None


def test_a_decompression_bomb_is_refused_past_the_unpack_limit() -> None:
    """A forged record that would expand past UNPACK_MAX is unreadable (no memory blow-up)."""
    bomb = zlib.compress(b"{" + b" " * (UNPACK_MAX + 1024), 9)
    assert len(bomb) < 200_000
    assert unpack(bomb) is None
    assert unpack("z:" + base64.b64encode(bomb).decode()) is None


EVENT = (
    '{"type":"stage","stage":"critic","worker_id":"analyst_02","iteration":1,"round":1,'
    '"pass_id":"0f3a9c2b7d1e4a56","critic":"heuristic","score":0.8,"defects":1,"tokens":0,'
    '"l0_skipped_critic":false,"elapsed_ms":0.547}'
)


def test_a_trace_event_packs_to_under_half_and_unpacks_to_the_same_json() -> None:
    """The event dictionary makes a typical stage event less than half its JSON."""
    packed = pack_event(EVENT)
    assert isinstance(packed, bytes) and packed[:1] == b"\x01"
    assert len(packed) < len(EVENT) / 2
    assert unpack(packed) == EVENT
    as_text = pack_event(EVENT, binary=False)
    assert isinstance(as_text, str) and unpack(as_text) == EVENT


def test_an_event_packs_to_the_bytes_of_the_largest_deflate_memory() -> None:
    """The packer's small zlib memory level costs no byte: the same packed event as memLevel
    9, zlib's largest (what earlier versions allocated per event)."""
    from pipeline.store.packing import _EVENT_DICT_V1

    for event in (EVENT, EVENT.replace('"defects":1', '"defects":12,"note":"' + "x y " * 60 + '"')):
        deflate = zlib.compressobj(
            9, zlib.DEFLATED, -15, 9, zlib.Z_DEFAULT_STRATEGY, _EVENT_DICT_V1
        )
        data = event.encode()
        assert pack_event(event) == b"\x01" + deflate.compress(data) + deflate.flush()


def test_an_event_that_would_not_shrink_is_stored_as_it_is() -> None:
    """A tiny event: the JSON itself."""
    assert pack_event('{"a":1}') == '{"a":1}'


def test_a_packed_event_past_its_limit_is_unreadable() -> None:
    """The limit a reader gives bounds an event too (the trace reader gives 1 MiB)."""
    big = '{"note":"' + "x" * 5000 + '"}'
    assert unpack(pack_event(big), limit=1000) is None
    assert unpack(pack_event(big)) == big


def test_an_unchecked_result_and_its_event_with_no_scores_pack_and_unpack() -> None:
    """A result with None scores round-trips packed, and its result event (null scores, words
    outside the frozen event dictionary) still packs to under half its JSON."""
    result = CritiqueResult(
        run_id="q3-sales",
        worker_id="analyst_02",
        status="unchecked",
        stop_reason="disabled",
        output="# Q3 report\n\nTODO: fill in the numbers. " * 8,
        original_score=None,
        best_score=None,
        envelope=CritiqueEnvelope(worker_id="analyst_02", score=0.0, critic="disabled"),
        pass_id="0f3a9c2b7d1e4a56",
    )
    stored = unpack(pack_record(result.model_dump_json()))
    assert stored is not None and CritiqueResult.model_validate_json(stored) == result
    event = encode_event(result.trace_event(round=0, stage="gate"))
    assert '"best_score":null' in event and '"status":"unchecked"' in event
    packed = pack_event(event)
    assert len(packed) < len(event) / 2 and unpack(packed) == event
