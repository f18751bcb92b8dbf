"""The round's defect diff: which critical and warning defects a round fixed, kept, found new,
or saw come back (see docs/pipeline.md, "Defect diff per round").

Defects are matched by (category, location) as :class:`~pipeline.models.DefectRef`, never by
id or wording, so a critic that rephrases a defect does not make it new.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.models import Defect, DefectRef


def sorted_refs(refs: Iterable[DefectRef]) -> tuple[DefectRef, ...]:
    """``refs`` deduplicated and sorted by their (category, location) key."""
    return tuple(sorted(set(refs), key=lambda r: r.key))


def defect_refs(defects: Iterable[Defect]) -> tuple[DefectRef, ...]:
    """Defects by (category, location), deduplicated and sorted."""
    return sorted_refs(DefectRef(category=d.category, location=d.location) for d in defects)


def defect_diff(
    previous: Iterable[DefectRef],
    current: Iterable[DefectRef],
    ever_fixed: Iterable[DefectRef] = (),
) -> dict[str, tuple[DefectRef, ...]]:
    """The round's defect diff, matched by (category, location).

    ``fixed``: in the previous round, gone now; ``remaining``: in both; ``new``: here now, not
    in the previous round and never fixed before; ``regressed``: here now, not in the previous
    round, but fixed in an earlier round. ``new`` and ``regressed`` are disjoint."""
    before = {r.key: r for r in previous}
    now = {r.key: r for r in current}
    fixed_before = {r.key for r in ever_fixed}
    appeared = [r for k, r in now.items() if k not in before]
    return {
        "fixed": sorted_refs(r for k, r in before.items() if k not in now),
        "remaining": sorted_refs(r for k, r in now.items() if k in before),
        "new": sorted_refs(r for r in appeared if r.key not in fixed_before),
        "regressed": sorted_refs(r for r in appeared if r.key in fixed_before),
    }
