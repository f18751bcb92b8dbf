"""Layer-0 contract: the six default checks, the suite, extensions, and the conversions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from pipeline.config import ExtraCheck, OutputContractConfig
from pipeline.contract import (
    DEFAULT_CHECKS,
    ContractSuite,
    build_suite,
    check_submission,
    output_text,
    run_contract,
)
from pipeline.contract.models import ContractFailure, ContractInput
from pipeline.errors import ConfigError, ExtensionLoadError
from pipeline.models import FileRef, Submission
from tests.support import require_fastscan

ENGINES = [
    "python",
    pytest.param("c", marks=pytest.mark.fastscan),
]

LONG = (
    "The survey team walked the length of the eastern embankment twice, measuring the height of "
    "the water against painted marks on the bridge piers, photographing every crack in the stone "
    "facing, and interviewing the lock keeper about how quickly the river had risen during the "
    "storms of the previous autumn and what the council had promised to repair afterwards."
)


def run(text: str, engine: str = "python", **kw: Any) -> list[ContractFailure]:
    suite = build_suite(engine=engine)
    return list(suite.run([ContractInput(text=text, **kw)]).failures)


def of(failures: Iterable[ContractFailure], check: str) -> list[ContractFailure]:
    return [f for f in failures if f.check == check]


# ---- no_placeholder --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("Fix this TODO later.", ["TODO"]),
        ("Budget: TBD.", ["TBD"]),
        ("TODOS are listed below.", []),
        ("MASTODON is a network.", []),
        ("todo list and tbd-ish", []),
        ("my_TODO_marker stays", []),
        ("(TODO) and TODO: done", ["TODO", "TODO"]),
        ("Why??? Because.", ["???"]),
        ("Really?? no", []),
        ("What?????", ["?????"]),
        ("FIXME: XXX here", ["FIXME", "XXX"]),
        ("XXXX is not XXX-rated", ["XXX"]),
        ("lorem IPSUM dolor", ["lorem IPSUM"]),
        ("Lorem\n  ipsum", ["Lorem\n  ipsum"]),
        ("# Title goes here", ["Title goes here"]),
        ("by Author Name, 2024", ["Author Name"]),
        ("the author name field", []),
        ("Details: To be   filled.", ["To be   filled"]),
        ("a sentence to be filledin", []),
        ("naïveTODO résuméTBD", []),
        ("—TODO—", ["TODO"]),
    ],
)
def test_placeholder_whole_word_rules(engine: str, text: str, found: list[str]) -> None:
    """Placeholders match as whole words with the documented case rules, nothing else."""
    failures = of(run(text, engine), "no_placeholder")
    assert [
        text[f.offset : f.offset + len(w)] for f, w in zip(failures, found, strict=False)
    ] == found
    assert len(failures) == len(found)


def test_placeholder_reports_context_and_offset() -> None:
    """A placeholder failure names the match, shows its surroundings and its character offset."""
    text = "é" * 5 + " the function body is TODO for now"
    [f] = of(run(text), "no_placeholder")
    assert f.offset == text.index("TODO")
    assert "'TODO'" in f.reason and "function body is TODO for now" in f.reason
    assert f.severity == "error"


def test_placeholder_failures_are_capped_with_a_summary() -> None:
    """Hundreds of placeholders give 20 failures plus one saying how many were left out."""
    failures = of(run("TODO " * 300), "no_placeholder")
    assert len(failures) == 21
    assert failures[-1].reason.startswith("280 more")


# ---- disguised placeholders (pipeline/text/textnorm.py) ------------------------------------------

DISGUISED = [
    ("Intro \x1b[31mTODO\x1b[0m later.", "TODO"),  # ANSI colour around the word
    ("Budget: \x1b[1;33mTBD\x1b[m.", "TBD"),
    ("Intro TO\u200bDO later.", "TO\u200bDO"),  # zero-width space inside
    ("Fix F\u00adIX\u2060ME", "F\u00adIX\u2060ME"),  # soft hyphen, word joiner
    ("Intro ＴＯＤＯ later.", "ＴＯＤＯ"),  # fullwidth
    (
        "Intro \U0001d413\U0001d40e\U0001d403\U0001d40e later.",
        "\U0001d413\U0001d40e\U0001d403\U0001d40e",
    ),
    ("Intro ТОDО later.", "ТОDО"),  # Cyrillic Т and О around a Latin D
    ("Intro \ua4d4\ua4f3\ua4d3\ua4f3 later.", "\ua4d4\ua4f3\ua4d3\ua4f3"),  # all Lisu
    ("Intro \u1d1b\u1d0f\u1d05\u1d0f later.", "\u1d1b\u1d0f\u1d05\u1d0f"),  # small capitals
    ("Intro \u13a2\u2c9e\u13a0\u2c9e later.", "\u13a2\u2c9e\u13a0\u2c9e"),  # Cherokee, Coptic
    ("Intro \U0001f183\U0001f17e\U0001f173\U0001f17e.", "\U0001f183\U0001f17e\U0001f173\U0001f17e"),
    ("Intro \u202eODOT\u202c later.", "ODOT"),  # an override displays it as TODO
    ("Intro \u2067EMXIF\u2069 later.", "EMXIF"),  # the same inside an isolate
]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("text", "shown"), DISGUISED)
def test_disguised_placeholders_are_found_at_their_original_offset(
    engine: str, text: str, shown: str
) -> None:
    """ANSI-wrapped, zero-width-split, fullwidth, mathematical and look-alike placeholders are
    flagged; the offset and the quoted match are the original text's."""
    [f] = of(run(text, engine), "no_placeholder")
    assert f.offset == text.index(shown)
    assert repr(shown) in f.reason


