"""Where a prompt's blank lines begin a block (a paragraph, a function, a needle
sentence): the units the selection keeps whole (`core.selection`), read from the
tokens' text. A unit cut in two glues one function's body to another's name."""

import numpy as np


class BlankLines:
    """Per token id, whether its text ends a blank line; each id decoded once."""

    def __init__(self, tokenizer):
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        self._decode = getattr(inner, "batch_decode", None) or (
            lambda rows: [inner.decode(row) for row in rows])
        self._known: dict = {}  # id -> (ends "\n\n", ends "\n", is only a newline)

    def __call__(self, tokens) -> np.ndarray:
        """A bool mask over `tokens`: True where a block begins (after a blank line)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        distinct = np.unique(tokens)
        new = [int(i) for i in distinct if int(i) not in self._known]
        for i, text in zip(new, self._decode([[i] for i in new]) if new else ()):
            end = text.rstrip(" \t")
            self._known[i] = (end.endswith("\n\n"), end.endswith("\n"), end.strip(" \t") == "\n")
        flags = np.array([self._known[int(i)] for i in distinct], dtype=bool).reshape(-1, 3)
        double, single, newline = flags[np.searchsorted(distinct, tokens)].T
        starts = np.zeros(tokens.size, dtype=bool)
        starts[1:] = double[:-1]
        starts[2:] |= newline[1:-1] & single[:-2]
        return starts
