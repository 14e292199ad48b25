"""Logprobs and `n` choices, on the demo pair: the engine's against a direct forward of
the model (dense and SpecPrefill), and the OpenAI endpoints' against the engine's."""

import asyncio
import hashlib
from types import SimpleNamespace

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine import Engine
from specprefill_engine.core import DraftScorer, cleanup_rope, select_chunks, sparse_prefill
from specprefill_engine.core.matching import question_match, with_matches
from specprefill_engine.core.scoring import default_draft_step_size
from specprefill_engine.core.sparse_prefill import cover_sliding_window
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.runtime import default_step_size
from specprefill_engine.engine.words import TokenWords
from models import ROPE_CASES, save_with_demo_tokenizer
from specprefill_server import ServerConfig
from test_server import KEY, Served

pytestmark = pytest.mark.timeout(600)
TOL = 2e-4  # float32 logprobs: a batched decode step against one forward over the reply


@pytest.fixture(scope="module")
def served():
    served = Served(Engine(densify="off"), ServerConfig(api_key=KEY, keepalive=0.05))
    yield served
    served.stop()


def prompt_ids(tokenizer, seed: int, n_tokens: int) -> list:
    messages = make_case(tokenizer, seed, "passkey", n_tokens).messages
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def log_softmax(logits: mx.array) -> np.ndarray:
    logits = logits.astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def dense_reference(model, ids: list, generated: list) -> np.ndarray:
    """Row j: log_softmax of the logits that predicted generated[j], one forward over
    the prompt and the reply."""
    logits = model(mx.array([ids + generated[:-1]]))[0, len(ids) - 1 :]
    return log_softmax(logits)


def check(result, reference: np.ndarray, k: int) -> None:
    """Each token's logprob and its k likeliest equal the reference's."""
    assert len(result.logprobs) == len(result.token_ids) == reference.shape[0]
    for row, entry, token in zip(reference, result.logprobs, result.token_ids):
        assert entry.token == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        values = [value for _, value in entry.top]
        assert len(entry.top) == k and values == sorted(values, reverse=True)
        assert values == pytest.approx(np.sort(row)[::-1][:k].tolist(), abs=TOL)
        assert [float(row[t]) for t, _ in entry.top] == pytest.approx(values, abs=TOL)


def test_dense_logprobs_are_log_softmax_of_the_models_logits_before_sampling(served, demo_pair):
    """Sampled with temperature and a repetition penalty, in a batch with rows that ask
    for other k or none: each row's logprobs are the raw logits' log_softmax, the first
    token's (sampled in the scheduler) included, and a stream carries the same ones."""
    engine, (model, _, tokenizer) = served.engine, demo_pair
    prompts = [prompt_ids(tokenizer, 40 + i, 200 + 40 * i) for i in range(3)]
    ks, lengths = [0, None, 4], [6, 4, 12]  # the first rows leave: the batch compacts

    async def together():
        return await asyncio.gather(*(
            engine.generate(ids, max_tokens=n, temperature=0.8, seed=i, repetition_penalty=1.3,
                            logprobs=k, specprefill=False, ignore_eos=True)
            for i, (ids, k, n) in enumerate(zip(prompts, ks, lengths))))

    results = asyncio.run(together())
    for ids, k, n, result in zip(prompts, ks, lengths, results):
        assert result.usage.completion_tokens == n and result.specprefill.batched
        if k is None:
            assert result.logprobs is None
            continue
        check(result, dense_reference(model, ids, result.token_ids), k)
    chunks = list(engine.stream_sync(prompts[2], max_tokens=12, temperature=0.8, seed=2,
                                     repetition_penalty=1.3, logprobs=4, specprefill=False,
                                     ignore_eos=True))
    streamed = [entry for chunk in chunks for entry in chunk.logprobs]
    assert [c.token_ids for c in chunks[:-1]] == [[e.token] for e in streamed[: len(chunks) - 1]]
    assert [e.token for e in streamed] == results[2].token_ids
    check(SimpleNamespace(logprobs=streamed, token_ids=results[2].token_ids),
          dense_reference(model, prompts[2], results[2].token_ids), 4)
    assert all(c.logprobs is None for c in engine.stream_sync(prompts[0], max_tokens=3))


def test_specprefill_logprobs_are_log_softmax_of_the_sparse_forwards_logits(served, demo_pair):
    """The reference repeats the engine's selection, the question's matches added (its
    digest proves it), and prefills the kept tokens at their positions, then feeds the
    reply."""
    engine, (model, draft, tokenizer) = served.engine, demo_pair
    ids = prompt_ids(tokenizer, 7, 1500)
    result = engine.generate_sync(ids, max_tokens=10, logprobs=5, specprefill=True, keep=0.3,
                                  cache_prompt=False)
    assert result.specprefill.engaged and result.specprefill.kept_tokens < len(ids)
    config = engine.config
    importance = DraftScorer(draft, config.n_lookahead, config.pool_kernel,
                             default_draft_step_size()).score(mx.array(ids))
    match = question_match(*TokenWords(tokenizer)(ids), config.n_window)
    importance = with_matches(np.array(importance), match, config.match_weight)
    kept = np.asarray(select_chunks(importance, 0.3, config.chunk_size, config.backbone_pct,
                                    config.tail_tokens), np.int64)
    kept = cover_sliding_window(kept, make_prompt_cache(model), len(ids))
    digest = hashlib.sha1(kept.astype(np.int64).tobytes()).hexdigest()[:16]
    assert digest == result.specprefill.selection_digest
    cache = make_prompt_cache(model)
    try:
        first = sparse_prefill(model, mx.array(ids), kept, cache, step_size=default_step_size())
        rest = model(mx.array([result.token_ids[:-1]]), cache=cache)
        reference = log_softmax(mx.concatenate([first[0, -1:], rest[0]], axis=0))
    finally:
        cleanup_rope(model)
    check(result, reference, 5)