def test_ansi_wrapped_todo_reports_the_offset_of_the_word() -> None:
    """The offset points at the T of TODO, after the escape sequence, not at the ESC."""
    text = "\x1b[31mTODO\x1b[0m"
    [f] = of(run(text), "no_placeholder")
    assert f.offset == 5 and text[f.offset : f.offset + 4] == "TODO"


def test_disguised_placeholder_reason_says_how_it_reads() -> None:
    """The failure quotes the disguised text and says what it reads as."""
    [f] = of(run("ＴＯＤＯ"), "no_placeholder")
    assert "'ＴＯＤＯ' (reads 'TODO')" in f.reason


def test_reversed_placeholder_reason_says_how_it_displays() -> None:
    """A placeholder an override displays reversed is quoted as stored and read as shown."""
    [f] = of(run("Next: \u202eODOT\u202c."), "no_placeholder")
    assert "'ODOT' (reads 'TODO')" in f.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_stored_and_display_order_hits_are_each_counted_once(engine: str) -> None:
    """A TODO in stored order inside an override run, and one only the display shows: two
    failures, each once; a palindrome such as XXX read both ways is one."""
    text = "a \u202eTODO ODOT\u202c b \u202eXXX\u202c"
    failures = of(run(text, engine), "no_placeholder")
    assert [f.offset for f in failures] == [3, 8, text.index("XXX")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "text",
    [
        "Съешь же ещё этих мягких французских булок, да выпей чаю. ХХХ век, ТОТ САМЫЙ.",
        "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο. ΤΟ ΧΧΧ.",
        "\x1b[32mPASS\x1b[0m all 12 tests; \x1b[1mdone\x1b[0m",
        "naïve café — “quoted” … todo list ½ ﬁne",
        "日本語のテキスト、ＴＯＤＯＳ、全角。",
        "עברית \u202bשלום TODOS\u202c, \u202eabc\u202c, a\u2067b\u2069",  # bidi, no placeholder
        "IPA [\u026ap\u0251] and \u1d0fk, Cherokee \u13a3\u13cd\u13d7 text",
    ],
)
def test_normalisation_adds_no_false_placeholders(engine: str, text: str) -> None:
    """Russian and Greek prose, coloured test output, typography and CJK text stay clean."""
    assert of(run(text, engine), "no_placeholder") == []


def test_ansi_todo_inside_a_dict_output_is_found() -> None:
    """A dict output is checked as JSON, where ESC is escaped: the TODO is still flagged, at
    its offset in that JSON text."""
    sub = submission(output={"summary": "Sales rose \x1b[31mTODO\x1b[0m.", "confidence": 0.9})
    [f] = of(check_submission(build_suite(), sub).failures, "no_placeholder")
    text = output_text(sub.output)
    assert f.offset == text.index("TODO")


def test_raw_and_disguised_hits_are_not_double_counted() -> None:
    """A plain TODO next to an ANSI-wrapped one: two failures, each once, in text order."""
    text = "TODO and \x1b[31mTODO\x1b[0m and é"
    failures = of(run(text), "no_placeholder")
    assert [f.offset for f in failures] == [0, text.index("TODO", 1)]


