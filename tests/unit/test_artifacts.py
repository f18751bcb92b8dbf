"""Artifacts and the manager summary: content, tree layout, determinism and confinement."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.errors import PathEscapeError, SubmissionError
from pipeline.models import (
    CritiqueEnvelope,
    CritiqueResult,
    Defect,
    Pattern,
    RepairAttempt,
    Usage,
)
from pipeline.records.artifacts import (
    atomic_write_many,
    manager_summary,
    render_critique_md,
    write_artifacts,
    write_delegation_artifacts,
)


def _defect(sev: str, desc: str, fp: bool = False) -> Defect:
    return Defect(
        category="missing_data",
        severity=sev,
        description=desc,
        source="llm",
        false_positive=fp,
    )


REPAIRED = CritiqueResult(
    run_id="run-7",
    iteration=1,
    worker_id="analyst_01",
    status="repaired",
    stop_reason="accepted",
    output={"summary": "fixed", "confidence": 0.8},
    original_score=0.45,
    best_score=0.82,
    envelope=CritiqueEnvelope(
        worker_id="analyst_01",
        score=0.82,
        defects=(_defect("warning", "summary is thin | short"), _defect("info", "x", fp=True)),
        prescriptions=("Include the 'summary' field", "Cite a source"),
        summary="Mostly fine.",
    ),
    attempts=(
        RepairAttempt(
            worker_id="analyst_01",
            attempt=1,
            original_score=0.45,
            repaired_score=0.82,
            defects_fixed=3,
            defects_remaining=0,
            stop_reason="accepted",
        ),
    ),
    usage=Usage(tokens_in=100, tokens_out=50, cost=0.01, calls=2),
)

CLEAN = CritiqueResult(
    run_id="run-7",
    iteration=1,
    worker_id="writer_02",
    status="accepted",
    stop_reason="accepted",
    output="All good.",
    original_score=0.95,
    best_score=0.95,
    envelope=CritiqueEnvelope(
        worker_id="writer_02",
        score=0.95,
        defects=(_defect("critical", "no table"),),
        prescriptions=("Include  the 'summary'   field",),
    ),
    usage=Usage(tokens_in=10, tokens_out=5, calls=1),
)

PATTERNS = (
    Pattern(
        category="wrong_format",
        frequency=2,
        description="confidence as string",
        prevention_rule="Output confidence as a float, not a string",
        first_seen_iteration=1,
        last_seen_iteration=1,
    ),
    Pattern(
        category="missing_data",
        frequency=3,
        description="no summary",
        prevention_rule="Always include the 'summary' field in your output",
        first_seen_iteration=1,
        last_seen_iteration=1,
    ),
)


def test_manager_summary_content() -> None:
    """Per-worker scores and counts, prescriptions by frequency, patterns, repair history."""
    s = manager_summary("run-7", 1, [CLEAN, REPAIRED], PATTERNS)
    assert [w["worker_id"] for w in s["workers"]] == ["analyst_01", "writer_02"]
    a = s["workers"][0]
    assert (a["original_score"], a["best_score"]) == (0.45, 0.82)
    assert a["defects"] == {"critical": 0, "warning": 1, "info": 1}
    assert a["false_positives"] == 1 and a["repair_attempts"] == 1
    assert (a["status"], a["stop_reason"]) == ("repaired", "accepted")
    assert s["top_prescriptions"][0] == {"prescription": "Include the 'summary' field", "count": 2}
    assert s["known_patterns"][0]["category"] == "missing_data"
    assert s["known_patterns"][0]["frequency"] == 3
    assert s["repair_history"] == [
        {
            "worker_id": "analyst_01",
            "attempt": 1,
            "original_score": 0.45,
            "repaired_score": 0.82,
            "defects_fixed": 3,
            "defects_remaining": 0,
            "stop_reason": "accepted",
        }
    ]
    assert s["mean_score"] == pytest.approx(0.885)
    assert s["totals"]["defects"] == {"critical": 1, "warning": 1, "info": 1}
    assert s["totals"]["tokens_in"] == 110
    json.dumps(s)


def test_summary_rejects_duplicate_worker() -> None:
    """Two results for one worker in an iteration is an error (their files would collide)."""
    with pytest.raises(SubmissionError, match="appears twice"):
        manager_summary("run-7", 1, [CLEAN, CLEAN], ())


def test_render_critique_md_mentions_every_worker() -> None:
    """CRITIQUE.md has a section per worker, prescriptions, pitfalls and repair history."""
    s = manager_summary("run-7", 1, [CLEAN, REPAIRED], PATTERNS)
    md = render_critique_md(s, [CLEAN, REPAIRED])
    assert "## Worker `analyst_01` — repaired (stop: accepted)" in md
    assert "## Worker `writer_02` — accepted (stop: accepted)" in md
    assert "1. [×2] Include the 'summary' field" in md
    assert "- [seen 3x] missing_data: Always include the 'summary' field in your output" in md
    assert "| `analyst_01` | 1 | 0.45 | 0.82 | 3 | 0 | accepted |" in md
    assert "summary is thin \\| short" in md
    assert "(false positive)" in md


UNCHECKED = CritiqueResult(
    run_id="run-7",
    iteration=1,
    worker_id="drafter_03",
    status="unchecked",
    stop_reason="disabled",
    output="# Q3 report\n\nTODO: fill in the numbers.",
    original_score=None,
    best_score=None,
    envelope=CritiqueEnvelope(worker_id="drafter_03", score=0.0, critic="disabled"),
)


def test_critique_md_says_unchecked_with_no_score_and_leaves_it_out_of_the_mean() -> None:
    """An unchecked worker shows no score, says nothing was checked, and is not in the mean."""
    s = manager_summary("run-7", 1, [CLEAN, UNCHECKED], ())
    assert s["mean_score"] == pytest.approx(0.95)
    assert (s["totals"]["unchecked"], s["totals"]["cancelled"]) == (1, 0)
    md = render_critique_md(s, [CLEAN, UNCHECKED])
    assert "Mean score **0.95** over 1 checked worker(s) (1 unchecked, not counted);" in md
    assert "## Worker `drafter_03` — unchecked (stop: disabled)" in md
    assert "| best score | — |" in md and "| band | — (not checked: unchecked) |" in md
    assert "| checked | no: critique is off (enabled: false): nothing was checked" in md


def test_write_artifacts_tree_and_roundtrip(tmp_path: Path) -> None:
    """The seed's tree is written; per-worker files round-trip through the models."""
    written = write_artifacts(tmp_path, "run-7", 1, [CLEAN, REPAIRED], PATTERNS)
    it = tmp_path / "runs" / "run-7" / "iterations" / "001"
    assert written == [
        it / "critique.json",
        it / "CRITIQUE.md",
        it / "delegations" / "analyst_01" / "critique.json",
        it / "delegations" / "analyst_01" / "repairs.json",
        it / "delegations" / "writer_02" / "critique.json",
    ]
    assert not (it / "delegations" / "writer_02" / "repairs.json").exists()
    text = (it / "delegations" / "analyst_01" / "critique.json").read_text(encoding="utf-8")
    assert CritiqueResult.model_validate_json(text) == REPAIRED
    repairs = json.loads((it / "delegations" / "analyst_01" / "repairs.json").read_text("utf-8"))
    assert repairs == [
        {
            "worker_id": "analyst_01",
            "attempt": 1,
            "original_score": 0.45,
            "repaired_score": 0.82,
            "defects_fixed": 3,
            "defects_remaining": 0,
            "stop_reason": "accepted",
        }
    ]
    top = json.loads((it / "critique.json").read_text(encoding="utf-8"))
    assert [CritiqueResult.model_validate(c) for c in top["critiques"]] == [REPAIRED, CLEAN]
    assert top["summary"]["run_id"] == "run-7"
    md = (it / "CRITIQUE.md").read_text(encoding="utf-8")
    assert "analyst_01" in md and "writer_02" in md
    assert not [p for p in it.rglob("*.tmp")]


