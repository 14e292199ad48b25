"""The engine on one GPU and on tensor-parallel ranks: TTFT and decode speed.

A target that is tight on one GPU (default: a random-weight Qwen3-32B shape, 64 layers,
hidden 5120, MLP 25600, 64 heads, 8 KV heads, head_dim 128: about 62 GB in bfloat16)
with a random Qwen3-0.6B-shape draft, the demo tokenizer's 4096-token vocabulary for
both. Everything runs through the real `Engine` API, as a script would use it:

- TTFT of dense prefill and of SpecPrefill at each `--keeps` for each `--lengths`
  (`generate(ids, max_tokens=1, specprefill=..., keep=..., cache_prompt=False)`, the
  Result's `timings.time_to_first_token`, also scoring and prefill seconds): one
  warm-up request per (length, method) first (a GPU compiles kernels on a shape's first
  forward), then the median of `--repeats`, each on a fresh random prompt;
- decode tokens/s for `--streams` concurrent streams of `--new-tokens` tokens
  (ignore_eos, greedy, `--decode-prompt`-token prompts): the Results' per-stream
  `decode_tokens_per_s` and, for several streams, the aggregate rate over the window in
  which every stream is decoding (after the last one's first token, before the first
  one's end; from the stream chunks' arrival times);
- memory per rank: the parameters it holds (its shard of the target; the draft on
  rank 0), `mx.get_active_memory()` once loaded and `mx.get_peak_memory()` (the
  other ranks write theirs to `<json>.rank<r>` as they exit; rank 0 adds them).

Run it as one process (one GPU) and under the launcher (one rank per GPU); the prompts
are the same (seeded), every row names its rank count:

    python benchmarks/distributed.py --json one.json               # 1 rank
    python benchmarks/distributed.py --launch 2 --json two.json    # 2 ranks, this host

`--launch N` runs this same command under MLX's launcher (`mlx.launch`, i.e.
`mlx._distributed_utils.launch`, which is also there when `mlx.launch` is not on the
PATH) with `-n N` on this host: backend nccl when CUDA is available (the launcher gives
rank r `CUDA_VISIBLE_DEVICES=r` and the NCCL rendezvous variables; every other variable,
NCCL_NVLS_ENABLE included, is inherited), else ring. Running it under `mlx.launch`
yourself works as well. On a CPU, small shapes test the whole path:

    python benchmarks/distributed.py --shape tiny --draft-shape tiny --lengths 1024 \\
        --new-tokens 16 --repeats 1 --launch 2 --json /tmp/d.json

What is patched, and why: the 32B target's weights are never written to disk (64 GB)
nor read from it. The script writes, per model, a directory holding a `config.json`
(the shape, marked with the key `specprefill_benchmark_random`) and the demo
tokenizer's files, and hands its path to `Engine(model=..., draft=...)`, so the engine
loads it as any model (`loading.load_model` -> `mlx_lm.load`, or for a sharded target
`mlx_lm.load(lazy=True)`, `check_shardable`, `Model.shard(group)`, `mx.eval`). While
the engine runs, ONE function is replaced: `mlx_lm.utils.load_model`, the part of
`mlx_lm.load` that builds the model class from config.json and reads the safetensors.
For a marked directory it builds the same class the same way (`_get_classes`,
`ModelArgs.from_dict`), but instead of loading weights it sets every parameter of two
or more dimensions to `normal * 0.02` in bfloat16 (norm weights: ones), lazily; with
`lazy=False` (one process) it evaluates them, as mlx-lm does. The model is an instance
of a subclass whose only change is `shard()`: mlx-lm's own `shard()`, then the same
re-draw of the now sharded parameters, so that the full-size arrays are never
evaluated: each rank materialises only its shard (about 31 GB of a 62 GB model on two
ranks). Everything else (the tokenizer's loading, the dtype the engine picks (the
stored bfloat16 on a GPU; float32 on the CPU, as for any model), the shard check, the
sharding itself, the engine) is the real code. Any other path loads normally.

Random weights make the selection meaningless but the timing real.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import mlx_lm.utils
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from specprefill_engine import Engine
from specprefill_engine.loading import DEMO_TARGET

from common import SHAPES, add_run_arguments
MARK = "specprefill_benchmark_random"  # config.json key of the directories built here
VOCAB = 4096  # the demo tokenizer's
GB = 1e9
PARAMS: dict = {}  # role -> parameters this process holds (its shard of the target)
_real_load_model = mlx_lm.utils.load_model


# models ---------------------------------------------------------------------------------


def model_dir(root: Path, role: str, shape: str) -> str:
    config = dict(model_type="qwen3", vocab_size=VOCAB, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False,
                  eos_token_id=4, torch_dtype="bfloat16", **{"head_dim": 128, **SHAPES[shape]})
    config[MARK] = role
    path = root / role
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    return str(path)


def randomize(model, role: str) -> None:
    """Every matrix a fresh lazy normal * 0.02 of its current shape, bfloat16; the
    arrays it had (lazy, never evaluated) are dropped."""
    model.set_dtype(mx.bfloat16)
    fresh = [(name, mx.random.normal(value.shape, dtype=mx.bfloat16) * 0.02
              if value.ndim >= 2 else value)
             for name, value in tree_flatten(model.parameters())]
    model.update(tree_unflatten(fresh))
    PARAMS[role] = sum(value.size for _, value in fresh)


def random_class(base: type, role: str) -> type:
    def shard(self, group=None):
        base.shard(self, group)  # mlx-lm's split (lazy slices of never-evaluated arrays)
        randomize(self, role)  # so only the shard's shapes are ever computed

    return type(base.__name__, (base,), {"shard": shard, "__module__": base.__module__})


def load_model(model_path, lazy: bool = False, *args, **kwargs):
    """`mlx_lm.utils.load_model` for the directories made here: random weights."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    role = config.get(MARK)
    if role is None:
        return _real_load_model(model_path, lazy, *args, **kwargs)
    model_class, args_class = mlx_lm.utils._get_classes(config=config)
    model = random_class(model_class, role)(args_class.from_dict(config))
    randomize(model, role)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model, config