# ---- no_duplicate_headings -------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_duplicate_markdown_headings_case_and_whitespace_insensitive(engine: str) -> None:
    """'# Results' and '##   results ' are the same heading; the second one is reported."""
    text = "# Results\n\nbody\n\n##   results  \n\nmore\n\n### Other\n"
    [f] = of(run(text, engine), "no_duplicate_headings")
    assert f.offset == text.index("##")
    assert "2 times" in f.reason and "first at offset 0" in f.reason


@pytest.mark.parametrize("engine", ENGINES)
def test_duplicate_latex_sections(engine: str) -> None:
    """\\section{Method} and \\subsection*{ method } duplicate; \\section{Methods} does not."""
    text = "\\section{Method}\ntext\n\\subsection*{ method }\n\\section[short]{Methods}\n"
    [f] = of(run(text, engine, claimed_format="latex"), "no_duplicate_headings")
    assert f.offset == text.index("\\subsection")


@pytest.mark.parametrize("engine", ENGINES)
def test_headings_inside_code_fences_do_not_count(engine: str) -> None:
    """A '# comment' line inside a fenced block is code, not a heading."""
    text = "# Setup\n\n```bash\n# Setup\necho hi\n```\n\n~~~\n# Setup\n~~~\n"
    assert of(run(text, engine), "no_duplicate_headings") == []


def test_heading_closing_sequence_and_sharp_titles() -> None:
    """'## C# ##' has title 'C#' (closing run stripped), same as '# c#'; '#hashtag' is text."""
    text = "## C# ##\n\n# c#\n\n#hashtag\n\n#hashtag\n"
    [f] = of(run(text), "no_duplicate_headings")
    assert "'C#'" in f.reason


def test_headings_not_checked_in_python() -> None:
    """Repeated '# comment' lines in a Python file are not headings."""
    text = "# setup\nx = 1\n# setup\n"
    assert of(run(text, path="a.py"), "no_duplicate_headings") == []


# ---- balanced_delimiters ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_delimiters_in_fences_and_inline_code_do_not_count(engine: str) -> None:
    """Unbalanced brackets inside ``` fences and `code` spans are ignored in prose."""
    text = "Call `f(` then ``g[`` as shown:\n\n```\nif (x {\n```\n\nAll (balanced) here.\n"
    assert of(run(text, engine), "balanced_delimiters") == []


@pytest.mark.parametrize("engine", ENGINES)
def test_apostrophes_are_not_strings_in_prose(engine: str) -> None:
    """In prose, quotes do not hide brackets: "it's (x" is an unclosed '(' warning."""
    text = "It's a \"quote (with\" a paren and don't (forget)."
    [f] = of(run(text, engine), "balanced_delimiters")
    assert f.severity == "warning"
    assert f.offset == text.index("(with")


@pytest.mark.parametrize("engine", ENGINES)
def test_delimiters_in_code_strings_do_not_count(engine: str) -> None:
    """Python strings/comments and JSON strings hide their brackets; the rest must balance."""
    py = "s = 'a(' + \"]\" + '''\n{{\n'''  # ) comment\nf(s)\n"
    assert of(run(py, engine, path="m.py"), "balanced_delimiters") == []
    js = '{"a": "[(", "b": [1, 2]}'
    assert of(run(js, engine, path="d.json"), "balanced_delimiters") == []


@pytest.mark.parametrize("engine", ENGINES)
def test_delimiter_severity_by_format(engine: str) -> None:
    """An unclosed '(' is an error for Python/JSON (by path or claim) and a warning in prose."""
    text = "print((1)\n"
    assert of(run(text, engine, path="a.py"), "balanced_delimiters")[0].severity == "error"
    assert (
        of(run(text, engine, claimed_format="python"), "balanced_delimiters")[0].severity == "error"
    )
    assert (
        of(run(text, engine, claimed_format="markdown"), "balanced_delimiters")[0].severity
        == "warning"
    )
    [f] = of(run("[1, 2]]", engine, claimed_format="json"), "balanced_delimiters")
    assert f.severity == "error" and f.offset == 6 and "first unmatched ']'" in f.reason


