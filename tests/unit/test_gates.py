"""Completion gates: order, every gate's event, the ground-truth bypass, partial, redundancy."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.config import CritiqueConfig, OutputContractConfig
from pipeline.loop.gates import (
    GATE_ORDER,
    GateContext,
    L0Finding,
    TextItem,
    deliverable_keywords,
    evaluate_completion,
    implies_deliverable,
    is_deliverable_file,
    redundancy_guard,
    scan_placeholders,
    validate_deliverable,
)
from pipeline.models import CritiqueEnvelope, CritiqueResult, FileRef, GateEvent, Status
from pipeline.records.run_scores import mean_best_score, not_counted

CFG = CritiqueConfig(enabled=True)


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png(width: int, height: int, pad_to: int = 0) -> bytes:
    """A structurally valid PNG of the given size, padded with a tEXt chunk to ``pad_to``."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    raw = b"".join(b"\x00" + bytes(width) for _ in range(height))
    body = _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw))
    head = b"\x89PNG\r\n\x1a\n"
    size = len(head) + len(body) + 12
    if pad_to > size:
        body += _chunk(b"tEXt", b"Comment\x00" + b"x" * max(0, pad_to - size - 12 - 8))
    return head + body + _chunk(b"IEND", b"")


def pdf(pages: int) -> bytes:
    """A tiny but well-formed-looking PDF with ``pages`` page objects, padded past 512 B."""
    objs = [b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj"]
    kids = " ".join(f"{3 + i} 0 R" for i in range(pages)).encode()
    objs.append(b"2 0 obj << /Type /Pages /Kids [" + kids + b"] /Count %d >> endobj" % pages)
    for i in range(pages):
        objs.append(b"%d 0 obj << /Type /Page /Parent 2 0 R >> endobj" % (3 + i))
    body = b"%PDF-1.4\n" + b"\n".join(objs) + b"\n%" + b"p" * 600 + b"\n%%EOF\n"
    return body


def result(
    worker: str, best: float, iteration: int = 1, original: float | None = None
) -> CritiqueResult:
    return CritiqueResult(
        run_id="run1",
        iteration=iteration,
        worker_id=worker,
        status="accepted" if best >= 0.6 else "escalated",
        stop_reason="accepted",
        output={"summary": "ok"},
        original_score=best if original is None else original,
        best_score=best,
        envelope=CritiqueEnvelope(worker_id=worker, score=best),
    )


class FakeL0:
    """An L0 runner that returns canned findings and records what it was asked."""

    def __init__(self, findings: Sequence[L0Finding] = ()) -> None:
        self.findings = list(findings)
        self.calls: list[tuple[tuple[str, ...], list[TextItem]]] = []

    def __call__(
        self, contract: OutputContractConfig, items: Sequence[TextItem]
    ) -> list[L0Finding]:
        self.calls.append((contract.checks, list(items)))
        return [
            f
            for f in self.findings
            if contract.checks != ("no_placeholder",) or f.check == "no_placeholder"
        ]


def run(
    *,
    final: str | dict[str, Any] = "The chart shows revenue rising 12% in Q3.",
    results: Sequence[CritiqueResult] = (),
    files: Sequence[FileRef] = (),
    task: str = "Summarise the quarter.",
    expected: bool | None = None,
    config: CritiqueConfig = CFG,
    previous: int = 0,
    l0: FakeL0 | None = None,
    blobs: dict[str, bytes] | None = None,
    evaluate: Any = None,
) -> Any:
    store = blobs or {}
    return evaluate_completion(
        run_id="run1",
        iteration=2,
        final_result=final,
        results=results,
        files=files,
        task=task,
        deliverable_expected=expected,
        config=config,
        previous_rejections=previous,
        l0=l0 or FakeL0(),
        read_bytes=lambda f: store.get(f.path, f.content.encode() if f.content else None),
        evaluate=evaluate,
    )


def by_gate(decision: Any) -> dict[str, GateEvent]:
    return {e.gate: e for e in decision.events}


REAL_PNG = png(64, 48, pad_to=900)
CHART = FileRef(path="out/chart.png", size=len(REAL_PNG), sha256="x" * 64)


# --- deliverable inference ---------------------------------------------------------------


def test_implies_deliverable_whole_words_and_flag() -> None:
    """Keywords count as whole words (plurals too); the explicit flag always wins."""
    assert implies_deliverable("Plot the sales as a chart", None)
    assert implies_deliverable("Export two CSVs", None)
    assert not implies_deliverable("Use pdfx to read the reports_db table", None)
    assert not implies_deliverable("Explain the reporting line and imaginary numbers", None)
    assert not implies_deliverable("Figure out why the build fails and report back", None)
    assert implies_deliverable("Figure out the trend and draw a figure", None)
    assert not implies_deliverable("Make a chart", False)
    assert implies_deliverable("Answer in one sentence", True)
    assert deliverable_keywords("A PDF report with a figure and the report") == (
        "pdf",
        "report",
        "figure",
    )


# --- file validator ----------------------------------------------------------------------


def test_validator_size_floor() -> None:
    """511 B is rejected, 512 B is not (metadata-only check)."""
    assert "511 B" in (validate_deliverable(FileRef(path="a.csv", size=511), None) or "")
    assert validate_deliverable(FileRef(path="a.csv", size=512), None) is None


def test_validator_rejects_1x1_png_even_when_padded() -> None:
    """A 1×1 PNG padded past the size floor is still a placeholder image."""
    tiny = png(1, 1, pad_to=800)
    assert len(tiny) >= 512
    reason = validate_deliverable(FileRef(path="img.png", size=len(tiny)), tiny)
    assert reason is not None and "1×1" in reason


def test_validator_accepts_real_looking_png_and_csv() -> None:
    """A 64×48 PNG of 900 B and a 600-byte CSV pass."""
    assert validate_deliverable(CHART, REAL_PNG) is None
    csv = ("region,revenue\n" + "north,100\n" * 60).encode()[:600]
    assert len(csv) == 600
    assert validate_deliverable(FileRef(path="data.csv", size=600), csv) is None


def test_validator_pdf_rules() -> None:
    """A PDF with no page objects or a zero page count is empty; one with pages passes."""
    good = pdf(2)
    assert validate_deliverable(FileRef(path="r.pdf", size=len(good)), good) is None
    empty = pdf(0)
    reason = validate_deliverable(FileRef(path="r.pdf", size=len(empty)), empty)
    assert reason is not None and "empty PDF" in reason
    fake = b"not a pdf " * 80
    assert "not a PDF" in (validate_deliverable(FileRef(path="r.pdf", size=800), fake) or "")


def test_validator_judges_a_prefix_cautiously() -> None:
    """With only a prefix of a large PDF, missing page objects are not proof of emptiness."""
    head = b"%PDF-1.7\n" + b"%" + b"z" * 1000
    big = FileRef(path="big.pdf", size=5_000_000)
    assert validate_deliverable(big, head) is None
    whole = FileRef(path="small.pdf", size=len(head))
    assert validate_deliverable(whole, head) is not None
    assert validate_deliverable(FileRef(path="x.bin", size=9_000), b"\x00" * 800) is None


def test_validator_rejects_blank_and_corrupt_png() -> None:
    """A file of only whitespace, or a .png without a PNG header, is rejected."""
    blank = b" \n" * 400
    assert "blank" in (validate_deliverable(FileRef(path="x.txt", size=800), blank) or "")
    junk = b"x" * 800
    assert "not a valid PNG" in (validate_deliverable(FileRef(path="x.png", size=800), junk) or "")


def test_deliverable_files_selection() -> None:
    """Without a file task only deliverable types are judged; logs and hidden files never."""
    notes = FileRef(path="notes.md", size=10)
    assert not is_deliverable_file(notes, task_wants_file=False)
    assert is_deliverable_file(notes, task_wants_file=True)
    assert is_deliverable_file(FileRef(path="a/b.PNG", size=1), task_wants_file=False)
    assert not is_deliverable_file(FileRef(path="run.log", size=1), task_wants_file=True)
    assert not is_deliverable_file(FileRef(path=".keep", size=0), task_wants_file=True)


# --- placeholder patterns ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("Summary: final output here.", "output_here"),
        ("Revenue grew by XX% year on year", "percent_stub"),
        ('{"your": "value"}', "stub_key"),
        ('{"field_name": 3}', "stub_key"),
        ("Contact <your-email@example.com> today", "angle_stub"),
        ('{"summary": "..."}', "ellipsis_value"),
        ("Insert chart title here", "insert_here"),
        ("Title: [insert the company name here]", "insert_here"),
    ],
)
def test_placeholder_patterns_hit(text: str, pattern: str) -> None:
    """Each of the seed's completion-gate stub forms is found and named."""
    hits = scan_placeholders(text, "final_result")
    assert pattern in {h.pattern for h in hits}


