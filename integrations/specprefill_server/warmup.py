"""Before the port accepts: a prefill spanning two of the engine's units, then two
requests decoding together, so a session's first request does not pay the device's
one-time work (a GPU builds each kernel on its first use). Nothing is cached, scored or
recorded: the prompts are dense and `cache_prompt=False`. A step the engine refuses (a
KV budget too small for it) is skipped: the first requests pay instead."""

import asyncio
import logging

import numpy as np

from specprefill_engine import Engine

logger = logging.getLogger(__name__)


async def warm_up(engine: Engine) -> None:
    info = engine.info
    length = 2 * info.step_size if not info.context_length else \
        min(2 * info.step_size, info.context_length - 8)
    ids = (np.arange(length) * 7919 % max(info.vocab_size - 256, 1) + 128).tolist()
    options = dict(max_tokens=4, ignore_eos=True, specprefill=False, cache_prompt=False)
    for prompts in ([ids], [ids[:64], ids[:96]]):
        done = await asyncio.gather(*(engine.generate(prompt, **options) for prompt in prompts),
                                    return_exceptions=True)
        for error in done:
            if isinstance(error, Exception):  # the server starts all the same
                logger.info("warm-up step skipped: %s", error)
