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


@pytest.mark.parametrize("budget", [6, 12, 23, 40])
def test_json_objects_end_whole_within_max_tokens(gen, budget):
    """A model that would go on (random weights) is made to finish the value in time: the reply is a
    whole JSON object ended by the end-of-sequence token, speculative as plain."""
    for shift in range(3):
        prompt = list(range(5 + shift, 50 + shift))
        spec = gen.generate(prompt, max_new_tokens=budget, json_schema=True)
        plain = gen.generate(prompt, max_new_tokens=budget, json_schema=True, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.finish_reason == "stop" and len(spec.token_ids) <= budget
        assert isinstance(json.loads(spec.text), dict)


def test_sampled_json_objects_end_whole_within_max_tokens(gen):
    for seed in range(8):
        out = gen.generate(list(range(9, 40)), max_new_tokens=24, json_schema=True, temperature=1.0, seed=seed)
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


REQUIRED = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "number"},
                                             "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["answer", "score", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("budget", [40, 64])
def test_schema_replies_end_whole_within_max_tokens(gen, budget):
    """Past the generic completion, a schema's required keys: the reply still ends as a value of the
    schema, with every required key, before max_tokens."""
    for shift in range(3):
        prompt = list(range(7 + shift, 40 + shift))
        spec = gen.generate(prompt, max_new_tokens=budget, json_schema=REQUIRED)
        plain = gen.generate(prompt, max_new_tokens=budget, json_schema=REQUIRED, speculative=False)
        assert spec.token_ids == plain.token_ids
        value = json.loads(spec.text)
        assert spec.finish_reason == "stop" and set(value) == {"answer", "score", "tags"}
        assert isinstance(value["answer"], str) and isinstance(value["tags"], list)


def test_the_draft_leaves_out_what_the_grammar_forbids(gen):
    """Draft candidates whose path the grammar forbids (and lookup tokens past the first such) are
    left out of the tree: their rows go to candidates that can be accepted."""
    constraint = gen.constraint(True)
    grammar = constraint.grammar
    brace, quote = (grammar.tokenizer.greedy_tokenize(t)[0] for t in ("{", '"'))
    constraint.end_within(100)
    constraint.consume([brace])
    other = next(t for t in range(gen.vocab_size) if t not in (brace, quote) and not constraint.allowed()[t])
    # The root's children: a quote (allowed after "{") and a forbidden token; a child of each.
    tokens, parents = [quote, other, quote, quote], [-1, -1, 0, 1]
    assert constraint.valid_paths(tokens, parents).tolist() == [True, False, True, False]
    assert constraint.valid_prefix([quote, quote, other]) == [quote, quote]
