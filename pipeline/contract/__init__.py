"""Layer-0 output contract: deterministic, token-free checks before any critic.

``build_suite(config)`` turns ``observability.output_contract`` into a :class:`ContractSuite`;
``run_contract`` / ``check_submission`` run it and return a :class:`ContractReport` whose
failures convert to defects (``to_defect``) and gate events (``to_gate_event``). A failed check
is data; an exception means the suite could not be built (``ConfigError``,
``ExtensionLoadError``). A check that raises while running fails closed: it becomes an error
failure naming the broken check, never a silent pass.

The built-in checks share one scan of each document (compiled when ``_fastscan`` is built, see
``_scan.py``); extension checks (``module:Callable``, imported only from configuration, never
from a submission) are called with each :class:`ContractInput`.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline.config import OutputContractConfig
from pipeline.contract import _scan
from pipeline.contract.checks import BUILTIN_CHECKS, BuiltinCheck
from pipeline.contract.models import (
    ContractFailure,
    ContractInput,
    ContractReport,
    OutputContractCheck,
)
from pipeline.errors import ConfigError, ExtensionLoadError
from pipeline.llm.tokens import text_of
from pipeline.models import Submission
from pipeline.records.files import FileReader, file_text
from pipeline.records.files import read_file as read_file_bytes

__all__ = [
    "DEFAULT_CHECKS",
    "ContractSuite",
    "build_suite",
    "check_submission",
    "compiled_available",
    "output_text",
    "run_contract",
]

DEFAULT_CHECKS: tuple[str, ...] = tuple(BUILTIN_CHECKS)
compiled_available = _scan.compiled_available


class _ExtensionCheck:
    """A configured ``module:Callable`` under its configured name."""

    def __init__(self, name: str, implementation: str, fn: Any) -> None:
        self.name = name
        self.implementation = implementation
        self._fn = fn

    def __call__(self, doc: ContractInput) -> Iterable[ContractFailure]:
        result: Iterable[ContractFailure] = self._fn(doc)
        return result

    def __repr__(self) -> str:
        return f"<extension check {self.name} = {self.implementation}>"


def load_extension(name: str, implementation: str) -> OutputContractCheck:
    """Import ``package.module:Callable``; a class is instantiated with no arguments.

    Raises :class:`~pipeline.errors.ExtensionLoadError` naming the check when the module or
    attribute is missing, the class cannot be built, or the result is not callable.
    """
    module_name, _, attr = implementation.partition(":")
    where = f"output_contract.extra check {name!r} ({implementation})"
    if not module_name or not attr:
        raise ExtensionLoadError(
            f"{where}: implementation must look like 'package.module:Callable'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ExtensionLoadError(
            f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}",
            hint="install the package or fix the module path",
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ExtensionLoadError(
                f"{where}: module {module_name!r} has no attribute {attr!r}"
            ) from exc
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ExtensionLoadError(
                f"{where}: cannot instantiate {attr} with no arguments: {exc}"
            ) from exc
    if not callable(obj):
        raise ExtensionLoadError(f"{where}: {attr} is not callable")
    return _ExtensionCheck(name, implementation, obj)


def _coerce(produced: Any, check: str, doc: ContractInput) -> list[ContractFailure]:
    """A check's return value as failures; None means none. Anything else is a broken check."""
    if produced is None:
        return []
    if isinstance(produced, ContractFailure | Mapping | str | bytes):
        raise TypeError(f"returned {type(produced).__name__}, not an iterable of ContractFailure")
    out: list[ContractFailure] = []
    for item in produced:
        if isinstance(item, ContractFailure):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(ContractFailure.model_validate({"path": doc.path, **item}))
        else:
            raise TypeError(f"yielded {type(item).__name__}, not a ContractFailure")
    return out


