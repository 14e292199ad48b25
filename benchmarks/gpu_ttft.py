"""TTFT at realistic sizes on a GPU: random-weight Qwen3-shaped models (a 0.6B draft,
an 8B target), bfloat16. Every row of a length is measured side by side in one run:

- dense: the target's chunked prefill of the whole prompt (the engine's GPU step,
  2048-token chunks) to the first token's logits; the same with cost-balanced chunks
  (the CPU's default); mlx-lm's own generate_step;
- draft prefill: the draft's own dense prefill of the prompt, at the scoring chunk size;
- scoring: `score_tokens` as configured (`--lookahead`, `--window`, `--draft-step`);
- per keep: dense prefill of N contiguous tokens (N = the kept count), sparse prefill of
  the N kept tokens (one RoPE call per layer) and, for comparison, the same with RoPE
  called once per run of kept tokens (the old path), SpecPrefill end to end (score,
  select, sparse prefill, first token) and the ideal t(draft prefill) + t(dense N);
- the automatic policy's choice for each length and keep (`specprefill=None`) before any
  prefill ran (its prediction from the models' shapes), next to the measured gain;
- vllm-mlx 0.6.0 on the same prompts and keeps (`--peer-site`).

Random weights make the selection meaningless but the timing real; `--target-path` and
`--draft-path` time real model folders instead (the Qwen2.5-Coder pair at 4 bits, say).
`--json` keeps rows.

    python benchmarks/gpu_ttft.py --lengths 8192 32768 65536 --keeps 0.1 0.3 --peer-site SITE
    python benchmarks/gpu_ttft.py --target-path 1.5B --draft-path 0.5B --lengths 8192 16384 32768
"""

import argparse
import json
import logging
import statistics
import sys
import time
from unittest import mock

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX on a CPU)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.core import (
    chunked_prefill, cleanup_rope, score_tokens, select_chunks, sparse_prefill,
)
from specprefill_engine.core import positions as positions_module
from specprefill_engine.core.scoring import run_steps

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # qwen3-8b's layers at a width where the forward costs little next to the Python
    # that builds it: a CPU stand-in for decode bound by the host, as an 8B model is on an H200
    "qwen3-8b-host": dict(hidden_size=64, num_hidden_layers=36, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # a layout whose 32K-token prompt prefills in seconds on a 2-core CPU, with head_dim
    # 64 so quantized KV (groups of 64) applies: memory measurements at long context
    "qwen3-narrow": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "qwen3-small": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64),  # CPU scale
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, intermediate_size=17408,
                      num_attention_heads=40, num_key_value_heads=8),
}
STEP = 2048  # the engine's GPU prefill step


def build(shape: str, vocab: int):
    args = qwen3.ModelArgs(model_type="qwen3", vocab_size=vocab, rms_norm_eps=1e-6,
                           max_position_embeddings=131072, rope_theta=1e6,
                           tie_word_embeddings=False, **{"head_dim": 128, **SHAPES[shape]})
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def load_folder(path: str):
    from mlx_lm import load

    model, _ = load(path)
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


def dense(model, tokens, step=STEP, balanced=None):
    """The chunked-prefill routine, dense, to the last token's logits: chunks as the
    engine prefills a target (the device's default), or fixed as scoring prefills a draft."""
    cache = make_prompt_cache(model)
    mx.eval(run_steps(chunked_prefill(model, tokens, cache, step, balanced=balanced)))


def policy_choices(target, draft, lengths, keeps) -> dict:
    """What the engine's automatic policy (specprefill=None) would choose for these
    models before any prefill ran: its prediction from the models' shapes alone."""
    from specprefill_engine.engine.policy import CostModel, expected_kept, predict, shape_of
    from specprefill_engine.engine.runtime import EngineConfig

    config, costs = EngineConfig(), CostModel(shape_of(target), shape_of(draft))
    choices = {}
    for length in lengths:
        for keep in keeps:
            kept = expected_kept(length, keep, None, config.chunk_size, config.tail_tokens)
            prediction = predict(costs, length, 0, 0, kept)
            engaged = length >= config.threshold and prediction.pays(config.specprefill_margin)
            choices[(length, keep)] = (engaged, prediction)
    return choices


def mlx_lm_first_token(model, tokens):
    for _ in generate_step(tokens, model, max_tokens=1, prefill_step_size=STEP):
        break


