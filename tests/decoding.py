"""Greedy decoding with mlx-lm's generate_step and one constraint, for tests."""

import mlx.core as mx
from mlx_lm.generate import generate_step


def constrained_decode(model, tokenizer, processor, ids: list, max_tokens: int) -> list:
    """The tokens greedy decoding writes after `ids`, the processor fed only those."""
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens,
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                                  logits_processors=[lambda t, l: processor(t[len(ids):], l)]):
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out