def test_placeholder_offsets_survive_unicode_lowering() -> None:
    """Offsets point into the original text even when lower-casing changes its length."""
    text = "İstanbul: ...final output here, XX%"
    hits = scan_placeholders(text, "final_result")
    assert [(h.pattern, h.offset, text[h.offset or 0 :].startswith(h.match)) for h in hits] == [
        ("output_here", 13, True),
        ("percent_stub", 32, True),
    ]


def test_placeholder_patterns_leave_prose_alone() -> None:
    """Ordinary prose with 'your', percentages and angle brackets is not a stub."""
    text = (
        "Your results are here: revenue grew 12% and 3 < 4 > 2. Here is your answer: "
        'the field "name" holds the "your-data" string, and XXL shirts sold well. '
        "Then insert the card here and the answer here is 42."
    )
    assert scan_placeholders(text, "final_result") == []


# --- the chain ---------------------------------------------------------------------------


def test_all_pass_complete_and_gate_order() -> None:
    """A clean run is complete, with one event per gate, in the documented order."""
    d = run(results=[result("w1", 0.9), result("w2", 0.7)])
    assert d.verdict == "complete"
    assert [e.gate for e in d.events] == list(GATE_ORDER)
    assert all(e.iteration == 2 for e in d.events)
    g = by_gate(d)
    assert g["l0"].verdict == "pass"
    assert g["critique_score"].verdict == "pass" and "0.800" in g["critique_score"].reason
    assert g["deliverable_presence"].verdict == "skip"
    assert g["placeholder"].verdict == "pass"
    assert g["file_validator"].verdict == "skip"
    assert g["evaluation"].verdict == "skip"
    assert d.reasons == () and d.rejected_count == 0
    assert d.mean_score == pytest.approx(0.8)


