"""Time to first token: dense against SpecPrefill at each keep, with mlx-lm's own prefill
side by side in one run (and vllm-mlx 0.6.0's SpecPrefill, in its own environment).

On the demo pair (the default): retrieval prompts from the demo tasks through the
engine, dense and at each keep, against mlx-lm's `stream_generate`, and vllm-mlx unless
`--no-peer`.

On `--shape` (random-weight Qwen3 shapes: a 0.6B draft and e.g. an 8B target, bfloat16,
a 152K vocabulary; timing only) or `--model` / `--draft` folders: the core functions
timed directly, each row a median of `--repeats` after a warm-up, the same prompt per
length for every row:
- dense: the target's chunked prefill of the whole prompt (the engine's GPU step,
  2048-token chunks) to the first token's logits; the same with cost-balanced chunks
  (the CPU's default); mlx-lm's own `generate_step`;
- draft prefill: the draft's own dense prefill of the prompt, at the scoring chunk size;
  scoring: `score_tokens` as configured (`--lookahead`, `--window`, `--draft-step`);
- per keep: dense prefill of N contiguous tokens (N = the kept count), sparse prefill of
  the N kept tokens, SpecPrefill end to end (score, select, sparse prefill, first token)
  against the ideal t(draft prefill) + t(dense N), and the automatic policy's choice
  (`specprefill=None`) from the models' shapes before any prefill ran;
- vllm-mlx 0.6.0 on the same prompts and keeps with `--peer-site`;
- with `--mac`, each length projected to a Mac from the two models' shapes and the kept
  counts measured (common.py's M3 Pro rates; projected, not measured).

    python benchmarks/ttft.py --lengths 1024 2048 4096 8192 --json ttft-cpu.json
    python benchmarks/ttft.py --shape qwen3-8b --lengths 8192 32768 65536 --json ttft-gpu.json
    python benchmarks/ttft.py --model 1.5B --draft 0.5B --lengths 8192 32768 --mac

`benchmarks/plots.py` draws TTFT against prompt length from the JSON.
"""

import argparse
import logging
import statistics
import sys
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine._blas import blas_status
from specprefill_engine.benchmarking import ttft_rows, ttft_table
from specprefill_engine.core import (
    chunked_prefill, cleanup_rope, score_tokens, select_chunks, sparse_prefill,
)
from specprefill_engine.core.scoring import run_steps
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.policy import shape_of
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, default_dtype, load_model

from common import (
    MAC_REFERENCE, SHAPES, add_model_arguments, add_run_arguments, copy_demo_tokenizer,
    mac_ttft_rows, run_vllm_mlx, write_json,
)


def demo_vllm_mlx_rows(lengths, keeps, runs, dense: dict, site=None) -> tuple:
    _, tokenizer = load_model()
    cases = [{"ids": tokenizer.apply_chat_template(
        make_case(tokenizer, 0, "passkey", n).messages, add_generation_prompt=True),
        "n_tokens": 1} for n in lengths]
    out = run_vllm_mlx({"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT), "keeps": keeps,
                        "float32": default_dtype() is not None, "cases": cases,
                        "runs": runs, "warmup": 1}, site)
    if "error" in out:
        return [], out["error"]
    rows = []
    for length, result in zip(lengths, out["results"]):
        for keep in keeps:
            ttft = statistics.median(result[str(keep)]["ttfts"])
            rows.append({"length": length, "method": f"vllm-mlx 0.6.0 keep {keep}", "ttft": ttft,
                         "vs_dense": ttft / dense[length]})
    return rows, ""


STEP = 2048  # the engine's GPU prefill step


def build(shape: str, vocab: int):
    """A random-weight Qwen3 of this shape, in memory, at a real model's vocabulary."""
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


def sparse(model, tokens, kept):
    cache = make_prompt_cache(model)
    try:
        mx.eval(sparse_prefill(model, tokens, kept, cache, step_size=STEP))
    finally:
        cleanup_rope(model)


def demo_main(args) -> int:
    rows = ttft_rows(args.lengths, args.keeps, args.repeats,
                     report=lambda m: print(m, file=sys.stderr, flush=True))
    peer_error = ""
    if not args.no_peer:
        dense = {r["length"]: r["ttft"] for r in rows if r["method"] == "engine dense"}
        peer_rows, peer_error = demo_vllm_mlx_rows(args.lengths, args.keeps, args.repeats,
                                                   dense, args.peer_site)
        rows += peer_rows
    rows.sort(key=lambda r: r["length"])
    print(f"device {mx.default_device()}, mlx {mx.__version__}, BLAS: {blas_status()}; "
          f"medians of {args.repeats} after a warm-up")
    print(ttft_table(rows))
    if peer_error:
        print(f"\nvllm-mlx 0.6.0 failed: {peer_error}")
    write_json(args.json, {"rows": rows, "peer_error": peer_error})
    return 0