def test_write_artifacts_is_deterministic(tmp_path: Path) -> None:
    """Writing twice (in any input order) gives identical bytes: sorted keys, newline end."""
    first = write_artifacts(tmp_path / "a", "run-7", 1, [CLEAN, REPAIRED], PATTERNS)
    second = write_artifacts(tmp_path / "b", "run-7", 1, [REPAIRED, CLEAN], PATTERNS)
    for p, q in zip(first, second, strict=True):
        assert p.read_bytes() == q.read_bytes()
    raw = first[0].read_text(encoding="utf-8")
    assert raw.endswith("}\n") and raw.startswith('{\n  "critiques"')


def test_rewrite_removes_stale_repairs(tmp_path: Path) -> None:
    """Rewriting a worker with no repairs removes its earlier repairs.json."""
    write_artifacts(tmp_path, "run-7", 2, [REPAIRED], ())
    no_repairs = REPAIRED.model_copy(update={"attempts": ()})
    write_delegation_artifacts(tmp_path, "run-7", 2, no_repairs)
    folder = tmp_path / "runs" / "run-7" / "iterations" / "002" / "delegations" / "analyst_01"
    assert (folder / "critique.json").exists()
    assert not (folder / "repairs.json").exists()


@pytest.mark.parametrize("run_id", ["../x", "a/b", "..", "", ".hidden", "a b"])
def test_unsafe_run_id_refused(tmp_path: Path, run_id: str) -> None:
    """Run ids that are not safe identifiers never become paths."""
    with pytest.raises(SubmissionError):
        write_artifacts(tmp_path, run_id, 1, [], ())
    assert not (tmp_path / "runs").exists()


