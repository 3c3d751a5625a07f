"""The base and draft sessions of one artifact, the sequences that share them, and the buffers
every step reuses.

Each step is one graph call over the rows of one or more sequences (Rows), its inputs written into
preallocated buffers; the generation loop in generation.py decides what to call, and the scheduler
of runtime/batch.py packs several sequences' rows into one step where the graphs are slotted: the
caches hold `sequences` sequences side by side, each at the positions it has alone, and each row
attends only to its own sequence, so it is computed as it would be alone. Nothing here allocates
per step beyond small index arrays and each part's own attention bias.

The sessions are whatever backend runs the provider (runtime/providers.py); the engine uses only
their contract (runtime/backend.Session), so everything from this class to the API is shared. With a
resident session (ONNX Runtime or torch on an accelerator) the base's hidden states, the features
and the draft's hidden states are device tensors that never leave the device; the same indexing
serves both.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.graphs import GraphSpec
from eagle2 import DraftTree, tree_from_parents, write_attention_bias
from models.cpu import kv_bytes_per_position, physical_memory

from .backend import Session
from .prefix_cache import Block, Hit, PrefixCache
from .providers import check_target, open_session

PREFILL_CHUNK = 128
MAX_TREE_TOKENS = 128   # largest verify step (total_tokens)
MAX_TOP_K = 16          # largest draft branching (top_k)
MAX_LOOKUP = 16        # longest prompt-lookup branch
MAX_DEPTH = 16          # deepest draft expansion (depth); nodes sit at most depth+1 past the context
DRAFT_TREE_ROWS = MAX_DEPTH * MAX_TOP_K  # the draft cache's rows past the context: a round's tree
# Surplus base-cache positions, over what the open sequences use, worth a re-layout to drop when a
# sequence ends (docs/benchmarks.md#what-a-step-of-many-sequences-reads).
FIT_SLACK = 128
# The caches take memory as sequences use it; max_length is capped where every sequence at its full
# length would need more than this share of the machine's memory.
KV_MEMORY_SHARE = 2
log = logging.getLogger("runtime")


def fitting_max_length(manifest: dict, wanted: int, sequences: int, value_bytes: int = 4) -> int:
    """`wanted`, or less where `sequences` sequences of it, with caches of `value_bytes` a value,
    would not fit the machine's memory (said)."""
    per_position, memory = kv_bytes_per_position(manifest["model"]["config"], value_bytes), physical_memory()
    cap = memory // KV_MEMORY_SHARE // (per_position * sequences) // 64 * 64
    if wanted <= cap:
        return wanted
    cap = max(cap, 64)
    log.warning("max_length %d instead of %d: %d sequence(s) of %d positions would hold %.1f GiB of K/V, more than "
                "1/%d of this machine's %.0f GiB", cap, wanted, sequences, wanted,
                wanted * sequences * per_position / 2**30, KV_MEMORY_SHARE, memory / 2**30)
    return cap


class NoRoom(Exception):
    """Every sequence slot of the caches is taken; one frees when its generation ends."""


@dataclass(eq=False)
class Sequence:
    """One sequence's share of the engine: its slot in the caches, the base hidden states the head
    has not read yet, and the hidden states of its last verify step."""
    slot: int
    features: object                   # [max_length + 1, H], host array or device tensor
    last_hidden: object = None
    end: int = 0                       # base cache positions its steps have written, from 0


@dataclass(eq=False)
class Rows:
    """One sequence's rows in a step of the base ("prefill", "verify") or the draft ("draft"):
    tokens at RoPE positions, written to the sequence's cache positions first_slot.., the attention
    bias over its own positions [rows, first_slot + rows], and the rows whose outputs it wants.
    Draft rows also carry their features and top-k. `prompt` rows (a prompt's chunk) go in steps of
    their own when steps are shared: every sequence of a step is padded to its longest part."""
    seq: Sequence
    kind: str
    ids: np.ndarray
    positions: np.ndarray
    bias: np.ndarray
    first_slot: int
    logit_rows: np.ndarray             # indices into this part's rows
    features: object = None
    top_k: int = 0
    prompt: bool = False
    outputs: dict = field(default_factory=dict, repr=False)  # set by the step: views until the next one

    @property
    def rows(self) -> int:
        return len(self.ids)

    @property
    def graph(self) -> str:
        return "draft" if self.kind == "draft" else "base"