def models_main(args) -> int:
    logging.getLogger("specprefill_engine.core.positions").setLevel(logging.ERROR)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, "
          f"target {args.model or args.shape}, draft {args.draft or args.draft_shape}, scoring: n_lookahead {args.lookahead}, n_window {args.window}, "
          f"draft chunks {args.draft_step}; medians of {args.repeats} after a warm-up", flush=True)
    target = load_folder(args.model) if args.model else build(args.shape, args.vocab)
    draft = load_folder(args.draft) if args.draft else build(args.draft_shape, args.vocab)
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
        dense_s = timed(lambda: dense(target, tokens), args.repeats)
        row(length, "dense target prefill", dense_s, per_token_ms=1e3 * dense_s / length)
        row(length, "mlx-lm generate_step", timed(lambda: mlx_lm_first_token(target, tokens), args.repeats))
        row(length, f"dense target prefill, cost-balanced {STEP} chunks",
            timed(lambda: dense(target, tokens, balanced=True), args.repeats))
        draft_s = timed(lambda: dense(draft, tokens, args.draft_step, False), args.repeats)
        row(length, f"draft prefill ({args.draft_step} chunks)", draft_s,
            per_token_ms=1e3 * draft_s / length, r=draft_s / dense_s)
        if args.draft_step != STEP:
            row(length, f"draft prefill ({STEP} chunks)",
                timed(lambda: dense(draft, tokens, STEP, False), args.repeats))

        def score(lookahead=args.lookahead, window=args.window, step=args.draft_step):
            return score_tokens(draft, tokens, n_lookahead=lookahead, n_window=window,
                                step_size=step)

        score_s = timed(lambda: mx.eval(score()), args.repeats)
        row(length, "scoring", score_s, vs_draft_prefill=score_s / draft_s)
        importance = score()
        for keep in args.keeps:
            kept = select_chunks(importance, keep)
            n = int(kept.size)
            dense_n = timed(lambda: dense(target, tokens[:n]), args.repeats)
            row(length, f"dense prefill of N={n} contiguous (keep {keep})", dense_n)
            sparse_n = timed(lambda: sparse(target, tokens, kept), args.repeats)
            row(length, f"sparse prefill of the N={n} kept, per-token RoPE", sparse_n,
                vs_dense_n=sparse_n / dense_n)

            def specprefill():
                selected = select_chunks(score(), keep)
                sparse(target, tokens, selected)

            total = timed(specprefill, args.repeats)
            ideal = draft_s + dense_n
            engaged, prediction = choices[(length, keep)]
            row(length, f"SpecPrefill keep {keep}", total, keep=keep, kept=n,
                speedup=dense_s / total, ideal_s=ideal, vs_ideal=total / ideal,
                policy="SpecPrefill" if engaged else "dense",
                predicted_speedup=prediction.gain)
        write_json(args.json, {"rows": rows})  # saved as each length completes
    if args.peer_site:
        for line in shape_vllm_mlx_rows(target, draft, args.lengths, args.keeps, args.repeats,
                                  args.peer_site, args.vocab):
            rows.append(line)
            print(f"| {line['length']} | {line['method']} | {line['ttft']:.3f} | |", flush=True)
        ours = {(r["length"], r.get("keep")): r["ttft"] for r in rows if "SpecPrefill" in r["method"]}
        for line in rows:
            if line["method"].startswith("vllm-mlx") and (line["length"], line["keep"]) in ours:
                ratio = line["ttft"] / ours[(line["length"], line["keep"])]
                print(f"{line['length']} keep {line['keep']}: vllm-mlx / ours = {ratio:.2f}x")
    if args.mac:
        print(f"\nprojected to a Mac, not measured: {MAC_REFERENCE}")
        print("| tokens | dense | " + " | ".join(f"keep {k}" for k in args.keeps) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in args.keeps) + " |")
        kept = {(r["length"], r["keep"]): r["kept"] for r in rows if "kept" in r and "keep" in r}
        projected = mac_ttft_rows(shape_of(target), shape_of(draft), args.lengths, args.keeps, kept)
        for length in args.lengths:
            mine = [r for r in projected if r["length"] == length]
            cells = [f"{r['ttft']:.2f} s ({r['speedup']:.2f}x)" for r in mine[1:]]
            print(f"| {length // 1024}K | {mine[0]['ttft']:.2f} s | " + " | ".join(cells) + " |")
        rows += [{**r, "method": f"Mac projected, {r['method']}"} for r in projected]
    write_json(args.json, {"rows": rows, "args": vars(args)})
    return 0


def shape_vllm_mlx_rows(target, draft, lengths, keeps, runs, site, vocab) -> list:
    """Save the random models with the demo tokenizer and time vllm-mlx on them."""
    import shutil
    import tempfile
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model

    folder = Path(tempfile.mkdtemp())
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        paths[name] = folder / name
        save_model(paths[name], model)
        save_config({**vars(model.args)}, paths[name] / "config.json")
        copy_demo_tokenizer(paths[name])
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_run_arguments(parser, lengths=[1024, 2048, 4096, 8192], repeats=3)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--no-peer", action="store_true", help="demo pair: skip vllm-mlx")
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31 (no pip); "
                        "with --shape or --model: adds vllm-mlx's rows")
    parser.add_argument("--peer-only", action="store_true", help="only the vllm-mlx rows")
    parser.add_argument("--lookahead", type=int, default=1, help="score_tokens n_lookahead")
    parser.add_argument("--window", type=int, default=1, help="score_tokens n_window")
    parser.add_argument("--draft-step", type=int, default=8192, help="scoring prefill chunk")
    parser.add_argument("--vocab", type=int, default=151936, help="--shape's vocabulary")
    parser.add_argument("--mac", action="store_true",
                        help="with --shape or --model: also project each length to a Mac")
    args = parser.parse_args(argv)
    if args.shape or args.model:
        return models_main(args)
    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
