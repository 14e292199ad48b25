"""Runs vllm-mlx 0.6.0's published SpecPrefill functions on a job, in vllm-mlx's own
environment (it pins mlx-lm < 0.32, so it cannot share ours). Started by
`benchmarks/common.py` (`run_vllm_mlx`); reads a job JSON file, writes results JSON to stdout.

For each case and keep: score with the draft (greedy lookahead, as ours), select,
sparse-prefill the target, then greedy-decode; time to the first token is measured
from the start of scoring to the first token being evaluated.
"""

import json
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from vllm_mlx.specprefill import (
    _llama_extract_queries, cleanup_rope, score_tokens, select_chunks, sparse_prefill,
)


def run_case(model, draft, ids, keep, n_tokens, eos):
    started = time.perf_counter()
    # the extractor its docstring names for standard Llama/Mistral models: its own
    # detection takes mlx-lm's attention for a RoPE-less one (see docs/benchmarks.md)
    importance = score_tokens(draft, ids, temp=0.0, query_extractor=_llama_extract_queries)
    selected = select_chunks(importance, keep_pct=keep)
    cache = make_prompt_cache(model)
    try:
        logits = sparse_prefill(model, ids, selected, cache)
        token = mx.argmax(logits[0, -1]).item()
        ttft = time.perf_counter() - started
        tokens = [token]
        while len(tokens) < n_tokens and tokens[-1] not in eos:
            logits = model(mx.array([[tokens[-1]]]), cache=cache)
            tokens.append(mx.argmax(logits[0, -1]).item())
    finally:
        cleanup_rope(model)
    return tokens, ttft


def position_error(model, ids, keep_every: int = 3) -> float:
    """Max |layer-0 key after its sparse prefill - dense key at the same index|."""
    tokens = mx.array(ids)
    n_chunks = -(-len(ids) // 32)
    chunks = sorted({0, n_chunks - 1} | set(range(1, n_chunks, keep_every)))
    kept = mx.array([i for c in chunks for i in range(c * 32, min(c * 32 + 32, len(ids)))])
    dense, sparse = make_prompt_cache(model), make_prompt_cache(model)
    model(tokens[None], cache=dense)
    try:
        sparse_prefill(model, tokens, kept, sparse)
    finally:
        cleanup_rope(model)
    expected = dense[0].keys[..., : len(ids), :][..., kept, :]
    return mx.abs(sparse[0].keys[..., : kept.size, :] - expected).max().item()


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    model, tokenizer = load(job["target"])
    draft, _ = load(job["draft"])
    if job.get("float32"):
        model.set_dtype(mx.float32)
        draft.set_dtype(mx.float32)
    eos = set(tokenizer.eos_token_ids)
    probe = position_error(model, job["cases"][0]["ids"]) if job["cases"] else None
    results = []
    for case in job["cases"]:
        entry = {}
        for keep in job["keeps"]:
            runs = [run_case(model, draft, case["ids"], keep, case["n_tokens"], eos)
                    for _ in range(job.get("runs", 1) + job.get("warmup", 0))]
            runs = runs[job.get("warmup", 0):]
            entry[str(keep)] = {"tokens": runs[0][0], "ttfts": [t for _, t in runs]}
        results.append(entry)
    json.dump({"mlx_lm": __import__("mlx_lm").__version__, "position_error": probe,
               "results": results}, sys.stdout)
    return 0