def test_l0_reject_carries_check_fields() -> None:
    """An L0 error becomes a reject event with l0_check, l0_reason and violating_path."""
    l0 = FakeL0(
        [
            L0Finding(
                check="json_valid_if_claimed",
                severity="error",
                reason="bad JSON at 3",
                path="out/data.json",
            ),
            L0Finding(check="balanced_delimiters", severity="warning", reason="prose"),
        ]
    )
    files = [FileRef(path="out/data.json", size=20, content='{"a": ')]
    d = run(results=[result("w1", 0.9)], files=files, l0=l0)
    assert d.verdict == "rejected"
    l0_events = [e for e in d.events if e.gate == "l0"]
    assert len(l0_events) == 1
    ev = l0_events[0]
    assert (ev.verdict, ev.l0_check, ev.violating_path) == (
        "reject",
        "json_valid_if_claimed",
        "out/data.json",
    )
    assert ev.l0_reason == "bad JSON at 3"
    # The contract saw the final result and the text file (with its format guessed).
    checks, items = l0.calls[0]
    assert checks == ("default",)
    assert [(i.path, i.claimed_format) for i in items] == [(None, None), ("out/data.json", "json")]


def test_l0_warnings_only_pass() -> None:
    """L0 warnings do not reject."""
    l0 = FakeL0([L0Finding(check="balanced_delimiters", severity="warning", reason="(")])
    d = run(results=[result("w1", 0.9)], l0=l0)
    assert by_gate(d)["l0"].verdict == "pass" and d.verdict == "complete"


def test_dict_final_result_is_checked_as_json() -> None:
    """A dict final result is serialised as JSON for L0 and the placeholder scan."""
    l0 = FakeL0()
    d = run(final={"your": "x", "summary": "fine"}, results=[result("w1", 0.9)], l0=l0)
    assert l0.calls[0][1][0].claimed_format == "json"
    assert by_gate(d)["placeholder"].verdict == "reject"
    assert any(h.pattern == "stub_key" for h in d.placeholder_hits)


