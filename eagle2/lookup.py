"""Prompt lookup: propose the tokens that followed the newest n-gram the last time it occurred.

Replies repeat their prompt (extraction, summaries, code edits, quotes) and themselves (lists,
templates, a small model's loops); a head trained on other text drafts such spans poorly, a
lookup in the committed tokens drafts them for free. The proposal depends only on committed
tokens and is one deterministic candidate, like the head's top-k, so grafting it onto the draft
tree keeps greedy output identical to plain decoding and sampling exact (see
verify.accept_sampling: its argument holds whatever the draft proposed).
"""
import numpy as np


class NgramIndex:
    """The committed sequence, in a buffer allocated once, searched backwards for its newest n-gram.

    A scan of a few thousand tokens costs microseconds a cycle against milliseconds for a verify
    step, and keeps the memory fixed (an index of every n-gram would grow with the sequence).
    """

    def __init__(self, n: int, capacity: int):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"the n-gram size must be an integer >= 1, got {n!r}")
        self.n = int(n)
        self._tokens = np.zeros(capacity, np.int32)
        self._length = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[:self._length]

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens).reshape(-1)
        end = self._length + tokens.shape[0]
        if end > self._tokens.shape[0]:
            raise ValueError(f"the sequence would exceed the index's capacity of {self._tokens.shape[0]} tokens")
        self._tokens[self._length:end] = tokens
        self._length = end

    def propose(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the newest n-gram."""
        n, size, seq = self.n, self._length, self._tokens
        if length < 1 or size <= n:
            return []
        starts = size - n  # candidate occurrences start before the newest n-gram and have a successor
        match = seq[:starts] == seq[starts]
        for j in range(1, n):
            match &= seq[j:starts + j] == seq[starts + j]
        hits = np.flatnonzero(match)
        if hits.shape[0] == 0:
            return []
        start = int(hits[-1]) + n
        return seq[start:min(start + length, size)].tolist()
