"""A reduced draft vocabulary (FR-Spec, arXiv 2502.14856): the draft ranks only the N tokens the
base model's replies use most, so each draft call reads N rows of the vocabulary projection
instead of all of them. Verification keeps the whole vocabulary, so the output cannot change; a
reply token outside the N only costs acceptance.

Frequencies are counted on the assistant turns of the head's training data (ShareGPT's training
split, rendered with the base's chat template, end-of-turn tokens included), never on prompts
used for evaluation.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .train_data import DataError, encode, read_conversations, split

COUNTS_FILE = "token_counts.npy"  # shipped next to a head: int64 [vocab]
DEV_PERCENT = 2.0                 # the held-out split training.train_head uses
SEED = 0
# Conversations counted when a head ships no counts: enough for a stable top-N (a few million
# reply tokens), about a minute of tokenizing.
COUNT_CONVERSATIONS = 4000


@dataclass(frozen=True)
class DraftVocab:
    ids: np.ndarray   # int64 [N], ascending base token ids
    counted_on: str   # where the frequencies come from

    def describe(self) -> dict:
        return {"size": len(self.ids), "counted_on": self.counted_on}


def count_tokens(tokenizer, vocab_size: int, data: str = "sharegpt", max_conversations: int | None = None,
                 max_len: int = 2048) -> np.ndarray:
    """int64 [vocab_size]: how often each token occurs in the assistant turns of the training split."""
    train, _ = split(read_conversations(data), DEV_PERCENT, SEED)
    if max_conversations is not None:
        train = train[:max_conversations]
    counts = np.zeros(vocab_size, np.int64)
    for conv in tqdm(train, desc="draft vocabulary: counting reply tokens", unit="conv", file=sys.stderr):
        example = encode(tokenizer, conv, max_len)
        if example is not None:
            ids = example.ids[example.mask.astype(bool)]
            np.add.at(counts, ids[ids < vocab_size], 1)
    if counts.sum() == 0:
        raise DataError(f"no assistant tokens counted in {data}")
    return counts


def draft_vocab(tokenizer, vocab_size: int, head_dir: Path | None, size: int, stop_ids: list[int]) -> DraftVocab:
    """The `size` most frequent reply tokens: counts shipped with the head, else counted on ShareGPT."""
    path = None if head_dir is None else Path(head_dir) / COUNTS_FILE
    if path is not None and path.is_file():
        counts = np.load(path, allow_pickle=False)
        if counts.shape != (vocab_size,):
            raise DataError(f"{path} holds {counts.shape[0]} counts but the vocabulary has {vocab_size} tokens")
        source = f"{COUNTS_FILE} shipped with the head ({int(counts.sum())} reply tokens)"
    else:
        counts = count_tokens(tokenizer, vocab_size, max_conversations=COUNT_CONVERSATIONS)
        source = f"ShareGPT training split, first {COUNT_CONVERSATIONS} conversations ({int(counts.sum())} reply tokens)"
    return DraftVocab(select(counts, size, stop_ids), source)


def select(counts: np.ndarray, size: int, always: list[int]) -> np.ndarray:
    """int64 [size]: the `size` most frequent token ids (ties: lower id first), plus every id in
    `always` (stop tokens: a draft that cannot propose the end of a reply stalls there), in
    ascending id order so that ties in the draft's top-k resolve as over the full vocabulary."""
    if not 0 < size <= len(counts):
        raise ValueError(f"draft vocabulary size must be in [1, {len(counts)}], got {size}")
    forced = sorted(set(int(t) for t in always if 0 <= t < len(counts)))
    if len(forced) > size:
        raise ValueError(f"draft vocabulary size {size} cannot hold the {len(forced)} stop tokens")
    order = np.lexsort((np.arange(len(counts)), -counts))
    rest = [int(t) for t in order if t not in set(forced)][: size - len(forced)]
    return np.array(sorted(forced + rest), np.int64)
