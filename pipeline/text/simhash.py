"""64-bit simhash over word 3-gram shingles, and a linear near-duplicate index.

Features: words are maximal runs of non-whitespace (``str.split()``), ASCII letters folded to
lower case; a word hashes to a rotate-xor of its code points (:func:`word_hash`); a 3-gram shingle
``(a, b, c)`` to ``fmix64(a ^ rotl(b, 21) ^ rotl(c, 42))``. Bit ``i`` of the fingerprint is set
when more than half of the features have it set. Texts of one or two words use the word hashes
as features; an empty text has fingerprint 0. Shingles rather than single words because distinct
paragraphs of real prose share most of their vocabulary but few of their word triples: with
single words, distinct paragraphs of ordinary license texts came within Hamming 5–9 of each
other; with word 3-grams the closest distinct pairs sit at 16 or more.

The compiled module ``pipeline.text._fastscan`` computes the same numbers when it is built;
this module is the reference (numpy is imported lazily, only for large inputs without it).

Near duplicates (:func:`near_duplicate_pairs`, :func:`nearest_earlier`) use multi-index
hashing, never an all-pairs loop: the 64 bits are cut into ``B`` disjoint blocks and every pair
of blocks keys one table (``B·(B-1)/2`` tables); only fingerprints that agree exactly on a
table's two blocks are compared. Two fingerprints ``d`` bits apart touch at most ``d`` blocks,
so with ``B = k + 2`` every pair within ``k`` agrees on two blocks and is found: the search is
*exact*. That choice (55 tables of ~12-bit keys for ``k = 9``) is kept while a key leaves about
8 random fingerprints per bucket, i.e. up to ~25 000 fingerprints for ``k = 9``. Beyond that
``B`` shrinks (:func:`near_blocks`) so keys lengthen with ``log2 n`` and the work stays linear;
the guarantee then drops to ``d ≤ B - 2`` (:func:`guaranteed_distance`; ``k = 9``: ``d ≤ 8``
up to ~57 000 fingerprints, ``d ≤ 7`` up to ~150 000), and a pair farther apart is still found
whenever its differing bits leave two blocks untouched. Measured by ``bench/l0.py`` with
80 000 fingerprints (``B = 9``): all pairs at ``d ≤ 7``, 99.3 % at ``d = 8``, 95.3 % at ``d = 9``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from itertools import combinations
from typing import Any

from pipeline.text.compiled import FASTSCAN

MASK64 = (1 << 64) - 1
WORD_SEED = 0xCBF29CE484222325
WORD_MUL = 0x9E3779B97F4A7C15
TEXT_LOOP_MAX_DISTANCE = 9
"""Similarity > 0.85 on 64 bits: Hamming distance ≤ 9."""
FIXPOINT_MIN_SIMILARITY = 0.95
"""Consecutive repair outputs at least this similar are a fixpoint (Hamming ≤ 3)."""

_BRUTE_FORCE_MAX = 256


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finaliser: spreads every input bit over the whole word."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK64
    k ^= k >> 33
    return k


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK64


def word_hash(word: str) -> int:
    """Hash of one word: ``h = rotl(h, 7) ^ (code point × WORD_MUL)`` per character, ASCII
    A-Z folded to lower case (cheap to chain in C; the shingle hash mixes it afterwards)."""
    h = WORD_SEED
    for ch in word:
        o = ord(ch)
        if 65 <= o <= 90:
            o += 32
        h = (((h << 7) | (h >> 57)) & MASK64) ^ ((o * WORD_MUL) & MASK64)
    return h


def shingle_hash(a: int, b: int, c: int) -> int:
    """Hash of the word 3-gram whose word hashes are ``a, b, c`` (order-sensitive)."""
    return fmix64(a ^ _rotl(b, 21) ^ _rotl(c, 42))


def features(words: Sequence[str]) -> list[int]:
    """Simhash features of a word sequence: 3-gram shingles, or the words under three words."""
    hs = [word_hash(w) for w in words]
    if len(hs) < 3:
        return hs
    return [shingle_hash(hs[i], hs[i + 1], hs[i + 2]) for i in range(len(hs) - 2)]


def combine(feats: Sequence[int]) -> int:
    """Majority vote per bit: bit ``i`` is set when more than half of the features have it."""
    n = len(feats)
    if n == 0:
        return 0
    counts = [0] * 64
    for f in feats:
        b = 0
        while f:
            if f & 1:
                counts[b] += 1
            f >>= 1
            b += 1
    fp = 0
    for b, c in enumerate(counts):
        if 2 * c > n:
            fp |= 1 << b
    return fp


def fingerprint_py(text: str) -> int:
    """Pure-Python :func:`fingerprint` (the reference the compiled one is tested against)."""
    return fingerprints([text.split()])[0]


def fingerprints(paragraphs: Sequence[Sequence[str]]) -> list[int]:
    """Fingerprints of word lists: plain Python for a few words, numpy for many."""
    if sum(len(p) for p in paragraphs) <= 2000:
        return [combine(features(p)) for p in paragraphs]
    return fingerprints_numpy(paragraphs)


def fingerprint(text: str) -> int:
    """64-bit simhash of ``text``'s word 3-gram shingles (word features under three words)."""
    ext = FASTSCAN
    if ext is not None:
        return int(ext.fingerprint(text))
    return fingerprint_py(text)


