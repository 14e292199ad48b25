"""TTFT at realistic sizes on a GPU: random-weight Qwen3-shaped models (a 0.6B
draft, an 8B target), dense prefill (2048-token chunks, as mlx-lm's generate_step does) vs SpecPrefill.
Random weights make the selection meaningless but the timing real.

    python benchmarks/gpu_ttft.py --lengths 8192 32768 65536 --keeps 0.1 0.3
"""

import argparse
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.core import cleanup_rope, score_tokens, select_chunks, sparse_prefill

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, intermediate_size=17408,
                      num_attention_heads=40, num_key_value_heads=8),
}


def build(shape: str):
    args = qwen3.ModelArgs(model_type="qwen3", vocab_size=151936, rms_norm_eps=1e-6,
                           max_position_embeddings=131072, head_dim=128, rope_theta=1e6,
                           tie_word_embeddings=False, **SHAPES[shape])
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def timed(fn, runs: int) -> float:
    fn()  # warm-up: kernels compile for new shapes
    times = []
    for _ in range(runs):
        mx.synchronize()
        started = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def dense(model, tokens):
    cache = make_prompt_cache(model)
    for start in range(0, tokens.size - 1, 2048):
        model(tokens[start : min(start + 2048, tokens.size - 1)][None], cache=cache)
        mx.eval([c.state for c in cache])
    mx.eval(model(tokens[-1:][None], cache=cache)[:, -1])


def mlx_lm_first_token(model, tokens):
    """mlx-lm's own generate_step to its first token: the dense baseline."""
    for _ in generate_step(tokens, model, max_tokens=1):
        break


def specprefill(model, draft, tokens, keep, parts):
    started = time.perf_counter()
    importance = score_tokens(draft, tokens)
    mx.eval(importance)
    parts.append(time.perf_counter() - started)
    selected = select_chunks(importance, keep)
    cache = make_prompt_cache(model)
    mx.eval(sparse_prefill(model, tokens, selected, cache))
    cleanup_rope(model)


def vllm_mlx_rows(target, draft, lengths, keeps, runs, site) -> str:
    """Save the random models with the demo tokenizer and time vllm-mlx on them."""
    import shutil
    import tempfile
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model

    sys.path.insert(0, str(Path(__file__).parent))
    from peers import run_vllm_mlx
    from specprefill_engine.loading import DEMO_TARGET

    folder = Path(tempfile.mkdtemp())
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        paths[name] = folder / name
        save_model(paths[name], model)
        save_config({**vars(model.args)}, paths[name] / "config.json")
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(DEMO_TARGET / file, paths[name] / file)
    cases = [{"ids": mx.random.randint(0, 150000, (n,)).tolist(), "n_tokens": 1} for n in lengths]
    out = run_vllm_mlx({"target": str(paths["target"]), "draft": str(paths["draft"]),
                        "keeps": keeps, "cases": cases, "runs": runs, "warmup": 1}, site)
    shutil.rmtree(folder)
    if "error" in out:
        return f"vllm-mlx 0.6.0 failed: {out['error']}"
    lines = []
    for length, result in zip(lengths, out["results"]):
        for keep in keeps:
            ttft = statistics.median(result[str(keep)]["ttfts"])
            lines.append(f"| {length} | vllm-mlx 0.6.0 keep {keep} | {ttft:.2f} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--target", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31: adds its rows")
    args = parser.parse_args(argv)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, target {args.target}, draft qwen3-0.6b")
    target, draft = build(args.target), build("qwen3-0.6b")
    print("| tokens | method | TTFT s | speedup vs dense | scoring s |")
    print("| --- | --- | --- | --- | --- |")
    for length in args.lengths:
        tokens = mx.random.randint(0, 150000, (length,))
        dense_s = timed(lambda: dense(target, tokens), args.runs)
        draft_s = timed(lambda: dense(draft, tokens), 1)
        print(f"| {length} | dense (engine path) | {dense_s:.2f} | 1.00x | r = {draft_s / dense_s:.2f} |")
        baseline_s = timed(lambda: mlx_lm_first_token(target, tokens), args.runs)
        print(f"| {length} | mlx-lm generate_step | {baseline_s:.2f} | {dense_s / baseline_s:.2f}x | |")
        for keep in args.keeps:
            parts = []
            sparse_s = timed(lambda: specprefill(target, draft, tokens, keep, parts), args.runs)
            print(f"| {length} | SpecPrefill keep {keep} | {sparse_s:.2f} | {dense_s / sparse_s:.2f}x "
                  f"(ideal {1 / (draft_s / dense_s + keep):.2f}x) | {statistics.median(parts[1:]):.2f} |")
        sys.stdout.flush()
    if args.peer_site:
        print(vllm_mlx_rows(target, draft, args.lengths, args.keeps, args.runs, args.peer_site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
