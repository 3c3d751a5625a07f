"""Runtime API, stopping rules, bad inputs, thread safety and the no-allocation steady state."""
import json
import shutil
import threading
import tracemalloc

import pytest

import runtime
from artifact.manifest import ArtifactError
from export.onnx_export import export_onnx
from models.registry import load_checkpoint
from runtime.backend import ProviderError


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "tiny-llama"
    export_onnx(load_checkpoint("tiny-llama"), path, "fp32", max_length=512, verify=False, log=lambda m: None)
    return path


@pytest.fixture(scope="module")
def gen(artifact):
    return runtime.load(artifact)


def test_output_fields(gen):
    out = gen.generate("hello", max_new_tokens=10)
    assert out.finish_reason in ("stop", "length")
    assert out.text == gen.tokenizer.decode(out.token_ids)
    assert sum(out.accept_lengths) >= len(out.token_ids) - 1
    assert out.mean_accept_length >= 1
    for key in ("prefill", "draft", "verify", "host", "total", "tokens_per_s"):
        assert key in out.timings
    assert out.timings["draft"] > 0, "speculative=None must use the artifact's head"


def test_max_new_tokens_exact(gen):
    for n in (1, 2, 5, 33):
        out = gen.generate("The", max_new_tokens=n, total_tokens=60, depth=5, top_k=10)
        assert len(out.token_ids) == n or out.finish_reason == "stop"


def test_stops_at_stop_token(gen):
    plain = gen.generate("hello", max_new_tokens=60, speculative=False)
    stop_token = plain.token_ids[5]
    gen.stop_ids.add(stop_token)
    try:
        out = gen.generate("hello", max_new_tokens=60)
    finally:
        gen.stop_ids.discard(stop_token)
    assert out.finish_reason == "stop"
    assert out.token_ids == plain.token_ids[: plain.token_ids.index(stop_token) + 1]


def test_stream_and_chat_match_generate(gen):
    out = gen.generate("hello there", max_new_tokens=30)
    assert "".join(gen.stream("hello there", max_new_tokens=30)) == out.text
    stream = gen.stream("hello there", max_new_tokens=30)
    with pytest.raises(StopIteration) as done:
        while True:
            next(stream)
    assert done.value.value.token_ids == out.token_ids
    messages = [{"role": "user", "content": "hi"}]
    chat = gen.chat(messages, max_new_tokens=12)
    ids = gen.tokenizer.apply_chat_template(messages)
    assert chat.token_ids == gen.generate(ids, max_new_tokens=12).token_ids


def test_stop_strings_cut_the_text_and_the_tokens(gen):
    plain = gen.generate("hello", max_new_tokens=40, speculative=False)
    text = plain.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    for speculative in (False, True):
        out = gen.generate("hello", max_new_tokens=40, speculative=speculative, stop=["\x00never", stop])
        assert out.finish_reason == "stop"
        assert out.text == text[: text.index(stop)]
        # The tokens end with the one that completed the stop string, no further.
        assert out.token_ids == plain.token_ids[: len(out.token_ids)]
        assert stop in gen.tokenizer.decode(out.token_ids)
        assert stop not in gen.tokenizer.decode(out.token_ids[:-1])
        assert "".join(gen.stream("hello", max_new_tokens=40, speculative=speculative, stop=stop)) == out.text


def test_stop_strings_split_across_deltas_are_held_back():
    from runtime.tokenizer import StopStrings
    stops = StopStrings(["END", "xyz"])
    released = [stops.push(d) for d in ("abc E", "N", "D tail")]
    assert released == ["abc ", "", ""] and stops.hit
    stops = StopStrings(["END"])
    assert stops.push("abc EN") == "abc " and stops.push("d") == "ENd" and not stops.hit
    assert stops.push("E") == "" and stops.flush() == "E"


def test_events_carry_text_and_token_deltas(gen):
    events = gen.events("hello there", max_new_tokens=30)
    texts, ids = [], []
    with pytest.raises(StopIteration) as done:
        while True:
            delta, new, _ = next(events)
            texts.append(delta)
            ids.extend(new)
    out = done.value.value
    assert "".join(texts) == out.text and ids == out.token_ids
    assert out.token_ids == gen.generate("hello there", max_new_tokens=30).token_ids


