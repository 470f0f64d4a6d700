"""Prompt-lookup drafting: propose the tokens that followed the latest earlier occurrence of
the lane's longest matching suffix. Pure Python, no weights.

The index maps every n-gram (n in [min_n, max_n]) to the position of the token after its
most recent occurrence that has a token after it. It is built as tokens arrive, one token at
a time, so a round costs O(max_n) lookups plus the k tokens copied, whatever the length:

    tokens:  a b c d a b c ?          suffix "a b c" (n=3) last occurred at 0..2,
             0 1 2 3 4 5 6            so the proposal starts at 3: "d a b ..."

An occurrence ending at the last token never matches itself: n-grams ending at position i
enter the index only once token i + 1 exists.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class NgramIndex:
    """Longest-suffix-match lookup over one lane's tokens (prompt and output)."""

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after it
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (accepted ones only); each costs O(max_n) index updates."""
        for t in tokens:
            self.tokens.append(t)
            self._index_ending_at(len(self.tokens) - 2)

    def truncate(self, length: int) -> None:
        """Forget tokens past `length` (the lane went back to an earlier cut). Rebuilds the
        index from the kept tokens: rare, so O(length) is fine here."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"truncate to {length} of {len(self.tokens)} tokens")
        if length == len(self.tokens):
            return
        kept = self.tokens[:length]
        self.tokens = []
        self._next = {}
        self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest suffix (at most max_n, at least min_n
        tokens) seen earlier; [] when no suffix occurred before or k is 0."""
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """`propose(k)` and the length of the suffix that matched (0 with no proposal)."""
        if k <= 0:
            return [], 0
        n_tokens = len(self.tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(self.tokens[n_tokens - n:]))
            if start is not None:
                return self.tokens[start : min(start + k, n_tokens)], n
        return [], 0

    def _index_ending_at(self, end: int) -> None:
        if end < 0:
            return
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            self._next[tuple(self.tokens[end - n + 1 : end + 1])] = end + 1


def accept_greedy(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """Greedy verification: `argmax[i]` is the model's token after the last accepted token
    (i = 0) and after draft i - 1. Returns the accepted drafts plus the model's token after
    them: the longest prefix of `drafts` equal to `argmax`, then one token."""
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"{len(argmax)} verify rows for {len(drafts)} drafts")
    out: list[int] = []
    for draft, token in zip(drafts, argmax):
        out.append(token)
        if token != draft:
            return out
    out.append(argmax[len(drafts)])
    return out