def fingerprints_numpy(paragraphs: Sequence[Sequence[str]]) -> list[int]:
    """Fingerprints of many word lists at once, vectorised with numpy (same numbers as above)."""
    import numpy as np

    vocab: dict[str, int] = {}
    ids: list[int] = []
    lengths: list[int] = []
    for words in paragraphs:
        lengths.append(len(words))
        for w in words:
            h = vocab.get(w)
            if h is None:
                h = vocab[w] = word_hash(w)
            ids.append(h)
    out = [0] * len(paragraphs)
    if not ids:
        return out
    hs = np.array(ids, dtype=np.uint64)
    lens = np.array(lengths, dtype=np.int64)
    ends = np.cumsum(lens)
    starts = ends - lens
    # Global shingles over consecutive words; keep only those inside one paragraph.
    u21, u42 = np.uint64(21), np.uint64(42)
    a, b, c = hs[:-2], hs[1:-1], hs[2:]
    with np.errstate(over="ignore"):
        mixed = a ^ ((b << u21) | (b >> np.uint64(43))) ^ ((c << u42) | (c >> np.uint64(22)))
        sh = _fmix64_np(np, mixed) if len(mixed) else mixed
    long_paras = np.nonzero(lens >= 3)[0]
    if len(long_paras):
        counts = lens[long_paras] - 2
        first = starts[long_paras]
        offsets = np.repeat(first - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        sel = np.arange(int(counts.sum()), dtype=np.int64) + offsets
        feats = sh[sel]
        seg = np.concatenate(([0], np.cumsum(counts)[:-1]))
        fps = _majority_np(np, feats, seg, counts)
        for k, p in enumerate(long_paras.tolist()):
            out[p] = fps[k]
    for p in np.nonzero((lens > 0) & (lens < 3))[0].tolist():
        s = int(starts[p])
        out[p] = combine([int(x) for x in hs[s : s + int(lens[p])]])
    return out


def _fmix64_np(np: Any, k: Any) -> Any:
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xFF51AFD7ED558CCD)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(0xC4CEB9FE1A85EC53)
    return k ^ (k >> np.uint64(33))


