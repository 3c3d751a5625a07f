"""The OpenAI-compatible server (runtime/serve/) on loopback, against real tiny artifacts.

Servers run in-process (runtime.serve.ServerThread, any free port on 127.0.0.1) so tests can look
at the worker pool and inject faults through its fault_hook; the official openai client and httpx
talk to them over real sockets. Every expected text comes from Generator.generate() with the same
settings. Process-level behaviour (SIGTERM, load) is in test_server_load.py.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: bash ci/install_serve.sh")
pytest.importorskip("uvicorn", reason="the server needs the serve extra: bash ci/install_serve.sh")
pytest.importorskip("prometheus_client", reason="the server needs the serve extra: bash ci/install_serve.sh")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx: bash ci/install_serve.sh")

import runtime  # noqa: E402
from runtime import serve as srv  # noqa: E402

MAX_LENGTH = 512
MODEL = None                          # the artifact directory's name = the model id (set by `artifact`)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]
TIMEOUT = httpx.Timeout(30.0)


# ------------------------------------------------------------------------------------------------
# Fixtures: one artifact, a reference Generator, servers with injectable faults.
# ------------------------------------------------------------------------------------------------

class Faults:
    """fault_hook for WorkerPool: runs in the worker thread before a generation, keyed by the
    request's "user" field. "raise" -> RuntimeError; "block:NAME" -> wait until release(NAME)."""

    def __init__(self):
        self.gates: dict[str, threading.Event] = {}

    def gate(self, name: str) -> threading.Event:
        return self.gates.setdefault(name, threading.Event())

    def __call__(self, job):
        if job.user == "raise":
            raise RuntimeError("injected worker fault")
        if job.user and job.user.startswith("block:"):
            if not self.gate(job.user[6:]).wait(20):
                raise TimeoutError("the test never released this worker")

    def release_all(self):
        for event in self.gates.values():
            event.set()


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    global MODEL
    path = tiny_artifact("tiny-llama", "fp32")
    MODEL = path.name
    return path


@pytest.fixture(scope="module")
def ref(artifact):
    return runtime.load(artifact, max_length=MAX_LENGTH, threads=1)


def _serve(artifact, workers=2, max_queue=8, api_key=None, max_length=MAX_LENGTH, faults=None):
    """More than one worker: slots of one Generator decoding side by side (the server's default)."""
    pool = srv.load_pool(artifact, 1, max_queue, max_length=max_length, threads=1, fault_hook=faults,
                         parallel=workers)
    return pool, srv.ServerThread(srv.create_app(pool, artifact, api_key=api_key))


@pytest.fixture(scope="module")
def live(artifact):
    """A server decoding 2 requests side by side: (url, pool, faults)."""
    faults = Faults()
    pool, thread = _serve(artifact, faults=faults)
    with thread as url:
        yield url, pool, faults
        faults.release_all()


@pytest.fixture
def url(live):
    return live[0]


@pytest.fixture
def oai(url):
    openai = pytest.importorskip("openai", reason="the client tests need the openai package: bash ci/install_serve.sh")
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def chat_ids(ref, messages=MESSAGES):
    return ref.tokenizer.apply_chat_template(messages)


def _wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_error(response, status, param=None, code=None):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ------------------------------------------------------------------------------------------------
# The openai client: text equal to generate() with the same settings.
# ------------------------------------------------------------------------------------------------

def _chat(oai, stream: bool, **kwargs):
    """(text, finish_reason, usage, eagle) of one chat completion through the openai client."""
    if not stream:
        r = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert r.object == "chat.completion" and len(r.choices) == 1
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage, r.model_extra["eagle"]
    parts, finish, usage, eagle = [], None, None, None
    chunks = oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                         stream_options={"include_usage": True}, **kwargs)
    for i, chunk in enumerate(chunks):
        assert chunk.object == "chat.completion.chunk"
        if i == 0:
            assert chunk.choices[0].delta.role == "assistant"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                finish, eagle = choice.finish_reason, chunk.model_extra.get("eagle")
    return "".join(parts), finish, usage, eagle


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_greedy_equals_generate(oai, ref, stream):
    ids = chat_ids(ref)
    want = ref.generate(ids, max_new_tokens=40, temperature=0.0)
    text, finish, usage, eagle = _chat(oai, stream, max_tokens=40, temperature=0)
    assert text == want.text
    assert finish == want.finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(want.token_ids))
    assert usage.total_tokens == len(ids) + len(want.token_ids)
    assert eagle["tau"] == pytest.approx(want.mean_accept_length, abs=1e-3)
    assert {"draft_ms", "verify_ms", "tokens_per_s", "prefill_ms"} <= set(eagle)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_seeded_sampling_equals_generate(oai, ref, stream):
    want = ref.generate(chat_ids(ref), max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1234)
    text, finish, _, _ = _chat(oai, stream, max_tokens=32, temperature=0.8, top_p=0.9, seed=1234)
    assert (text, finish) == (want.text, want.finish_reason)
    other = ref.generate(chat_ids(ref), max_new_tokens=32, temperature=0.8, top_p=0.9, seed=99)
    assert other.text != want.text            # the seed does matter: the check above is not vacuous


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_greedy_equals_generate(oai, ref, stream):
    prompt = "The capital of France is"
    want = ref.generate(prompt, max_new_tokens=24, temperature=0.0)
    if stream:
        parts, finish = [], None
        for chunk in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True):
            assert chunk.object == "text_completion"
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        text = "".join(parts)
    else:
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(want.token_ids)
    assert (text, finish) == (want.text, want.finish_reason)


