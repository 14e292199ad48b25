"""Speculative decoding with the SpecPrefill draft (`num_draft_tokens`): a greedy request
that decodes alone takes the draft's proposals the target agrees with, and its reply is
plain decoding's, token for token, after a dense or a SpecPrefill prompt; limits and
stops end it at the same token; a request that joins moves it into the shared batch;
its cache serves the next turn; rows it cannot serve, and pairs whose caches cannot be
cut back, are told why. The bundled demo pair (float32)."""

import asyncio

import pytest

from models import HYBRID_CASES, save_with_demo_tokenizer
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(600)
REPLY = 32


@pytest.fixture(scope="module")
def engines():
    with Engine(densify="off") as plain, Engine(densify="off", num_draft_tokens=3) as spec:
        yield plain, spec


def messages(engine, seed: int = 3, n_tokens: int = 1000) -> list:
    return make_case(engine.tokenizer, seed, "passkey", n_tokens).messages


@pytest.mark.parametrize("specprefill", [False, True])
def test_a_reply_equals_plain_decoding_with_fewer_target_forwards(engines, specprefill):
    plain, spec = engines
    prompt = messages(plain)
    expected = plain.generate_sync(prompt, max_tokens=REPLY, ignore_eos=True,
                                   specprefill=specprefill, cache_prompt=False)
    result = spec.generate_sync(prompt, max_tokens=REPLY, ignore_eos=True,
                                specprefill=specprefill, cache_prompt=False)
    assert result.token_ids == expected.token_ids
    assert result.specprefill.engaged is specprefill
    report = result.specprefill
    assert report.speculative == "3 draft tokens a round"
    assert not report.batched and "draft proposing" in report.batch_reason
    # each round is one target forward: the reply took fewer than one per token
    assert 0 < report.accepted_tokens <= report.drafted_tokens
    assert report.drafted_tokens % 3 == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 10, 11])
def test_a_limit_inside_a_round_ends_the_reply_at_that_token(engines, max_tokens):
    plain, spec = engines
    prompt = messages(plain, seed=4)
    expected = plain.generate_sync(prompt, max_tokens=max_tokens, ignore_eos=True,
                                   cache_prompt=False)
    result = spec.generate_sync(prompt, max_tokens=max_tokens, ignore_eos=True,
                                cache_prompt=False)
    assert result.token_ids == expected.token_ids
    assert len(result.token_ids) == max_tokens and result.finish_reason == "length"


def test_a_stop_inside_a_round_ends_the_reply_where_plain_decoding_stops(engines):
    plain, spec = engines
    prompt = messages(plain, seed=5)
    expected = plain.generate_sync(prompt, max_tokens=REPLY, cache_prompt=False)
    result = spec.generate_sync(prompt, max_tokens=REPLY, cache_prompt=False)
    assert (result.text, result.finish_reason) == (expected.text, expected.finish_reason)
    stop = expected.text[2:4]  # a stop string inside the reply
    expected = plain.generate_sync(prompt, max_tokens=REPLY, stop=[stop], cache_prompt=False)
    result = spec.generate_sync(prompt, max_tokens=REPLY, stop=[stop], cache_prompt=False)
    assert (result.text, result.finish_reason) == (expected.text, "stop")


async def test_a_request_that_joins_moves_the_row_into_the_shared_batch(engines):
    plain, spec = engines
    first, second = messages(plain, seed=6), messages(plain, seed=7, n_tokens=600)
    options = dict(max_tokens=REPLY, ignore_eos=True, cache_prompt=False)
    expected = [await plain.generate(p, **options) for p in (first, second)]
    got, started = [], asyncio.Event()

    async def stream_first():
        chunks = []
        async for chunk in spec.stream(first, **options):
            chunks.append(chunk)
            if sum(len(c.token_ids) for c in chunks) >= 8:
                started.set()
        return chunks

    task = asyncio.create_task(stream_first())
    await started.wait()
    other = await spec.generate(second, **options)
    chunks = await task
    got = [sum((c.token_ids for c in chunks), []), other.token_ids]
    assert got == [r.token_ids for r in expected]
    report = chunks[-1].specprefill
    assert report.speculative.endswith("then in the shared batch, another request joined")
    assert report.batched and report.accepted_tokens > 0
    assert other.specprefill.speculative.startswith("off: other requests are running")
    assert other.specprefill.drafted_tokens == 0


