"""Code cases over generated Python sources (`code_tasks`) and the draft check
(`engine/vouch.py`): a draft whose selection loses the answers the target's own would
keep is not vouched for, the verdict persists per pair, and the automatic policy does not
engage such a draft."""

import json
import logging
import os

import pytest

from specprefill_engine import Engine
from specprefill_engine.code_tasks import KINDS, is_right, make_case
from specprefill_engine.engine import vouch
from specprefill_engine.engine.runtime import EngineConfig
from specprefill_engine.loading import DEMO_TARGET, load_model

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("kind", KINDS)
def test_code_cases_are_seeded_and_their_spans_are_the_answer(kind, demo_pair):
    tokenizer = demo_pair[2]
    case = make_case(tokenizer, kind, 1500, seed=3)
    assert case == make_case(tokenizer, kind, 1500, seed=3)
    assert case.ids != make_case(tokenizer, kind, 1500, seed=4).ids
    assert 1400 <= len(case.ids) <= 1600
    text = tokenizer.decode(case.ids)
    assert text.count("\ndef ") >= 20 and text.startswith("<|user|>")
    # the answer's own tokens lie in the needles the answer needs
    for start, end in case.answer_spans:
        assert any(a <= start and end <= b for a, b in case.needles)
    first = tokenizer.decode(case.ids[slice(*case.answer_spans[0])])
    needles = [tokenizer.decode(case.ids[a:b]) for a, b in case.needles]
    if kind == "code_far":  # the value in the table, the constant's name in the function
        name = tokenizer.decode(case.ids[slice(*case.answer_spans[1])]).strip()
        assert needles[0] == f"{name} = {case.answer}\n" and first == f" {case.answer}"
        assert needles[1].startswith("def ") and f"+ {name}\n" in needles[1]
        assert case.needles[1][0] > 0.8 * len(case.ids) > 5 * case.needles[0][0]  # far apart
    elif kind == "code_const":
        assert first == f" {case.answer}" and needles[0].endswith(f" = {case.answer}\n")
        assert needles[0].split(" =")[0] in text[-200:]  # the question names the constant
    else:
        assert first == f" {case.answer}" and needles[0].startswith("def ")
        asked = needles[0][4:needles[0].index("(")]
        assert f"`{asked}`" in text[-200:]  # the question names the needle's function
    assert is_right(case, f" {case.answer}`, then more") and not is_right(case, " 0")


def test_cases_differing_in_the_question_share_their_source(demo_pair):
    tokenizer = demo_pair[2]
    cases = [make_case(tokenizer, "code_return", 600, seed=1, ask=ask) for ask in range(6)]
    source_end = max(case.needles[0][1] for case in cases)
    shared = len(os.path.commonprefix([case.ids for case in cases]))
    assert shared >= source_end and len({case.answer for case in cases}) == 6
    assert len({case.needles for case in cases}) == 6


# the draft check ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A random-weight llama (2 layers, hidden 64) with the demo tokenizer."""
    from models import save_with_demo_tokenizer

    return save_with_demo_tokenizer(("llama", {}), tmp_path_factory.mktemp("random-draft"))


def check_for(draft_path, target_path=DEMO_TARGET) -> vouch.DraftCheck:
    settings = dict(n_lookahead=1, pool_kernel=13, chunk_size=32, tail_tokens=32,
                    backbone_pct=0.0)
    key = {"target": str(target_path), "draft": str(draft_path), "settings": settings}
    return vouch.DraftCheck(key, settings, 0.3, names=(str(draft_path), str(target_path)))


def test_a_verdict_persists_and_a_damaged_file_is_dropped(fresh_cache_dir, random_draft,
                                                          demo_pair, caplog):
    # the tiny random model probes itself, quickly: keeping a verdict does not depend on it
    tokenizer = demo_pair[2]
    target = draft = load_model(str(random_draft))[0]
    check = check_for(random_draft, random_draft)
    assert check.pending and check.verdict(0.3).vouched is None
    check.run(target, draft, tokenizer)
    assert not check.pending and check.path.is_file()
    assert check.path.parent == fresh_cache_dir / vouch.FOLDER
    again = check_for(random_draft, random_draft)
    assert again.probe == check.probe and again.verdict(0.3) == check.verdict(0.3)
    saved = json.loads(check.path.read_text())
    damaged = {
        "not JSON": "{'version': 1",
        "another version": json.dumps({**saved, "version": vouch.VERSION + 1}),
        "another pair": json.dumps({**saved, "key": {**saved["key"], "draft": "other"}}),
        "a keep above 1": json.dumps({**saved, "probe": {**saved["probe"], "draft": [
            2.0] * vouch.QUESTIONS}}),
        "too few questions": json.dumps({**saved, "probe": {**saved["probe"], "target": [
            0.1]}}),
        "a negative time": json.dumps({**saved, "probe": {**saved["probe"], "target_s": -1}}),
    }
    for why, text in damaged.items():
        check.path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=vouch.__name__):
            loaded = check_for(random_draft, random_draft)
        assert loaded.pending, why  # measured anew on the first prompt that would engage
        assert "ignoring" in caplog.text, why
    loaded.run(target, draft, tokenizer)  # a new measurement replaces the damaged file
    assert check_for(random_draft, random_draft).probe == loaded.probe
    assert (loaded.probe.target, loaded.probe.draft) == (check.probe.target, check.probe.draft)