def test_report_ok_ignores_warnings() -> None:
    """Warnings are reported but the report stays ok; an error makes it not ok."""
    suite = build_suite()
    warn = suite.run([ContractInput(text="a (b")])
    assert warn.warnings and warn.ok
    err = suite.run([ContractInput(text="a (b", path="x.py")])
    assert err.errors and not err.ok


# ---- json_valid_if_claimed -------------------------------------------------------------------


def test_invalid_json_claimed_reports_position() -> None:
    """Claimed JSON that does not parse fails with the parser's message and offset."""
    text = '{"a": 1,\n "b": }'
    [f] = of(run(text, claimed_format="json"), "json_valid_if_claimed")
    assert f.offset == text.index("}")
    assert "line 2 column 7" in f.reason


def test_json_paths_must_parse_and_valid_json_passes() -> None:
    """A .json file is checked even unclaimed; valid JSON and non-JSON prose pass."""
    assert of(run("nope", path="data/out.JSON"), "json_valid_if_claimed")
    assert of(run('{"ok": [1, 2]}', path="a.json"), "json_valid_if_claimed") == []
    assert of(run("{not json} but prose"), "json_valid_if_claimed") == []


# ---- file_size_delta -------------------------------------------------------------------------


def test_size_delta_boundary_is_two_and_a_half() -> None:
    """Exactly 2.5× the previous size passes; one byte more fails; no previous size, no check."""
    assert of(run("x" * 2500, previous_size=1000), "file_size_delta") == []
    [f] = of(run("x" * 2501, previous_size=1000), "file_size_delta")
    assert "2.50×" in f.reason and f.offset is None
    assert of(run("x" * 10_000), "file_size_delta") == []


def test_size_delta_ignores_small_absolute_growth() -> None:
    """A tiny output that gains a field (54 → 300 bytes) is not a runaway repair: the growth
    must also exceed 1 KiB; 100 → 1125 bytes (growth 1025) does fire."""
    assert of(run("x" * 300, previous_size=54), "file_size_delta") == []
    assert of(run("x" * 1124, previous_size=100), "file_size_delta") == []
    assert of(run("x" * 1125, previous_size=100), "file_size_delta")


def test_size_delta_counts_utf8_bytes() -> None:
    """Sizes are UTF-8 bytes: 1251 two-byte characters (2502 bytes) exceed 2.5 × 1000."""
    assert of(run("é" * 1251, previous_size=1000), "file_size_delta")
    assert of(run("é" * 1250, previous_size=1000), "file_size_delta") == []


# ---- no_text_loop ----------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_verbatim_repeat_is_a_loop(engine: str) -> None:
    """A paragraph repeated word for word is flagged at the repeat's offset."""
    text = f"{LONG}\n\nSomething else entirely, short.\n\n{LONG}\n"
    [f] = of(run(text, engine), "no_text_loop")
    assert f.offset == text.rindex("The survey team")
    assert "offset 0" in f.reason and f.severity == "error"


@pytest.mark.parametrize("engine", ENGINES)
def test_one_word_changed_repeat_is_a_loop(engine: str) -> None:
    """A repeat with one word changed is still within the simhash distance and flagged."""
    changed = LONG.replace("photographing", "sketching")
    text = f"{LONG}\n\n{changed}\n"
    [f] = of(run(text, engine), "no_text_loop")
    assert f.offset == len(LONG) + 2


@pytest.mark.parametrize("engine", ENGINES)
def test_short_repeats_are_ignored(engine: str) -> None:
    """Paragraphs under 20 words may repeat (signatures, list items)."""
    short = "Thanks again for reading, and see you next week with more notes from the field."
    assert len(short.split()) < 20
    assert of(run(f"{short}\n\n{short}\n\n{short}", engine), "no_text_loop") == []


def test_text_loop_skips_code_and_fenced_blocks() -> None:
    """Similar blocks in Python files or inside fences are not prose loops."""
    assert of(run(f"{LONG}\n\n{LONG}", path="gen.py"), "no_text_loop") == []
    fenced = f"{LONG}\n\n```\n{LONG}\n```\n"
    assert of(run(fenced), "no_text_loop") == []


def test_many_repeats_are_capped() -> None:
    """An output that loops 50 times reports 20 repeats and a summary of the rest."""
    failures = of(run("\n\n".join([LONG] * 50)), "no_text_loop")
    assert len(failures) == 21 and failures[-1].reason.startswith("29 more")


