"""The question's words matched in the prompt (`core/matching.py`, `engine/words.py`)."""

import numpy as np
import pytest

from specprefill_engine.core import select_chunks
from specprefill_engine.core.matching import question_match, with_matches
from specprefill_engine.engine.words import TokenWords


def test_a_run_of_the_question_marks_its_earlier_occurrences_by_rarity():
    """Keys 7 8 occur once before the question (weight 1), 3 4 twice (1/2 each); a run
    of one word (8 9, 9 a non-word) or through a control token (-1) marks nothing, nor
    does the question itself."""
    keys = np.array([1, 7, 8, 2, 3, 4, 5, 3, 4, 6, 8, 9, 0, 6, -1, 5,
                     7, 8, 0, 3, 4, 8, 9, -1, 5])
    words = keys != 9
    words[keys < 0] = False
    match = question_match(keys, words, window=9)
    expected = np.zeros(keys.size, np.float32)
    expected[[1, 2]] = 1.0
    expected[[4, 5, 7, 8]] = 0.5
    assert match.tolist() == expected.tolist()
    assert not question_match(keys, words, window=keys.size).any()  # no prompt before it


def test_a_question_before_later_messages_marks_the_file_after_it():
    """A coding agent's prompt: the question (positions 2-5), then the file that holds
    the asked name (7 8 at 12-13), then the prompt's last tokens. The name is marked where
    the question's positions are given, and not where only the last window is read."""
    keys = np.array([1, 2, 7, 8, 3, 4, 5, 6, 9, 10, 11, 12, 7, 8, 13, 14, 15, 16])
    words = np.ones(keys.size, bool)
    match = question_match(keys, words, window=3, question=np.arange(2, 6))
    expected = np.zeros(keys.size, np.float32)
    expected[[12, 13]] = 1.0
    assert match.tolist() == expected.tolist()
    assert not question_match(keys, words, window=3).any()


def test_a_unique_match_ranks_with_the_drafts_top_and_its_passage_is_kept():
    """The draft's attention points elsewhere; the question's rare run pulls the chunks
    after its earlier occurrence into the selection, as the spread carries a peak."""
    length = 2048
    rng = np.random.default_rng(0)
    keys = rng.integers(100, 50_000, length)
    keys[700:703] = keys[-10:-7] = [11, 12, 13]  # the function's name, in the question too
    words = np.ones(length, bool)
    importance = np.full(length, 0.01, np.float32)
    importance[1500:1540] = 0.2  # where the draft looked
    plain = np.asarray(select_chunks(importance, 0.2))
    matched = np.asarray(select_chunks(with_matches(importance, question_match(
        keys, words, 32), 1.0), 0.2))
    answer = np.arange(700, 740)
    assert not np.isin(answer, plain).all()
    assert np.isin(answer, matched).all()
    assert with_matches(importance, np.zeros(length, np.float32), 1.0).max() == 1.0


def test_token_words_compare_a_word_whatever_its_spacing_and_case(demo_pair):
    _, _, tokenizer = demo_pair
    words = TokenWords(tokenizer)
    spaced, bare, upper = (tokenizer.encode(text, add_special_tokens=False)
                           for text in (" the", "the", "The"))
    keys, flags = words(np.array(spaced + bare + upper))
    assert len(set(keys.tolist())) == 1 and flags.all()
    control = tokenizer.encode("<|user|>", add_special_tokens=False)
    keys, flags = words(np.array(control + tokenizer.encode(" ,", add_special_tokens=False)))
    assert keys[0] == -1 and not flags[0] and not flags[-1]


def test_the_engine_keeps_the_line_a_question_names_whatever_its_draft(tmp_path,
                                                                       fresh_cache_dir):
    """A random-weight draft ranks nothing; at keep 0.1 the registry line the question
    names is kept by the match alone (match_weight=1, the default), and the demo target
    answers from it. Without the match (0) the same selection loses it."""
    from models import save_with_demo_tokenizer

    from specprefill_engine import Engine
    from specprefill_engine.demo_tasks import make_case
    from specprefill_engine.loading import DEMO_TARGET

    draft = save_with_demo_tokenizer(("llama", {}), tmp_path)
    answers = {}
    for weight in (1.0, 0.0):
        with Engine(model=str(DEMO_TARGET), draft=str(draft), match_weight=weight) as engine:
            case = make_case(engine.tokenizer, 0, "registry", 1500)
            result = engine.generate_sync(case.messages, specprefill=True, keep=0.1,
                                          max_tokens=8, cache_prompt=False)
            assert result.specprefill.engaged and result.specprefill.kept_tokens < 200
            answers[weight] = result.text.strip().startswith(case.answer)
    assert answers == {1.0: True, 0.0: False}


def test_a_bad_match_weight_is_refused_naming_it():

    from specprefill_engine.engine.runtime import EngineConfig

    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="match_weight must be a number >= 0"):
            EngineConfig(match_weight=bad)
    assert EngineConfig(match_weight=0).match_weight == 0