def test_a_random_draft_is_not_vouched_for_and_the_policy_declines(fresh_cache_dir,
                                                                   random_draft, demo_pair,
                                                                   caplog):
    from specprefill_engine.demo_tasks import make_case as demo_case

    tokenizer = demo_pair[2]
    messages = demo_case(tokenizer, 40, "passkey", 1200).messages
    options = dict(max_tokens=4, cache_prompt=False)
    with caplog.at_level(logging.WARNING):
        with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
            assert engine.info.draft.vouched is None  # lazy: not probed before it matters
            auto = engine.generate_sync(messages, **options)
            verdict = engine.info.draft
            given = engine.generate_sync(messages, keep=0.3, **options)
            forced = engine.generate_sync(messages, specprefill=True, **options)
    assert verdict.vouched is False and "probe questions" in verdict.reason
    # judged at the longest file the demo target's own attention reads
    assert f"over {verdict.probe.length} tokens" in verdict.reason
    report = auto.specprefill
    assert not report.engaged and report.kept_tokens == report.total_tokens
    assert report.reason == f"policy: draft not vouched for: {verdict.reason}"
    assert report.predicted_dense_s > report.predicted_specprefill_s  # it would have paid
    assert "is not vouched for the target" in caplog.text
    # a keep given, or SpecPrefill asked for, runs it, with a warning
    assert given.specprefill.engaged and given.specprefill.reason.startswith("policy: predicted")
    assert forced.specprefill.engaged and forced.specprefill.reason == "requested"
    assert "runs as asked" in caplog.text
    # the next engine knows it from the start, from the file
    with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
        assert engine.info.draft == verdict
        again = engine.generate_sync(messages, **options)
    assert again.specprefill.reason == report.reason


def test_the_check_can_run_at_load_or_not_at_all(fresh_cache_dir, random_draft, demo_pair,
                                                tmp_path):
    from models import save_with_demo_tokenizer
    from specprefill_engine.demo_tasks import make_case as demo_case

    messages = demo_case(demo_pair[2], 41, "passkey", 1200).messages
    # a tiny random target probes quickly: that the probe ran as the engine started counts
    target = save_with_demo_tokenizer(("llama", {}), tmp_path / "random-target")
    with Engine(model=str(target), draft=str(random_draft), draft_check="load") as engine:
        assert engine.info.draft.probe is not None and not engine.info.draft.vouched
    with Engine(model=str(DEMO_TARGET), draft=str(random_draft), draft_check="off") as engine:
        assert engine.info.draft.vouched is None and "off" in engine.info.draft.reason
        result = engine.generate_sync(messages, max_tokens=4, cache_prompt=False)
    assert result.specprefill.engaged and result.specprefill.reason.startswith("policy: predicted")
    with pytest.raises(ValueError, match="draft_check"):
        EngineConfig(draft_check="eager")


def test_the_demo_pair_engages_as_before_without_a_probe(fresh_cache_dir, demo_pair):
    from specprefill_engine.demo_tasks import make_case as demo_case

    messages = demo_case(demo_pair[2], 42, "passkey", 1200).messages
    with Engine() as engine:
        assert engine.info.draft.vouched is None and "demo pair" in engine.info.draft.reason
        result = engine.generate_sync(messages, max_tokens=4)
    assert result.specprefill.engaged and result.specprefill.reason.startswith("policy: predicted")
    assert not (fresh_cache_dir / vouch.FOLDER).exists()  # no probe ran
    with Engine(model=str(DEMO_TARGET), draft=str(DEMO_TARGET)) as engine:
        assert engine.info.draft.vouched is True and "is the target" in engine.info.draft.reason


