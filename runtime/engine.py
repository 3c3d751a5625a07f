"""The base and draft sessions of one artifact, and the buffers every step reuses.

Each method is one graph call with its inputs written into preallocated buffers; the generation
loop in generation.py decides what to call. Nothing here allocates per step beyond tiny index
arrays (the tree's own arrays and the attention-mask bookkeeping of eagle2).

The sessions are whatever backend runs the provider (runtime/providers.py); the engine uses only
their contract (runtime/backend.Session), so everything from this class to the API is shared. With a
resident session (torch on an accelerator) the base's hidden states, the features and the draft's
hidden states are device tensors that never leave the device; the same indexing serves both.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from eagle2 import DraftTree, tree_from_parents, write_attention_bias

from .backend import Session
from .providers import check_target, open_session

PREFILL_CHUNK = 128
MAX_TREE_TOKENS = 128   # largest verify step (total_tokens)
MAX_TOP_K = 16          # largest draft branching (top_k)
MAX_LOOKUP = 16        # longest prompt-lookup branch
MAX_DEPTH = 16          # deepest draft expansion (depth); nodes sit at most depth+1 past the context


class Engine:
    def __init__(self, root: Path, manifest: dict, provider: str, max_length: int | None = None,
                 threads: int | None = None, device: str = "cpu", provider_options: dict | None = None):
        check_target(manifest, provider)
        self.manifest = manifest
        self.max_length = min(max_length or manifest["max_length"], manifest["max_length"])
        self.io_dtype = np.float16 if manifest["io_dtype"] == "float16" else np.float32
        self.masked = np.finfo(self.io_dtype).min
        steps = max(PREFILL_CHUNK, MAX_TREE_TOKENS)
        graphs = manifest["graphs"]
        self.base: Session = open_session(root, graphs["base"], provider, device, self.max_length, steps, 64,
                                          threads, provider_options)
        # The draft cache also holds the current round's tree: depth * top_k rows past the context.
        total = self.max_length + MAX_DEPTH * MAX_TOP_K
        self.draft: Session | None = None
        if "draft" in graphs:
            self.draft = open_session(root, graphs["draft"], provider, device, total, steps, MAX_TOP_K, threads,
                                      provider_options)
        hidden = manifest["model"]["config"]["hidden_size"]
        self.ids = np.zeros(steps, np.int64)
        self.positions = np.zeros(steps, np.int64)
        self.rows = np.arange(steps, dtype=np.int64)
        self.bias = np.zeros(steps * total, self.io_dtype)
        self.causal = np.triu(np.full((steps, steps), self.masked, self.io_dtype), k=1)
        self.resident = self.base.resident
        features = np.zeros((self.max_length + 1, hidden), self.io_dtype)  # base hidden rows not yet drafted on
        self.features = self.base.device_array(features)
        self.top_k = np.zeros(1, np.int64)
        self.timings = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
        # Trees must not straddle a block of the exact attention's key sums (export/onnx_graph.py,
        # models/attention.py); with fused attention no placement is exact, so there is nothing to keep.
        self.key_block = manifest.get("exact_key_block") or self.max_length + 1
        # Fewest rows a verify step runs (export/onnx_export.py): kernels whose one-row path rounds
        # otherwise than their multi-row one get every step, plain decoding included, as multi-row.
        self.min_rows = manifest.get("verify_min_rows", 1)
        # The manifest's claim, kept where the backend finds this machine keeps it.
        self.verify_exact = (manifest.get("verify_exact", False)
                             and self.base.keeps_exactness(manifest, self.verification_matches_decoding))

    def verification_matches_decoding(self) -> bool:
        """Whether the nodes of a small branching tree, verified in one step, get the bits their
        tokens get decoded alone after their paths (as tests/test_runtime_bitwise.py checks at
        length): a few steps of the base, at load."""
        rng = np.random.default_rng(0)
        vocab = self.manifest["model"]["config"]["vocab_size"]
        parents = np.array([-1, 0, 0, 1, 2, 4])  # node 5's ancestors 2 and 4 are not side by side
        context = min(37, self.max_length - 2 * len(parents))
        prompt = rng.integers(0, vocab, context)
        tree = tree_from_parents(rng.integers(0, vocab, len(parents)), parents)
        self.start(context + len(parents))
        self.prefill(prompt, 0)
        rows = self.verify(tree, context).copy()
        for path in ([1, 3], [2, 4, 5]):
            self.prefill(prompt, 0)
            for i, node in enumerate([0] + path):
                alone = self.verify(tree_from_parents([tree.tokens[node]], [-1]), context + i)
            if not np.array_equal(rows[path[-1]], alone[0]):
                return False
        return True

    def _bias(self, t: int, context: int) -> np.ndarray:
        return self.bias[: t * (context + t)].reshape(t, context + t)

    def _causal_bias(self, t: int, context: int) -> np.ndarray:
        bias = self._bias(t, context)
        bias[:, :context] = 0
        bias[:, context:] = self.causal[:t, :t]
        return bias

    def start(self, prompt_length: int) -> None:
        """A new generation: size growing caches for its prompt (a long earlier one may have grown them)."""
        self.base.reserve(prompt_length + 1, shrink=True)

    def _inputs(self, t: int, bias: np.ndarray, logit_rows: np.ndarray) -> dict:
        return {"input_ids": self.ids[:t].reshape(1, t), "position_ids": self.positions[:t].reshape(1, t),
                "attention_bias": bias.reshape(1, 1, *bias.shape), "logit_rows": logit_rows}

    def _timed(self, kind, session, inputs, k=1):
        start = time.perf_counter()
        out = session.run(inputs, k)
        self.timings[kind] += time.perf_counter() - start
        return out

    # --- base -------------------------------------------------------------------------------
    def prefill(self, tokens: np.ndarray, context: int) -> np.ndarray:
        """Run prompt tokens at positions context.. ; keep their features; return last logits [V]."""
        t = len(tokens)
        self.ids[:t] = tokens
        self.positions[:t] = np.arange(context, context + t)
        out = self._timed("prefill", self.base, self._inputs(t, self._causal_bias(t, context), self.rows[t - 1:t]))
        self.features[context:context + t] = out["hidden_states"][0]
        return out["logits"][0, 0]

    def verify(self, tree: DraftTree, context: int) -> np.ndarray:
        """One base forward over the tree (written to cache rows context..); returns logits [T, V].

        A tree smaller than min_rows is padded with copies of its root that see only the context
        and themselves: no tree node attends to them, their logits are dropped and their cache rows,
        past the tree's, are overwritten by the next step."""
        t = len(tree.tokens)
        n = max(t, self.min_rows)
        self.ids[:t] = tree.tokens
        self.positions[:t] = context + tree.depths
        bias = self._bias(n, context)
        write_attention_bias(bias[:t, :context + t], tree, context, self.masked)
        if n > t:
            self.ids[t:n] = tree.tokens[0]
            self.positions[t:n] = context
            bias[:t, context + t:] = self.masked
            bias[t:, :context] = 0
            bias[t:, context:] = self.masked
            bias[np.arange(t, n), context + np.arange(t, n)] = 0
        out = self._timed("verify", self.base, self._inputs(n, bias, self.rows[:n]))
        self._last_hidden = out["hidden_states"][0, :t]
        return out["logits"][0, :t]

    def commit(self, accepted: np.ndarray, context: int) -> None:
        """Keep the accepted nodes' K/V at rows context.. and their features; drop the rest."""
        n = len(accepted)
        if self.resident:
            self.features[context:context + n] = self._last_hidden[accepted]
        else:
            np.take(self._last_hidden, accepted, axis=0, out=self.features[context:context + n])
        if n > 1 and not np.array_equal(accepted, self.rows[:n]):
            self.base.move(context + accepted[1:], context + 1)

    # --- draft ------------------------------------------------------------------------------
    def draft_context(self, next_tokens: np.ndarray, start: int, top_k: int):
        """Feed the head rows start.. (feature f_j with token x_{j+1}); return the last row's
        hidden state [1, H] and its top-k (ids, log-probs), i.e. the root's children."""
        t = len(next_tokens)
        self.ids[:t] = next_tokens
        self.positions[:t] = np.arange(start, start + t)
        self.top_k[0] = top_k
        inputs = self._inputs(t, self._causal_bias(t, start), self.rows[t - 1:t])
        inputs["features"] = self.features[start:start + t].reshape(1, t, -1)
        inputs["top_k"] = self.top_k
        out = self._timed("draft", self.draft, inputs, top_k)
        return out["hidden_states"][0, t - 1:t], out["topk_ids"][0, 0], out["topk_logprobs"][0, 0]

    def draft_expand(self, tokens: np.ndarray, features: np.ndarray, mask: np.ndarray, context: int, step: int,
                     top_k: int):
        """Run the head on one frontier (k nodes at depth step+1, head position context+step).
        mask [k, (step+1)*k] says which tree rows each node sees (itself and its ancestors)."""
        k = len(tokens)
        self.ids[:k] = tokens
        self.positions[:k] = context + step
        bias = self._bias(k, context + step * k)
        bias[:, :context] = 0
        np.copyto(bias[:, context:], np.where(mask, 0, self.masked).astype(self.io_dtype, copy=False))
        self.top_k[0] = top_k
        inputs = self._inputs(k, bias, self.rows[:k])
        inputs["features"] = features.reshape(1, k, -1) if self.resident else \
            np.ascontiguousarray(features).reshape(1, k, -1)
        inputs["top_k"] = self.top_k
        out = self._timed("draft", self.draft, inputs, top_k)
        return out["hidden_states"][0], out["topk_ids"][0], out["topk_logprobs"][0]