def test_the_next_turn_continues_from_a_speculative_turn(engines):
    plain, spec = engines
    results = {}
    for name, engine in (("plain", plain), ("spec", spec)):
        turn = messages(engine, seed=8)
        first = engine.generate_sync(turn, max_tokens=REPLY, ignore_eos=True)
        turn = turn + [{"role": "assistant", "content": first.text},
                       {"role": "user", "content": "Say it again."}]
        results[name] = (first, engine.generate_sync(turn, max_tokens=REPLY, ignore_eos=True))
    (first, second), (spec_first, spec_second) = results["plain"], results["spec"]
    assert spec_first.token_ids == first.token_ids
    assert spec_second.token_ids == second.token_ids
    # the row's last token has no KV yet (it is the next round's input): one entry fewer
    assert second.usage.cached_tokens - 1 <= spec_second.usage.cached_tokens > 0
    assert spec_second.specprefill.accepted_tokens > 0


def test_rows_it_cannot_serve_decode_plainly_and_say_why(engines):
    _, spec = engines
    prompt = messages(spec, seed=9, n_tokens=400)
    for options, reason in (({"temperature": 0.7, "seed": 1}, "off: sampling"),
                            ({"repetition_penalty": 1.1}, "off: logits processors"),
                            ({"logprobs": 2}, "off: logprobs")):
        result = spec.generate_sync(prompt, max_tokens=8, cache_prompt=False, **options)
        assert result.specprefill.speculative.startswith(reason)
        assert result.specprefill.drafted_tokens == 0


def test_without_the_option_nothing_is_drafted(engines):
    plain, _ = engines
    result = plain.generate_sync(messages(plain, seed=10, n_tokens=400), max_tokens=8)
    assert (result.specprefill.speculative, result.specprefill.drafted_tokens) == ("", 0)


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3-small-window"])
def test_a_pair_whose_caches_cannot_be_cut_back_is_refused_by_name(family, tmp_path):
    path = str(save_with_demo_tokenizer(HYBRID_CASES[family], tmp_path))
    with pytest.raises(ValueError, match=r"num_draft_tokens=2: .*cannot be cut back"):
        with Engine(model=path, draft=path, num_draft_tokens=2):
            pass
    with Engine(model=path, draft=path) as engine:  # a request asking: its report says why
        result = engine.generate_sync("a b c", max_tokens=4, num_draft_tokens=2)
    assert result.specprefill.speculative.startswith("off: the target's caches")
    assert result.specprefill.drafted_tokens == 0


def test_the_option_needs_a_draft():
    from specprefill_engine.loading import DEMO_TARGET

    with pytest.raises(ValueError, match="it needs a draft model"):
        with Engine(model=str(DEMO_TARGET), num_draft_tokens=2):
            pass
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0"):
        Engine(num_draft_tokens=-1)


def test_a_request_sets_its_own_draft_tokens(engines):
    plain, spec = engines
    prompt = messages(plain, seed=11, n_tokens=600)
    expected = plain.generate_sync(prompt, max_tokens=24, ignore_eos=True, cache_prompt=False)
    on = plain.generate_sync(prompt, max_tokens=24, ignore_eos=True, cache_prompt=False,
                             num_draft_tokens=2)
    off = spec.generate_sync(prompt, max_tokens=24, ignore_eos=True, cache_prompt=False,
                             num_draft_tokens=0)
    assert on.token_ids == off.token_ids == expected.token_ids
    assert on.specprefill.speculative == "2 draft tokens a round"
    assert on.specprefill.drafted_tokens % 2 == 0 and on.specprefill.drafted_tokens > 0
    assert (off.specprefill.speculative, off.specprefill.drafted_tokens) == ("", 0)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 0"):
        plain.generate_sync(prompt, max_tokens=4, num_draft_tokens=-2)