def test_unsafe_worker_id_refused(tmp_path: Path) -> None:
    """A worker id that could escape is refused before anything is written for it."""
    evil = CLEAN.model_copy(update={"worker_id": "../../etc"})
    with pytest.raises(SubmissionError, match="worker_id"):
        write_artifacts(tmp_path, "run-7", 1, [evil], ())
    assert not (tmp_path / "etc").exists()


def test_mismatched_run_and_bad_iteration_refused(tmp_path: Path) -> None:
    """Results from another run, or an iteration below 1, are refused."""
    other = CLEAN.model_copy(update={"run_id": "run-8"})
    with pytest.raises(SubmissionError, match="belongs to run"):
        write_artifacts(tmp_path, "run-7", 1, [other], ())
    with pytest.raises(SubmissionError, match="iteration"):
        write_artifacts(tmp_path, "run-7", 0, [CLEAN], ())


def test_symlinked_runs_folder_leaving_root_refused(tmp_path: Path) -> None:
    """A 'runs' folder that is a symlink out of the root is refused."""
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "runs")
    with pytest.raises(PathEscapeError):
        write_artifacts(root, "run-7", 1, [CLEAN], ())
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_atomic_batch_writes_every_file_and_leaves_no_temp_files(tmp_path: Path) -> None:
    """A batch over several folders writes each text exactly (UTF-8, \\n) and nothing else."""
    a, b = tmp_path / "x" / "a.md", tmp_path / "y" / "z" / "b.json"
    atomic_write_many([(a, "é\nline\n"), (b, "{}\n")])
    assert a.read_bytes() == "é\nline\n".encode() and b.read_text(encoding="utf-8") == "{}\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["a.md", "b.json"]


def test_a_failed_atomic_batch_changes_no_target_and_leaves_no_temp_files(
    tmp_path: Path,
) -> None:
    """When a later file of the batch cannot be written, an earlier target keeps its old
    content (nothing is renamed before every file is written) and no temp file stays."""
    a = tmp_path / "a.md"
    a.write_text("old\n", encoding="utf-8")
    (tmp_path / "blocker").write_text("a file, not a folder", encoding="utf-8")
    with pytest.raises(OSError):
        atomic_write_many([(a, "new\n"), (tmp_path / "blocker" / "b.md", "x")])
    assert a.read_text(encoding="utf-8") == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "blocker"]