def test_critique_score_reject_and_disabled() -> None:
    """Mean under the threshold rejects; min_score_to_complete 0.0 skips the gate."""
    low = [result("w1", 0.3), result("w2", 0.5)]
    d = run(results=low)
    ev = by_gate(d)["critique_score"]
    assert ev.verdict == "reject" and "0.400" in ev.reason
    assert d.verdict == "rejected" and d.rejected_count == 1
    off = run(results=low, config=CritiqueConfig(enabled=True, min_score_to_complete=0.0))
    assert by_gate(off)["critique_score"].verdict == "skip"
    assert off.verdict == "complete"


def test_critique_score_threshold_is_inclusive_and_uses_latest_iteration() -> None:
    """A mean exactly at the threshold passes; a worker's latest iteration is the one counted."""
    d = run(results=[result("w1", 0.5), result("w2", 0.7)])
    assert by_gate(d)["critique_score"].verdict == "pass"
    assert mean_best_score([result("w1", 0.2, 1), result("w1", 0.8, 2)]) == pytest.approx(0.8)
    assert mean_best_score([]) is None
    assert by_gate(run())["critique_score"].verdict == "skip"


def unscored(worker: str, status: Status = "unchecked", iteration: int = 1) -> CritiqueResult:
    """A result with no score: critique off (``unchecked``) or a cancelled pass."""
    return CritiqueResult(
        run_id="run1",
        iteration=iteration,
        worker_id=worker,
        status=status,
        stop_reason="disabled" if status == "unchecked" else "cancelled",
        output="# Q3 report\n\nTODO: fill in the numbers.",
        original_score=None,
        best_score=None,
        envelope=CritiqueEnvelope(worker_id=worker, score=0.0, critic="disabled"),
    )


def test_mean_skips_unchecked_and_cancelled_and_says_so() -> None:
    """The mean is over checked outputs only; the gate names what it did not count."""
    mixed = [result("w1", 0.8), unscored("w2"), unscored("w3"), unscored("w4", "cancelled")]
    assert mean_best_score(mixed) == pytest.approx(0.8)
    assert not_counted(mixed) == " (1 cancelled, 2 unchecked, not counted)"
    assert not_counted([result("w1", 0.8)]) == ""
    ev = by_gate(run(results=mixed))["critique_score"]
    assert ev.verdict == "pass"
    assert "over 1 worker (1 cancelled, 2 unchecked, not counted)" in ev.reason


def test_complete_with_every_output_unchecked_is_refused() -> None:
    """No checked output: the score gate rejects, naming enabled: false, unless its bar is 0."""
    d = run(results=[unscored("w1"), unscored("w2")])
    ev = by_gate(d)["critique_score"]
    assert d.verdict == "rejected" and d.mean_score is None
    assert ev.verdict == "reject" and "(2 unchecked, not counted)" in ev.reason
    assert "enabled: false" in ev.reason and "min_score_to_complete: 0.0" in ev.reason
    off = CritiqueConfig(enabled=True, min_score_to_complete=0.0)
    assert by_gate(run(results=[unscored("w1")], config=off))["critique_score"].verdict == "skip"


def test_latest_pass_per_worker_decides_what_counts() -> None:
    """A worker's latest result is the one counted: a later unchecked iteration is not averaged
    with its earlier scored one, and a later scored one counts over an earlier unchecked one."""
    assert mean_best_score([result("w1", 0.9, 1), unscored("w1", iteration=2)]) is None
    assert mean_best_score([unscored("w1", iteration=1), result("w1", 0.4, 2)]) == 0.4
    assert not_counted([result("w1", 0.9, 1), unscored("w1", iteration=2)]) == (
        " (1 unchecked, not counted)"
    )


