"""Worker-made text stays text where it is shown (issue 28 item 6): escaped for the terminal by
one helper (pipeline.text.escaping, workers.commands._text), escaped for Markdown in every .md
artifact, and a closed stdout ends the CLI quietly instead of being blamed on Redis."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pipeline.loop.ab import ABRow, DefectCount, escalation_markdown
from pipeline.loop.pitfalls import render_lessons
from pipeline.models import CritiqueEnvelope, CritiqueResult, Defect, Lesson
from pipeline.text.escaping import escape_controls, md_cell, md_text
from workers.cli import main
from workers.commands._common import service_guard
from workers.commands._text import json_line, printable
from workers.exit_codes import EXIT_BROKEN_PIPE

EVIL = "<script>alert(1)</script>"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("a\x1b]0;pwned\x07.md", "a\\x1b]0;pwned\\x07.md"),  # OSC retitle + BEL
        ("x\x1b[2Jy", "x\\x1b[2Jy"),  # clear screen
        ("c1\x9b2J", "c1\\x9b2J"),  # the one-byte C1 CSI
        ("del\x7f", "del\\x7f"),
        ("line\nbreak\rtab\t", "line\\nbreak\\rtab\\t"),
        ("bidi\u202eevil", "bidi\\u202eevil"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("sep\u2028x", "sep\\u2028x"),
        ("lone\udc80", "lone\\udc80"),
    ],
)
def test_escape_controls_makes_each_control_visible(raw: str, shown: str) -> None:
    """Each C0/C1 control, ESC, DEL, bidi/zero-width format character, line separator and
    lone surrogate becomes a visible Python-style escape, encodable as UTF-8."""
    assert escape_controls(raw) == shown
    shown.encode("utf-8")


def test_escape_controls_keeps_normal_unicode() -> None:
    """Letters of any script, emoji, punctuation and the no-break space are kept as they are."""
    text = "Résumé — 東京 ünïcödé 😀 → « ok » a\u00a0b"
    assert escape_controls(text) == text


def test_printable_is_one_cut_line() -> None:
    """printable escapes newlines (one line) and cuts to the limit with an ellipsis."""
    assert printable("a\nb" * 100, 20) == ("a\\nb" * 10)[:19] + "…"
    assert printable("ok") == "ok"


def test_json_line_escapes_what_json_leaves_raw_and_round_trips() -> None:
    """DEL, C1, bidi and lone surrogates become \\u escapes; the JSON decodes to the same
    values and Unicode letters stay as they are."""
    doc = {"path": "a\x1b]0;x\x07\x7f\x9b\u202e\udc80.md", "name\x9b": "東京"}
    line = json_line(doc)
    assert not any(ch in line for ch in "\x1b\x07\x7f\x9b\u202e\udc80")
    assert "\\u009b" in line and "\\u202e" in line and "東京" in line
    assert json.loads(line) == doc


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (EVIL, "&lt;script&gt;alert(1)&lt;/script&gt;"),
        ("a & b", "a &amp; b"),
        ("col | split", "col \\| split"),
        ("two\nlines\n\n# heading", "two lines # heading"),
        ("![x](http://evil/p.png)", "!\\[x\\](http://evil/p.png)"),
        ("`code` and \\|", "\\`code\\` and \\\\\\|"),
        ("<http://evil>", "&lt;http://evil&gt;"),
        ("esc\x1b[2J", "esc\\\\x1b\\[2J"),
    ],
)
def test_md_text_renders_as_literal_text(raw: str, shown: str) -> None:
    """HTML, autolinks, links/images, code spans, pipes and line breaks are escaped; a control
    character shows as a visible escape (safe to `cat`)."""
    assert md_text(raw) == shown


def test_md_cell_cuts_before_escaping() -> None:
    """A long cell is cut on the raw text, so no entity or escape is cut in half."""
    cell = md_cell("<" * 300, limit=10)
    assert cell == "&lt;" * 9 + "…"


def _defect(description: str, location: str | None = None) -> Defect:
    return Defect(
        category="incomplete",
        severity="critical",
        location=location,
        description=description,
        source="heuristic",
    )


def test_lessons_md_escapes_every_stored_string() -> None:
    """lessons.md shows a lesson's category, rule and description as text."""
    lesson = Lesson(
        category="<b>cat</b>",
        description=f"the output reports an error: {EVIL}",
        prevention_rule="Remove the '<img src=x>' | field",
        runs=2,
    )
    md = render_lessons([lesson], scope="fleet")
    assert "<script" not in md and "<img" not in md and "<b>" not in md
    assert "## 1. &lt;b&gt;cat&lt;/b&gt; (seen in 2 runs)" in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "\\| field" in md


def test_escalation_markdown_escapes_defects_and_notes() -> None:
    """The ab escalation file shows defect text and notes as text (the output stays fenced)."""
    row = ABRow(run_id="ab-1", mode="B", input_id="in1", defects=1, latency_s=0.1)
    result = CritiqueResult(
        run_id="ab-1",
        worker_id="w1",
        status="escalated",
        stop_reason="attempts_exhausted",
        output={"error": EVIL},
        original_score=0.0,
        best_score=0.0,
        envelope=CritiqueEnvelope(worker_id="w1", score=0.0, defects=(_defect(EVIL, "<f>.md:0"),)),
        notes=(f"note {EVIL}",),
    )
    md = escalation_markdown(row, result, DefectCount(l0=1, details=(EVIL,)), retry_command="r")
    body = md.split("## Best output")[0]
    assert "<script" not in body and "<f>" not in body
    assert "&lt;f&gt;.md:0: &lt;script&gt;" in body


def test_service_guard_leaves_a_broken_pipe_to_the_cli() -> None:
    """A BrokenPipeError from printing is not reported as an unreachable Redis (exit 3)."""

    def body() -> int:
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        service_guard("status", body)


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_cli_ends_quietly_when_stdout_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reader gone before the command's first line: exit 141, nothing on stderr."""
    path = tmp_path / "ok.md"
    path.write_text("# Notes\n\nAll good.\n", encoding="utf-8")
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert main(["l0", str(path)]) == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_submit_wait_result_line_is_terminal_safe() -> None:
    """`submit --wait` prints a stored result's line with its worker id and fallback note
    escaped (a result read back from Redis is not trusted to hold identifiers)."""
    from workers.commands.submit import _result_line

    result = CritiqueResult(
        run_id="r1",
        worker_id="w\x1b]0;x\x07",
        status="accepted",
        stop_reason="accepted",
        output="ok",
        original_score=1.0,
        best_score=1.0,
        envelope=CritiqueEnvelope(worker_id="w", score=1.0),
        notes=("critic fallback: LLM said \x1b[2J",),
    )
    line = _result_line(result)
    assert "\x1b" not in line and "\x07" not in line
    assert "w\\x1b]0;x\\x07" in line and "[FALLBACK critic fallback: LLM said \\x1b[2J]" in line
