"""Simhash fingerprints, the fixpoint threshold and the linear near-duplicate index."""

from __future__ import annotations

import random

import pytest

from pipeline.text import simhash

needs_c = pytest.mark.fastscan


def brute_pairs(fps: list[int], k: int) -> list[tuple[int, int]]:
    n = len(fps)
    return [
        (i, j) for i in range(n) for j in range(i + 1, n) if simhash.hamming(fps[i], fps[j]) <= k
    ]


def brute_nearest(fps: list[int], k: int) -> list[int]:
    out = []
    for j, f in enumerate(fps):
        out.append(next((i for i in range(j) if simhash.hamming(fps[i], f) <= k), -1))
    return out


def planted(n: int, k: int, seed: int) -> list[int]:
    """Random fingerprints with a quarter of them copied from earlier ones, 0..k+2 bits flipped."""
    r = random.Random(seed)
    fps = [r.getrandbits(64) for _ in range(n)]
    for t in r.sample(range(1, n), n // 4):
        src = fps[r.randrange(t)]
        for b in r.sample(range(64), r.randint(0, k + 2)):
            src ^= 1 << b
        fps[t] = src
    return fps


def test_hamming_and_similarity() -> None:
    """Hamming counts differing bits; similarity is 1 - hamming/64."""
    assert simhash.hamming(0b1011, 0b0001) == 2
    assert simhash.hamming(0, (1 << 64) - 1) == 64
    assert simhash.similarity(5, 5) == 1.0
    assert simhash.similarity(0, 0b111) == 1 - 3 / 64


def test_fixpoint_threshold_is_hamming_three() -> None:
    """Similarity ≥ 0.95 is a fixpoint: Hamming 3 (0.953) is, Hamming 4 (0.9375) is not."""
    base = random.Random(1).getrandbits(64)
    assert simhash.is_fixpoint_fingerprints(base, base ^ 0b111)
    assert not simhash.is_fixpoint_fingerprints(base, base ^ 0b1111)


def test_is_fixpoint_on_texts() -> None:
    """Identical outputs are a fixpoint; unrelated outputs are not."""
    a = "The repaired report lists every station with its readings and the dates they were taken."
    assert simhash.is_fixpoint(a, a)
    assert simhash.is_fixpoint(a, a.replace("  ", " ") + " ")
    assert not simhash.is_fixpoint(a, "A completely different answer about bread, ovens and flour.")


def test_fingerprint_is_stable_and_case_folds_ascii() -> None:
    """The same words give the same fingerprint; ASCII case and spacing do not matter."""
    text = "Alpha beta gamma delta epsilon"
    assert simhash.fingerprint(text) == simhash.fingerprint("alpha  BETA\ngamma delta\tepsilon")
    assert simhash.fingerprint(text) != simhash.fingerprint("alpha beta gamma delta zeta")
    assert simhash.fingerprint("") == 0


def test_short_texts_use_word_features() -> None:
    """Under three words the features are the word hashes themselves."""
    one = simhash.word_hash("hello")
    assert simhash.fingerprint_py("hello") == one
    assert simhash.fingerprint_py("a b") == simhash.combine(
        [simhash.word_hash("a"), simhash.word_hash("b")]
    )


@needs_c
def test_compiled_fingerprint_matches_python() -> None:
    """The C fingerprint equals the reference for short, long, Unicode and odd-space texts."""
    r = random.Random(3)
    vocab = ["a", "Bb", "ccc", "é", "日本語", "\U0001f600x", "TODO", "x_y", "Σίσυφος"]
    seps = [" ", "\n", "\t", "\u2003", "\x1c", "  "]
    for n in [0, 1, 2, 3, 4, 5, 50, 3000]:
        for _ in range(20):
            text = "".join(r.choice(vocab) + r.choice(seps) for _ in range(n))
            assert simhash.fingerprint(text) == simhash.fingerprint_py(text), text


@pytest.mark.parametrize("k", [0, 1, 3, 9])
@pytest.mark.parametrize("n", [40, 700])
def test_near_duplicate_pairs_equal_brute_force(k: int, n: int) -> None:
    """The banded index returns exactly the brute-force pairs (small n and indexed n)."""
    fps = planted(n, k, seed=n + k)
    expected = brute_pairs(fps, k)
    assert simhash._near_py(fps, k, True) == expected
    assert simhash.near_duplicate_pairs(fps, k) == expected
    assert expected  # the planted copies make the comparison meaningful


@pytest.mark.parametrize("k", [3, 9])
def test_nearest_earlier_equals_brute_force(k: int) -> None:
    """For each fingerprint, the smallest earlier index within k (or -1), as brute force says."""
    fps = planted(900, k, seed=k)
    expected = brute_nearest(fps, k)
    assert simhash._near_py(fps, k, False) == expected
    assert simhash.nearest_earlier(fps, k) == expected


@needs_c
def test_random_fingerprints_within_three_bits_match_brute_force() -> None:
    """On 3000 random fingerprints with planted pairs, distance ≤ 3 matches brute force."""
    fps = planted(3000, 3, seed=11)
    assert simhash.near_duplicate_pairs(fps, 3) == brute_pairs(fps, 3)


@needs_c
def test_large_inputs_keep_the_documented_guarantee() -> None:
    """Past the exact regime every pair within guaranteed_distance is still found, and every
    reported pair is a true one."""
    n, k = 40_000, 9
    guaranteed = simhash.guaranteed_distance(n, k)
    assert 7 <= guaranteed < k
    r = random.Random(5)
    fps = [r.getrandbits(64) for _ in range(n)]
    targets = r.sample(range(n // 2, n), 200)
    for t in targets:
        src = fps[r.randrange(n // 2)]
        for b in r.sample(range(64), guaranteed):
            src ^= 1 << b
        fps[t] = src
    nearest = simhash.nearest_earlier(fps, k)
    assert all(nearest[t] >= 0 for t in targets)
    assert all(simhash.hamming(fps[i], fps[j]) <= k for j, i in enumerate(nearest) if i >= 0)


def test_many_identical_fingerprints_stay_cheap() -> None:
    """Thousands of identical fingerprints (a looping output) each point at the first one."""
    fps = [12345] * 5000 + [random.Random(2).getrandbits(64)]
    nearest = simhash.nearest_earlier(fps, 9)
    assert nearest[0] == -1 and set(nearest[1:5000]) == {0}
    assert simhash._near_py(fps, 9, False) == nearest


def test_guaranteed_distance_is_exact_for_small_inputs() -> None:
    """Up to ~25 000 fingerprints the index is exact at distance 9."""
    assert simhash.guaranteed_distance(100) == 9
    assert simhash.guaranteed_distance(20_000) == 9
    assert simhash.near_blocks(20_000, 9) == 11
