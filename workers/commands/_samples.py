"""The demo's sample run (``critique demo``): realistic worker outputs over three iterations.

A manager studies a market entry for a coffee subscription in German cities and fans the work
out to LLM workers. Their outputs carry the defects the pipeline exists for: JSON results with
missing fields, an ``error`` field, low or non-numeric confidence, empty strings, invalid JSON;
Markdown and LaTeX reports with placeholders, repeated paragraphs and duplicate headings; clean
ones; paper drafts for the rubric critic; near-hopeless ones that escalate. Every sample runs
on the token-free critics (heuristic, rubric) and the deterministic revisers, so the demo needs
no API key, and each one states the status and stop reason it must end with — the same through
the broker-free runner and through Celery workers.

The token-free reviser invents nothing: it repairs what it can fix exactly (a
verbatim repeated paragraph, a placeholder-only line, a duplicate heading, JSON in a code fence,
a confidence written as text) and ends everything else ``escalated`` / ``needs_model`` — a
missing field or section, an ``error`` field, a placeholder inside a sentence — so the manager
knows a model or a person must act. The rubric pair is the demo pair: its reviser writes the
critic's suggestions with stock text, and its results' notes say so.

Everything here is data: deterministic, JSON-safe, no I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.models import Status, StopReason, Submission

SampleCritic = Literal["heuristic", "rubric"]

DEMO_TOTAL_TOKENS = 400_000
"""The demo run's total token budget; repairs may spend ``repair_budget_fraction`` of it."""

REQUIRED = ("summary", "findings")
"""Output-contract fields every research worker is asked for."""

_JSON_TASK = (
    "Research {topic} for a coffee subscription launching in {city}. Return a JSON object with "
    "'summary', 'findings', 'sources' and a numeric 'confidence' between 0 and 1."
)
_REPORT_TASK = (
    "Write a Markdown report on {topic} for the coffee subscription launch, with the sections "
    "{sections}."
)


@dataclass(frozen=True)
class Sample:
    """One worker output of the demo run and the outcome it must have."""

    iteration: int
    worker_id: str
    kind: str
    """What is wrong with it (or not), in a few words, for the demo table."""
    task: str
    output: str | dict[str, Any]
    expected_status: Status
    expected_stop: StopReason
    claimed_format: Literal["json", "markdown", "latex", "text"] | None = None
    required_fields: tuple[str, ...] = REQUIRED
    critic: SampleCritic = "heuristic"
    files: tuple[dict[str, Any], ...] = field(default=())

    def submission(self, run_id: str) -> Submission:
        """The sample as a submission of run ``run_id``."""
        return Submission.model_validate(
            {
                "run_id": run_id,
                "iteration": self.iteration,
                "worker_id": self.worker_id,
                "subtask_signature": f"{self.worker_id}:{self.kind}",
                "task": self.task,
                "output": copy.deepcopy(self.output),
                "claimed_format": self.claimed_format,
                "required_fields": list(self.required_fields),
                "files": [dict(f) for f in self.files],
            }
        )


def overrides_for(critic: SampleCritic, total_tokens: int = DEMO_TOTAL_TOKENS) -> dict[str, Any]:
    """Configuration overrides for a sample's critic: token-free critic, deterministic reviser,
    and the run's total token budget (so the repair budget applies)."""
    return {
        "enabled": True,
        "critic": critic,
        "repairer": "deterministic",
        "max_repair_attempts": 2,
        "pattern_memory": True,
        "budget": {"total_tokens": total_tokens},
    }


def _json_task(topic: str, city: str) -> str:
    return _JSON_TASK.format(topic=topic, city=city)


def _report_task(topic: str, sections: tuple[str, ...]) -> str:
    names = ", ".join(s.replace("_", " ").title() for s in sections)
    return _REPORT_TASK.format(topic=topic, sections=names)


_REPEATED = (
    "Customers in every district told us that freshness matters more than price, that they "
    "would pay a small premium for beans roasted within the last week, and that a flexible "
    "delivery schedule is the feature most likely to keep them subscribed."
)