class ContractSuite:
    """An ordered set of checks; built-ins share one scan per document."""

    def __init__(self, checks: Sequence[OutputContractCheck], *, engine: str = "auto") -> None:
        names = [c.name for c in checks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(
                f"output_contract: check name(s) {dup} used twice; names must be unique",
                key="output_contract.extra",
            )
        if engine not in ("auto", "c", "python"):
            raise ValueError(f"engine must be 'auto', 'c' or 'python', not {engine!r}")
        self.checks: tuple[OutputContractCheck, ...] = tuple(checks)
        self.engine = engine
        self._want = 0
        for c in self.checks:
            if isinstance(c, BuiltinCheck):
                self._want |= c.want

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.checks)

    @classmethod
    def from_config(
        cls, config: OutputContractConfig | None = None, *, engine: str = "auto"
    ) -> ContractSuite:
        """``checks: [default]`` means the six built-ins; names pick them individually."""
        config = config or OutputContractConfig()
        selected: list[OutputContractCheck] = []
        for name in config.checks:
            names = DEFAULT_CHECKS if name == "default" else (name,)
            for n in names:
                if n not in BUILTIN_CHECKS:
                    raise ConfigError(
                        f"unknown output_contract check {n!r}; allowed: "
                        f"{', '.join(('default', *DEFAULT_CHECKS))} (or an 'extra' entry)",
                        key="output_contract.checks",
                    )
                if n not in [c.name for c in selected]:
                    selected.append(BUILTIN_CHECKS[n]())
        for extra in config.extra:
            selected.append(load_extension(extra.name, extra.implementation))
        return cls(selected, engine=engine)

    def run(self, items: Sequence[ContractInput]) -> ContractReport:
        """Run every check on every item; a check that raises fails closed."""
        t0 = time.perf_counter()
        failures: list[ContractFailure] = []
        check_ms: dict[str, float] = {}
        for doc in items:
            mode = _scan.mode_for(doc.path, doc.claimed_format)
            result = None
            if self._want:
                ts = time.perf_counter()
                try:
                    result = _scan.scan(doc.text, mode, self._want, engine=self.engine)
                except Exception as exc:
                    failures.append(_broken("scan", doc, exc))
                check_ms["scan"] = check_ms.get("scan", 0.0) + 1000 * (time.perf_counter() - ts)
            for check in self.checks:
                ts = time.perf_counter()
                try:
                    if isinstance(check, BuiltinCheck):
                        if check.want and result is None:
                            continue
                        found = check.evaluate(doc, mode, result)
                    else:
                        found = _coerce(check(doc), check.name, doc)
                except Exception as exc:
                    found = [_broken(check.name, doc, exc)]
                failures.extend(found)
                ms = 1000 * (time.perf_counter() - ts)
                check_ms[check.name] = check_ms.get(check.name, 0.0) + ms
        return ContractReport(
            failures=tuple(failures),
            elapsed_ms=1000 * (time.perf_counter() - t0),
            check_ms=check_ms,
        )

    def __repr__(self) -> str:
        return f"ContractSuite({list(self.names)})"


def _broken(name: str, doc: ContractInput, exc: Exception) -> ContractFailure:
    return ContractFailure(
        check=name,
        severity="error",
        reason=f"check {name!r} raised {type(exc).__name__}: {exc}; failing closed",
        path=doc.path,
        offset=None,
        category="policy_violation",
    )


def build_suite(
    config: OutputContractConfig | None = None, *, engine: str = "auto"
) -> ContractSuite:
    """The suite configured by ``observability.output_contract`` (defaults: the six checks)."""
    return ContractSuite.from_config(config, engine=engine)


def run_contract(suite: ContractSuite, items: Sequence[ContractInput]) -> ContractReport:
    """Run ``suite`` over ``items``."""
    return suite.run(items)


def output_text(output: str | dict[str, Any]) -> str:
    """The canonical text of an output: the string itself, or the dict as indented JSON
    (:func:`pipeline.llm.tokens.text_of`)."""
    return text_of(output)


def check_submission(
    suite: ContractSuite,
    submission: Submission,
    output: str | dict[str, Any] | None = None,
    previous_size: int | None = None,
    read_file: FileReader | None = None,
) -> ContractReport:
    """Check a submission's output (or ``output``, e.g. a repair's) and every text file.

    A dict output is checked as JSON. ``previous_size`` applies to the output only. Every file
    is read through ``read_file`` (:mod:`pipeline.records.files`; default: inline content only), so
    a file held by reference is checked exactly like an inline one; binary files (bytes that are
    not UTF-8, unless the name says text) are not scanned. A file whose content cannot be read
    (a missing or expired blob, or a blob and no reader that follows it) raises
    :class:`~pipeline.records.files.UnreadableFileError`: never skipped in silence.
    """
    out = submission.output if output is None else output
    claimed = "json" if isinstance(out, dict) else submission.claimed_format
    items = [
        ContractInput(
            text=output_text(out), path=None, claimed_format=claimed, previous_size=previous_size
        )
    ]
    for f in submission.files:
        data = None if f.content is not None else read_file_bytes(f, read_file)
        text = file_text(f, data)
        if text is not None:
            items.append(ContractInput(text=text, path=f.path))
    return suite.run(items)