def test_a_model_that_cannot_batch_gives_the_same_logprobs(tmp_path):
    """Its rows decode one by one (`SoloDecode`), each step's token read at once."""
    from specprefill_engine import load_model

    path = save_with_demo_tokenizer(ROPE_CASES["dynamic-ntk"], tmp_path / "dynamic")
    model, tokenizer = load_model(str(path))
    ids = tokenizer.encode("def parse(text):")
    with Engine(model=str(path), draft=None) as engine:
        assert not engine.info.batching
        result = engine.generate_sync(ids, max_tokens=8, logprobs=3, temperature=0.7, seed=1,
                                      ignore_eos=True)
    check(result, dense_reference(model, ids, result.token_ids), 3)


def test_engine_refuses_bad_logprobs(served):
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        served.engine.generate_sync("x", max_tokens=1, logprobs=21)
    with pytest.raises(TypeError, match="logprobs must be an integer"):
        served.engine.generate_sync("x", max_tokens=1, logprobs=True)


def test_openai_logprobs_and_n_choices_equal_seeded_single_requests(served):
    """n = 2 at temperature 1.2 with a seed: choice i is the engine's request seeded
    seed + i, text and logprobs, streamed or not; usage counts the prompt once."""
    engine, client = served.engine, served.openai()
    messages = [{"role": "user", "content": "Tell me something."}]
    options = dict(max_tokens=8, temperature=1.2, seed=11)
    singles = [engine.generate_sync(messages, **dict(options, seed=11 + i), logprobs=3,
                                    ignore_eos=True) for i in range(2)]
    options["extra_body"] = {"ignore_eos": True}
    assert singles[0].token_ids != singles[1].token_ids  # the rows really sample apart
    reply = client.chat.completions.create(model="m", messages=messages, n=2, logprobs=True,
                                           top_logprobs=3, **options)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, single in zip(reply.choices, singles):
        assert choice.message.content == single.text
        content = choice.logprobs.content
        assert [e.token for e in content] == [engine.tokenizer.decode([t])
                                              for t in single.token_ids]
        assert [e.logprob for e in content] == pytest.approx(
            [e.logprob for e in single.logprobs], abs=TOL)
        assert [[t.token for t in e.top_logprobs] for e in content] == [
            [engine.tokenizer.decode([t]) for t, _ in e.top] for e in single.logprobs]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = list(client.chat.completions.create(
        model="m", messages=messages, n=2, logprobs=True, stream=True,
        stream_options={"include_usage": True}, **options))
    for index, single in enumerate(singles):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == single.text
        lps = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.logprob for e in lps] == pytest.approx(
            [e.logprob for e in single.logprobs], abs=TOL)
        assert all(e.top_logprobs == [] for e in lps)
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    unasked = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert unasked.choices[0].logprobs is None


def test_completions_logprobs_and_n(served):
    engine, client = served.engine, served.openai()
    prompt = "def parse(text):"
    single = engine.generate_sync(prompt, max_tokens=6, logprobs=2)
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=6, logprobs=2, n=2)
    assert [c.text for c in reply.choices] == [single.text] * 2  # greedy: the rows agree
    shaped = reply.choices[1].logprobs
    assert "".join(shaped.tokens) == single.text
    assert shaped.token_logprobs == pytest.approx([e.logprob for e in single.logprobs], abs=TOL)
    assert shaped.text_offset == np.cumsum([0] + [len(t) for t in shaped.tokens[:-1]]).tolist()
    for top, entry in zip(shaped.top_logprobs, single.logprobs):
        chosen = engine.tokenizer.decode([entry.token])
        assert top[chosen] == pytest.approx(entry.logprob, abs=TOL) and 2 <= len(top) <= 3
    streamed = [c.choices[0] for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=6, logprobs=2, stream=True) if c.choices]
    assert "".join(c.text for c in streamed) == single.text
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == shaped.tokens and offsets == shaped.text_offset


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat/completions", {"logprobs": 5}, "logprobs"),  # chat's logprobs is a boolean
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat/completions", {"n": 0}, "n"),
    ("completions", {"n": -1}, "n"),
    ("chat/completions", {"n": 129}, "n"),
])
def test_bad_logprobs_and_n_are_a_400_naming_the_field(served, path, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if path.startswith("chat") \
        else {"prompt": "hi"}
    answer = httpx.post(f"{served.base}/v1/{path}", json={"model": "m", "max_tokens": 2,
                                                           **base, **body},
                        headers={"authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_a_failing_row_ends_every_choice_with_the_error(served):
    """A row the engine refuses (its seed out of range) is the request's 400; the rows
    that ran are aborted, none is left behind."""
    client = served.openai()
    with pytest.raises(openai.BadRequestError, match="seed") as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, n=3, seed=2**64 - 2, temperature=0.5)
    assert refused.value.body["param"] == "seed"
    assert served.settled()
