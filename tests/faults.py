"""Faults injected into the executor's stages, by patching the methods each stage calls
(the package has no fault hooks): `raises(handle)` runs where that stage works on a
request and may raise there, as the real failure would (memory, a bad cache).

Stages: "restore" (a prefix-cache restore), "prefill" (a prompt chunk), "join" (into the
decode batch), "decode" (a row's step being prepared: it leaves before the step),
"store" (the copy of a decoding row's cache for the prefix cache).
"""

from contextlib import ExitStack, contextmanager
from typing import Callable

from specprefill_engine.engine.batch import DecodeBatch, SoloDecode
from specprefill_engine.engine.executor import Executor


def _before(cls, name: str, handle_of: Callable, raises: Callable[[int], None]):
    original = getattr(cls, name)

    def patched(self, *args, **kwargs):
        raises(handle_of(self, *args))
        return original(self, *args, **kwargs)

    return original, patched


def _decode_with(raises: Callable[[int], None]):
    original = Executor._decode

    def patched(self, outcome):
        for handle in [h for h, row in self.rows.items() if row.group is not None]:
            try:
                raises(handle)
            except Exception as error:
                outcome.failed[handle] = error
                self._release(handle)
        return original(self, outcome)

    return original, patched


@contextmanager
def executor_fault(stage: str, raises: Callable[[int], None]):
    """Within the block, `raises(handle)` runs inside `stage` for every request."""
    targets = {
        "restore": [(Executor, "_restore", lambda self, restore: restore.handle)],
        "prefill": [(Executor, "_chunk", lambda self, chunk, outcome: chunk.handle)],
        "join": [(DecodeBatch, "add", lambda self, handle, *rest: handle),
                 (SoloDecode, "__init__", lambda self, model, handle, *rest: handle)],
        "store": [(DecodeBatch, "extract", lambda self, handle, count: handle),
                  (SoloDecode, "extract", lambda self, handle, count: handle)],
    }
    with ExitStack() as stack:
        if stage == "decode":
            patches = [(Executor, "_decode", *_decode_with(raises))]
        else:
            patches = [(cls, name, *_before(cls, name, handle_of, raises))
                       for cls, name, handle_of in targets[stage]]
        for cls, name, original, patched in patches:
            setattr(cls, name, patched)
            stack.callback(setattr, cls, name, original)
        yield
