"""Public API: runtime.load(artifact) -> Generator with generate / stream / chat / hf_generate."""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from artifact.manifest import read_manifest

from . import cpu_fit
from .batch import FINISHED, Scheduler
from .engine import Engine
from .generation import DEFAULT_LOOKUP, Decoder, Settings, tree_label
from .prefix_cache import PrefixCache, default_budget_bytes
from .providers import check_provider
from .step_costs import load_or_probe
from .tokenizer import ChatTokenizer, StopStrings, StreamDecoder
from .tuning import plain_from, read_tuning

log = logging.getLogger("runtime")

CANCEL_POLL_S = 0.05  # how often a generation waiting on the scheduler looks at its cancel event


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (from the logits it was chosen from, the
    verify step's for speculated tokens), and the most likely tokens there, most likely first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]       # (token id, log-probability)


class Event(NamedTuple):
    """What Generator.events yields per decoding cycle."""
    text: str                          # the text delta
    token_ids: list[int]               # the new tokens
    logprobs: list[TokenLogprob] | None  # theirs, where asked for


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str                 # "stop" (end-of-turn/eos token or a stop string), "length" or "cancelled"
    accept_lengths: list[int]          # tokens per verify cycle, bonus included (EAGLE's tau)
    timings: dict = field(default_factory=dict)  # seconds, tokens_per_s, and prefix_hit_tokens (prompt tokens reused)
    logprobs: list[TokenLogprob] | None = None   # one per token, with logprobs=k

    @property
    def mean_accept_length(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0


class Generator:
    """One artifact loaded for generation. With parallel=1, calls are serialized: one generation at a
    time. With parallel=N, up to N generations decode side by side, their base steps batched
    (runtime/batch.py), from any number of threads."""

    def __init__(self, path, provider: str = "cpu", max_length: int | None = None, threads: int | None = None,
                 verify_checksums: bool = True, device: str = "cpu", provider_options: dict | None = None,
                 parallel: int = 1, row_budget: int | None = None, prefix_cache_mb: float | None = None,
                 size_trees: bool = True):
        check_provider(provider)
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.path = Path(path)
        self.manifest = read_manifest(self.path, verify_checksums)
        self.provider = provider
        self.engine = Engine(self.path, self.manifest, provider, max_length, threads, device, provider_options,
                             sequences=parallel)
        if provider == "cpu" and (why := cpu_fit.advice(self.manifest)):
            log.warning(why)
        self.tokenizer = ChatTokenizer(self.path / self.manifest["tokenizer"])
        self.stop_ids = set(self.manifest["stop_token_ids"])
        # The tree used when a call names none: what `python -m runtime tune` chose for this provider,
        # else the artifact's default. Tuning may also find that plain decoding is faster here.
        self.tree_defaults = dict(self.manifest["tree_defaults"])
        self.speculative_default = self.engine.draft is not None
        self.tree_source = "the artifact's default"
        tuned = read_tuning(self.path, provider)
        if tuned is not None and "tree" in tuned and self.engine.draft is not None:
            self.tree_source = f"tuned on {tuned['machine']} ({tuned['date']})"
            if tuned["tree"] is None:
                self.speculative_default = False
            else:
                self.tree_defaults = dict(tuned["tree"])
        self.tree_defaults.setdefault("lookup", DEFAULT_LOOKUP)  # manifests and tunings that predate it
        # Calls that name no tree get the default tree sized each cycle by this machine's step costs.
        self.step_costs = (load_or_probe(self.path, provider, self.engine)
                           if size_trees and self.speculative_default else None)
        self.prefix_cache = self._prefix_cache(prefix_cache_mb)
        self._grammar = None               # runtime/constraints.GrammarTokenizer, made at first use
        self.scheduler: Scheduler | None = None
        if parallel > 1:
            # A fixed row budget is the caller's policy; otherwise the tuned load from which plain steps win.
            plain = None if row_budget is not None else plain_from(tuned, tree_label(self.tree_defaults))
            self.scheduler = Scheduler(self.engine, row_budget, plain)
            self.scheduler.start()
        self._lock = threading.Lock()
        self._owner: int | None = None

    def _prefix_cache(self, megabytes: float | None) -> PrefixCache | None:
        """None: on, at the default budget, where this engine can reuse prefixes exactly; 0: off."""
        if megabytes is None:
            self.prefix_note = self.engine.prefix_refusal()
            return None if self.prefix_note else self.engine.use_prefix_cache(default_budget_bytes())
        if megabytes < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0: off), got {megabytes}")
        if megabytes == 0:
            self.prefix_note = "prefix reuse off (prefix_cache_mb=0)"
            return None
        self.prefix_note = None
        return self.engine.use_prefix_cache(int(megabytes * 2**20))

    def describe_prefix_cache(self) -> str:
        return self.prefix_cache.describe() if self.prefix_cache is not None else self.prefix_note

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    @property
    def verify_exact(self) -> bool:
        """Whether verification computes every tree node bitwise as plain decoding does, here: the
        manifest's claim, for torch artifacts also checked on this machine's GEMMs at load."""
        return self.engine.verify_exact

    @property
    def vocab_size(self) -> int:
        return self.manifest["model"]["config"]["vocab_size"]

    def describe_default(self) -> str:
        """Which decoding a call without tree arguments gets, and where that choice comes from."""
        if not self.speculative_default:
            return f"plain decoding ({self.tree_source})" if self.engine.draft is not None else "plain decoding (no head)"
        tree = f"EAGLE-2 tree {tree_label(self.tree_defaults)} ({self.tree_source})"
        if self.step_costs is not None:
            tree += f", sized each cycle by {self.step_costs.describe()}"
        if self.scheduler is not None and self.scheduler.plain_from:
            tree += f"; plain steps from {self.scheduler.plain_from} generations side by side (runtime tune --batch)"
        return tree

    def tree(self, total_tokens=None, depth=None, top_k=None, lookup=None) -> dict:
        """The tree a call with these arguments gets: each None is the default tree's value (0 is a value)."""
        chosen = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k, "lookup": lookup}
        return {name: self.tree_defaults[name] if v is None else v for name, v in chosen.items()}

    def _settings(self, max_new_tokens: int = 256, speculative: bool | None = None, total_tokens=None, depth=None,
                  top_k=None, lookup=None, temperature: float = 0.0, top_p: float = 1.0, sampling_top_k: int = 0,
                  min_p: float = 0.0, seed: int | None = None, logprobs: int | None = None) -> Settings:
        """The Settings of a call with these arguments (None: the defaults this Generator chose)."""
        if speculative is None:
            speculative = self.speculative_default
        # A seeded sampled reply draws what it draws with its tree: only fixed trees repeat it anywhere.
        named = (total_tokens, depth, top_k, lookup) != (None,) * 4 or (temperature > 0 and seed is not None)
        return Settings(max_new_tokens=max_new_tokens, speculative=speculative,
                        **self.tree(total_tokens, depth, top_k, lookup), temperature=temperature, top_p=top_p,
                        sampling_top_k=sampling_top_k, min_p=min_p, seed=seed, logprobs=logprobs,
                        sizing=None if named else self.step_costs)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        vocab = self.manifest["model"]["config"]["vocab_size"]
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _acquire(self):
        if self._owner == threading.get_ident():
            raise RuntimeError("this Generator is already running a generation in this thread "
                               "(finish or close the open stream first)")
        self._lock.acquire()
        self._owner = threading.get_ident()

    def _release(self):
        self._owner = None
        self._lock.release()

    def close(self) -> None:
        """Stop the scheduler of a parallel Generator, cancelling what it decodes."""
        if self.scheduler is not None:
            self.scheduler.stop()

    def constraint(self, json_schema):
        """A grammar for one generation: json_schema True, any JSON object; a dict, that schema's JSON."""
        if json_schema is None or json_schema is False:
            return None
        if self._grammar is None:
            from .constraints import GrammarTokenizer
            self._grammar = GrammarTokenizer(self.path / self.manifest["tokenizer"] / "tokenizer.json", self.vocab_size,
                                             sorted(self.stop_ids))
        return self._grammar.json(None if json_schema is True else json_schema)

    def _run(self, prompt, settings: Settings, cancel: threading.Event | None = None, constraint=None):
        """A generator of (new token ids, decoder): the scheduler's when there is one (the generation
        is queued now), else one decoding in the caller's thread under the lock."""
        ids = self._prompt_ids(prompt)
        if self.scheduler is None:
            return self._run_alone(ids, settings, constraint)
        return self._receive(self.scheduler.submit(ids, settings, self.stop_ids, constraint), cancel)

    def _receive(self, request, cancel: threading.Event | None):
        """The scheduler's items for `request`; `cancel` is watched also while it waits for a slot
        or fills its prompt, when no item comes."""
        try:
            while True:
                try:  # without a cancel event there is nothing to watch: block
                    item = request.tokens.get(timeout=None if cancel is None else CANCEL_POLL_S)
                except queue.Empty:
                    if cancel.is_set():
                        self.scheduler.cancel(request)
                    continue
                if item is FINISHED:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item, request.decoder
        finally:
            self.scheduler.cancel(request)  # no effect once it has ended; else it ends at its next step

    def _run_alone(self, ids: list[int], settings: Settings, constraint=None):
        self._acquire()
        tokens = None
        try:
            decoder = Decoder(self.engine, ids, settings, self.stop_ids, constraint=constraint)
            tokens = decoder.tokens()
            for new in tokens:
                yield new, decoder
        finally:
            if tokens is not None:
                tokens.close()  # its end (the prefix it leaves) comes before another generation starts
            self._release()

    @staticmethod
    def _logprobs(decoder: Decoder, start: int, end: int) -> list[TokenLogprob] | None:
        """Tokens [start, end)'s log-probabilities, where the generation asked for them."""
        if decoder is None or decoder.s.logprobs is None:
            return None
        return [TokenLogprob(int(token), lp, list(zip(ids.tolist(), top.tolist())))
                for token, (lp, ids, top) in zip(decoder.sequence[len(decoder.prompt) + start:],
                                                  decoder.logprobs[start:end])]

    def _output(self, decoder: Decoder, token_ids: list[int], text: str, cycles: int) -> GenerationOutput:
        """`cycles`: the verify cycles whose tokens the caller took (a scheduler's decoder may have run
        one more before it saw a stop string's finish)."""
        if decoder is None:  # cancelled while it waited for a slot: it never started
            return GenerationOutput(text=text, token_ids=token_ids, finish_reason="cancelled", accept_lengths=[],
                                    timings={})
        st = decoder.stats
        t = {}
        if self.scheduler is None:  # batched steps are shared: a generation's own share is not measured
            t = dict(self.engine.timings)
            t["host"] = max(st.total_s - sum(t.values()), 0.0)
        t["total"] = st.total_s
        t["first_token"] = st.first_token_s
        t["prefix_hit_tokens"] = st.prefix_hit_tokens
        decode_s = st.total_s - st.first_token_s
        t["tokens_per_s"] = (len(token_ids) - 1) / decode_s if decode_s > 0 and len(token_ids) > 1 else 0.0
        return GenerationOutput(text=text, token_ids=token_ids, finish_reason=decoder.finish_reason,
                                accept_lengths=st.accept_lengths[:max(cycles, 0)], timings=t,
                                logprobs=self._logprobs(decoder, 0, len(token_ids)))

    def generate(self, prompt, max_new_tokens: int = 256, speculative: bool | None = None,
                 total_tokens: int | None = None, depth: int | None = None, top_k: int | None = None,
                 lookup: int | None = None, temperature: float = 0.0, top_p: float = 1.0, sampling_top_k: int = 0,
                 min_p: float = 0.0, seed: int | None = None, stop: list[str] | str | None = None,
                 cancel: threading.Event | None = None, logprobs: int | None = None,
                 json_schema: dict | bool | None = None) -> GenerationOutput:
        """Generate from a prompt string or token ids. speculative=None uses the head when there is one.
        total_tokens / depth / top_k shape the draft tree and `lookup` is the length of the
        prompt-lookup branch grafted onto it (0: none; None = the artifact's defaults);
        temperature > 0 samples (with top_p, sampling_top_k and min_p), losslessly in both modes. `stop`:
        strings that end the reply (cut before them, finish_reason "stop"); `cancel`: an event
        that ends the generation at the next cycle (finish_reason "cancelled"); `logprobs`: each
        token's log-probability and that many most likely ones (0-20) in output.logprobs, from the
        logits it was chosen from (a tree's verify step: what plain decoding computes); `json_schema`:
        the reply is JSON, any object (True) or the schema's (a dict), every token chosen under the
        grammar's mask, trees included (runtime/constraints.py; needs llguidance)."""
        events = self.events(prompt, max_new_tokens=max_new_tokens, speculative=speculative,
                             total_tokens=total_tokens, depth=depth, top_k=top_k, lookup=lookup,
                             temperature=temperature, top_p=top_p, sampling_top_k=sampling_top_k, min_p=min_p, seed=seed,
                             stop=stop, cancel=cancel, logprobs=logprobs, json_schema=json_schema)
        return self._drain(events)

    def generate_many(self, prompts: list, **kwargs) -> list[GenerationOutput]:
        """generate() for each prompt, the same keyword arguments for all; side by side on a
        Generator loaded with parallel > 1 (each output is the one generate() gives it alone)."""
        runs = [self.events(p, **kwargs) for p in prompts]  # all queued before any is read
        return [self._drain(run) for run in runs]

    @staticmethod
    def _drain(events) -> GenerationOutput:
        while True:
            try:
                next(events)
            except StopIteration as done:
                return done.value

    def stream(self, prompt, **kwargs):
        """Yield text deltas as tokens are accepted; the same keyword arguments as generate().
        When exhausted, the generator returns the GenerationOutput (StopIteration.value)."""
        events = self.events(prompt, **kwargs)
        while True:
            try:
                delta = next(events).text
            except StopIteration as done:
                return done.value
            if delta:
                yield delta

    def events(self, prompt, **kwargs):
        """Yield an Event (text delta, new token ids, their log-probabilities with logprobs=k) per
        decoding cycle, the same keyword arguments as generate(); return the GenerationOutput.
        Closing it early ends the generation. Text is held back while it may be an incomplete
        character or the start of a stop string, so the deltas joined are always the output's text."""
        stop, cancel = kwargs.pop("stop", None), kwargs.pop("cancel", None)
        constraint = self.constraint(kwargs.pop("json_schema", None))
        settings = self._settings(**kwargs)  # an argument it does not know raises TypeError naming it
        return self._events(self._run(prompt, settings, cancel, constraint), stop, cancel)

    def _events(self, run, stop, cancel):
        text = StreamDecoder(self.tokenizer)
        stops = StopStrings([stop] if isinstance(stop, str) else list(stop or []))
        tokens, released, decoder = [], [], None
        cycles = -1  # the first list is the prefill's token
        try:
            for new, decoder in run:
                if cancel is not None and cancel.is_set():
                    decoder.finish("cancelled")
                    break
                cycles += 1
                before = len(tokens)
                tokens.extend(new)
                delta = stops.push(text.push(new))
                released.append(delta)
                if stops.hit:
                    del tokens[self._stop_end(tokens, before, stops.stops):]
                    decoder.finish("stop")
                    yield Event(delta, tokens[before:], self._logprobs(decoder, before, len(tokens)))
                    break
                yield Event(delta, new, self._logprobs(decoder, before, len(tokens)))
        finally:
            run.close()  # releases the generator's lock now, also when the caller closes us early
        if not stops.hit:
            tail = stops.push(text.push([], final=True)) + stops.flush()
            released.append(tail)
            if tail:
                yield Event(tail, [], self._logprobs(decoder, 0, 0))
        return self._output(decoder, tokens, "".join(released), cycles)

    def _stop_end(self, tokens: list[int], before: int, stops: list[str]) -> int:
        """How many tokens to keep: up to the one whose text completes a stop string."""
        for k in range(before + 1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:k])
            if any(s in text for s in stops):
                return k
        return len(tokens)

    def chat(self, messages: list[dict], stream: bool = False, **kwargs):
        """Apply the chat template (with the assistant prompt) and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.stream(prompt, **kwargs) if stream else self.generate(prompt, **kwargs)

    def hf_generate(self, input_ids, max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                    top_p: float = 1.0, top_k: int = 0, seed: int | None = None, speculative: bool | None = None):
        """transformers-style: input_ids [1, n] (torch tensor, numpy or list) -> [1, n + new] of the same kind.
        top_k here is transformers' sampling top-k, as in GenerationConfig."""
        arr = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids, dtype=np.int64).reshape(1, -1)
        out = self.generate(arr[0], max_new_tokens=max_new_tokens, speculative=speculative,
                            temperature=temperature if do_sample else 0.0, top_p=top_p,
                            sampling_top_k=top_k if do_sample else 0, seed=seed)
        result = np.concatenate([arr, np.asarray(out.token_ids, np.int64)[None]], axis=1)
        if hasattr(input_ids, "cpu"):
            import torch
            return torch.from_numpy(result)
        return result