def test_completion_token_id_prompt(url, ref):
    ids = ref.tokenizer.encode("token ids in")
    want = ref.generate(ids, max_new_tokens=12)
    r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text


def _stop_case(ref):
    """A prompt whose greedy reply contains a 2-character stop string, and the expected cut."""
    ids = chat_ids(ref)
    full = ref.generate(ids, max_new_tokens=60).text
    stop = next(full[i:i + 2] for i in range(6, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    return full, stop, full[:full.find(stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("as_list", [False, True], ids=["str", "list"])
def test_stop_strings_cut_the_text(oai, ref, stream, as_list):
    full, stop, cut = _stop_case(ref)
    stops = [stop, "never-seen-\u2603"] if as_list else stop
    want = ref.generate(chat_ids(ref), max_new_tokens=60, stop=stops)
    assert want.text == cut
    text, finish, usage, eagle = _chat(oai, stream, max_tokens=60, temperature=0, stop=stops)
    assert text == cut and finish == "stop"
    assert stop not in text and len(text) < len(full)
    # The tokens up to the one that completed the stop string, and the runtime's own statistics.
    assert usage.completion_tokens == len(want.token_ids)
    assert eagle["tau"] == pytest.approx(want.mean_accept_length, abs=1e-3)


def test_a_reply_without_max_tokens_stops_at_the_cache(url, ref):
    """No max_tokens: the default may not fit beside a long prompt; the reply fills the context and
    ends there (a max_tokens that cannot fit is refused: test_max_tokens_beyond_context_names_the_numbers)."""
    from runtime.serve.schema import DEFAULT_MAX_TOKENS
    prompt = "z" * (MAX_LENGTH - 20)
    ids = ref.tokenizer.encode(prompt)
    assert len(ids) + DEFAULT_MAX_TOKENS > MAX_LENGTH
    want = ref.generate(prompt, max_new_tokens=DEFAULT_MAX_TOKENS)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == want.text
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= MAX_LENGTH


# ------------------------------------------------------------------------------------------------
# Models, health, metrics, auth.
# ------------------------------------------------------------------------------------------------

def test_health_is_503_while_the_scheduler_is_unhealthy(live):
    """The fault is the scheduler's own record (runtime/batch.py; its paths: test_runtime_scheduler_faults.py)."""
    url, pool, _ = live
    pool.scheduler.fault = RuntimeError("freeing a slot failed")
    try:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "unhealthy" and "freeing a slot" in r.json()["error"]
    finally:
        pool.scheduler.fault = None
    assert httpx.get(url + "/health").status_code == 200


def test_models_health_and_model_aliases(oai, url, ref):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["workers"] == 2 and health["model"] == MODEL
    # The manifest's model source is accepted as an alias of the directory name.
    source = ref.manifest["model"]["source"]
    r = httpx.post(url + "/v1/completions", json={"model": source, "prompt": "hi", "max_tokens": 2},
                   timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["model"] == source


def test_metrics_exposition(url, oai):
    oai.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    text = httpx.get(url + "/metrics").text
    for name in ("eagle2_requests_total", "eagle2_generated_tokens_total", "eagle2_prompt_tokens_total",
                 "eagle2_tokens_per_second_bucket", "eagle2_acceptance_length_bucket", "eagle2_queue_depth",
                 "eagle2_workers_busy", "eagle2_time_to_first_token_seconds_bucket",
                 "eagle2_request_latency_seconds_bucket", "eagle2_cancelled_generations_total"):
        assert name in text, name
    assert 'eagle2_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'eagle2_requests_total{endpoint="/v1/completions",status="404"}' in text


def _metric(url, name) -> float:
    line = next(l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith(name + " "))
    return float(line.split()[1])


def test_a_conversation_reuses_its_earlier_turns(url, oai, ref):
    """Each turn resends the history: the server starts it from the caches the earlier turn left."""
    messages = [{"role": "user", "content": "Tell me a long story about a cat who sails the sea at night, "
                                            "with every port it visits and every fish it meets on the way."}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    before = _metric(url, "eagle2_prefix_cache_hit_tokens_total")
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert _metric(url, "eagle2_prefix_cache_hit_tokens_total") - before >= 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert 0 < _metric(url, "eagle2_prefix_cache_hit_rate") < 1
    assert second.choices[0].message.content == ref.generate(chat_ids(ref, messages), max_new_tokens=24).text


def test_the_conversation_benchmark_reports_reuse_by_turn(url, ref):
    """runtime.load_bench --turns' client (runtime/conversations.py) against this server."""
    import asyncio

    from runtime import conversations
    system = conversations.system_prompt(ref.tokenizer, 60)
    results, wall = asyncio.run(conversations.run_conversations(url, system, conversations.user_turns(2, 2), 2, 8))
    want = [ref.generate(ref.tokenizer.apply_chat_template(t["messages"]), max_new_tokens=8).text
            for c in results for t in c]
    row = conversations.summary("this server", 2, results, wall, 0.0, want)
    assert row["turns"] == 2 and len(row["ttft_ms"]) == 2 and row["identical_to_in_process"] == row["replies"] == 4
    assert all(t["cached_tokens"] >= 16 for c in results for t in c[1:])  # the system prompt at least
    report = conversations.table({"conversations": 2, "system_tokens": 60, "max_tokens": 8, "machine": "here",
                                  "rows": [row]})
    assert "turn 2 TTFT p50 / p95 ms" in report and "| 4/4 |" in report


@pytest.mark.parametrize("parallel", [1, 2], ids=["one at a time", "side by side"])
def test_a_request_ends_at_its_time_limit(artifact, ref, parallel):
    """A request's "timeout" (or the server's --request-timeout): the answer ends with what it has,
    finish_reason "length"; a request with nothing yet by then gets 504."""
    pool, thread = _serve(artifact, workers=parallel)
    engine, run = pool.generators[0].engine, pool.generators[0].engine.run

    def slow(parts):  # about 60 ms a cycle
        time.sleep(0.01)
        run(parts)
    engine.run = slow
    prompt = list(range(5, 40))
    with thread as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 300, "temperature": 0,
                                                      "timeout": 0.5}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["eagle"]["timed_out"]
        assert 0 < body["usage"]["completion_tokens"] < 300
        assert ref.generate(prompt, max_new_tokens=300).text.startswith(body["choices"][0]["text"])
        for stream in (False, True):
            assert_error(httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
                "prompt": prompt, "max_tokens": 300, "timeout": 0.001, "stream": stream}), 504, code="timeout")
        assert_error(httpx.post(url + "/v1/completions", json={"prompt": prompt, "timeout": 0}), 400, param="timeout")
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_runtimes(oai, ref, stream):
    want = ref.generate(chat_ids(ref), max_new_tokens=12, logprobs=3)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        content = [e for chunk in oai.chat.completions.create(stream=True, **kwargs) for c in chunk.choices
                   if c.logprobs and c.logprobs.content for e in c.logprobs.content]
    else:
        content = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == len(want.token_ids)  # one entry per token, the end-of-turn token's too
    for entry, w in zip(content, want.logprobs):
        assert entry.logprob == w.logprob and bytes(entry.bytes) == ref.tokenizer.token_bytes(w.token_id)
        assert [t.logprob for t in entry.top_logprobs] == [lp for _, lp in w.top]
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely


def test_completion_logprobs_legacy_shape(url, ref):
    prompt = list(range(5, 30))
    want = ref.generate(prompt, max_new_tokens=6, logprobs=2)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2},
                   timeout=TIMEOUT).json()["choices"][0]
    lp = r["logprobs"]
    assert lp["token_logprobs"] == [w.logprob for w in want.logprobs]
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"]) and len(lp["tokens"]) == 6
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_share_the_prompt_and_each_is_the_runtimes(url, oai, ref, stream):
    """n = 3 seeded choices: choice i is gen.generate(seed=seed + i); choices after the first reuse the
    prompt the first filled."""
    prompt = "Once upon a time there was a robot who wanted to learn how to paint the sea at night"
    ids = ref.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    want = [ref.generate(ids, max_new_tokens=10, temperature=0.8, seed=7 + i).text for i in range(3)]
    before = _metric(url, "eagle2_prefix_cache_hit_tokens_total")
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=10, temperature=0.8, seed=7,
                  n=3)
    if stream:
        texts = ["", "", ""]
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        r = oai.chat.completions.create(**kwargs)
        texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        assert r.usage.completion_tokens == sum(len(ref.generate(ids, max_new_tokens=10, temperature=0.8,
                                                                 seed=7 + i).token_ids) for i in range(3))
    assert texts == want
    assert _metric(url, "eagle2_prefix_cache_hit_tokens_total") - before >= 2 * ((len(ids) - 1) // 16 * 16)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema(oai, ref, stream):
    pytest.importorskip("llguidance", reason="structured output needs llguidance: bash ci/install_serve.sh")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2]}},
              "required": ["ok", "n"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert text == ref.generate(chat_ids(ref), max_new_tokens=40, json_schema=schema).text
    value = json.loads(text)
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2)
    any_object = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                             response_format={"type": "json_object"}).choices[0].message.content
    assert any_object == ref.generate(chat_ids(ref), max_new_tokens=12, json_schema=True).text
    assert isinstance(json.loads(any_object), dict)  # whole within max_tokens


