"""Prefix reuse across generations: what a generation leaves in its caches, kept in host memory in
blocks of BLOCK_TOKENS tokens, so that a later prompt sharing those tokens starts after them.

A block is keyed by a hash chained over every token up to its end (vLLM's scheme), so a block
stands for the whole prefix it ends and two prompts share blocks exactly as far as they share
tokens. It holds everything a continuation needs for EAGLE-2 to grow the trees it would have grown
from scratch:
- the base model's K/V at its positions [s, e);
- the base's features (last hidden states) at [s, e), which the head reads;
- the head's K/V at head positions [s - 1, e - 1): head position j reads feature j with token j + 1,
  so shifted by one every row depends only on tokens before e (the block's key). Optional: a
  generation that never drafted leaves none.

Blocks are copied into a sequence's cache slot on a hit and copied out of it when a generation
ends, never shared in place: a stream extending a stored prefix writes only its own slot. A hit
leaves at least the prompt's last token to compute, whose logits give the first new token.

Eviction is least recently used within a byte budget. Touching a chain from its end to its root
keeps every block more recent than its descendants, so the least recent block is always a leaf and
evicting it never strands a stored descendant.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from models.cpu import physical_memory

# Tokens per block: a hit is rounded down to a whole block, so smaller blocks reuse more of each
# prompt, at the price of more copies per hit (docs/serving.md#prefix-reuse).
BLOCK_TOKENS = 16
# The default budget: this share of the machine's memory.
DEFAULT_SHARE = 8


def default_budget_bytes(share: int = DEFAULT_SHARE) -> int:
    """1/share of the machine's physical memory."""
    return physical_memory() // share


@dataclass(eq=False)
class Block:
    key: bytes
    base: list[np.ndarray]               # each base cache's [heads, BLOCK_TOKENS, width]
    features: np.ndarray                 # [BLOCK_TOKENS, hidden]
    draft: list[np.ndarray] | None = None  # each head cache's rows at head positions [s - 1, e - 1) (from 0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.base) + self.features.nbytes + sum(a.nbytes for a in self.draft or [])


@dataclass
class Hit:
    """The stored blocks a prompt starts with: base K/V and features for `tokens` positions; the head's
    K/V for head positions below `draft_tokens - 1` (the leading blocks that hold it)."""
    blocks: list[Block] = field(default_factory=list)
    tokens: int = 0
    draft_tokens: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes <= 0:
            raise ValueError(f"the prefix cache's budget must be > 0 bytes, got {budget_bytes}")
        self.budget, self.block_tokens = budget_bytes, block_tokens
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.lookups = self.hits = self.hit_tokens = self.prompt_tokens = self.evicted = 0

    def keys(self, tokens) -> list[bytes]:
        """The chained key of every whole block of `tokens`."""
        b, ids = self.block_tokens, np.ascontiguousarray(tokens, np.int64)
        keys, key = [], b""
        for start in range(0, len(ids) - b + 1, b):
            key = hashlib.blake2b(key + ids[start:start + b].tobytes(), digest_size=16).digest()
            keys.append(key)
        return keys

    def lookup(self, prompt) -> Hit:
        """The longest run of stored blocks the prompt starts with, leaving its last token out."""
        hit = Hit()
        with self._lock:
            for key in self.keys(prompt[:len(prompt) - 1]):
                block = self._blocks.get(key)
                if block is None:
                    break
                hit.blocks.append(block)
            self._touch([b.key for b in hit.blocks])
            hit.tokens = len(hit.blocks) * self.block_tokens
            drafted = next((i for i, b in enumerate(hit.blocks) if b.draft is None), len(hit.blocks))
            hit.draft_tokens = drafted * self.block_tokens
            self.lookups += 1
            self.hits += bool(hit.blocks)
            self.hit_tokens += hit.tokens
            self.prompt_tokens += len(prompt)
        return hit

    def missing(self, keys: list[bytes], drafted: int) -> list[tuple[int, bytes, bool, Block | None]]:
        """(index, key, with the head's K/V, the block stored now) of the blocks of a chain to copy out:
        those not stored, and stored ones without the head's K/V where blocks within `drafted` tokens
        have it now (their base part, the same bits, need not be copied again)."""
        b = self.block_tokens
        with self._lock:
            wanted = []
            for i, key in enumerate(keys):
                block = self._blocks.get(key)
                draft = (i + 1) * b <= drafted
                if block is None or (draft and block.draft is None):
                    wanted.append((i, key, draft, block))
            return wanted

    def insert(self, keys: list[bytes], blocks: dict[bytes, Block]) -> None:
        """Store the new `blocks` of the chain `keys` (root first), evicting the least recently used
        others to stay within budget; a block that cannot fit ends the chain there."""
        with self._lock:
            chain = set(keys)
            for key in keys:
                new = blocks.get(key)
                if new is None:
                    if key not in self._blocks:
                        break  # a gap: later blocks would be unreachable
                    continue
                old = self._blocks.get(key)
                grow = new.nbytes - (old.nbytes if old is not None else 0)
                while self.bytes + grow > self.budget and self._blocks and next(iter(self._blocks)) not in chain:
                    _, evicted = self._blocks.popitem(last=False)
                    self.bytes -= evicted.nbytes
                    self.evicted += 1
                if self.bytes + grow > self.budget:
                    break
                self._blocks[key] = new
                self.bytes += grow
            self._touch([k for k in keys if k in self._blocks])

    def _touch(self, chain: list[bytes]) -> None:
        """Most recently used, the root last: a block stays more recent than its descendants."""
        for key in reversed(chain):
            self._blocks.move_to_end(key)

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict:
        with self._lock:
            return {"budget_bytes": self.budget, "bytes": self.bytes, "blocks": len(self._blocks),
                    "block_tokens": self.block_tokens, "lookups": self.lookups, "hits": self.hits,
                    "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens, "evicted": self.evicted}

    def describe(self) -> str:
        return (f"prefix reuse on: up to {self.budget / 2**20:.0f} MiB of K/V in blocks of {self.block_tokens} "
                "tokens (--prefix-cache-mb; 0 turns it off)")