def test_a_pair_that_loses_code_answers_declines_code_and_engages_on_prose(
        fresh_cache_dir, random_draft, demo_pair):
    """The probe's verdict is per kind: a pair whose target answered a code question dense
    and not from the draft's selection is not engaged on code prompts (the report says
    why), while prose prompts engage. The measurement is the saved one, as a later engine
    of the pair reads it."""
    from specprefill_engine.demo_tasks import make_case as demo_case
    from specprefill_engine.prose_tasks import make_case as prose_case

    tokenizer = demo_pair[2]
    code = demo_case(tokenizer, 43, "passkey", 2200).messages  # a Python file
    prose = [{"role": "user", "content": tokenizer.decode(
        prose_case(tokenizer, "passkey", 2200, 1).ids[4:])}]
    with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
        check = engine._worker.runtime.vouch
    found = [0.01] * vouch.QUESTIONS  # the draft holds every answer the target does
    for answers, code_engaged in (([[True, True]] * 3, True),
                                  ([[True, True], [True, False], [True, True]], False)):
        check.path.parent.mkdir(parents=True, exist_ok=True)
        check.path.write_text(json.dumps({
            "version": vouch.VERSION, "key": check.key, "measured_at": 0,
            "probe": {"target": found, "draft": found, "target_s": 1.0, "draft_s": 1.0,
                      "length": 2048, "code_answers": answers}}))
        with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
            on_code = engine.generate_sync(code, max_tokens=2, cache_prompt=False).specprefill
            on_prose = engine.generate_sync(prose, max_tokens=2, cache_prompt=False).specprefill
        assert on_prose.engaged, on_prose.reason
        assert on_code.engaged is code_engaged, on_code.reason
        if not code_engaged:
            assert on_code.reason.startswith("policy: draft not vouched for: code: from the "
                                             "draft's selection the target answers 2 of the 3")


def test_the_kind_of_content_is_code_where_a_file_sits_among_long_prose(demo_pair):
    from specprefill_engine import code_tasks, prose_tasks
    from specprefill_engine.core.kinds import content_kind

    tokenizer = demo_pair[2]
    prose = tokenizer.decode(prose_tasks.make_case(tokenizer, "qa", 8000, 2).ids)
    code = tokenizer.decode(code_tasks.make_case(tokenizer, "code_return", 900, 1).ids)
    assert content_kind(prose) == "prose" and content_kind(code) == "code"
    assert content_kind(prose + "\n" + code) == "code"  # an agent's read file, say


def test_a_prompt_shorter_than_the_probe_is_not_vouched_for(fresh_cache_dir, random_draft,
                                                            demo_pair):
    """The probe vouches from its file's length up: a vouched pair's policy declines a
    prose prompt shorter than the probe's 2,048 tokens and says why, and engages on a
    longer one. (On the real pair, CPU, the default engaged on 1.5K-token prose and lost
    3 of 5 answers dense gave, at 3955275.)"""
    from specprefill_engine.prose_tasks import make_case as prose_case

    tokenizer = demo_pair[2]

    def prose(length):
        return [{"role": "user", "content": tokenizer.decode(
            prose_case(tokenizer, "passkey", length, 2).ids[4:])}]

    with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
        check = engine._worker.runtime.vouch
    found = [0.01] * vouch.QUESTIONS
    check.path.parent.mkdir(parents=True, exist_ok=True)
    check.path.write_text(json.dumps({
        "version": vouch.VERSION, "key": check.key, "measured_at": 0,
        "probe": {"target": found, "draft": found, "target_s": 1.0, "draft_s": 1.0,
                  "length": 2048, "code_answers": [[True, True]] * 3}}))
    with Engine(model=str(DEMO_TARGET), draft=str(random_draft)) as engine:
        assert engine.info.draft.vouched is True
        short = engine.generate_sync(prose(1500), max_tokens=2, cache_prompt=False).specprefill
        long = engine.generate_sync(prose(2400), max_tokens=2, cache_prompt=False).specprefill
        given = engine.generate_sync(prose(1500), max_tokens=2, cache_prompt=False,
                                     keep=0.3).specprefill
    assert not short.engaged and short.reason.startswith(
        "policy: draft not vouched for: a prompt of "), short.reason
    assert "shorter than the probe's 2048" in short.reason
    assert long.engaged, long.reason
    assert given.engaged, given.reason  # a keep given: the user's choice, as before


def test_serve_probes_the_draft_while_it_starts(fresh_cache_dir, random_draft):
    """`serve` probes its draft as the engine starts, before the port accepts, so no
    session's first request waits behind the probe on the worker (lazily, the first
    request the policy would engage on runs it while every other request waits)."""
    from specprefill_engine.cli import make_engine, parser, serve_settings

    args = parser().parse_args(["serve", "--model", str(DEMO_TARGET), "--draft",
                                str(random_draft)])
    with make_engine(args, **serve_settings(args)) as engine:
        assert engine.info.draft.vouched is not None, engine.info.draft.reason
        assert list((fresh_cache_dir / vouch.FOLDER).glob("*.json"))  # measured and kept
