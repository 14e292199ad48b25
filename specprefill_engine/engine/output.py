"""Output processing, apart from the model work: detokenize, apply stop rules, and
turn a request's tokens into stream chunks and its final Result.

The worker hands each sampled token to `OutputProcessor.accept`; nothing here
touches MLX.
"""

import time
from typing import Callable, Optional

from .results import Chunk, Result
from .sampling import SamplingParams, StopMatcher


class OutputProcessor:
    def __init__(self, request_id: str, params: SamplingParams, max_tokens: int, tokenizer,
                 stream: bool, emit: Callable[[object], None]):
        self.request_id, self.stream, self.emit = request_id, stream, emit
        self.max_tokens = max_tokens
        eos = () if params.ignore_eos else tokenizer.eos_token_ids
        self.stop_ids = set(eos) | set(params.stop_token_ids)
        self.detokenizer = tokenizer.detokenizer
        self.stopper = StopMatcher(params.stop)
        self.tokens: list[int] = []
        self.logprobs: Optional[list] = None if params.logprobs is None else []
        self.sent = 0  # logprobs already in a stream chunk
        self.parts: list[str] = []
        self.first_token_at: Optional[float] = None
        self.stop_string_hit = False

    def accept(self, token: int, logprob=None) -> Optional[str]:
        """Take one sampled token (and its TokenLogprob when asked); return a finish
        reason when the request is done."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if token in self.stop_ids:
            return "stop"
        self.tokens.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        self.detokenizer.add_token(token)
        text, self.stop_string_hit = self.stopper.feed(self.detokenizer.last_segment)
        self.parts.append(text)
        if self.stream and (text or not self.stop_string_hit):
            self.emit(Chunk(text, [token], request_id=self.request_id,
                            logprobs=self._unsent()))
        if self.stop_string_hit:
            return "stop"
        return "length" if len(self.tokens) >= self.max_tokens else None

    def _unsent(self) -> Optional[list]:
        if self.logprobs is None:
            return None
        unsent, self.sent = self.logprobs[self.sent :], len(self.logprobs)
        return unsent

    def flush(self) -> str:
        """Release the text held back for stop matching, unless a stop string hit:
        only a stop string may drop text (EOS, stop ids and limits keep it)."""
        if self.stop_string_hit:
            return ""
        self.detokenizer.finalize()
        tail, self.stop_string_hit = self.stopper.feed(self.detokenizer.last_segment)
        if not self.stop_string_hit:
            tail += self.stopper.held
        self.stopper.held = ""
        self.parts.append(tail)
        return tail

    def finish(self, reason: str, usage, timings, report, called: float, warnings) -> None:
        """Emit the last chunk (when streaming) and the Result; `called`: when the
        caller's call began, where the time to first token starts."""
        if self.first_token_at is not None:
            timings.time_to_first_token = self.first_token_at - called
            if len(self.tokens) > 1:
                elapsed = time.perf_counter() - self.first_token_at
                timings.decode_tokens_per_s = (len(self.tokens) - 1) / max(elapsed, 1e-9)
        tail = self.flush()
        usage.completion_tokens = len(self.tokens)
        if self.stream:
            self.emit(Chunk(tail, [], reason, usage, timings, report, self.request_id,
                            list(warnings), self._unsent()))
        self.emit(Result("".join(self.parts), list(self.tokens), reason, usage, timings, report,
                         self.request_id, list(warnings),
                         None if self.logprobs is None else list(self.logprobs)))