def _majority_np(np: Any, feats: Any, seg: Any, counts: Any) -> list[int]:
    """Per-segment majority vote of 64-bit features (segments are contiguous and non-empty)."""
    fp = np.zeros(len(seg), dtype=np.uint64)
    one = np.uint64(1)
    for bit in range(64):
        col = ((feats >> np.uint64(bit)) & one).astype(np.int64)
        ones = np.add.reduceat(col, seg)
        fp |= (2 * ones > counts).astype(np.uint64) << np.uint64(bit)
    return [int(x) for x in fp]


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two 64-bit fingerprints."""
    return ((a ^ b) & MASK64).bit_count()


def similarity(a: int, b: int) -> float:
    """``1 - hamming / 64``: 1.0 for identical fingerprints."""
    return 1.0 - hamming(a, b) / 64.0


def is_fixpoint_fingerprints(previous: int, current: int) -> bool:
    """True when two fingerprints are at least 0.95 similar (Hamming distance ≤ 3)."""
    return similarity(previous, current) >= FIXPOINT_MIN_SIMILARITY


def is_fixpoint(previous: str, current: str) -> bool:
    """True when two consecutive outputs are near-identical (simhash similarity ≥ 0.95)."""
    return is_fixpoint_fingerprints(fingerprint(previous), fingerprint(current))


def near_blocks(n: int, k: int) -> int:
    """Number of blocks the index cuts 64 bits into for ``n`` fingerprints and distance ``k``.

    ``k + 2`` (exact) while a 2-block key leaves about 8 random fingerprints or fewer per bucket;
    beyond that, fewer and wider blocks, so keys lengthen with ``log2(n)`` and work stays linear.
    """
    exact = min(k + 2, 64)
    load_bits = math.log2(n / 8.0) if n > 16 else 1.0
    blocks = int(128.0 / load_bits)
    if blocks >= exact:
        return exact
    return max(blocks, 3)


def guaranteed_distance(n: int, k: int = TEXT_LOOP_MAX_DISTANCE) -> int:
    """Largest distance (≤ ``k``) at which every pair among ``n`` fingerprints is found."""
    if n <= _BRUTE_FORCE_MAX or k >= 48:
        return k
    return min(k, near_blocks(n, k) - 2)


def _block_masks(blocks: int) -> list[int]:
    masks = []
    for b in range(blocks):
        lo, hi = b * 64 // blocks, (b + 1) * 64 // blocks
        masks.append(((1 << (hi - lo)) - 1) << lo)
    return masks


def _near_py(fps: Sequence[int], k: int, all_pairs: bool) -> list[Any]:
    """Reference implementation of the index (same answers as the compiled one)."""
    n = len(fps)
    best = [-1] * n
    pairs: list[tuple[int, int]] = []
    if k < 0:
        return pairs if all_pairs else best
    if n <= _BRUTE_FORCE_MAX or k >= 48:
        for j in range(1, n):
            fj = fps[j]
            for i in range(j):
                if (fps[i] ^ fj).bit_count() <= k:
                    if not all_pairs:
                        best[j] = i
                        break
                    pairs.append((i, j))
        pairs.sort()
        return pairs if all_pairs else best
    r, blocks = 2, near_blocks(n, k)
    bmask = _block_masks(blocks)
    for combo in combinations(range(blocks), r):
        tmask = 0
        for b in combo:
            tmask |= bmask[b]
        table: dict[int, list[int]] = {}
        for p, f in enumerate(fps):
            members = table.setdefault(f & tmask, [])
            if all_pairs:
                for q in members:
                    x = fps[q] ^ f
                    if x.bit_count() > k:
                        continue
                    agree = [bb for bb in range(blocks) if not x & bmask[bb]][:r]
                    if tuple(agree) == combo:
                        pairs.append((q, p))
            else:
                cur = best[p]
                for q in members:
                    if cur >= 0 and q >= cur:
                        break
                    if (fps[q] ^ f).bit_count() <= k:
                        cur = q
                        break
                best[p] = cur
            members.append(p)
    if all_pairs:
        pairs.sort()
        return pairs
    return best


def _pack(fps: Sequence[int]) -> bytes:
    return array("Q", [f & MASK64 for f in fps]).tobytes()


def near_duplicate_pairs(
    fps: Sequence[int], max_distance: int = TEXT_LOOP_MAX_DISTANCE
) -> list[tuple[int, int]]:
    """Every index pair ``(i, j)``, ``i < j``, whose fingerprints are within ``max_distance``.

    Sorted. Linear work for distinct fingerprints (banded index, see the module docstring);
    the output itself is quadratic when many fingerprints are near each other.
    """
    ext = FASTSCAN
    if ext is not None:
        return [(int(i), int(j)) for i, j in ext.near(_pack(fps), max_distance, True)]
    out: list[tuple[int, int]] = _near_py(fps, max_distance, True)
    return out


def nearest_earlier(fps: Sequence[int], max_distance: int = TEXT_LOOP_MAX_DISTANCE) -> list[int]:
    """For each fingerprint, the smallest earlier index within ``max_distance``, else -1.

    Linear in the number of fingerprints even when thousands repeat (the index stops at the
    first match), which is what a text-loop check needs.
    """
    ext = FASTSCAN
    if ext is not None:
        return [int(x) for x in ext.near(_pack(fps), max_distance, False)]
    out: list[int] = _near_py(fps, max_distance, False)
    return out
