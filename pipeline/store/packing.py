"""Compact storage for what a finished output leaves in Redis: results and trace events.

Redis holds a finished output's result and trace for the retention period, so their size is
the store's memory bill. Both are JSON; both are stored packed when that is shorter:

* a **record** (a result, hundreds of bytes to kilobytes): zlib (a stream starting ``0x78``);
* a **trace event** (one small JSON object, ~150-450 bytes, mostly the same keys and words each
  time): raw deflate with a preset dictionary of those keys and words (:data:`_EVENT_DICT_V1`),
  after a version byte ``0x01``. The dictionary is part of the stored format: it never changes;
  a new one gets a new version byte.

A client that decodes replies as text stores the same bytes as ``z:`` + base64. Anything that
starts like JSON is read as it is, so records written before packing stay readable. Unpacking
is bounded (:data:`UNPACK_MAX`): a forged record that would expand past it reads as None.
"""

from __future__ import annotations

import base64
import binascii
import zlib

PACK_MIN = 200
"""Records shorter than this (bytes of JSON) are stored as they are: zlib would not pay."""
UNPACK_MAX = 64 * 1024 * 1024
"""Most bytes a packed record may expand to; a record that would expand past it (a forged
decompression bomb) is treated as unreadable."""
_TEXT_PREFIX = "z:"
"""What a packed value stored as text starts with (a client that decodes responses)."""
_EVENT_MEM_LEVEL = 4
"""zlib's memory level for packing an event: its hash table (memLevel 9: 256 KiB allocated and
cleared per event, ~45 µs) is far larger than an event and the dictionary need; 4 packs the
same bytes in ~7 µs. Not part of the format: inflating does not depend on it."""
_EVENT_V1 = b"\x01"
"""The version byte of an event packed with :data:`_EVENT_DICT_V1`."""
_JSON_START = (b"{", b"[", b" ", b"\n", b"\t", b"\r")

# The words trace events repeat (pipeline.loop.stages's stage, round and result events, the gates'
# events): deflate finds them here instead of spelling them out in every event. Later bytes
# are the cheapest to refer to, so the most common come last. Frozen: see the module doc.
_EVENT_DICT_V1 = (
    b'"gate":"l0","verdict":"reject","l0_check":"","l0_reason":"","evidence":"'
    b'"fixed":[],"remaining":[],"new":[],"regressed":[],"category":"","location":"output:'
    b'"policy_violation","missing_field","format_error","hallucination","needs_model"'
    b'"critic":"heuristic","critic":"rubric","critic":"llm","cache":"hit","lease":"'
    b'"reserved":0,"charged":0,"budget_wait_s":0,"note":"'
    b'"verdict":"continue","verdict":"escalated","verdict":"repaired","escalate_band",'
    b'"stop_reason":null,"stop_reason":"accepted","status":"accepted","status":"escalated",'
    b'"reason":"score 0.00 is in the escalate band (< 0.3)","reason":"repair: 1 critical defect(s)'
    b'"reason":"score \xe2\x89\xa5 0.6 with no critical defect",'
    b'"reason":"score 1.00, no critical defect"'
    b'{"type":"stage","stage":"repair","attempt":1,"reviser":"auto","suggestions_applied":1,'
    b'{"type":"result","stage":"gate","status":"repaired","stop_reason":"accepted","best_score":1.0,'
    b'"original_score":0.0,"attempts":0,"tokens":0,"repair_tokens":0,"budget_charged":0,'
    b'{"type":"round","stage":"decide","score":0.0,"scores":{},"mean":0.0,"defects":0,'
    b'"suggestions_applied":0,"verdict":"accepted","stop_reason":"accepted","reason":"'
    b'{"type":"stage","stage":"critic","critic":"heuristic","score":1.0,"defects":0,"tokens":0,'
    b'"l0_skipped_critic":false,"elapsed_ms":0.'
    b'{"type":"stage","stage":"l0","worker_id":"","iteration":1,"round":0,"pass_id":"'
    b'","defects":0,"errors":0,"warnings":0,"elapsed_ms":0.'
)


def pack_record(raw: str, *, binary: bool = True) -> bytes | str:
    """A JSON record as stored: zlib-compressed when that is shorter (raw bytes, or ``z:`` and
    base64 where the client decodes replies as text); a short record as it is."""
    data = raw.encode("utf-8")
    if len(data) < PACK_MIN:
        return raw
    return _smaller(raw, len(data), zlib.compress(data, 6), binary)


def pack_event(raw: str, *, binary: bool = True) -> bytes | str:
    """One encoded trace event (compact JSON) as stored: deflated with the event dictionary
    when that is shorter, else as it is."""
    data = raw.encode("utf-8")
    deflate = zlib.compressobj(
        9, zlib.DEFLATED, -15, _EVENT_MEM_LEVEL, zlib.Z_DEFAULT_STRATEGY, _EVENT_DICT_V1
    )
    return _smaller(raw, len(data), _EVENT_V1 + deflate.compress(data) + deflate.flush(), binary)


def _smaller(raw: str, size: int, packed: bytes, binary: bool) -> bytes | str:
    """``packed`` as stored (bytes, or ``z:`` + base64 as text) if shorter than ``raw``'s
    ``size`` bytes, else ``raw``."""
    if binary:
        return packed if len(packed) < size else raw
    text = _TEXT_PREFIX + base64.b64encode(packed).decode("ascii")
    return text if len(text) < size else raw


def unpack(stored: bytes | str, limit: int = UNPACK_MAX) -> str | None:
    """The JSON text of a stored record or event (packed or plain); None when it is packed but
    does not unpack (garbage, truncated) within ``limit`` bytes."""
    if isinstance(stored, str):
        if not stored.startswith(_TEXT_PREFIX):
            return stored
        try:
            data = base64.b64decode(stored[len(_TEXT_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            return None
    elif not stored or stored[:1] in _JSON_START:
        return stored.decode("utf-8", errors="replace")
    elif stored.startswith(_TEXT_PREFIX.encode()):
        return unpack(stored.decode("ascii", errors="replace"), limit)
    else:
        data = stored
    if data[:1] == _EVENT_V1:
        inflater = zlib.decompressobj(-15, zdict=_EVENT_DICT_V1)
        data = data[1:]
    else:
        inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit)
    except zlib.error:
        return None
    if inflater.unconsumed_tail or not inflater.eof:
        return None
    return out.decode("utf-8", errors="replace")
