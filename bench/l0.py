"""Layer-0 contract benchmark: all six default checks on generated Markdown of 1, 10 and 50 MB.

Run: ``.venv/bin/python bench/l0.py`` (``--quick`` for 1 and 10 MB only, ``--sizes 1 10``).
Prints, per size and with/without a planted repeated paragraph: the median time of the whole
suite (compiled scanner), the shared scan and each check's own share, MB/s, and whether the
planted loop was found; then a baseline row per size (the pure-Python reference scanner, same
checks, same answers), the time of each check run alone at 10 MB, and the measured recall of
the near-duplicate index and of the text-loop check itself.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.contract import ContractSuite, build_suite, compiled_available
from pipeline.contract.checks import BUILTIN_CHECKS
from pipeline.contract.models import ContractInput
from pipeline.text import simhash

MB = 1_000_000

_FUNCTION = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "this",
    "which",
    "it",
    "be",
    "are",
]
_SUBJECTS = [
    "the committee",
    "our analysis",
    "the harbour authority",
    "this report",
    "the survey team",
    "each region",
    "the pilot programme",
    "the second cohort",
    "local operators",
    "the model",
    "the field crew",
    "the review board",
    "most households",
    "the sensor network",
    "the regional office",
]
_VERBS = [
    "examined",
    "recorded",
    "estimated",
    "compared",
    "revised",
    "documented",
    "measured",
    "questioned",
    "confirmed",
    "reported",
    "modelled",
    "sampled",
    "outlined",
    "reconciled",
    "audited",
    "projected",
    "traced",
    "ranked",
]
_NOUNS = [
    "rainfall",
    "freight volumes",
    "school enrolment",
    "repair costs",
    "energy demand",
    "river levels",
    "ticket sales",
    "clinic visits",
    "grain prices",
    "bridge loads",
    "turbine output",
    "wait times",
    "survey responses",
    "soil moisture",
    "bus ridership",
    "water quality",
    "housing starts",
    "crop yields",
    "injury rates",
    "broadband uptake",
    "fish stocks",
    "parcel delays",
    "patient outcomes",
    "tax receipts",
]
_ADJ = [
    "seasonal",
    "unexpected",
    "gradual",
    "regional",
    "persistent",
    "modest",
    "sharp",
    "uneven",
    "recent",
    "historical",
    "projected",
    "observed",
    "weighted",
    "adjusted",
    "provisional",
    "marginal",
    "sustained",
    "localised",
]
_CONNECT = [
    "However,",
    "In contrast,",
    "As a result,",
    "Meanwhile,",
    "For this reason,",
    "Notably,",
    "In practice,",
    "Taken together,",
    "At the same time,",
    "By comparison,",
    "Even so,",
    "Later that year,",
]
_PLACES = [
    "Aldgate",
    "Brenton",
    "Calder",
    "Dunmore",
    "Elsworth",
    "Farrow",
    "Glenmoor",
    "Harwick",
    "Ilston",
    "Jarrow",
]


def _word(r: random.Random) -> str:
    """A pseudo-word, so paragraphs carry distinct content beyond the fixed vocabulary."""
    syll = ["ka", "lo", "ren", "ti", "mar", "sel", "qu", "dor", "vin", "ash", "el", "po", "ru"]
    return "".join(r.choice(syll) for _ in range(r.randint(2, 4)))


def _sentence(r: random.Random) -> str:
    parts = []
    if r.random() < 0.3:
        parts.append(r.choice(_CONNECT))
    subj = r.choice(_SUBJECTS)
    parts.append(subj[0].upper() + subj[1:] if not parts else subj)
    parts.append(r.choice(_VERBS))
    parts.append(f"the {r.choice(_ADJ)} {r.choice(_NOUNS)}")
    parts.append(f"{r.choice(['in', 'near', 'across', 'around'])} {r.choice(_PLACES)}")
    for _ in range(r.randint(1, 4)):
        parts.append(r.choice(_FUNCTION))
        parts.append(r.choice([_word(r), r.choice(_NOUNS), r.choice(_ADJ)]))
    if r.random() < 0.25:
        parts.append(f"(about {r.randint(2, 98)} per cent)")
    if r.random() < 0.15:
        parts.append(f"using `{_word(r)}_{r.randint(1, 9)}`")
    return " ".join(parts) + r.choice([".", ".", ".", ";", "!"]).replace(";", ".")


def _paragraph(r: random.Random) -> str:
    return " ".join(_sentence(r) for _ in range(r.randint(2, 7)))


def _code(r: random.Random) -> str:
    name = _word(r)
    return (
        "```python\n"
        f"def {name}(values: list[float]) -> dict[str, float]:\n"
        f'    """Summarise {name}."""\n'
        "    total = sum(values)\n"
        f'    return {{"total": total, "mean": total / max(len(values), {r.randint(1, 9)})}}\n'
        "```"
    )


def generate_markdown(size: int, seed: int = 0, planted: bool = False) -> str:
    """Realistic Markdown of about ``size`` characters: distinct paragraphs, unique headings,
    lists, links and code fences. ``planted`` repeats one paragraph verbatim and once more with
    one word changed, far apart."""
    r = random.Random(seed)
    blocks: list[str] = [f"# Field report {seed}"]
    n = 0
    section = 0
    total = len(blocks[0])
    while total < size:
        if n % 12 == 0:
            section += 1
            blocks.append(f"## {section}. {r.choice(_NOUNS).capitalize()} in {r.choice(_PLACES)}")
        kind = r.random()
        if kind < 0.08:
            block = "\n".join(
                f"- {r.choice(_ADJ).capitalize()} {r.choice(_NOUNS)} ([source](https://example.org/{_word(r)}))"
                for _ in range(r.randint(2, 5))
            )
        elif kind < 0.11:
            block = _code(r)
        else:
            block = _paragraph(r)
        blocks.append(block)
        total += len(block) + 2
        n += 1
    if planted:
        prose = [i for i, b in enumerate(blocks) if not b.startswith(("#", "-", "```"))]
        src = blocks[prose[len(prose) // 5]]
        while len(src.split()) < 40:
            src = src + " " + _sentence(r)
        blocks[prose[len(prose) // 5]] = src
        words = src.split()
        words[len(words) // 2] = "regrettably"
        blocks.insert(prose[len(prose) // 2], src)
        blocks.insert(prose[(4 * len(prose)) // 5], " ".join(words))
    return "\n\n".join(blocks) + "\n"


def _median_run(
    suite: ContractSuite, doc: ContractInput, runs: int
) -> tuple[float, float, dict[str, float], bool, int]:
    """Median wall and CPU milliseconds of ``runs`` suite runs, per-check medians, loop found."""
    times: list[float] = []
    cpu: list[float] = []
    parts: dict[str, list[float]] = {}
    loop = False
    nfail = 0
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        report = suite.run([doc])
        times.append(1000 * (time.perf_counter() - t0))
        cpu.append(1000 * (time.process_time() - c0))
        for k, v in report.check_ms.items():
            parts.setdefault(k, []).append(v)
        loop = any(f.check == "no_text_loop" for f in report.failures)
        nfail = len(report.failures)
    return (
        statistics.median(times),
        statistics.median(cpu),
        {k: statistics.median(v) for k, v in parts.items()},
        loop,
        nfail,
    )


def _index_recall(n: int, distances: range, planted: int = 300, seed: int = 7) -> dict[int, float]:
    """Share of planted near pairs (exactly ``d`` bits apart) the index finds, per ``d``."""
    r = random.Random(seed)
    out = {}
    for d in distances:
        fps = [r.getrandbits(64) for _ in range(n)]
        targets = r.sample(range(n // 2, n), planted)
        for t in targets:
            src = fps[r.randrange(0, n // 2)]
            for b in r.sample(range(64), d):
                src ^= 1 << b
            fps[t] = src
        nearest = simhash.nearest_earlier(fps, simhash.TEXT_LOOP_MAX_DISTANCE)
        out[d] = sum(nearest[t] >= 0 for t in targets) / planted
    return out


def _loop_distances(samples: int = 400, seed: int = 3) -> dict[str, list[int]]:
    """Hamming distance between a generated paragraph and a copy with one word changed."""
    r = random.Random(seed)
    buckets: dict[str, list[int]] = {"20-39": [], "40-79": [], "80+": []}
    while min(len(v) for v in buckets.values()) < samples:
        p = _paragraph(r)
        words = p.split()
        n = len(words)
        if n < 20:
            continue
        key = "20-39" if n < 40 else "40-79" if n < 80 else "80+"
        if len(buckets[key]) >= samples:
            continue
        changed = list(words)
        changed[r.randrange(n)] = "regrettably"
        buckets[key].append(
            simhash.hamming(simhash.fingerprint(p), simhash.fingerprint(" ".join(changed)))
        )
    return buckets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 10, 50], help="sizes in MB")
    parser.add_argument("--quick", action="store_true", help="1 and 10 MB only")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = [1, 10] if args.quick else args.sizes
    if not compiled_available():
        print("WARNING: the compiled scanner is not built; timing the pure-Python one only.")
        print("         build it with: .venv/bin/python setup.py build_ext --inplace\n")
    suite = build_suite()
    engine = "c" if compiled_available() else "python"
    fast = ContractSuite(suite.checks, engine=engine)
    slow = ContractSuite(suite.checks, engine="python")
    short = {
        "scan": "scan",
        "no_placeholder": "ph",
        "no_text_loop": "loop",
        "file_size_delta": "size",
        "no_duplicate_headings": "head",
        "balanced_delimiters": "delim",
        "json_valid_if_claimed": "json",
    }
    print(f"engine: {engine}; median of {args.runs} runs (3 at 50 MB); all six default checks\n")
    header = (
        f"{'size':>6} {'planted':>7} {'engine':>7} {'median ms':>10} {'cpu ms':>7} {'MB/s':>7} "
        + " ".join(f"{v:>6}" for v in short.values())
        + f" {'loop found':>10} {'failures':>8}"
    )
    print(header)
    print("-" * len(header))
    docs: dict[int, ContractInput] = {}
    for size in sizes:
        for planted in (False, True):
            text = generate_markdown(size * MB, seed=size, planted=planted)
            doc = ContractInput(text=text, claimed_format="markdown", previous_size=len(text))
            if size == 10 and not planted:
                docs[size] = doc
            runs = 3 if size >= 50 else args.runs
            med, cpu, parts, loop, nfail = _median_run(fast, doc, runs)
            mbs = len(text.encode()) / MB / (med / 1000)
            cols = " ".join(f"{parts.get(k, 0.0):6.1f}" for k in short)
            print(
                f"{size:>4}MB {'yes' if planted else 'no':>7} {engine:>7} {med:10.1f} {cpu:7.1f} "
                f"{mbs:7.1f} "
                f"{cols} {'yes' if loop else 'no':>10} {nfail:>8}"
            )
        if engine == "c" and size <= 10:
            text = generate_markdown(size * MB, seed=size, planted=True)
            doc = ContractInput(text=text, claimed_format="markdown", previous_size=len(text))
            med, cpu, parts, loop, nfail = _median_run(slow, doc, 1)
            mbs = len(text.encode()) / MB / (med / 1000)
            cols = " ".join(f"{parts.get(k, 0.0):6.1f}" for k in short)
            print(
                f"{size:>4}MB {'yes':>7} {'python':>7} {med:10.1f} {cpu:7.1f} {mbs:7.1f} "
                f"{cols} {'yes' if loop else 'no':>10} {nfail:>8}   <- baseline"
            )
    if 10 in docs:
        print("\neach check alone (its own scan, only what it needs), 10 MB, median ms:")
        for name, cls in BUILTIN_CHECKS.items():
            alone = ContractSuite([cls()], engine=engine)
            med, cpu, _, _, _ = _median_run(alone, docs[10], args.runs)
            print(f"  {name:<24} {med:8.1f} (cpu {cpu:.1f})")
    print("\nnear-duplicate index recall (planted pairs exactly d bits apart, k = 9):")
    for n in (16_000, 80_000):
        rec = _index_recall(n, range(0, 11))
        print(f"  n={n:>6}: " + "  ".join(f"d{d}={v:.3f}" for d, v in rec.items()))
    print("\none word changed in a generated paragraph: Hamming distance to the original")
    for key, ds in _loop_distances().items():
        ds.sort()
        within = sum(d <= simhash.TEXT_LOOP_MAX_DISTANCE for d in ds) / len(ds)
        print(
            f"  {key:>5} words: median {statistics.median(ds):4.1f}, 90th pct "
            f"{ds[int(0.9 * len(ds))]:3d}, flagged (≤9) {100 * within:5.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
