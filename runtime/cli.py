"""python -m runtime generate ARTIFACT --prompt "..." | chat ARTIFACT | tune ARTIFACT | serve ARTIFACT"""
from __future__ import annotations

import argparse
import sys

from artifact.manifest import ArtifactError

from .generation import PromptTooLongError, tree_label
from .backend import ProviderError


def _common(p):
    p.add_argument("artifact", help="artifact directory made by python -m export")
    p.add_argument("--provider", default="cpu", help="cpu, cuda or openvino (ONNX artifacts); ipex or torch "
                   "(torch artifacts)")
    p.add_argument("--device", default="cpu", help="torch artifacts: cpu, cuda or xpu")
    p.add_argument("--openvino-device", default="CPU", help="provider openvino: CPU, GPU, NPU, GPU.0, ...")
    p.add_argument("--openvino-precision", help="provider openvino: inference precision hint, e.g. bf16 (AMX / "
                   "AVX512-BF16 CPUs) or f16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--no-speculative", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--total-tokens", type=int, help="tokens verified per cycle (default: the artifact's)")
    p.add_argument("--depth", type=int, help="draft expansions per cycle (0: the root's draft children only)")
    p.add_argument("--top-k", type=int, help="draft branching per node")
    p.add_argument("--lookup", type=int, help="tokens of the prompt-lookup branch added to each tree (0: none)")
    p.add_argument("--fixed-trees", action="store_true", help="verify the default tree whole every cycle, "
                   "instead of sizing it by this machine's step costs")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stats", action="store_true", help="print tau, tokens/s and the time split")


def parser():
    p = argparse.ArgumentParser(prog="python -m runtime", epilog="benchmarks: python -m runtime.bench (decoders side by "
                                "side), python -m runtime.load_bench (the server under load)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion")
    _common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template to the prompt")
    c = sub.add_parser("chat", help="interactive chat (empty line or Ctrl-D to quit)")
    _common(c)
    sub.add_parser("tune", help="choose the draft tree for this machine (python -m runtime tune --help)",
                   add_help=False)
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (python -m runtime serve --help)",
                   add_help=False)
    return p


def _kwargs(a) -> dict:
    return dict(max_new_tokens=a.max_new_tokens, speculative=False if a.no_speculative else None,
                total_tokens=a.total_tokens, depth=a.depth, top_k=a.top_k, lookup=a.lookup, temperature=a.temperature,
                top_p=a.top_p, sampling_top_k=a.sampling_top_k, seed=a.seed)


def _decoding(gen, a) -> str:
    """What decoding the command's arguments select, in words."""
    if a.no_speculative:
        return "plain decoding"
    if any(v is not None for v in (a.total_tokens, a.depth, a.top_k, a.lookup)):
        return "EAGLE-2 tree " + tree_label(gen.tree(a.total_tokens, a.depth, a.top_k, a.lookup))
    return gen.describe_default()


def _print_stats(out, mode, file=sys.stderr):
    t = out.timings
    print(f"\n[{mode}; {len(out.token_ids)} tokens, finish={out.finish_reason}, tau={out.mean_accept_length:.2f}, "
          f"{t['tokens_per_s']:.1f} tok/s after the first token; time: prefill {t['prefill']*1e3:.0f} ms, "
          f"draft {t['draft']*1e3:.0f} ms, verify {t['verify']*1e3:.0f} ms, host {t['host']*1e3:.0f} ms]", file=file)


def _reply(gen, prompt_ids, kwargs):
    """Stream one reply to stdout; return its GenerationOutput."""
    stream = gen.stream(prompt_ids, **kwargs)
    while True:
        try:
            print(next(stream), end="", flush=True)
        except StopIteration as done:
            print()
            return done.value


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:
        from .tune import main as tune
        return tune(argv[1:])
    if argv[:1] == ["serve"]:
        try:
            from .serve.main import main as serve
        except ImportError as e:       # the serve extra is not installed
            print(f"error: {e}", file=sys.stderr)
            return 1
        return serve(argv[1:])
    a = parser().parse_args(argv)
    import runtime
    try:
        options = runtime.openvino_options(a.openvino_device, a.openvino_precision) if a.provider == "openvino" else None
        gen = runtime.load(a.artifact, provider=a.provider, device=a.device, provider_options=options,
                           size_trees=not a.fixed_trees)
        kwargs = _kwargs(a)
        if a.command == "generate":
            if a.raw or gen.tokenizer.chat_template is None:
                prompt = gen.tokenizer.encode(a.prompt)
            else:
                prompt = gen.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}])
            out = _reply(gen, prompt, kwargs)
            if a.stats:
                _print_stats(out, _decoding(gen, a))
            return 0
        history = []
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                return 0
            if not line:
                return 0
            history.append({"role": "user", "content": line})
            prompt = gen.tokenizer.apply_chat_template(history)
            out = _reply(gen, prompt, kwargs)
            if a.stats:
                _print_stats(out, _decoding(gen, a))
            history.append({"role": "assistant", "content": out.text})
    except (ArtifactError, ProviderError, PromptTooLongError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