PAPER_DRAFT: dict[str, Any] = {
    "title": "Subscription Churn in Specialty Coffee",
    "abstract": "We study why specialty coffee subscribers cancel and report early results.",
    "originality_tag": "low",
    "sections": [
        {
            "id": "intro",
            "title": "Introduction",
            "body": "Subscriptions churn. Coffee subscriptions churn fast.",
            "figure_refs": [],
            "cites": [],
        },
        {
            "id": "data",
            "title": "Data",
            "body": "We collected 1,200 cancellation surveys from three roasters.",
            "figure_refs": [],
            "cites": [],
        },
        {
            "id": "results",
            "title": "Results",
            "body": "Delivery timing explained most cancellations.",
            "figure_refs": [],
            "cites": [],
        },
        {
            "id": "conclusion",
            "title": "Conclusion",
            "body": "Flexible delivery should reduce churn.",
            "figure_refs": [],
            "cites": [],
        },
    ],
}
"""A thin draft the rubric critic scores low on every dimension; its reviser reaches target."""

_LONG_TOPICS = (
    "Introduction",
    "Background",
    "Data",
    "Survey design",
    "Sampling",
    "Method",
    "Related work",
    "Results",
    "Churn drivers",
    "Delivery timing",
    "Pricing",
    "Discussion",
    "Limitations",
    "Conclusion",
)
LONG_PAPER_DRAFT: dict[str, Any] = {
    "title": "Churn in Coffee Subscriptions: A Survey of 1,200 Cancellations",
    "abstract": "We survey why specialty coffee subscribers cancel.",
    "originality_tag": "medium",
    "sections": [
        {
            "id": topic.lower().replace(" ", "-"),
            "title": topic,
            "body": f"This section on {topic.lower()} summarises what the roasters told us about "
            f"{topic.lower()} and how it shaped the analysis of churn in the survey of 1,200 "
            "subscribers.",
            "figure_refs": ["fig1"] if topic == "Results" else [],
            "cites": ["smith2020"] if topic == "Related work" else [],
        }
        for topic in _LONG_TOPICS
    ],
}
"""A long draft with thin sections: each repair adds a paragraph to one of fourteen sections, so
the second repair changes the draft by less than 5% and the loop stops at a fixpoint."""


ITERATION_1: tuple[Sample, ...] = (
    Sample(
        1,
        "prices-berlin",
        "clean JSON result",
        _json_task("retail coffee prices", "Berlin"),
        {
            "summary": "Specialty beans retail at 28-36 EUR per kg in Berlin.",
            "findings": "Prices are highest in Mitte; discounters do not stock specialty.",
            "sources": ["store survey, 14 shops", "roaster price lists"],
            "confidence": 0.91,
        },
        "accepted",
        "accepted",
        "json",
    ),
    Sample(
        1,
        "prices-frankfurt",
        "empty optional field",
        _json_task("retail coffee prices", "Frankfurt"),
        {
            "summary": "Specialty beans retail at 30-38 EUR per kg in Frankfurt.",
            "findings": "Office districts buy more whole beans than households do.",
            "sources": ["store survey, 9 shops"],
            "notes": "",
            "confidence": 0.88,
        },
        "accepted",
        "accepted",
        "json",
    ),
    Sample(
        1,
        "prices-munich",
        "JSON missing a required field",
        _json_task("retail coffee prices", "Munich"),
        {
            "summary": "Specialty beans retail at 32-40 EUR per kg in Munich.",
            "sources": ["store survey, 11 shops"],
            "confidence": 0.84,
        },
        "escalated",
        "needs_model",
        "json",
    ),
    Sample(
        1,
        "survey-hamburg",
        "JSON with an error field",
        _json_task("consumer demand", "Hamburg"),
        {
            "summary": "About a third of respondents buy specialty coffee monthly.",
            "findings": "Demand is strongest among 25-40 year olds.",
            "sources": ["online panel"],
            "confidence": 0.7,
            "error": "survey API returned HTTP 503 after 3 retries; sample is partial",
        },
        "escalated",
        "needs_model",
        "json",
    ),
    Sample(
        1,
        "competitors-berlin",
        "low confidence, empty field",
        _json_task("competing subscriptions", "Berlin"),
        {
            "summary": "Four roasters already sell subscriptions in Berlin.",
            "findings": "Two of them deliver by bike within the Ring.",
            "sources": ["company websites"],
            "notes": "",
            "confidence": 0.2,
        },
        "accepted_with_warnings",
        "accepted",
        "json",
    ),
    Sample(
        1,
        "report-draft",
        "Markdown with a placeholder-only line",
        _report_task("the launch plan", REQUIRED),
        "# Launch plan\n\n## Summary\n\nWe launch in Berlin first, then Munich.\n\n"
        "## Findings\n\nRetention after three months is 71% in the pilot.\n\n- TBD\n",
        "repaired",
        "accepted",
        "markdown",
    ),
    Sample(
        1,
        "market-overview",
        "Markdown with duplicate headings",
        _report_task("the market overview", REQUIRED),
        "# Market overview\n\n## Summary\n\nThe market is growing by about 8% a year.\n\n"
        "## Findings\n\nSubscriptions are a small but fast-growing channel.\n\n"
        "## Findings\n\nMost subscribers are found through social media.\n",
        "repaired",
        "accepted",
        "markdown",
    ),
    Sample(
        1,
        "churn-paper",
        "paper draft (rubric demo pair)",
        "Write a short paper on subscription churn in specialty coffee.",
        PAPER_DRAFT,
        "repaired",
        "target",
        "json",
        required_fields=(),
        critic="rubric",
    ),
    Sample(
        1,
        "logistics-munich",
        "near-hopeless JSON",
        _json_task("delivery logistics", "Munich"),
        {
            "summary": "",
            "error": "courier rate API rejected the credentials; nothing was retrieved",
        },
        "escalated",
        "escalate_band",
        "json",
    ),
)
"""The outputs of iteration 1, each with the outcome it must have."""