class Engine:
    def __init__(self, root: Path, manifest: dict, provider: str, max_length: int | None = None,
                 threads: int | None = None, device: str = "cpu", provider_options: dict | None = None,
                 sequences: int = 1):
        """sequences: how many sequences the caches hold side by side (more than one to decode them
        together: runtime/batch.py). The caches' capacity follows the longest of them, and their
        memory is touched only as far as it is used."""
        check_target(manifest, provider)
        self.manifest = manifest
        self.threads = threads
        cache_bytes = np.dtype(GraphSpec.parse(manifest["graphs"]["base"]).cache_dtype).itemsize
        self.max_length = fitting_max_length(manifest, min(max_length or manifest["max_length"], manifest["max_length"]),
                                             sequences, cache_bytes)
        self.io_dtype = np.float16 if manifest["io_dtype"] == "float16" else np.float32
        self.masked = np.finfo(self.io_dtype).min
        steps = max(PREFILL_CHUNK, MAX_TREE_TOKENS)
        # Most rows of a step: one sequence's largest, twice that where steps are shared.
        self.step_rows = steps if sequences == 1 else 2 * steps
        self.sequences = sequences
        graphs = manifest["graphs"]
        # Room for a last tree past max_length's context; in the draft cache for the current round's
        # tree, depth * top_k rows past the context.
        base_length, draft_length = self.max_length + MAX_TREE_TOKENS, self.max_length + DRAFT_TREE_ROWS
        self.base: Session = open_session(root, graphs["base"], provider, device, base_length, self.step_rows, 64,
                                          threads, provider_options, sequences)
        self.draft: Session | None = None
        if "draft" in graphs:
            self.draft = open_session(root, graphs["draft"], provider, device, draft_length, self.step_rows,
                                      MAX_TOP_K, threads, provider_options, sequences)
        self.slotted = self.base.slotted and (self.draft is None or self.draft.slotted)
        self._open: dict[int, Sequence] = {}  # by slot
        self.fit_slack: int | None = FIT_SLACK  # None: the caches shrink only once no sequence is open
        # Trees must not straddle a block of the exact attention's key sums (export/onnx_graph.py,
        # models/attention.py); with fused attention no placement is exact, so there is nothing to keep.
        self.key_block = manifest.get("exact_key_block") or self.max_length + 1
        self.hidden_size = manifest["model"]["config"]["hidden_size"]
        self.ids = np.zeros(self.step_rows, np.int64)
        self.positions = np.zeros(self.step_rows, np.int64)
        self.rows = np.arange(self.step_rows, dtype=np.int64)
        self.step_features = self.base.device_array(np.zeros((self.step_rows, self.hidden_size), self.io_dtype))
        # A step's attention bias, [sequences, 1, rows, capacity] at most (capacities stop at the cache length).
        self.wide_bias = np.zeros(sequences * self.step_rows * draft_length, self.io_dtype)
        self.causal = np.triu(np.full((steps, steps), self.masked, self.io_dtype), k=1)
        self.resident = self.base.resident
        self._solo: Sequence | None = None
        self.top_k = np.zeros(1, np.int64)
        self.timings = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
        # Base cache positions the steps read (every bound sequence at the capacity) and hold in use.
        self.cache_positions = {"read": 0, "used": 0}
        # Fewest rows a verify step runs (export/onnx_export.py): kernels whose one-row path rounds
        # otherwise than their multi-row one get every step, plain decoding included, as multi-row.
        self.min_rows = manifest.get("verify_min_rows", 1)
        # The manifest's claim, kept where the backend finds this machine keeps it.
        self.verify_exact = (manifest.get("verify_exact", False)
                             and self.base.keeps_exactness(manifest, self.verification_matches_decoding))
        self.prefix: PrefixCache | None = None

    # --- prefix reuse (runtime/prefix_cache.py) ---------------------------------------------------
    def prefix_refusal(self) -> str | None:
        """Why this engine cannot reuse prefixes (None: it can). A prompt's reused part must give the bits
        a cold prefill gives, in whatever chunks: only where verification is exact, whose rows are
        computed alone; and the caches must be host arrays to copy blocks in and out."""
        if not self.verify_exact:
            return ("prefix reuse needs an artifact whose steps compute every row as it is computed alone "
                    "(verify_exact, on this machine): a reused prefix would change the bits of later steps")
        if self.base.resident or (self.draft is not None and self.draft.resident):
            return "prefix reuse copies caches held in host memory; this provider keeps them on the device"
        return None

    def use_prefix_cache(self, budget_bytes: int) -> PrefixCache:
        why = self.prefix_refusal()
        if why:
            raise ValueError(why)
        self.prefix = PrefixCache(budget_bytes)
        return self.prefix

    def restore_prefix(self, seq: Sequence, hit: Hit) -> None:
        """Copy a hit's blocks into the sequence's slot: base K/V and features at [0, hit.tokens), the
        head's K/V at head positions [0, hit.draft_tokens - 1)."""
        if not hit.tokens:
            return
        b = self.prefix.block_tokens
        self.base.reserve(hit.tokens)
        seq.end = max(seq.end, hit.tokens)
        base = self.base.cache_arrays()
        for i, block in enumerate(hit.blocks):
            for cache, kept in zip(base, block.base):
                cache[seq.slot][:, i * b:(i + 1) * b] = kept
            seq.features[i * b:(i + 1) * b] = block.features
        if hit.draft_tokens and self.draft is not None:
            self.draft.reserve(hit.draft_tokens)
            draft = self.draft.cache_arrays()
            for i, block in enumerate(hit.blocks[:hit.draft_tokens // b]):
                for cache, kept in zip(draft, block.draft):
                    cache[seq.slot][:, max(i * b - 1, 0):(i + 1) * b - 1] = kept

    def keep_prefix(self, seq: Sequence, tokens, context: int, drafted: int) -> None:
        """Copy the whole blocks of `tokens` the prefix cache lacks out of the sequence's slot: the base
        holds `context` of them, the head's rows every pair within the first `drafted`."""
        cache, b = self.prefix, self.prefix.block_tokens
        keys = cache.keys(tokens[:context])
        wanted = cache.missing(keys, drafted if self.draft is not None else 0)
        base = self.base.cache_arrays()
        draft = self.draft.cache_arrays() if self.draft is not None else []
        blocks = {}
        for i, key, with_draft, stored in wanted:
            s, e = i * b, (i + 1) * b
            head = [np.array(a[seq.slot][:, max(s - 1, 0):e - 1]) for a in draft] if with_draft else None
            if stored is not None:  # its base part stored already (at prefill): add the head's rows
                blocks[key] = Block(key, stored.base, stored.features, head)
            else:
                blocks[key] = Block(key, [np.array(a[seq.slot][:, s:e]) for a in base], np.array(seq.features[s:e]),
                                    head)
        cache.insert(keys, blocks)  # with nothing new, it marks the chain used

    # --- sequences --------------------------------------------------------------------------
    def open_sequence(self) -> Sequence:
        """A slot of the caches for a new sequence (raises NoRoom when every slot is taken)."""
        free = [slot for slot in range(self.sequences) if slot not in self._open]
        if not free:
            raise NoRoom(f"all {self.sequences} sequence slots are taken")
        features = self.base.device_array(np.zeros((self.max_length + 1, self.hidden_size), self.io_dtype))
        seq = self._open[free[0]] = Sequence(free[0], features)
        return seq

    def close_sequence(self, seq: Sequence) -> None:
        del self._open[seq.slot]

    @property
    def open_sequences(self) -> int:
        return len(self._open)

    @property
    def solo(self) -> Sequence:
        """The sequence of one generation at a time (runtime.Generator's own calls and the tests')."""
        if self._solo is None:
            self._solo = self.open_sequence()
        return self._solo

    def release_solo(self) -> None:
        """Give the solo sequence's slot back (to sequences decoded side by side)."""
        if self._solo is not None:
            self.close_sequence(self._solo)
            self._solo = None

    @property
    def features(self):
        return self.solo.features

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

    def start(self, prompt_length: int) -> None:
        """A new generation of the solo sequence: size growing caches for its prompt (a long earlier
        one may have grown them)."""
        self.solo
        self.base.reserve(prompt_length + 1, shrink=True)

    def fit(self) -> None:
        """After a sequence ends: hand the caches over at no more capacity than the open sequences
        need. With none open, every cache at its smallest; otherwise the base's, where the longest
        open sequence leaves FIT_SLACK positions or more unused: each step of the others reads the
        whole capacity, while a re-layout costs about as much as a few such steps read."""
        if not self._open:
            for session in (self.base, self.draft):
                if session is not None:
                    session.reserve(1, shrink=True)
            return
        need = max(1, *(seq.end for seq in self._open.values()))
        if self.fit_slack is not None and self.base.capacity - need >= self.fit_slack:
            self.base.reserve(need, shrink=True)

    def _causal_bias(self, t: int, context: int) -> np.ndarray:
        bias = np.zeros((t, context + t), self.io_dtype)
        bias[:, context:] = self.causal[:t, :t]
        return bias

    # --- the rows of a step ---------------------------------------------------------------
    def prefill_rows(self, tokens: np.ndarray, context: int, seq: Sequence) -> Rows:
        """Prompt tokens at positions context.. (causal), the last row's logits wanted."""
        t = len(tokens)
        return Rows(seq, "prefill", np.asarray(tokens, np.int64), np.arange(context, context + t),
                    self._causal_bias(t, context), context, np.array([t - 1]), prompt=True)

    def verify_rows(self, tree: DraftTree, context: int, seq: Sequence) -> Rows:
        """The tree's nodes at rows context.. of the sequence, every node's logits wanted."""
        t = len(tree.tokens)
        bias = np.empty((t, context + t), self.io_dtype)
        write_attention_bias(bias, tree, context, self.masked)
        return Rows(seq, "verify", tree.tokens, context + tree.depths, bias, context, np.arange(t))

    def draft_context_rows(self, next_tokens: np.ndarray, start: int, top_k: int, seq: Sequence,
                           prompt: bool = False) -> Rows:
        """The head's rows start.. (feature f_j with token x_{j+1}), the last row's top-k wanted."""
        t = len(next_tokens)
        return Rows(seq, "draft", np.asarray(next_tokens, np.int64), np.arange(start, start + t),
                    self._causal_bias(t, start), start, np.array([t - 1]), seq.features[start:start + t], top_k,
                    prompt=prompt)

    def draft_expand_rows(self, tokens: np.ndarray, features, mask: np.ndarray, context: int, step: int,
                          top_k: int, seq: Sequence) -> Rows:
        """One frontier (k nodes at depth step+1, head position context+step, draft tree slots
        context + step*k ..); mask [k, (step+1)*k] says which tree slots each node sees (itself and
        its ancestors)."""
        k = len(tokens)
        bias = np.zeros((k, context + step * k + k), self.io_dtype)
        bias[:, context:] = np.where(mask, 0, self.masked)
        return Rows(seq, "draft", np.asarray(tokens, np.int64), np.full(k, context + step), bias,
                    context + step * k, np.arange(k), features, top_k)

    # --- a step -----------------------------------------------------------------------------
    def run(self, parts: list[Rows]) -> None:
        """One step of one graph over the rows of every part (each a different sequence); sets each
        part's outputs: "hidden" [rows, H] and, for the base, "logits" [its logit rows, V], for the
        draft "ids" and "logp" [its logit rows, its top_k]; views valid until the next step.

        A step of fewer than min_rows rows is padded with copies of the first part's first row that
        see only that row's context and themselves: nothing attends to them, their outputs are
        dropped and their cache rows, past the part's own, are overwritten by a later step."""
        graph = parts[0].graph
        session = self.draft if graph == "draft" else self.base
        t = sum(p.rows for p in parts)
        n = max(t, self.min_rows)
        if n > self.step_rows:
            raise ValueError(f"a step of {n} rows exceeds this engine's {self.step_rows}")
        if len(parts) > 1 and not self.slotted:
            raise ValueError("this artifact's graphs hold one sequence per step")
        row = 0
        for p in parts:
            self.ids[row:row + p.rows] = p.ids
            self.positions[row:row + p.rows] = p.positions
            if graph == "draft":
                self.step_features[row:row + p.rows] = p.features
            row += p.rows
        first = parts[0]
        if n > t:
            self.ids[t:n] = first.ids[0]
            self.positions[t:n] = first.positions[0]
            if graph == "draft":
                self.step_features[t:n] = first.features[0]
        inputs = {"input_ids": self.ids[:n].reshape(1, n), "position_ids": self.positions[:n].reshape(1, n),
                  "logit_rows": np.concatenate([start + p.logit_rows for start, p in
                                                zip(np.cumsum([0] + [p.rows for p in parts]), parts)])}
        if graph == "base":
            for p in parts:
                p.seq.end = max(p.seq.end, p.first_slot + p.rows + (n - t if p is first else 0))
        if len(parts) > 1:
            inputs.update(self._grouped(parts, t, n, session))
            span = (min(p.seq.slot for p in parts), max(p.seq.slot for p in parts) + 1)
        else:
            # One sequence, its rows side by side: the session completes the inputs (runtime/caches.py).
            width = first.first_slot + n
            bias = self.wide_bias[: n * width].reshape(1, 1, n, width)
            bias[0, 0, :t] = self.masked
            bias[0, 0, :t, :first.bias.shape[1]] = first.bias
            if n > t:
                self._pad_bias(bias[0, 0, t:], first, np.arange(first.first_slot + t, first.first_slot + n))
            inputs["attention_bias"] = bias
            span = (first.seq.slot, first.seq.slot + 1)
        k = 1
        if graph == "draft":
            k = self.top_k[0] = max(p.top_k for p in parts)
            inputs["features"] = self.step_features[:n].reshape(1, n, -1)
            inputs["top_k"] = self.top_k
        kind = "draft" if graph == "draft" else "verify" if any(p.kind == "verify" for p in parts) else "prefill"
        start = time.perf_counter()
        out = session.run(inputs, k, span)
        self.timings[kind] += time.perf_counter() - start
        if graph == "base":
            self.cache_positions["read"] += session.capacity * (span[1] - span[0])
            self.cache_positions["used"] += sum(p.first_slot + p.rows for p in parts)
        row = r = 0
        for p in parts:
            wanted = len(p.logit_rows)
            p.outputs = {"hidden": out["hidden_states"][0, row:row + p.rows]}
            if graph == "draft":
                p.outputs["ids"] = out["topk_ids"][0, r:r + wanted, :p.top_k]
                p.outputs["logp"] = out["topk_logprobs"][0, r:r + wanted, :p.top_k]
            else:
                p.outputs["logits"] = out["logits"][0, r:r + wanted]
            row, r = row + p.rows, r + wanted

    def _pad_bias(self, bias: np.ndarray, first: Rows, slots: np.ndarray) -> None:
        """Padding rows: each sees the first part's context and itself."""
        bias[:] = self.masked
        bias[:, :first.first_slot] = 0
        bias[np.arange(len(slots)), slots] = 0

    def _grouped(self, parts: list[Rows], t: int, n: int, session: Session) -> dict:
        """A slotted graph's inputs: the rows regrouped by sequence over the span of cache sequences
        the parts hold, M rows each (padding rows see one key, so that they stay finite), the
        attention bias over each sequence's cache, and where each row is written."""
        first_seq = min(p.seq.slot for p in parts)
        span = max(p.seq.slot for p in parts) + 1 - first_seq
        counts = [p.rows + (n - t if i == 0 else 0) for i, p in enumerate(parts)]
        m = max(counts)
        capacity = session.reserve(max(p.first_slot + c for p, c in zip(parts, counts)))
        bias = self.wide_bias[: span * m * capacity].reshape(span, 1, m, capacity)
        bias.fill(self.masked)
        bias[..., 0] = 0
        gather = np.zeros(span * m, np.int64)
        scatter, sequences, slots = (np.empty(n, np.int64) for _ in range(3))
        row = 0
        pad = t  # padding rows follow the parts' rows
        for i, (p, count) in enumerate(zip(parts, counts)):
            s = p.seq.slot - first_seq
            rows = np.arange(row, row + p.rows)
            if i == 0 and count > p.rows:
                rows = np.concatenate([rows, np.arange(pad, n)])
            gather[s * m:s * m + count] = rows
            scatter[rows] = s * m + np.arange(count)
            sequences[rows] = s
            slots[rows] = p.first_slot + np.arange(count)
            group = bias[s, 0]
            group[:p.rows, :p.bias.shape[1]] = p.bias
            if count > p.rows:
                self._pad_bias(group[p.rows:count], p, slots[rows[p.rows:]])
            row += p.rows
        return {"attention_bias": bias, "row_gather": gather, "row_scatter": scatter, "cache_sequences": sequences,
                "cache_slots": slots}

    # --- what a step's outputs leave behind ---------------------------------------------------
    def finish_prefill(self, part: Rows) -> np.ndarray:
        """Keep the prompt rows' features; return the last row's logits [V]."""
        part.seq.features[part.first_slot:part.first_slot + part.rows] = part.outputs["hidden"]
        return part.outputs["logits"][0]

    def finish_verify(self, part: Rows) -> np.ndarray:
        """Keep the tree's hidden states (commit picks the accepted ones); return its logits [T, V]."""
        part.seq.last_hidden = part.outputs["hidden"]
        return part.outputs["logits"]

    @staticmethod
    def finish_draft(part: Rows):
        """(hidden states [rows, H], top-k ids, top-k log-probs [wanted rows, top_k])."""
        return part.outputs["hidden"], part.outputs["ids"], part.outputs["logp"]

    def commit(self, accepted: np.ndarray, context: int, seq: Sequence | None = None) -> None:
        """Keep the accepted nodes' K/V at rows context.. and their features; drop the rest."""
        seq = seq or self.solo
        n = len(accepted)
        if self.resident:
            seq.features[context:context + n] = seq.last_hidden[accepted]
        else:
            np.take(seq.last_hidden, accepted, axis=0, out=seq.features[context:context + n])
        if n > 1 and not np.array_equal(accepted, self.rows[:n]):
            self.base.move(context + accepted[1:], context + 1, seq.slot)

    # --- one sequence, one step: the solo generation's calls and the tests' -----------------------
    def prefill(self, tokens: np.ndarray, context: int, seq: Sequence | None = None) -> np.ndarray:
        """Run prompt tokens at positions context.. ; keep their features; return last logits [V]."""
        part = self.prefill_rows(tokens, context, seq or self.solo)
        self.run([part])
        return self.finish_prefill(part)

    def verify(self, tree: DraftTree, context: int, seq: Sequence | None = None) -> np.ndarray:
        """One base forward over the tree (written to cache rows context..); returns logits [T, V]."""
        part = self.verify_rows(tree, context, seq or self.solo)
        self.run([part])
        return self.finish_verify(part)

    def draft_context(self, next_tokens: np.ndarray, start: int, top_k: int, seq: Sequence | None = None):
        """The root's draft row: (hidden state [1, H], top-k ids [k], log-probs [k]) of the last row."""
        part = self.draft_context_rows(next_tokens, start, top_k, seq or self.solo)
        self.run([part])
        hidden, ids, logp = self.finish_draft(part)
        return hidden[-1:], ids[0], logp[0]

    def draft_expand(self, tokens: np.ndarray, features, mask: np.ndarray, context: int, step: int, top_k: int,
                     seq: Sequence | None = None):
        """Run the head on one frontier: (hidden states [k, H], top-k ids and log-probs [k, top_k])."""
        part = self.draft_expand_rows(tokens, features, mask, context, step, top_k, seq or self.solo)
        self.run([part])
        return self.finish_draft(part)
