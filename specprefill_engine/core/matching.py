"""Where the question's own words occur elsewhere in the prompt.

A small draft's attention finds a passage by meaning; it often misses one named only by
an identifier (a function's name among dozens like it, a key among similar keys),
where the target, reading the whole prompt, would find it. So the selection also ranks
by exact matches: every run of 2-4 tokens of the question (the prompt's last `window`
tokens, and the asked message's own positions where later messages follow it, as a
coding agent's file follows its question) that occurs elsewhere in the prompt marks each
of those occurrences, weighted by how rare it is there (1 / its count: a run repeated
everywhere points nowhere). A run counts only with at least two word tokens and no
control token (the chat template's markers repeat at every turn). Tokens compare by
`keys`: one integer per token, equal for tokens that are the same word with other
spacing or case (" group" and "group"), negative for control tokens. The engine adds
the matches where `match_weight` asks.
"""

from typing import Optional

import numpy as np

RUNS = (2, 3, 4)  # lengths of the question's token runs looked for
# on the real pair's code lookups a run found once ranks with the draft's top: the view
# then holds more of dense's answers in every placement (docs/benchmarks.md)
MATCH_WEIGHT = 1.0


def question_match(keys: np.ndarray, words: np.ndarray, window: int,
                   question: Optional[np.ndarray] = None, runs: tuple = RUNS) -> np.ndarray:
    """Per token, in [0, 1]: the highest 1 / count of a question run it is part of (0
    where none), over the tokens outside the question (the last `window` and the
    positions `question`); the question's own tokens get 0.

    keys: int per token, equal for the same word, negative for a control token (no run
    holding one counts); words: bool per token, True where it holds a letter or digit."""
    keys = np.asarray(keys, dtype=np.int64)
    words = np.asarray(words, dtype=bool)
    if keys.shape != words.shape or keys.ndim != 1:
        raise ValueError(f"keys and words must be 1-D of one length, got {keys.shape} and "
                         f"{words.shape}")
    length = keys.size
    match = np.zeros(length, dtype=np.float32)
    asked = np.zeros(length, dtype=bool)
    if window > 0:
        asked[-window:] = True
    if question is not None:
        asked[np.asarray(question, dtype=np.int64)] = True
    if asked.all() or not asked.any():
        return match
    control = keys < 0
    for size in runs:
        starts = np.arange(length - size + 1)
        if starts.size == 0:
            continue
        code = np.zeros(starts.size, dtype=np.int64)
        count = np.zeros(starts.size, dtype=np.int64)
        bad = np.zeros(starts.size, dtype=bool)
        inside = np.ones(starts.size, dtype=bool)  # the run lies in the question
        outside = np.ones(starts.size, dtype=bool)  # ... wholly out of it
        for offset in range(size):  # a run as one integer (wrapping: collisions negligible)
            code = code * np.int64(1_000_003) + keys[starts + offset]
            count += words[starts + offset]
            bad |= control[starts + offset]
            inside &= asked[starts + offset]
            outside &= ~asked[starts + offset]
        usable = ~bad & (count >= 2)
        wanted = np.unique(code[usable & inside])
        elsewhere = usable & outside
        codes, first = code[elsewhere], starts[elsewhere]
        found = np.isin(codes, wanted)
        if not found.any():
            continue
        _, inverse, counts = np.unique(codes, return_inverse=True, return_counts=True)
        weight = (1.0 / counts[inverse])[found].astype(np.float32)
        for offset in range(size):
            np.maximum.at(match, first[found] + offset, weight)
    return match


def with_matches(importance: np.ndarray, match: np.ndarray, weight: float) -> np.ndarray:
    """The draft's importance scaled to a maximum of 1, plus `weight` x the matches: at
    weight 1 a run found once ranks with the draft's most important token."""
    importance = np.asarray(importance, dtype=np.float32)
    top = float(importance.max()) if importance.size else 0.0
    scaled = importance / top if top > 0 else importance
    return scaled + np.float32(weight) * match