# ---- suite and configuration -----------------------------------------------------------------


def test_default_suite_has_the_six_checks() -> None:
    """`checks: [default]` expands to the six built-in checks in a fixed order."""
    assert build_suite().names == DEFAULT_CHECKS
    assert set(DEFAULT_CHECKS) == {
        "no_placeholder",
        "no_text_loop",
        "file_size_delta",
        "no_duplicate_headings",
        "balanced_delimiters",
        "json_valid_if_claimed",
    }


def test_checks_can_be_named_individually() -> None:
    """Naming checks selects just those, once each."""
    suite = build_suite(OutputContractConfig(checks=("no_placeholder", "no_placeholder")))
    assert suite.names == ("no_placeholder",)
    assert (
        run_contract(suite, [ContractInput(text="a (TODO")]).failures[0].check == "no_placeholder"
    )
    assert len(run_contract(suite, [ContractInput(text="a (TODO")]).failures) == 1


def test_unknown_check_is_a_config_error_listing_allowed_names() -> None:
    """An unknown check name raises ConfigError naming it and the allowed ones."""
    with pytest.raises(ConfigError) as err:
        build_suite(OutputContractConfig(checks=("default", "no_typos")))
    assert "no_typos" in str(err.value) and "no_placeholder" in str(err.value)


class ShoutCheck:
    """An extension check (a class, instantiated with no arguments)."""

    name = "ignored-own-name"

    def __call__(self, doc: ContractInput) -> Iterable[ContractFailure]:
        if doc.text.isupper():
            yield ContractFailure(
                check="no_shouting", severity="warning", reason="all caps", path=doc.path, offset=0
            )


def exploding_check(doc: ContractInput) -> list[ContractFailure]:
    """An extension check (a function) that is broken."""
    raise RuntimeError("boom")


def returns_a_string(doc: ContractInput) -> str:
    """An extension check returning the wrong type."""
    return "fine"


NOT_CALLABLE = 42


def extra(name: str, attr: str) -> OutputContractConfig:
    return OutputContractConfig(
        checks=("no_placeholder",),
        extra=(ExtraCheck(name=name, implementation=f"{__name__}:{attr}"),),
    )


def test_extension_checks_load_from_configuration() -> None:
    """`extra` entries import module:Callable; classes are instantiated, functions called."""
    suite = build_suite(extra("no_shouting", "ShoutCheck"))
    assert suite.names == ("no_placeholder", "no_shouting")
    report = suite.run([ContractInput(text="STOP", path="a.txt")])
    assert [(f.check, f.severity, f.path) for f in report.failures] == [
        ("no_shouting", "warning", "a.txt")
    ]


@pytest.mark.parametrize("attr", ["exploding_check", "returns_a_string"])
def test_a_broken_check_fails_closed(attr: str) -> None:
    """A check that raises or returns garbage becomes an error naming it, never a pass."""
    suite = build_suite(extra("fragile", attr))
    report = suite.run([ContractInput(text="fine text", path="f.md")])
    [f] = report.failures
    assert (f.check, f.severity, f.path) == ("fragile", "error", "f.md")
    assert "failing closed" in f.reason
    assert not report.ok


