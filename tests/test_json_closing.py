"""The shortest completion of a JSON prefix (runtime/json_closing.py): with it every prefix of a
compact JSON text parses, and feeding the completion's own start leaves the rest of it."""
from __future__ import annotations

import json

import pytest

from runtime.json_closing import JsonPrefix

TEXTS = ['{"a":[1,{"b":"c\\"d\\u00e9"},true,null,-1.5e+3,[]],"e":{"f":[false,"x"]},"g":{}}',
         '{"k":"v","n":-0.25E-2,"l":[[[]],{"x":{"y":null}}]}']


@pytest.mark.parametrize("text", TEXTS)
def test_every_prefix_completes_to_json(text):
    for end in range(len(text) + 1):
        completion = JsonPrefix().feed(text[:end]).completion()
        value = json.loads(text[:end] + completion)
        assert isinstance(value, dict), text[:end]
        if end == len(text):
            assert completion == ""


@pytest.mark.parametrize("text", TEXTS)
def test_the_completion_of_a_completion_is_its_rest(text):
    for end in range(len(text)):
        scan = JsonPrefix().feed(text[:end])
        completion = scan.completion()
        for k in range(len(completion)):
            assert scan.copy().feed(completion[:k]).completion() == completion[k:]


@pytest.mark.parametrize("prefix, completion", [("", "{}"), ('{"a', '":null}'), ('{"a":', "null}"), ('{"a":[', "]}"),
                                                ('{"a":[1,', "null]}"), ('{"a":"x\\', 'n"}'), ('{"a":"\\u0', '000"}'),
                                                ('{"a":tr', "ue}"), ('{"a":1e', "0}"), ('{"a":1,', '"":null}')])
def test_shortest_completions(prefix, completion):
    assert JsonPrefix().feed(prefix).completion() == completion