ITERATION_2: tuple[Sample, ...] = (
    Sample(
        2,
        "prices-hamburg",
        "JSON missing confidence",
        _json_task("retail coffee prices", "Hamburg"),
        {
            "summary": "Specialty beans retail at 29-35 EUR per kg in Hamburg.",
            "findings": "The harbour districts have the most independent roasters.",
            "sources": ["store survey, 10 shops"],
        },
        "escalated",
        "needs_model",
        "json",
    ),
    Sample(
        2,
        "survey-berlin",
        "JSON missing a field, empty summary",
        _json_task("consumer demand", "Berlin"),
        {
            "summary": " ",
            "sources": ["street interviews, 120 people"],
            "confidence": 0.66,
        },
        "escalated",
        "needs_model",
        "json",
    ),
    Sample(
        2,
        "report-berlin",
        "Lorem ipsum inside a paragraph",
        _report_task("the Berlin launch", REQUIRED),
        "# Berlin launch\n\n## Summary\n\nBerlin is the first city.\n\n## Findings\n\n"
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n",
        "escalated",
        "needs_model",
        "markdown",
    ),
    Sample(
        2,
        "interviews",
        "Markdown repeating a paragraph",
        _report_task("the customer interviews", REQUIRED),
        "# Customer interviews\n\n## Summary\n\nWe interviewed 40 customers in Berlin and "
        f"Munich.\n\n## Findings\n\n{_REPEATED}\n\n{_REPEATED}\n",
        "repaired",
        "accepted",
        "markdown",
    ),
    Sample(
        2,
        "report-munich",
        "clean Markdown report",
        _report_task("the Munich launch", REQUIRED),
        "# Munich launch\n\n## Summary\n\nMunich follows Berlin after eight weeks.\n\n"
        "## Findings\n\nPrices there support a premium tier at 39 EUR a month.\n",
        "accepted",
        "accepted",
        "markdown",
    ),
    Sample(
        2,
        "competitors-munich",
        "confidence given as a word",
        _json_task("competing subscriptions", "Munich"),
        {
            "summary": "Two roasters sell subscriptions in Munich.",
            "findings": "Neither offers weekly delivery.",
            "sources": ["company websites"],
            "confidence": "high",
        },
        "accepted_with_warnings",
        "accepted",
        "json",
    ),
    Sample(
        2,
        "regulation-check",
        "empty output",
        _report_task("food labelling rules", ("summary",)),
        "",
        "escalated",
        "needs_model",
        "markdown",
        required_fields=("summary",),
    ),
    Sample(
        2,
        "pricing-tiers",
        "JSON in a code fence, trailing comma",
        _json_task("the pricing tiers", "Berlin"),
        '```json\n{"tiers": [19, 29, 39], "currency": "EUR", "billing": "monthly",}\n```\n',
        "repaired",
        "accepted",
        "json",
        required_fields=(),
    ),
    Sample(
        2,
        "pricing-model",
        "truncated JSON text",
        _json_task("the pricing model", "Berlin"),
        "{'summary': 'Three tiers at 19, 29 and 39 EUR', 'confidence': 0.8,",
        "escalated",
        "needs_model",
        "json",
        required_fields=(),
    ),
)
"""The outputs of iteration 2, each with the outcome it must have."""