# measuring --------------------------------------------------------------------------------


def tokens(length: int, seed: int) -> list:
    """The same prompt on every run of the script: seeded by length and index."""
    return np.random.RandomState(seed * 1_000_003 + length).randint(16, VOCAB, length).tolist()


class Report:
    def __init__(self, path, ranks: int):
        self.path, self.ranks, self.rows = path, ranks, []

    def add(self, kind: str, **fields) -> dict:
        row = {"kind": kind, "ranks": self.ranks, **fields}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path:  # rewritten every row: a run cut short keeps what it measured
            Path(self.path).write_text(json.dumps(self.rows, indent=1))
        return row


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


async def ttft(engine, report: Report, length: int, keep, runs: int) -> None:
    sparse = keep is not None
    options = dict(max_tokens=1, specprefill=sparse, cache_prompt=False)
    if sparse:
        options["keep"] = keep
    await engine.generate(tokens(length, 999), **options)  # warm-up: this shape compiles
    results, walls = [], []
    for run in range(runs):
        started = time.perf_counter()
        results.append(await engine.generate(tokens(length, run), **options))
        walls.append(time.perf_counter() - started)
    last = results[-1]
    if sparse and not all(r.specprefill.engaged for r in results):
        print(f"warning: SpecPrefill did not engage: {last.specprefill.reason}", flush=True)
    report.add(
        "ttft", length=length, method="specprefill" if sparse else "dense", keep=keep,
        ttft_s=median(r.timings.time_to_first_token for r in results),
        scoring_s=median(r.timings.scoring for r in results),
        prefill_s=median(r.timings.prefill for r in results),
        wall_s=median(walls), runs_s=[round(r.timings.time_to_first_token, 4) for r in results],
        engaged=last.specprefill.engaged, kept=last.specprefill.kept_tokens,
        cached=max(r.usage.cached_tokens + r.usage.draft_cached_tokens for r in results))


async def one_stream(engine, prompt: list, new_tokens: int, seen: list) -> dict:
    times, final = [], None
    async for chunk in engine.stream(prompt, max_tokens=new_tokens, ignore_eos=True,
                                     specprefill=False, cache_prompt=False):
        if chunk.token_ids:
            times.extend([time.perf_counter()] * len(chunk.token_ids))
        if chunk.timings is not None:
            final = chunk
    seen.append(times)
    return {"tokens": final.usage.completion_tokens,
            "tps": final.timings.decode_tokens_per_s, "ttft": final.timings.time_to_first_token}


def window_rate(seen: list) -> tuple:
    """Tokens per second over the window in which every stream was decoding."""
    start = max(times[0] for times in seen)
    end = min(times[-1] for times in seen)
    if end <= start:
        return None, 0.0
    count = sum(sum(1 for t in times if start < t <= end) for times in seen)
    return count / (end - start), end - start