def sparse(model, tokens, kept, per_run=False):
    cache = make_prompt_cache(model)
    try:
        if per_run:  # the old path: one RoPE call per run of kept tokens
            with mock.patch.object(positions_module, "per_token_support",
                                   lambda *a: (False, "benchmark: per-run baseline")):
                mx.eval(sparse_prefill(model, tokens, kept, cache, step_size=STEP))
        else:
            mx.eval(sparse_prefill(model, tokens, kept, cache, step_size=STEP))
    finally:
        cleanup_rope(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--target", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--draft", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--target-path", help="a model folder instead of --target's random shape")
    parser.add_argument("--draft-path", help="a model folder instead of --draft's random shape")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--lookahead", type=int, default=1, help="score_tokens n_lookahead")
    parser.add_argument("--window", type=int, default=1, help="score_tokens n_window")
    parser.add_argument("--draft-step", type=int, default=8192, help="scoring prefill chunk")
    parser.add_argument("--compare-scoring", action="store_true",
                        help="also time scoring with 8 lookahead steps at 2048-token chunks")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31: adds its rows")
    parser.add_argument("--peer-only", action="store_true", help="only the vllm-mlx rows")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    logging.getLogger("specprefill_engine.core.positions").setLevel(logging.ERROR)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, "
          f"target {args.target_path or args.target}, draft {args.draft_path or args.draft}, scoring: n_lookahead {args.lookahead}, n_window {args.window}, "
          f"draft chunks {args.draft_step}; medians of {args.runs} after a warm-up", flush=True)
    target = load_folder(args.target_path) if args.target_path else build(args.target, args.vocab)
    draft = load_folder(args.draft_path) if args.draft_path else build(args.draft, args.vocab)
    rows = []
    choices = policy_choices(target, draft, args.lengths, args.keeps)

    def row(length, method, seconds, **extra):
        rows.append({"length": length, "method": method, "ttft": seconds, **extra})
        note = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in extra.items())
        print(f"| {length} | {method} | {seconds:.3f} | {note} |", flush=True)

    print("| tokens | method | seconds | notes |\n| --- | --- | --- | --- |")
    for length in [] if args.peer_only else args.lengths:
        tokens = mx.random.randint(0, args.vocab - 1000, (length,), key=mx.random.key(length))
        dense_s = timed(lambda: dense(target, tokens), args.runs)
        row(length, "dense target prefill", dense_s, per_token_ms=1e3 * dense_s / length)
        row(length, "mlx-lm generate_step", timed(lambda: mlx_lm_first_token(target, tokens), args.runs))
        row(length, f"dense target prefill, cost-balanced {STEP} chunks",
            timed(lambda: dense(target, tokens, balanced=True), args.runs))
        draft_s = timed(lambda: dense(draft, tokens, args.draft_step, False), args.runs)
        row(length, f"draft prefill ({args.draft_step} chunks)", draft_s,
            per_token_ms=1e3 * draft_s / length, r=draft_s / dense_s)
        if args.draft_step != STEP:
            row(length, f"draft prefill ({STEP} chunks)",
                timed(lambda: dense(draft, tokens, STEP, False), args.runs))

        def score(lookahead=args.lookahead, window=args.window, step=args.draft_step):
            return score_tokens(draft, tokens, n_lookahead=lookahead, n_window=window,
                                step_size=step)

        score_s = timed(lambda: mx.eval(score()), args.runs)
        row(length, "scoring", score_s, vs_draft_prefill=score_s / draft_s)
        if args.compare_scoring:
            row(length, f"scoring, 8 lookahead steps, {STEP} chunks (before)",
                timed(lambda: mx.eval(score(8, 1, STEP)), args.runs))
        importance = score()
        for keep in args.keeps:
            kept = select_chunks(importance, keep)
            n = int(kept.size)
            dense_n = timed(lambda: dense(target, tokens[:n]), args.runs)
            row(length, f"dense prefill of N={n} contiguous (keep {keep})", dense_n)
            sparse_n = timed(lambda: sparse(target, tokens, kept), args.runs)
            row(length, f"sparse prefill of the N={n} kept, per-token RoPE", sparse_n,
                vs_dense_n=sparse_n / dense_n)
            per_run = timed(lambda: sparse(target, tokens, kept, per_run=True), args.runs)
            row(length, f"sparse prefill of the N={n} kept, per-run RoPE (before)", per_run,
                vs_dense_n=per_run / dense_n)

            def specprefill():
                selected = select_chunks(score(), keep)
                sparse(target, tokens, selected)

            total = timed(specprefill, args.runs)
            ideal = draft_s + dense_n
            engaged, prediction = choices[(length, keep)]
            row(length, f"SpecPrefill keep {keep}", total, keep=keep, kept=n,
                speedup=dense_s / total, ideal_s=ideal, vs_ideal=total / ideal,
                policy="SpecPrefill" if engaged else "dense",
                predicted_speedup=prediction.gain)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
    if args.peer_site:
        for line in vllm_mlx_rows(target, draft, args.lengths, args.keeps, args.runs,
                                  args.peer_site, args.vocab):
            rows.append(line)
            print(f"| {line['length']} | {line['method']} | {line['ttft']:.3f} | |", flush=True)
        ours = {(r["length"], r.get("keep")): r["ttft"] for r in rows if "SpecPrefill" in r["method"]}
        for line in rows:
            if line["method"].startswith("vllm-mlx") and (line["length"], line["keep"]) in ours:
                ratio = line["ttft"] / ours[(line["length"], line["keep"])]
                print(f"{line['length']} keep {line['keep']}: vllm-mlx / ours = {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
    return 0


def vllm_mlx_rows(target, draft, lengths, keeps, runs, site, vocab) -> list:
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
    mx.clear_cache()  # the peer runs in its own process: leave it the GPU's memory
    cases = [{"ids": mx.random.randint(0, vocab - 1000, (n,), key=mx.random.key(n)).tolist(),
              "n_tokens": 1} for n in lengths]
    out = run_vllm_mlx({"target": str(paths["target"]), "draft": str(paths["draft"]),
                        "keeps": keeps, "cases": cases, "runs": runs, "warmup": 1}, site)
    shutil.rmtree(folder)
    if "error" in out:
        print(f"vllm-mlx 0.6.0 failed: {out['error']}", flush=True)
        return []
    return [{"length": length, "method": f"vllm-mlx 0.6.0 keep {keep}", "keep": keep,
             "ttft": statistics.median(result[str(keep)]["ttfts"])}
            for length, result in zip(lengths, out["results"]) for keep in keeps]


if __name__ == "__main__":
    sys.exit(main())