def test_deliverable_presence_rejects_without_big_file() -> None:
    """A chart task with only a tiny file is rejected by presence and by the validator."""
    tiny = FileRef(path="out/chart.png", size=67)
    d = run(task="Make a chart of revenue", results=[result("w1", 0.9)], files=[tiny])
    g = by_gate(d)
    assert g["deliverable_presence"].verdict == "reject"
    assert "'chart'" in g["deliverable_presence"].reason
    assert g["file_validator"].verdict == "reject" and "67 B" in g["file_validator"].reason
    assert d.verdict == "rejected"


def test_log_file_is_not_a_deliverable() -> None:
    """A big log file neither satisfies presence nor grounds a critique bypass."""
    log = FileRef(path="run.log", size=4096)
    d = run(task="Make a chart of revenue", results=[result("w1", 0.3)], files=[log])
    assert by_gate(d)["deliverable_presence"].verdict == "reject"
    assert by_gate(d)["critique_score"].verdict == "reject"


def test_deliverable_presence_via_flag_and_pass() -> None:
    """deliverable_expected=True demands a file; a valid 900-byte PNG satisfies it."""
    none = run(task="Do it", expected=True, results=[result("w1", 0.9)])
    assert by_gate(none)["deliverable_presence"].verdict == "reject"
    assert "deliverable_expected=True" in by_gate(none)["deliverable_presence"].reason
    ok = run(
        task="Do it",
        expected=True,
        results=[result("w1", 0.9)],
        files=[CHART],
        blobs={CHART.path: REAL_PNG},
    )
    assert by_gate(ok)["deliverable_presence"].verdict == "pass"
    assert by_gate(ok)["file_validator"].verdict == "pass"
    assert ok.verdict == "complete"


def test_ground_truth_bypass_overrules_low_score() -> None:
    """With a valid deliverable on disk, a failing critique gate becomes a bypass."""
    d = run(
        task="Plot revenue as a chart",
        results=[result("w1", 0.3)],
        files=[CHART],
        blobs={CHART.path: REAL_PNG},
    )
    ev = by_gate(d)["critique_score"]
    assert ev.verdict == "bypass" and "out/chart.png" in ev.reason
    assert d.verdict == "complete"


def test_bypass_still_subject_to_placeholder_and_file_gates() -> None:
    """The bypass is advisory: a stub in the result or a bad file still rejects."""
    stub = run(
        final="Revenue grew XX% — final output here",
        task="Plot revenue as a chart",
        results=[result("w1", 0.3)],
        files=[CHART],
        blobs={CHART.path: REAL_PNG},
    )
    assert by_gate(stub)["critique_score"].verdict == "bypass"
    assert by_gate(stub)["placeholder"].verdict == "reject"
    assert stub.verdict == "rejected"
    assert {h.pattern for h in stub.placeholder_hits} >= {"percent_stub", "output_here"}

    dot = png(1, 1, pad_to=700)
    pixel = FileRef(path="out/pixel.png", size=len(dot))
    bad_file = run(
        task="Plot revenue as a chart",
        results=[result("w1", 0.3)],
        files=[CHART, pixel],
        blobs={CHART.path: REAL_PNG, pixel.path: dot},
    )
    assert by_gate(bad_file)["critique_score"].verdict == "bypass"
    assert by_gate(bad_file)["file_validator"].verdict == "reject"
    assert bad_file.verdict == "rejected"


def test_no_bypass_without_valid_deliverable() -> None:
    """A 1×1 PNG does not count as ground truth: the low score still rejects."""
    dot = png(1, 1, pad_to=700)
    pixel = FileRef(path="out/chart.png", size=len(dot))
    d = run(
        task="Plot revenue as a chart",
        results=[result("w1", 0.3)],
        files=[pixel],
        blobs={pixel.path: dot},
    )
    assert by_gate(d)["critique_score"].verdict == "reject"
    assert by_gate(d)["deliverable_presence"].verdict == "pass"


def test_placeholder_gate_uses_contract_no_placeholder_and_text_files() -> None:
    """Text outputs are scanned; L0's no_placeholder findings count as placeholder hits."""
    l0 = FakeL0(
        [
            L0Finding(
                check="no_placeholder",
                severity="error",
                reason="TODO at 4",
                path="out/notes.md",
                offset=4,
            )
        ]
    )
    files = [FileRef(path="out/notes.md", size=9, content="See TODO")]
    d = run(results=[result("w1", 0.9)], files=files, l0=l0)
    assert by_gate(d)["placeholder"].verdict == "reject"
    assert [(h.where, h.pattern, h.offset) for h in d.placeholder_hits] == [
        ("out/notes.md", "no_placeholder", 4)
    ]
    assert l0.calls[1][0] == ("no_placeholder",)