def test_a_symlink_under_the_root_is_refused_even_when_it_stays_inside(tmp_path: Path) -> None:
    """No symlink under the root is followed: a run folder linked to another folder of the
    same root is refused too, naming the link, and nothing is written through it."""
    root = tmp_path / "root"
    (root / "runs" / "elsewhere").mkdir(parents=True)
    os.symlink(root / "runs" / "elsewhere", root / "runs" / "run-7")
    with pytest.raises(PathEscapeError, match=r"run-7' under the artifacts root .* is a symlink"):
        write_artifacts(root, "run-7", 1, [CLEAN], ())
    assert list((root / "runs" / "elsewhere").iterdir()) == []


def test_a_symlinked_target_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """CRITIQUE.md pre-created as a symlink to a file outside: refused, the outside file is
    unchanged, no other file of the batch is written and no temp file stays."""
    root, outside = tmp_path / "root", tmp_path / "victim.txt"
    outside.write_text("keep\n", encoding="utf-8")
    it = root / "runs" / "run-7" / "iterations" / "001"
    it.mkdir(parents=True)
    os.symlink(outside, it / "CRITIQUE.md")
    with pytest.raises(PathEscapeError, match=r"CRITIQUE\.md"):
        write_artifacts(root, "run-7", 1, [CLEAN], ())
    assert outside.read_text(encoding="utf-8") == "keep\n"
    assert [p.name for p in it.iterdir()] == ["CRITIQUE.md"]


def test_a_path_outside_the_root_is_refused(tmp_path: Path) -> None:
    """atomic_write_many with a root refuses a path that is not under it (or climbs out)."""
    root = tmp_path / "root"
    for path in (tmp_path / "other.md", root / ".." / "other.md"):
        with pytest.raises(PathEscapeError, match="not under"):
            atomic_write_many([(path, "x")], root=root)
    assert not (tmp_path / "other.md").exists()


def test_stale_repairs_are_removed_inside_the_root_only(tmp_path: Path) -> None:
    """Rewriting without repairs removes repairs.json through the confined folder; with the
    delegation folder swapped for a symlink, the removal is refused with the write."""
    write_artifacts(tmp_path, "run-7", 2, [REPAIRED], ())
    folder = tmp_path / "runs" / "run-7" / "iterations" / "002" / "delegations" / "analyst_01"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "repairs.json").write_text("[]\n", encoding="utf-8")
    for name in os.listdir(folder):
        os.unlink(folder / name)
    folder.rmdir()
    os.symlink(outside, folder)
    no_repairs = REPAIRED.model_copy(update={"attempts": ()})
    with pytest.raises(PathEscapeError, match="analyst_01"):
        write_delegation_artifacts(tmp_path, "run-7", 2, no_repairs)
    assert sorted(p.name for p in outside.iterdir()) == ["repairs.json"]


def test_critique_md_shows_worker_html_as_text() -> None:
    """Worker-made HTML, links and pipes in defects, summary and prescriptions are escaped."""
    evil = "<script>alert(1)</script>"
    bad = REPAIRED.model_copy(
        update={
            "envelope": REPAIRED.envelope.model_copy(
                update={
                    "defects": (
                        Defect(
                            category="incomplete",
                            severity="critical",
                            location="<b>x</b>.md:0",
                            description=f"the output reports an error: {evil}",
                            source="heuristic",
                        ),
                    ),
                    "summary": "![t](http://evil/p.png)",
                    "prescriptions": (f"Remove {evil}",),
                }
            )
        }
    )
    md = render_critique_md(manager_summary("run-7", 1, [bad], ()), [bad])
    assert "<script" not in md and "<b>" not in md and "![t](" not in md
    assert "| &lt;b&gt;x&lt;/b&gt;.md:0 | the output reports an error: &lt;script&gt;" in md
    assert "> !\\[t\\](http://evil/p.png)" in md
    assert "1. [×1] Remove &lt;script&gt;alert(1)&lt;/script&gt;" in md
