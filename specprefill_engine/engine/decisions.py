"""What the engine decided for a request before, so the same request gets the same plan.

A request's prefill depends on its prompt and settings, but the automatic policy also
reads what the engine has learned (the cost model, the draft check), and a conversation's
next turn reuses the view its previous turn kept. Both change with history. So the first
decision for a request is kept here, keyed by what makes it the same request (its prompt
tokens, `specprefill`, `keep` and whether the caller gave it, `threshold`): dense, or the
positions the target kept, in the order they were fed. A later identical request follows it: dense again, or the same
view (restored from whatever cached entry agrees with it; what none holds is prefilled
again), without the draft. Nothing is repaired or grows through repeats.

Only the worker reads and writes it. Least recently used records leave first.
"""

import hashlib
from collections import OrderedDict
from typing import Optional, Union

import numpy as np

MAX_RECORDS = 256
DENSE = "dense"  # the recorded decision of a request prefilled densely


def request_key(tokens: np.ndarray, specprefill: Optional[bool], keep: float, keep_given: bool,
                threshold: int) -> bytes:
    digest = hashlib.sha1(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
    digest.update(repr((specprefill, float(keep), bool(keep_given), int(threshold))).encode())
    return digest.digest()


class Decisions:
    """Request key -> `DENSE` or the kept positions (int32, in feed order)."""

    def __init__(self, max_records: int = MAX_RECORDS):
        self.max_records = max_records
        self.records: "OrderedDict[bytes, Union[str, np.ndarray]]" = OrderedDict()

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