def test_top_k_and_min_p_are_the_runtimes(url, ref):
    prompt = list(range(5, 30))
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "seed": 4, "top_k": 5, "min_p": 0.05}
    text = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    assert text == ref.generate(prompt, max_new_tokens=12, temperature=0.9, seed=4, sampling_top_k=5, min_p=0.05).text


def test_api_key(artifact):
    openai = pytest.importorskip("openai", reason="needs the openai package")
    pool, thread = _serve(artifact, workers=1, api_key="s3cret")
    with thread as url:
        body = {"prompt": "hi", "max_tokens": 2}
        assert_error(httpx.post(url + "/v1/completions", json=body), 401, code="invalid_api_key")
        assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "s3cret"}), 401)
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"},
                        timeout=TIMEOUT)
        assert ok.status_code == 200
        assert httpx.get(url + "/health").status_code == 200            # probes need no key
        with openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0) as client:
            assert client.models.list().data[0].id == MODEL
        with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


# ------------------------------------------------------------------------------------------------
# Bad requests: 4xx in OpenAI's error shape, and the server keeps serving.
# ------------------------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_LONG = "x" * (MAX_LENGTH + 50)
BAD = [
    # (id, path, body (dict or raw bytes), status, param, code)
    ("malformed-json", CHAT, b'{"messages": [', 400, None, "invalid_json"),
    ("not-utf8", CHAT, b"\xff\xfe{}", 400, None, "invalid_json"),
    ("body-not-object", CHAT, b"[1, 2]", 400, None, None),
    ("deeply-nested-json", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "invalid_json"),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": MESSAGES}, 404, "model", "model_not_found"),
    ("max-tokens-zero", CHAT, {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", None),
    ("max-tokens-negative", COMPLETIONS, {"prompt": "a", "max_tokens": -3}, 400, "max_tokens", None),
    ("max-tokens-string", CHAT, {"messages": MESSAGES, "max_tokens": "16"}, 400, "max_tokens", None),
    ("max-tokens-float", CHAT, {"messages": MESSAGES, "max_tokens": 16.0}, 400, "max_tokens", None),
    ("temperature-negative", CHAT, {"messages": MESSAGES, "temperature": -0.5}, 400, "temperature", None),
    ("temperature-string", COMPLETIONS, {"prompt": "a", "temperature": "hot"}, 400, "temperature", None),
    ("top-p-zero", CHAT, {"messages": MESSAGES, "top_p": 0}, 400, "top_p", None),
    ("stream-not-bool", CHAT, {"messages": MESSAGES, "stream": "yes"}, 400, "stream", None),
    ("seed-string", CHAT, {"messages": MESSAGES, "seed": "7"}, 400, "seed", None),
    ("seed-negative", CHAT, {"messages": MESSAGES, "seed": -1, "temperature": 0.5, "stream": True}, 400, None, None),
    ("messages-missing", CHAT, {"max_tokens": 3}, 400, "messages", None),
    ("messages-string", CHAT, {"messages": "hello"}, 400, "messages", None),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("role-unknown", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None),
    ("content-image", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", None),
    ("prompt-missing", COMPLETIONS, {"max_tokens": 3}, 400, "prompt", None),
    ("prompt-wrong-type", COMPLETIONS, {"prompt": {"text": "a"}}, 400, "prompt", None),
    ("prompt-token-out-of-vocab", COMPLETIONS, {"prompt": [1, 10 ** 9]}, 400, "prompt", None),
    ("two-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("n-too-many", CHAT, {"messages": MESSAGES, "n": 17}, 400, "n", None),
    ("top-logprobs-without-logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("top-logprobs-too-many", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", None),
    ("completion-logprobs-too-many", COMPLETIONS, {"prompt": "a", "logprobs": 6}, 400, "logprobs", None),
    ("unknown-argument", CHAT, {"messages": MESSAGES, "temprature": 0}, 400, "temprature", "unknown_parameter"),
    ("unknown-argument-completions", COMPLETIONS, {"prompt": "a", "guided_json": {}}, 400, "guided_json",
     "unknown_parameter"),
    ("response-format-xml", CHAT, {"messages": MESSAGES, "response_format": {"type": "xml"}}, 400,
     "response_format", "invalid_value"),
    ("response-format-schema-missing", CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "invalid_value"),
    ("top-k-negative", CHAT, {"messages": MESSAGES, "top_k": -2}, 400, "top_k", None),
    ("min-p-above-one", COMPLETIONS, {"prompt": "a", "min_p": 1.5}, 400, "min_p", None),
    ("repetition-penalty", CHAT, {"messages": MESSAGES, "repetition_penalty": 1.2}, 400, "repetition_penalty",
     "unsupported_value"),
    ("tool-choice", CHAT, {"messages": MESSAGES, "tool_choice": "auto"}, 400, "tool_choice", "unsupported_value"),
    ("max-tokens-beyond-context", COMPLETIONS, {"prompt": "a", "max_tokens": MAX_LENGTH}, 400, "max_tokens",
     "context_length_exceeded"),
    ("stop-empty-string", CHAT, {"messages": MESSAGES, "stop": ""}, 400, "stop", None),
    ("stop-not-strings", CHAT, {"messages": MESSAGES, "stop": [1, 2]}, 400, None, None),
    ("chat-prompt-beyond-cache", CHAT, {"messages": [{"role": "user", "content": _LONG}]}, 400, None,
     "context_length_exceeded"),
    ("completion-prompt-beyond-cache", COMPLETIONS, {"prompt": _LONG}, 400, None, "context_length_exceeded"),
    ("oversize-body", CHAT, b'{"messages": [{"role": "user", "content": "' + b"a" * (1 << 20) + b'"}]}', 413,
     None, "request_too_large"),
]


@pytest.mark.parametrize("path,body,status,param,code", [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_bad_request(url, path, body, status, param, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    assert_error(httpx.post(url + path, timeout=TIMEOUT, **kwargs), status, param, code)


def test_max_tokens_beyond_context_names_the_numbers(url, ref):
    prompt = len(chat_ids(ref))
    r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": MAX_LENGTH}, timeout=TIMEOUT)
    message = assert_error(r, 400, "max_tokens", "context_length_exceeded")["message"]
    assert f"context is {MAX_LENGTH} tokens" in message and f"{prompt + MAX_LENGTH} were requested" in message
    assert f"at most {MAX_LENGTH - prompt}" in message
    # What the message allows is answered, to the last token.
    r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": MAX_LENGTH - prompt, "temperature": 0},
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_neutral_values_of_unsupported_arguments_are_accepted(url, ref):
    """Clients send these at their no-op values; those change nothing and are answered."""
    want = ref.generate(chat_ids(ref), max_new_tokens=8)
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "response_format": {"type": "text"}, "metadata": {"team": "a"},
            "presence_penalty": 0.0, "tool_choice": "none"}
    r = httpx.post(url + CHAT, json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text, r.text


def test_oversize_chunked_body_and_wrong_routes(url, ref):
    def chunks():                      # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"b" * (300 * 1024)
        yield b'"}'

    assert_error(httpx.post(url + COMPLETIONS, content=chunks(), timeout=TIMEOUT), 413, code="request_too_large")
    assert_error(httpx.get(url + CHAT), 405)
    assert_error(httpx.get(url + "/v1/nothing-here"), 404)
    # After all the bad requests, a good one is answered as before.
    want = ref.generate(chat_ids(ref), max_new_tokens=8)
    r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text


# ------------------------------------------------------------------------------------------------
# Faults: a raising worker, a client that leaves mid-stream, a full queue.
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_worker_exception_is_a_500_for_that_request_only(live, ref, stream):
    url, pool, _ = live
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": stream}
    err = assert_error(httpx.post(url + CHAT, json={**body, "user": "raise"}, timeout=TIMEOUT), 500)
    assert err["type"] == "server_error"
    # Both workers keep serving (the pool has two; send more requests than that).
    want = ref.generate(chat_ids(ref), max_new_tokens=8)
    for _ in range(3):
        r = httpx.post(url + CHAT, json={**body, "stream": False}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
    assert pool.busy == 0 and len(pool.jobs) == 0


def test_client_disconnect_mid_stream_frees_the_worker(artifact, long_prompt):
    pool, thread = _serve(artifact, workers=1, max_length=2048)
    long_ref = runtime.load(artifact, threads=1)
    prompt = long_prompt(long_ref, 250)
    with thread as url:
        body = {"prompt": prompt, "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as client:
            with client.stream("POST", url + COMPLETIONS, json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"text":"' in line:
                        break                      # one chunk of text, then hang up
        _wait_for(lambda: pool.cancelled == 1 and pool.busy == 0, what="the generation to be cancelled")
        # The only worker is free again: the next request completes, with the right text.
        want = long_ref.generate("after", max_new_tokens=10)
        r = httpx.post(url + COMPLETIONS, json={"prompt": "after", "max_tokens": 10, "temperature": 0},
                       timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
        metrics = httpx.get(url + "/metrics").text
        assert "eagle2_cancelled_generations_total 1.0" in metrics
        assert 'eagle2_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics


def test_client_disconnect_while_queued_never_runs(artifact):
    faults = Faults()
    pool, thread = _serve(artifact, workers=1, max_queue=4, faults=faults)
    with thread as url:
        holder = threading.Thread(target=lambda: httpx.post(url + COMPLETIONS, timeout=TIMEOUT, json={
            "prompt": "hold", "max_tokens": 2, "user": "block:hold"}))
        holder.start()
        _wait_for(lambda: pool.busy == 1, what="the worker to be taken")
        with pytest.raises(httpx.ReadTimeout):     # queued behind the blocked worker, then gives up
            httpx.post(url + COMPLETIONS, json={"prompt": "queued", "max_tokens": 2, "stream": True}, timeout=0.5)
        _wait_for(lambda: pool.waiting == 0, what="the queued request to leave the queue")
        _wait_for(lambda: 'status="499"} 1.0' in httpx.get(url + "/metrics").text, what="the 499 to be counted")
        faults.release_all()
        holder.join(10)
        _wait_for(lambda: pool.busy == 0, what="the worker to be free")
        assert pool.cancelled == 0                 # it left before it ever reached a worker


def test_queue_overflow_is_429_with_retry_after(artifact, ref):
    faults = Faults()
    pool, thread = _serve(artifact, workers=1, max_queue=1, faults=faults)
    results = {}

    def post(name, user=None):
        body = {"prompt": name, "max_tokens": 6, "temperature": 0, **({"user": user} if user else {})}
        results[name] = httpx.post(url + COMPLETIONS, json=body, timeout=TIMEOUT)

    with thread as url:
        running = threading.Thread(target=post, args=("running", "block:gate"))
        running.start()
        _wait_for(lambda: pool.busy == 1, what="the worker to be taken")
        queued = threading.Thread(target=post, args=("queued",))
        queued.start()
        _wait_for(lambda: pool.waiting == 1, what="a request in the queue")
        over = httpx.post(url + COMPLETIONS, json={"prompt": "over", "max_tokens": 2}, timeout=TIMEOUT)
        err = assert_error(over, 429, code="rate_limit_exceeded")
        assert over.headers["retry-after"].isdigit()
        assert "queued" in err["message"]
        streamed = httpx.post(url + COMPLETIONS, json={"prompt": "over", "stream": True}, timeout=TIMEOUT)
        assert_error(streamed, 429)
        faults.release_all()
        running.join(15)
        queued.join(15)
        for name in ("running", "queued"):
            assert results[name].status_code == 200
            want = ref.generate(name, max_new_tokens=6)
            assert results[name].json()["choices"][0]["text"] == want.text
        assert 'eagle2_requests_total{endpoint="/v1/completions",status="429"} 2.0' in httpx.get(url + "/metrics").text