def test_cancel_ends_the_generation_and_frees_the_generator(gen):
    cancel = threading.Event()
    events = gen.events("hello", max_new_tokens=200, cancel=cancel)
    next(events)
    cancel.set()
    with pytest.raises(StopIteration) as done:
        while True:
            next(events)
    out = done.value.value
    assert out.finish_reason == "cancelled" and len(out.token_ids) < 200
    # Closing a stream early releases the generator for the next call at once.
    stream = gen.stream("hello", max_new_tokens=100)
    next(stream)
    stream.close()
    assert len(gen.generate("hello", max_new_tokens=3).token_ids) == 3


def test_bad_generation_arguments(gen):
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate("x", max_new_tokens=0)
    with pytest.raises(ValueError, match="top_k"):
        gen.generate("x", top_k=100)
    # 0 is a value, not "the default": refused where it is out of range, used where it is not.
    for name in ("total_tokens", "top_k"):
        with pytest.raises(ValueError, match=rf"{name} must be in \[1, "):
            gen.generate("x", max_new_tokens=3, **{name: 0})
    with pytest.raises(ValueError, match=r"depth must be in \[0, "):
        gen.generate("x", max_new_tokens=3, depth=-1)
    assert gen.generate("x", max_new_tokens=3, total_tokens=3, depth=0, top_k=2).token_ids == \
        gen.generate("x", max_new_tokens=3, speculative=False).token_ids
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="token ids"):
        gen.generate([10**6], max_new_tokens=3)


def test_no_head_artifact_refuses_speculation(tmp_path):
    path = tmp_path / "nohead"
    export_onnx(load_checkpoint("tiny-qwen2", no_head=True), path, "fp32", max_length=128, verify=False,
                log=lambda m: None)
    gen = runtime.load(path)
    assert gen.generate("hi", max_new_tokens=5).accept_lengths == [1] * len(gen.generate("hi", max_new_tokens=5).accept_lengths)
    with pytest.raises(ValueError, match="no draft head"):
        gen.generate("hi", max_new_tokens=5, speculative=True)


def test_broken_artifacts_are_refused(artifact, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    (broken / "draft.onnx").unlink()
    with pytest.raises(ArtifactError, match="missing draft.onnx"):
        runtime.load(broken)
    shutil.copy(artifact / "draft.onnx", broken / "draft.onnx")
    with open(broken / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02\x03")
    with pytest.raises(ArtifactError, match="checksum mismatch for weights.bin"):
        runtime.load(broken)
    shutil.copy(artifact / "weights.bin", broken / "weights.bin")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["format_version"] = 99
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 99"):
        runtime.load(broken)
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        runtime.load(tmp_path)


def test_unknown_and_missing_providers(artifact):
    with pytest.raises(ProviderError, match="unknown provider"):
        runtime.load(artifact, provider="tpu")
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ProviderError, match="CUDAExecutionProvider is not available"):
            runtime.load(artifact, provider="cuda")


def test_threads_are_serialized(gen):
    expected = {p: gen.generate(p, max_new_tokens=25).token_ids for p in ("alpha", "beta", "gamma")}
    results, errors = {}, []

    def work(p):
        try:
            for _ in range(3):
                results.setdefault(p, []).append(gen.generate(p, max_new_tokens=25).token_ids)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for p, outs in results.items():
        assert all(o == expected[p] for o in outs)


def test_reentrant_use_from_an_open_stream_is_refused(gen):
    stream = gen.stream("hello", max_new_tokens=20)
    next(stream)
    with pytest.raises(RuntimeError, match="already running"):
        gen.generate("x", max_new_tokens=2)
    stream.close()
    assert gen.generate("x", max_new_tokens=2).token_ids


def test_steady_state_allocates_no_buffers(artifact):
    """Over a long run, numpy allocations stay tiny: no per-step logits, bias, feature or cache
    copies (the cache alone is 2 x 2 x 2 x 512 x 32 floats = 256 KiB per copy), only the small arrays
    of each cycle's bookkeeping (the tree, its size by step costs). The prefix cache is off: what it
    copies out at a generation's end it keeps, on purpose (test_runtime_prefix_cache.py)."""
    gen = runtime.load(artifact, prefix_cache_mb=0)
    gen.stop_ids.clear()  # run the full length
    gen.generate("warm up", max_new_tokens=8)
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    out = gen.generate("a long run of tokens", max_new_tokens=300)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(out.token_ids) == 300
    assert peak - before < 128 * 1024, f"peak extra allocation {peak - before} bytes"



def test_session_pools_stop_spinning_after_each_run(gen):
    # The base and draft sessions alternate; a pool spinning on after its run slowed the next
    # session's run 1.6-1.9x on 2 cores.
    for s in (gen.engine.base.session, gen.engine.draft.session):
        assert s.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