@pytest.mark.parametrize(
    ("implementation", "message"),
    [
        ("no_such_module_xyz:Check", "cannot import module 'no_such_module_xyz'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_implementation_is_an_extension_load_error(implementation: str, message: str) -> None:
    """An extension that cannot be imported or called stops suite construction, naming it."""
    config = OutputContractConfig(extra=(ExtraCheck(name="x", implementation=implementation),))
    with pytest.raises(ExtensionLoadError) as err:
        build_suite(config)
    assert message in str(err.value) and "'x'" in str(err.value)


def test_duplicate_extension_names_are_rejected() -> None:
    """Two checks may not share a name (their failures would be indistinguishable)."""
    with pytest.raises(ConfigError):
        build_suite(
            OutputContractConfig(
                extra=(ExtraCheck(name="no_placeholder", implementation=f"{__name__}:ShoutCheck"),)
            )
        )


def test_engines_agree_on_a_mixed_document() -> None:
    """The compiled and pure-Python scanners give the same failures for every check."""
    require_fastscan()
    text = (
        f"# Intro\n\nTODO: {LONG}\n\n## intro\n\n```py\n# Intro\nx = (\n```\n\n"
        f"Unclosed (paren and `code [` span.\n\n{LONG}\n\n\\section{{Intro}}\n"
    )
    docs = [ContractInput(text=text), ContractInput(text=text, path="x.tex")]
    a = ContractSuite(build_suite().checks, engine="c").run(docs).failures
    b = ContractSuite(build_suite().checks, engine="python").run(docs).failures
    assert a == b and len(a) >= 4


# ---- conversions and submissions -------------------------------------------------------------


def test_failure_to_defect_and_gate_event() -> None:
    """Errors become critical defects (source l0) and reject gate events with L0 fields."""
    f = ContractFailure(
        check="no_placeholder", severity="error", reason="placeholder 'TODO'", path="r.md", offset=7
    )
    d = f.to_defect()
    assert (d.source, d.severity, d.category, d.location) == (
        "l0",
        "critical",
        "incomplete",
        "r.md:7",
    )
    w = ContractFailure(check="balanced_delimiters", severity="warning", reason="x").to_defect()
    assert (w.severity, w.category, w.location) == ("warning", "wrong_format", "output")
    assert (
        ContractFailure(check="no_text_loop", severity="error", reason="x", offset=3)
        .to_defect()
        .location
        == "output:3"
    )
    ev = f.to_gate_event(iteration=2, worker_id="w1")
    assert (ev.gate, ev.verdict, ev.l0_check, ev.l0_reason, ev.violating_path) == (
        "l0",
        "reject",
        "no_placeholder",
        "placeholder 'TODO'",
        "r.md",
    )
    assert (ev.iteration, ev.worker_id) == (2, "w1")


def submission(**kw: object) -> Submission:
    base: dict[str, object] = {"run_id": "r1", "worker_id": "w1", "task": "write", "output": "ok"}
    base.update(kw)
    return Submission.model_validate(base)


def test_check_submission_covers_output_and_inline_files() -> None:
    """The output and each text file are checked under their own paths; a binary blob is not."""
    sub = submission(
        output="Draft with TODO",
        files=[
            FileRef(path="notes.md", size=4, content="TBD."),
            FileRef(path="big.bin", size=10_000, blob="sha256:" + "ab" * 32),
            FileRef(path="cfg.json", size=3, content="{x}"),
        ],
    )
    binary = b"\x89TODO \xff\xfe {{{" * 100
    report = check_submission(build_suite(), sub, read_file=lambda f: binary)
    got = {(f.path, f.check) for f in report.failures}
    assert got == {
        (None, "no_placeholder"),
        ("notes.md", "no_placeholder"),
        ("cfg.json", "json_valid_if_claimed"),
    }


def test_check_submission_dict_output_is_json_and_override_and_previous_size() -> None:
    """A dict output is checked as JSON; `output` overrides it; previous_size is output-only."""
    sub = submission(
        output={"items": ["a (", "b"]}, files=[FileRef(path="f.txt", size=400, content="y" * 400)]
    )
    assert check_submission(build_suite(), sub).failures == ()
    assert output_text({"é": 1}) == '{\n  "é": 1\n}'
    report = check_submission(build_suite(), sub, output="z" * 3000, previous_size=1000)
    assert [(f.path, f.check) for f in report.failures] == [(None, "file_size_delta")]


def test_chance_fingerprint_collisions_are_not_loops_but_real_repeats_still_are() -> None:
    """A near fingerprint with unrelated text is ignored; a later true repeat is still found."""
    from pipeline.contract._scan import MODE_MD, ScanResult
    from pipeline.contract.checks import NoTextLoop

    other = LONG.replace("survey team", "harbour crew").replace("bridge", "ferry")
    unrelated = " ".join(reversed(LONG.split()))
    text = f"{unrelated}\n\n{other}\n\n{other}\n"
    a, b, c = 0, len(unrelated) + 2, len(unrelated) + len(other) + 4
    x = 0x0123456789ABCDEF
    paras = [
        (a, a + len(unrelated), 58, x),
        (b, b + len(other), 58, x ^ 0b110),
        (c, c + len(other), 58, x ^ 0b101),
    ]
    result = ScanResult([], 0, paras, [], ((0, 0, -1, -1),) * 3)
    failures = NoTextLoop().evaluate(ContractInput(text=text), MODE_MD, result)
    assert [(f.offset, f"offset {b}" in f.reason) for f in failures] == [(c, True)]