ITERATION_3: tuple[Sample, ...] = (
    Sample(
        3,
        "prices-cologne",
        "clean JSON result",
        _json_task("retail coffee prices", "Cologne"),
        {
            "summary": "Specialty beans retail at 27-34 EUR per kg in Cologne.",
            "findings": "The Belgian Quarter has the densest cafe scene.",
            "sources": ["store survey, 8 shops"],
            "confidence": 0.93,
        },
        "accepted",
        "accepted",
        "json",
    ),
    Sample(
        3,
        "survey-cologne",
        "confidence as text, empty fields",
        _json_task("consumer demand", "Cologne"),
        {
            "summary": "Demand is similar to Hamburg's.",
            "findings": "Students prefer the smallest tier.",
            "sources": "",
            "notes": "",
            "caveats": "",
            "confidence": "0.72",
        },
        "repaired",
        "accepted",
        "json",
    ),
    Sample(
        3,
        "delivery-costs",
        "error field, low confidence",
        _json_task("delivery costs", "Cologne"),
        {
            "summary": "Bike couriers cost 4.10 EUR per drop inside the ring.",
            "findings": "Parcel lockers halve the cost outside it.",
            "sources": ["courier quotes"],
            "confidence": 0.25,
            "error": "one courier quote timed out",
        },
        "escalated",
        "needs_model",
        "json",
    ),
    Sample(
        3,
        "summary-latex",
        "LaTeX with a placeholder author",
        "Write the executive summary in LaTeX with Summary and Findings sections.",
        "\\documentclass{article}\n\\title{Executive summary}\n\\author{Author Name}\n"
        "\\begin{document}\n\\maketitle\n\\section{Summary}\nLaunch in Berlin and Munich.\n"
        "\\section{Findings}\nFreshness beats price for our customers.\n\\end{document}\n",
        "escalated",
        "needs_model",
        "latex",
    ),
    Sample(
        3,
        "report-final",
        "repeated paragraph, missing section",
        _report_task("the final recommendation", ("summary", "findings", "recommendation")),
        "# Final report\n\n## Summary\n\nLaunch in Berlin, then Munich.\n\n## Findings\n\n"
        f"{_REPEATED}\n\n{_REPEATED}\n",
        "escalated",
        "needs_model",
        "markdown",
        required_fields=("summary", "findings", "recommendation"),
    ),
    Sample(
        3,
        "exec-summary",
        "Markdown missing a section",
        _report_task("the executive summary", REQUIRED),
        "# Executive summary\n\n## Summary\n\nWe recommend a Berlin launch in spring with a "
        "29 EUR tier.\n",
        "escalated",
        "needs_model",
        "markdown",
    ),
    Sample(
        3,
        "churn-paper-long",
        "long paper, repairs too small (rubric)",
        "Write a paper on subscription churn in specialty coffee.",
        LONG_PAPER_DRAFT,
        "failed",
        "repair_fixpoint_detected",
        "json",
        required_fields=(),
        critic="rubric",
    ),
    Sample(
        3,
        "competitors-cologne",
        "near-hopeless JSON",
        _json_task("competing subscriptions", "Cologne"),
        {"error": "search provider rate-limited the worker", "confidence": 0.1},
        "escalated",
        "escalate_band",
        "json",
    ),
)
"""The outputs of iteration 3, each with the outcome it must have."""


def demo_samples() -> tuple[Sample, ...]:
    """Every sample of the demo run, iteration by iteration (deterministic)."""
    return (*ITERATION_1, *ITERATION_2, *ITERATION_3)


def iterations(samples: tuple[Sample, ...]) -> list[int]:
    """The iterations the samples cover, in order."""
    return sorted({s.iteration for s in samples})
