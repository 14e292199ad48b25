"""What a decode step costs across ranks, without the engine: the latency of one
all-reduce of a decode step's activations (1 x 1 x hidden, bfloat16) on this host, and
mlx-lm's own `generate_step` on the same sharded random target (every rank runs it,
SPMD, as mlx-lm's sharded generation does). A tensor-parallel forward holds two
all-reduces per layer, so a 64-layer target pays 128 of them per token.

    python benchmarks/collectives.py                  # 1 rank
    python benchmarks/collectives.py --launch 2       # 2 ranks on this host (nccl on CUDA)
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import mlx_lm.utils
from mlx_lm.generate import generate_step

from distributed import SHAPES, load_model as random_load_model, model_dir, tokens
from specprefill_engine.loading import load_model


def all_reduce_ms(group, hidden: int, repeats: int = 200) -> float:
    x = mx.ones((1, 1, hidden), dtype=mx.bfloat16)
    for _ in range(10):
        mx.eval(mx.distributed.all_sum(x, group=group))
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(mx.distributed.all_sum(x, group=group))
    return (time.perf_counter() - started) / repeats * 1e3


def decode_tps(model, prompt: list, new_tokens: int) -> float:
    for _ in generate_step(mx.array(prompt), model, max_tokens=8):  # compile the shapes
        pass
    stamps = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen3-32b", choices=sorted(SHAPES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--launch", type=int, help="run under mlx.launch with this many ranks")
    parser.add_argument("--json", help="rank 0 writes its row here")
    args = parser.parse_args()
    if args.launch:
        backend = "nccl" if mx.cuda.is_available() else "ring"
        launcher = ("import sys; from mlx._distributed_utils.launch import main; "
                    "sys.argv[0] = 'mlx.launch'; sys.exit(main())")
        rest = [a for a in sys.argv[1:] if a not in ("--launch", str(args.launch))]
        return subprocess.call([sys.executable, "-c", launcher, "--backend", backend,
                                "-n", str(args.launch), "--", sys.executable,
                                str(Path(__file__).resolve()), *rest])
    group = mx.distributed.init()
    ranks = group.size()
    row = {"ranks": ranks, "target": args.target, "device": str(mx.default_device())}
    if ranks > 1:
        row["all_reduce_ms"] = all_reduce_ms(group, SHAPES[args.target]["hidden_size"])
    root = Path(tempfile.mkdtemp(prefix="specprefill-collectives-"))
    try:
        path = model_dir(root, "target", args.target)
        with mock.patch.object(mlx_lm.utils, "load_model", random_load_model):
            model, _ = load_model(path, group=group if ranks > 1 else None)
        row["mlx_lm_decode_tps"] = decode_tps(model, tokens(512, 0), args.new_tokens)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if group.rank() == 0:
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
