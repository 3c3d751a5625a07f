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

Complete within the token budget: near the end of a generation's budget (max_new_tokens, or the
cache's room), the tokens that finish the value (runtime/json_closing.py: close the string, `null`
for a dangling key, close the containers) are forced, one a token, so that the reply ends as a
whole value with room for the end-of-sequence token. The budget enters each row's mask by the
position of the token it chooses, so plain and speculative decoding still mask alike.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle2 import DraftTree

from .json_closing import JsonPrefix

# Tokens of room kept beyond what the value's completion needs before it is forced: one token the
# model chooses can open at most this much more to close (a key and a nested container at once);
# a schema's required keys add their own tokens and a short value's each.
CLOSING_MARGIN = 8
SHORT_VALUE_TOKENS = 2
# Where a schema takes not the generic completion's next token (it wants a required key, or a value
# of its type), the first of these it takes: ends, then separators (never another digit after a
# number that may end), then the shortest values.
CLOSERS = ('"', "}", "]", '"}', '"]', "}}", "]}", ",", ":", "0", '""', "[]", "{}", "false", "null")


def required_keys(schema) -> list[str]:
    """The keys a schema requires, nested ones included."""
    if isinstance(schema, dict):
        own = [k for k in schema.get("required", []) if isinstance(k, str)]
        return own + [k for v in schema.values() for k in required_keys(v)]
    if isinstance(schema, list):
        return [k for v in schema for k in required_keys(v)]
    return []


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
        # Each token's bytes as characters (latin-1: JSON's structure is ASCII), for the completion.
        self.pieces = [self.tokenizer.decode_bytes([i]).decode("latin-1") for i in range(vocab_size)]
        self.closers = [ids[0] for ids in map(self.tokenizer.greedy_tokenize, CLOSERS) if len(ids) == 1]

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
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self.scan = JsonPrefix()     # the consumed tokens' JSON so far
        self.emitted = 0             # tokens consumed
        self.budget: int | None = None
        self.margin = CLOSING_MARGIN + sum(len(grammar.tokenizer.greedy_tokenize(f',"{key}":')) + SHORT_VALUE_TOKENS
                                           for key in required_keys(schema))
        self._fill = lib.numpy.fill_next_token_bitmask
        self._bits = lib.numpy.allocate_token_bitmask(1, grammar.vocab_size)

    def end_within(self, tokens: int) -> None:
        """The generation ends after `tokens` more tokens at most: the value must be whole by then."""
        self.budget = self.emitted + tokens

    def allowed(self, scan: JsonPrefix | None = None, position: int | None = None) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next; where the token at `position` (default: the
        next) leaves no more room than the value's completion needs, only its completion's first token."""
        self._fill(self.matcher, self._bits, 0)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        if self.budget is None:
            return allowed
        left = self.budget - (self.emitted if position is None else position)
        completion = (scan or self.scan).completion()
        if not completion or left > self.margin + len(completion) + 1:  # a token is at least a character
            return allowed
        tokens = self.grammar.tokenizer.greedy_tokenize(completion)
        if left > self.margin + len(tokens) + 1:
            return allowed
        first = next((t for t in (tokens[0], *self.grammar.closers) if allowed[t]), None)
        if first is None:  # the grammar's own next token (a required key's text): it is all it allows
            return allowed
        only = np.zeros_like(allowed)
        only[first] = True
        return only

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
            scan = self.scan.copy().feed("".join(self.grammar.pieces[t] for t in path)) if path else self.scan
            allowed = self.allowed(scan, self.emitted + len(path))
            if allowed.any():  # else the path ended the grammar: this row, past its end, is never used
                rows[node] = np.where(allowed, rows[node], -np.inf)
            self.matcher.rollback(len(path))
        return rows

    def valid_paths(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """bool per draft candidate (tokens, parents as pool indices, -1 the root): whether the grammar
        takes its path from the root. A candidate it does not take would be rejected for sure: the draft
        grows its trees without them."""
        valid = np.ones(len(tokens), bool)
        for i in range(len(tokens)):
            path, u = [], i
            while u >= 0:
                path.append(int(tokens[u]))
                u = int(parents[u])
            path.reverse()
            valid[i] = self.matcher.validate_tokens(path) == len(path)
        return valid

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest start of `tokens` (a lookup branch) the grammar takes."""
        return tokens[:self.matcher.validate_tokens([int(t) for t in tokens])]

    def consume(self, tokens: list[int]) -> None:
        """Tokens chosen from masked rows. A complete value stops the grammar: only an end-of-sequence
        token was allowed after it, and the generation ends there."""
        for t in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(t)):
                raise RuntimeError(f"the grammar refused a token it allowed: {self.matcher.get_error()}")
            self.scan.feed(self.grammar.pieces[int(t)])
            self.emitted += 1
