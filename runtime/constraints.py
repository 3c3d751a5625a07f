"""Structured output: a JSON schema's grammar applied to the logits every token is chosen from, through
llguidance (the serve extra). llguidance, because it installs here as one dependency-free wheel, reads
the artifact's tokenizer.json itself (no transformers), and gives a matcher that consumes, validates
and rolls back tokens, which is what masking a tree's nodes one path at a time needs; xgrammar
imports torch and transformers, and outlines-core only bounds the recursion of arbitrary JSON.

Lossless under speculation: every verify row of a tree node is masked with the grammar's state after
that node's path, the mask plain constrained decoding applies after those tokens. A drafted token
the grammar forbids then has probability 0 under its parent's masked row and is never accepted, so
greedy speculative output equals greedy constrained decoding and sampling keeps the constrained
distribution. Whitespace is compact (no free whitespace between tokens), so a small model cannot
spend its reply on blanks.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle2 import DraftTree


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:
        raise ValueError("structured output needs llguidance: pip install 'eagle2-deploy[serve]' "
                         "(or bash ci/install_serve.sh)") from None
    return llguidance


class GrammarTokenizer:
    """The artifact's vocabulary as llguidance sees it: built once per Generator (a fraction of a second)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_ids: list[int]):
        self.lib = _llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = self.lib.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=sorted(stop_ids))

    def json(self, schema: dict | None) -> JsonConstraint:
        """A constraint for one generation: any JSON object (schema None), else the schema's JSON."""
        return JsonConstraint(self, {"type": "object"} if schema is None else schema)


class JsonConstraint:
    """One generation's grammar state: the masks of the next token, for a row or a tree's rows, and
    the tokens it has consumed."""

    def __init__(self, grammar: GrammarTokenizer, schema: dict):
        lib = grammar.lib
        try:
            source = lib.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise ValueError(f"the JSON schema cannot be compiled: {e}") from None
        self.matcher = lib.LLMatcher(grammar.tokenizer, source)
        if self.matcher.is_error():
            raise ValueError(f"the JSON schema cannot be compiled: {self.matcher.get_error()}")
        self.vocab_size = grammar.vocab_size
        self._fill = lib.numpy.fill_next_token_bitmask
        self._bits = lib.numpy.allocate_token_bitmask(1, grammar.vocab_size)

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        self._fill(self.matcher, self._bits, 0)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def mask(self, row) -> np.ndarray:
        """A masked copy of one logits row [V] (forbidden tokens -inf)."""
        return np.where(self.allowed(), np.asarray(row, np.float32), -np.inf).astype(np.float32)

    def mask_tree(self, tree: DraftTree, logits) -> np.ndarray:
        """A copy of a tree's verify rows [T, V], each masked with the state after its node's path (the
        root consumed already). Nodes whose path the grammar forbids are never reached: left as they are."""
        rows = np.array(logits[:len(tree.tokens)], np.float32)
        for node in range(len(rows)):
            path = []
            u = node
            while u > 0:
                path.append(int(tree.tokens[u]))
                u = int(tree.parents[u])
            path.reverse()
            if self.matcher.validate_tokens(path) < len(path):
                continue
            self.matcher.consume_tokens(path)
            allowed = self.allowed()
            if allowed.any():  # else the path ended the grammar: this row, past its end, is never used
                rows[node] = np.where(allowed, rows[node], -np.inf)
            self.matcher.rollback(len(path))
        return rows

    def consume(self, tokens: list[int]) -> None:
        """Tokens chosen from masked rows. A complete value stops the grammar: only an end-of-sequence
        token was allowed after it, and the generation ends there."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"the grammar refused a token it allowed: {self.matcher.get_error()}")