def test_empty_final_result_is_a_placeholder() -> None:
    """An empty final result is never a completion."""
    d = run(final="   ", results=[result("w1", 0.9)])
    assert by_gate(d)["placeholder"].verdict == "reject"
    assert run(final={}, results=[result("w1", 0.9)]).verdict == "rejected"


def test_evaluation_hook_result_is_recorded() -> None:
    """The evaluation hook sees the context and its event joins the chain (iteration fixed)."""
    seen: list[GateContext] = []

    def hook(ctx: GateContext) -> GateEvent:
        seen.append(ctx)
        return GateEvent(gate="evaluation", verdict="reject", reason="eval 0.2 < 0.5")

    d = run(results=[result("w1", 0.9)], evaluate=hook)
    ev = by_gate(d)["evaluation"]
    assert ev.verdict == "reject" and ev.iteration == 2
    assert seen[0].run_id == "run1" and seen[0].mean_score == pytest.approx(0.9)
    assert d.verdict == "rejected" and "evaluation: eval 0.2 < 0.5" in d.reasons


def test_partial_after_max_rejected_completions() -> None:
    """Rejections count up; the max-th rejected completion returns partial, not rejected."""
    low = [result("w1", 0.2)]
    cfg = CritiqueConfig(enabled=True, max_rejected_completions=3)
    assert run(results=low, config=cfg, previous=0).verdict == "rejected"
    second = run(results=low, config=cfg, previous=1)
    assert second.verdict == "rejected" and second.rejected_count == 2
    third = run(results=low, config=cfg, previous=2)
    assert third.verdict == "partial" and third.rejected_count == 3
    assert any("partial" in r for r in third.reasons)
    # A clean run does not count as a rejection.
    ok = run(results=[result("w1", 0.9)], config=cfg, previous=2)
    assert ok.verdict == "complete" and ok.rejected_count == 2


# --- redundancy guard --------------------------------------------------------------------


def test_redundancy_guard_refuses_reissue_under_threshold() -> None:
    """Re-issuing a dispatched signature with a low mean score is refused."""
    ev = redundancy_guard("sig-a", {"sig-a", "sig-b"}, 0.4, CFG, iteration=3, worker_id="w9")
    assert ev.gate == "redundancy" and ev.verdict == "reject"
    assert "sig-a" in ev.reason and ev.iteration == 3 and ev.worker_id == "w9"


def test_redundancy_guard_allows() -> None:
    """A new signature, a good mean score, or no scores yet are allowed."""
    assert redundancy_guard("sig-c", {"sig-a"}, 0.1, CFG).verdict == "pass"
    assert redundancy_guard("sig-a", {"sig-a"}, 0.6, CFG).verdict == "pass"
    assert redundancy_guard("sig-a", {"sig-a"}, None, CFG).verdict == "pass"


def test_redundancy_guard_disabled() -> None:
    """min_score_to_complete 0.0 (or no signature) turns the guard into a skip."""
    off = CritiqueConfig(enabled=True, min_score_to_complete=0.0)
    assert redundancy_guard("sig-a", {"sig-a"}, 0.1, off).verdict == "skip"
    assert redundancy_guard("", {""}, 0.1, CFG).verdict == "skip"


# --- the real contract -------------------------------------------------------------------------


def test_default_runner_uses_real_contract() -> None:
    """Without an injected runner, the real Layer-0 contract rejects a TODO."""
    d = evaluate_completion(
        run_id="run1",
        iteration=1,
        final_result="Section one: TODO",
        results=[result("w1", 0.9)],
        files=[],
        task="Write text",
        deliverable_expected=None,
        config=CFG,
    )
    g = by_gate(d)
    assert g["l0"].verdict == "reject" and g["l0"].l0_check == "no_placeholder"
    assert g["placeholder"].verdict == "reject"