async def decode(engine, report: Report, streams: int, prompt_length: int, new_tokens: int,
                 runs: int) -> None:
    async def once(new, seed):
        seen = []
        started = time.perf_counter()
        rows = await asyncio.gather(*(one_stream(engine, tokens(prompt_length, seed + i), new,
                                                 seen) for i in range(streams)))
        return rows, seen, time.perf_counter() - started

    await once(min(new_tokens, 16), 500)  # warm-up: every batch size up to `streams`
    measured = [await once(new_tokens, 100 * run) for run in range(runs)]
    windows = [window_rate(seen) for _, seen, _ in measured]
    report.add(
        "decode", streams=streams, prompt=prompt_length, new_tokens=new_tokens,
        per_stream_tps=median(r["tps"] for rows, _, _ in measured for r in rows),
        aggregate_tps=median(rate for rate, _ in windows) if streams > 1 else
        median(r["tps"] for rows, _, _ in measured for r in rows),
        window_s=median(span for _, span in windows),
        wall_s=median(wall for _, _, wall in measured),
        tokens=sum(r["tokens"] for r in measured[-1][0]))


def memory(rank: int, when: str) -> dict:
    """Parameters held (billions; bytes: times 2 in bfloat16, 4 in float32), and the
    allocator's active and peak bytes."""
    return dict(rank=rank, when=when, target_params_b=round(PARAMS.get("target", 0) / 1e9, 4),
                draft_params_b=round(PARAMS.get("draft", 0) / 1e9, 4),
                active_gb=round(mx.get_active_memory() / GB, 3),
                peak_gb=round(mx.get_peak_memory() / GB, 3))


def follower_rows(report: Report, ranks: int, wait: float = 60.0) -> None:
    """The other ranks' memory, from the files they write as they exit."""
    deadline = time.monotonic() + wait
    for rank in range(1, ranks):
        path = Path(f"{report.path}.rank{rank}")
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            print(f"rank {rank} wrote no memory row", flush=True)
            continue
        path.unlink()
        report.add("memory", **row)


async def run(args, root: Path) -> None:
    target = model_dir(root, "target", args.shape)
    draft = model_dir(root, "draft", args.draft_shape)
    engine = Engine(model=target, draft=draft)
    report = Report(args.json if engine.rank == 0 else None, engine.ranks)
    try:
        async with engine:  # on a rank > 0: serves rank 0, then SystemExit(0)
            report.add("setup", device=str(mx.default_device()), mlx=mx.__version__,
                       target=args.shape, draft=args.draft_shape, step_size=engine.info.step_size,
                       batching=engine.info.batching, runs=args.repeats,
                       cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                       nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
            report.add("memory", **memory(0, "loaded"))
            for length in args.lengths:
                for keep in [None, *args.keeps]:
                    await ttft(engine, report, length, keep, args.repeats)
            for streams in args.streams:
                await decode(engine, report, streams, args.decode_prompt, args.new_tokens,
                             args.repeats)
            report.add("memory", **memory(0, "end"))
    except SystemExit:
        if engine.rank:  # rank 0 shut down: this rank's memory, for rank 0's rows
            row = memory(engine.rank, "end")
            print(json.dumps({"kind": "memory", "ranks": engine.ranks, **row}), flush=True)
            if args.json:  # written whole, then renamed: rank 0 waits for the name
                partial = Path(f"{args.json}.rank{engine.rank}.partial")
                partial.write_text(json.dumps(row))
                partial.rename(f"{args.json}.rank{engine.rank}")
        raise
    if report.path and engine.ranks > 1:
        follower_rows(report, engine.ranks)


def launch(args, argv: list) -> int:
    """This command again under MLX's launcher, `--launch N` ranks on this host."""
    backend = args.backend or ("nccl" if mx.cuda.is_available() else "ring")
    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in ("--launch", "--backend"):
            skip = True
        elif not item.startswith(("--launch=", "--backend=")):
            rest.append(item)
    launcher = ("import sys; from mlx._distributed_utils.launch import main; "
                "sys.argv[0] = 'mlx.launch'; sys.exit(main())")
    command = [sys.executable, "-c", launcher, "--backend", backend, "-n", str(args.launch),
               "--", sys.executable, str(Path(__file__).resolve()), *rest]
    print("launching:", " ".join(command[3:]), flush=True)
    return subprocess.call(command)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-32b", choices=sorted(SHAPES),
                        help="the random-weight target's shape")
    parser.add_argument("--draft-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    add_run_arguments(parser, lengths=[8192, 32768], repeats=2,
                      repeats_what="measured runs after a warm-up (medians reported)")
    parser.add_argument("--keeps", type=float, nargs="*", default=[0.1, 0.3])
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-prompt", type=int, default=512, help="decode prompts' tokens")
    parser.add_argument("--launch", type=int, help="run under mlx.launch with this many ranks")
    parser.add_argument("--backend", help="with --launch: nccl (CUDA) or ring (default: "
                        "nccl when CUDA is available)")
    args = parser.parse_args(argv)
    if args.launch:
        return launch(args, argv)
    root = Path(tempfile.mkdtemp(prefix="specprefill-distributed-"))
    try:
        with mock.patch.object(mlx_lm.utils, "load_model", load_model):
            asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
