"""Agent turns on every model family: each turn reuses the previous turn's cache, the
target's and the draft's, dense and SpecPrefill, whatever the cache layers are.

A 3-turn chat with a tool call in every reply (the template re-renders the reply, so
the next prompt departs from the stored reply where the markup starts) on tiny random
models with the demo tokenizer: plain attention (qwen3), GatedDeltaNet + attention
(qwen3_next), Mamba2 + attention (nemotron_h) and sliding windows smaller than the
prompt (gemma3). On 0945836 the three non-plain families cached nothing (0 tokens).
"""

import json

import numpy as np
import pytest

from chat_templates import THINKING_TEMPLATE
from models import HYBRID_CASES, ROPE_CASES, save_with_demo_tokenizer
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(600)
CASES = {"qwen3": ROPE_CASES["qwen3"], "qwen3_next": HYBRID_CASES["qwen3_next"],
         "nemotron_h": HYBRID_CASES["nemotron_h"], "gemma3": HYBRID_CASES["gemma3-small-window"]}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    path = save_with_demo_tokenizer(CASES[request.param], tmp_path_factory.mktemp(request.param))
    return request.param, str(path)


def chat(engine, specprefill: bool) -> list:
    """Three turns; each next prompt adds the reply (with a tool call), its result and a
    question. Returns (prompt tokens, result) per turn."""
    case = make_case(engine.tokenizer, 40, "passkey", 500)
    messages, turns = list(case.messages), []
    for turn in range(3):
        tokens = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        result = engine.generate_sync(messages, max_tokens=6, specprefill=specprefill,
                                      ignore_eos=True)
        turns.append((len(tokens), messages, result))
        call = {"id": f"call-{turn}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"turn": turn})}}
        messages = messages + [  # the random models write whitespace: kept out of the text
            {"role": "assistant", "content": result.text.strip(), "tool_calls": [call]},
            {"role": "tool", "content": make_case(engine.tokenizer, 50 + turn, "passkey",
                                                  200).messages[-1]["content"],
             "tool_call_id": call["id"]},
            {"role": "user", "content": "And the next one?"}]
    return turns


def test_every_family_reuses_the_previous_prompt_dense_and_sparse(family):
    name, path = family
    with Engine(model=path, draft=path) as engine:
        dense = chat(engine, specprefill=False)
    with Engine(model=path, draft=path, reuse_coverage=0.0, densify="off") as engine:  # random:
        sparse = chat(engine, specprefill=True)  # no importance signal for the gate
    for turn in (1, 2):
        previous, result = dense[turn - 1][0], dense[turn][2]
        assert result.usage.cached_tokens >= previous, (name, turn, result.specprefill.reuse)
        assert result.specprefill.reuse.startswith("dense"), result.specprefill.reuse
        previous, result = sparse[turn - 1][0], sparse[turn][2]
        assert result.specprefill.reuse.startswith("sparse"), (name, result.specprefill.reuse)
        assert result.usage.draft_cached_tokens >= previous, (name, turn)
        assert result.usage.cached_tokens > 0
    if name != "qwen3":  # a checkpoint, not a cut anywhere
        assert "checkpoint at" in dense[1][2].specprefill.reuse
    with Engine(model=path, draft=path) as fresh:  # each dense turn as a fresh engine's
        for _, messages, result in dense:
            alone = fresh.generate_sync(messages, max_tokens=6, specprefill=False,
                                        ignore_eos=True, cache_prompt=False)
            assert alone.token_ids == result.token_ids, name
        first = fresh.generate_sync(sparse[0][1], max_tokens=6, specprefill=True,
                                    ignore_eos=True, cache_prompt=False)
        assert first.token_ids == sparse[0][2].token_ids, name


def test_a_plain_model_continues_from_the_exact_shared_prefix(family):
    name, path = family
    if name != "qwen3":
        pytest.skip("exact continuation is for caches that can be cut anywhere")
    with Engine(model=path, draft=None) as engine:
        case = make_case(engine.tokenizer, 41, "passkey", 900)
        ids = engine.tokenizer.apply_chat_template(case.messages, add_generation_prompt=True)
        engine.generate_sync(ids, max_tokens=4)
        grown = ids + np.random.default_rng(0).integers(10, 4000, 37).tolist()
        again = engine.generate_sync(grown, max_tokens=4, ignore_eos=True)
        # every shared token, not a chunk-grid point below (on 0945836: 786 of 882)
        assert again.usage.cached_tokens == len(ids)
        assert again.usage.prompt_tokens - again.usage.cached_tokens == 37
        alone = engine.generate_sync(grown, max_tokens=4, ignore_eos=True, cache_prompt=False)
    assert again.token_ids == alone.token_ids


# the demo template, thinking, re-rendering a past reply without its think block
STRIPPING_TEMPLATE = THINKING_TEMPLATE.replace(
    "{{ m['content'] if m['content'] is string else '' }}",
    "{{ (m['content'].split('</think>')[-1] | trim) if m['content'] is string else '' }}")


def test_a_template_that_strips_the_last_think_block_still_reuses_the_prompt(tmp_path):
    """The next prompt departs from the stored one inside the generation prompt (the
    reply's think block is gone): a hybrid continues from the checkpoint where the
    generation prompt starts."""
    path = save_with_demo_tokenizer(CASES["qwen3_next"], tmp_path / "thinking")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = STRIPPING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine(model=str(path), draft=None) as engine:
        messages = make_case(engine.tokenizer, 42, "passkey", 600).messages
        first = engine.generate_sync(messages, max_tokens=4, ignore_eos=True)
        without = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        grown = messages + [{"role": "assistant", "content": "<think>\nlet me see\n</think>\n\n42"},
                            {"role": "user", "content": "Once more?"}]
        second = engine.generate_sync(grown, max_tokens=4, ignore_eos=True)
    assert second.usage.cached_tokens == len(without), second.specprefill.reuse
    assert f"checkpoint at {len(without)}" in second.specprefill.reuse
    assert first.usage.prompt_tokens > len(without)  # the prompt's own end is not shared


def test_a_sliding_window_turn_reuses_its_view_up_to_a_window_before_its_end(tmp_path):
    """A next turn feeds its own last window anew, so a turn adding fewer tokens than the
    window restores from before the previous prompt's end: there a checkpoint waits (on
    115a5ba only chat boundaries had one, and the turn reused nothing)."""
    window = 256
    path = save_with_demo_tokenizer(("gemma3_text", {
        "sliding_window": window, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0}), tmp_path)
    with Engine(model=str(path), draft=str(path), reuse_coverage=0.0, densify="off") as engine:
        case = make_case(engine.tokenizer, 40, "passkey", 1500)
        first = engine.generate_sync(case.messages, max_tokens=6, specprefill=True,
                                     ignore_eos=True)
        grown = case.messages + [
            {"role": "assistant", "content": first.text.strip() or "ok"},
            {"role": "user", "content": make_case(engine.tokenizer, 50, "passkey",
                                                  200).messages[-1]["content"]}]
        second = engine.generate_sync(grown, max_tokens=6, specprefill=True, ignore_eos=True)
    previous = first.usage.prompt_tokens
    assert second.specprefill.reuse.startswith("sparse checkpoint"), second.specprefill.reuse
    restored_at = int(second.specprefill.reuse.split("checkpoint at ")[1].split()[0])
    assert restored_at >= previous - window - 32, second.specprefill.reuse
    assert second.usage.cached_tokens > 0


def test_a_next_turn_whose_reply_comes_back_otherwise_extends_the_view(fresh_cache_dir):
    """An agent's next prompt holds the previous prompt whole, but its reply as the client
    sends it back (a template re-rendering a tool call, reasoning dropped, an edit), not as
    generated: the turn still extends the previous turn's view from where they part (on
    b8dc896 a reply differing more than 16 tokens before its end made every later turn
    select anew, at a full SpecPrefill's cost)."""
    with Engine(densify="off") as engine:
        messages = make_case(engine.tokenizer, 44, "passkey", 1500).messages
        first = engine.generate_sync(messages, max_tokens=40, ignore_eos=True,
                                     specprefill=True, keep=0.3)
        grown = messages + [{"role": "assistant", "content": "Noted."},
                            {"role": "user", "content": "And the other number?"}]
        second = engine.generate_sync(grown, max_tokens=4, specprefill=True, keep=0.3)
    assert first.specprefill.engaged and second.specprefill.engaged
    assert "the previous turn's view" in second.specprefill.reuse, second.specprefill.reuse
    assert second.specprefill.reuse.startswith(f"sparse prefix of {first.usage.prompt_tokens} ")
