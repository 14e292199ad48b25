"""Is a sparse answer's miss the model's or the implementation's? For real-weights cases
(`benchmarks/real_models.py`), the last-token logits of SpecPrefill's sparse prefill
against an independent reference: one dense forward of the whole prompt in which every
attention layer masks the dropped keys (the layer's own mask, causal or causal within
its window, AND the kept keys), through mlx-lm's attention wrapped for the call. Equal
logits mean the sparse prefill computed what the model computes over that view, so a
wrong answer is the model's answer to it.

    .venv/bin/python benchmarks/masked_reference.py --model gemma3 --kind passkey \
        --length 8192 --seeds 10 21 22 26 --keep 0.1
"""

import argparse
import sys

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine import gguf
from specprefill_engine.benchmarking import dense_answer, sparse_answer
from specprefill_engine.core import cleanup_rope, score_tokens, select_chunks, sparse_prefill
from specprefill_engine.core.sparse_prefill import cover_sliding_window
from specprefill_engine.loading import default_dtype
from specprefill_engine.prose_tasks import KINDS, is_right, make_case


def masked_logits(model, ids: list, kept: np.ndarray) -> mx.array:
    """The last token's logits of a dense forward whose attention sees only `kept` keys."""
    module = sys.modules[type(model).__module__]
    attention = module.scaled_dot_product_attention
    visible = mx.array(np.isin(np.arange(len(ids)), kept))

    def masked(queries, keys, values, cache, scale, mask, **kwargs):
        if mask is None or isinstance(mask, str):
            mask = create_causal_mask(keys.shape[-2])
        return attention(queries, keys, values, cache=cache, scale=scale,
                         mask=mask & visible[None], **kwargs)

    module.scaled_dot_product_attention = masked
    try:
        return model(mx.array([ids]))[0, -1]
    finally:
        module.scaled_dot_product_attention = attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", choices=sorted(gguf.MODELS))
    parser.add_argument("--kind", default="passkey", choices=KINDS)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--step", type=int, default=512)
    args = parser.parse_args(argv)
    model, tokenizer = load(str(gguf.convert(args.model)))
    if default_dtype() is not None:
        model.set_dtype(default_dtype())
    for seed in args.seeds:
        case = make_case(tokenizer, args.kind, args.length, seed)
        protected = np.arange(len(case.ids)) < case.head
        importance = score_tokens(model, case.ids, step_size=args.step)
        kept = np.asarray(select_chunks(importance, args.keep, must_keep=protected), dtype=np.int64)
        cache = make_prompt_cache(model)
        try:
            sparse = sparse_prefill(model, case.ids, kept, cache, step_size=args.step)[0, -1]
        finally:
            cleanup_rope(model)
        seen = cover_sliding_window(kept, cache, len(case.ids))  # what the sparse prefill fed
        reference = masked_logits(model, case.ids, seen)
        eos = set(tokenizer.eos_token_ids)
        texts = {name: tokenizer.decode([t for t in tokens if t not in eos]) for name, tokens in (
            ("dense", dense_answer(model, case.ids, case.max_tokens, eos, args.step)),
            ("sparse", sparse_answer(model, case.ids, kept, case.max_tokens, eos, args.step)))}
        needed = np.concatenate([np.arange(a, b) for a, b in case.needles])
        same = mx.argmax(sparse).item() == mx.argmax(reference).item()
        print(f"{args.model} {args.kind} {len(case.ids)} tokens seed {seed}: kept {seen.size}, "
              f"needle kept {np.isin(needed, seen).mean():.2f}; max |sparse - masked dense| "
              f"{mx.abs(sparse - reference).max().item():.2e} (logits up to "
              f"{mx.abs(reference).max().item():.1f}), same first token: {same}; answer "
              f"{case.answer!r}: dense {is_right(case, texts['dense'])} {texts['dense']!r}, "
              f"sparse {is_right(case, texts['sparse'])} {texts['sparse']!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
