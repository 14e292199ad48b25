"""Each token's word, as `core.matching` compares them: the token's text without its
spacing, lower-cased, as an integer; control tokens (the chat template's markers) -1."""

import numpy as np


class TokenWords:
    """Keys and word flags of a tokenizer's tokens, each id decoded once, when first seen."""

    def __init__(self, tokenizer):
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        self._decode = getattr(inner, "batch_decode", None) or (
            lambda rows: [inner.decode(row) for row in rows])
        added = getattr(inner, "added_tokens_decoder", None) or {}
        self._control = {int(i) for i, token in added.items() if getattr(token, "special", False)}
        self._control |= {int(i) for i in getattr(inner, "all_special_ids", None) or ()}
        self._known: dict = {}  # id -> (key, word)
        self._keys: dict = {}  # text -> key

    def __call__(self, tokens) -> tuple:
        """(keys, words) for the token ids `tokens`: int64 and bool arrays of its length."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        distinct = np.unique(tokens)
        new = [int(i) for i in distinct if int(i) not in self._known]
        if new:
            for i, text in zip(new, self._decode([[i] for i in new])):
                if i in self._control:
                    self._known[i] = (-1, False)
                    continue
                text = text.strip().lower()
                key = self._keys.setdefault(text, len(self._keys))
                self._known[i] = (key, any(c.isalnum() for c in text))
        keys = np.array([self._known[int(i)][0] for i in distinct], dtype=np.int64)
        words = np.array([self._known[int(i)][1] for i in distinct], dtype=bool)
        where = np.searchsorted(distinct, tokens)
        return keys[where], words[where]
