"""Structured output (runtime/constraints.py): every token chosen under a grammar's mask, a tree's
rows each after its own path. Greedy speculative output equals greedy constrained plain decoding;
JSON replies are valid JSON of their schema. That sampling keeps the constrained distribution is
checked exactly on a small vocabulary in test_runtime_sampling.py."""
from __future__ import annotations

import json

import pytest

import runtime

pytest.importorskip("llguidance", reason="structured output needs llguidance: bash ci/install_serve.sh")

BOOLEAN = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
           "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def gen(tiny_artifact):
    return runtime.load(tiny_artifact("tiny-llama", "fp32", max_length=256))


@pytest.mark.parametrize("schema", [True, BOOLEAN], ids=["json_object", "json_schema"])
def test_greedy_speculative_equals_greedy_plain_under_the_grammar(gen, schema):
    prompt = list(range(5, 50))
    spec = gen.generate(prompt, max_new_tokens=40, json_schema=schema)
    plain = gen.generate(prompt, max_new_tokens=40, json_schema=schema, speculative=False)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.text.startswith("{")
    if schema is BOOLEAN:  # a finite grammar: the reply ends by itself, complete
        assert spec.finish_reason == "stop" and set(json.loads(spec.text)) == {"ok", "n"}


def test_every_seeded_reply_is_valid_json_of_its_schema(gen):
    for seed in range(8):
        out = gen.generate(list(range(9, 40)), max_new_tokens=40, json_schema=BOOLEAN, temperature=1.0, seed=seed)
        value = json.loads(out.text)
        assert out.finish_reason == "stop" and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)


def test_a_schema_that_cannot_compile_is_refused(gen):
    with pytest.raises(ValueError, match="JSON schema"):
        gen.generate([5, 6, 7], max_new_tokens=4, json_schema={"type": "no-such-type"})