def load(path, provider: str = "cpu", max_length: int | None = None, threads: int | None = None,
         verify_checksums: bool = True, device: str = "cpu", provider_options: dict | None = None,
         parallel: int = 1, row_budget: int | None = None, prefix_cache_mb: float | None = None,
         size_trees: bool = True) -> Generator:
    """Load an artifact directory made by `python -m export`. provider: cpu, cuda or openvino (ONNX
    Runtime) for ONNX artifacts, with ONNX Runtime `provider_options` (runtime.openvino_options(device,
    precision_hint) for OpenVINO); ipex or torch for torch artifacts, on `device` (cpu, cuda, xpu).
    parallel: how many generations may decode side by side, batched (ONNX artifacts with exact
    attention, on the cpu provider; the others decode one at a time); row_budget: the tree rows of
    one such step, shared by EAGLE-2's rerank across them (None: each its own tree, and from as many
    generations side by side as `runtime tune --batch` found plain steps faster, plain steps). More
    generations than `parallel` wait for one to end. prefix_cache_mb: host memory for the caches of
    earlier generations' tokens, reused by later prompts that start with them (runtime/prefix_cache.py;
    None: 1/8 of the machine's memory where the artifact's steps are exact here, else off; 0: off).
    size_trees: calls that name no tree get the default tree sized each cycle, up to its total_tokens,
    by this machine's step costs (runtime/step_costs.py, probed at the first load here), and plain
    steps while trees do not pay; False: the default tree as it is, every cycle."""
    return Generator(path, provider, max_length, threads, verify_checksums, device, provider_options, parallel,
                     row_budget, prefix_cache_mb, size_trees)
