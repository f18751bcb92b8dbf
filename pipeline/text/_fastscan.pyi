"""Types of the compiled Layer-0 scanner (pipeline/text/_fastscan.c)."""

def scan(
    text: str, mode: int, want: int, min_words: int, max_hits: int, /
) -> tuple[
    list[tuple[int, int, int]],
    int,
    list[tuple[int, int, int, int]],
    list[tuple[int, int, int]],
    tuple[tuple[int, int, int, int], ...],
]: ...
def fingerprint(text: str, /) -> int: ...
def near(fps: bytes, max_distance: int, all_pairs: bool, /) -> list[object]: ...
