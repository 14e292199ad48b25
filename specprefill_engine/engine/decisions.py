"""What the engine decided for a request before, so the same request gets the same plan.

A request's prefill depends on its prompt and settings, but the automatic policy also
reads what the engine has learned (the cost model, the draft check), and a conversation's
next turn reuses the view its previous turn kept. Both change with history. So the first
decision for a request is kept here, keyed by what makes it the same request (its prompt
tokens, the chat's protected tokens and question, `specprefill`, `keep` and whether the
caller gave it, `threshold`): dense, or the
positions the target kept, in the order they were fed. A later identical request follows it: dense again, or the same
view (restored from whatever cached entry agrees with it; what none holds is prefilled
again), without the draft. Nothing is repaired or grows through repeats.

It also keeps the prompts the automatic policy ran dense (their lengths and digests):
a conversation's next turn that adds too little to be worth sparsifying to such a turn
runs dense as well, whether or not that turn's KV is still cached (under load it may
have been evicted, and the turn would otherwise be weighed as a cold prompt).

Only the worker reads and writes it. Least recently used records leave first.
"""

import hashlib
from collections import OrderedDict
from typing import Optional, Union

import numpy as np

MAX_RECORDS = 256
DENSE = "dense"  # the recorded decision of a request prefilled densely


def request_key(tokens: np.ndarray, specprefill: Optional[bool], keep: float, keep_given: bool,
                threshold: int, protected: Optional[np.ndarray] = None,
                question: Optional[np.ndarray] = None) -> bytes:
    digest = hashlib.sha1(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    for part in (protected, question):  # what the selection reads besides the tokens
        digest.update(b"-" if part is None else np.packbits(part).tobytes()
                      if part.dtype == bool else np.ascontiguousarray(part, np.int64).tobytes())
    digest.update(repr((specprefill, float(keep), bool(keep_given), int(threshold))).encode())
    return digest.digest()


class Decisions:
    """Request key -> `DENSE` or the kept positions (int32, in feed order); and the
    prompts the policy ran dense, as (length, digest of their tokens)."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self.max_records = max_records
        self.records: "OrderedDict[bytes, Union[str, np.ndarray]]" = OrderedDict()
        self.prompts: "OrderedDict[tuple, None]" = OrderedDict()

    def ran_dense(self, tokens: np.ndarray) -> None:
        """A prompt the automatic policy ran dense."""
        data = np.ascontiguousarray(tokens, dtype=np.int32)
        key = (int(data.size), hashlib.sha1(data.tobytes()).digest())
        self.prompts[key] = None
        self.prompts.move_to_end(key)
        while len(self.prompts) > self.max_records:
            self.prompts.popitem(last=False)

    def dense_prefix(self, tokens: np.ndarray) -> int:
        """The longest prompt run dense before that `tokens` extends (0: none), in one
        pass over the tokens."""
        data = np.ascontiguousarray(tokens, dtype=np.int32)
        lengths = sorted({length for length, _ in self.prompts if length < data.size})
        digest, done, found = hashlib.sha1(), 0, 0
        for length in lengths:
            digest.update(data[done:length].tobytes())
            done = length
            if (length, digest.copy().digest()) in self.prompts:
                found = length
        return found

    def get(self, key: bytes) -> Optional[Union[str, np.ndarray]]:
        found = self.records.get(key)
        if found is not None:
            self.records.move_to_end(key)
        return found

    def record(self, key: bytes, decision: Union[str, np.ndarray]) -> None:
        """The first decision for `key` stands; a later one for it is ignored."""
        if key in self.records:
            return
        if not isinstance(decision, str):
            decision = np.asarray(decision, dtype=np.int32)
        self.records[key] = decision
        while len(self.records) > self.max_records:
            self.records.popitem(last=False)
