"""What the benchmarks share: the argument convention, the models they run on (the demo
pair, model folders, random-weight Qwen3 shapes), the peers they compare against, a
Mac projection from token counts, and how results are written.

The convention, in every entry point: `--model PATH` and `--draft PATH` (model folders;
default: the bundled demo pair) or `--shape NAME` and `--draft-shape NAME` (random-weight
Qwen3 shapes: timing only, their answers are meaningless), `--lengths` (prompt tokens),
`--repeats`, `--json PATH` (the results, with the command that made them).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.models import qwen3, qwen3_next
from mlx_lm.utils import save_config, save_model

from specprefill_engine.engine.policy import Shape
from specprefill_engine.loading import DEMO_TARGET


def add_model_arguments(parser: argparse.ArgumentParser, draft: bool = True,
                        target_shape: Optional[str] = None) -> None:
    """--model / --draft folders, or --shape / --draft-shape random weights."""
    parser.add_argument("--model", help="target model folder (default: the demo target)")
    if draft:
        parser.add_argument("--draft", help="draft model folder (default: the demo draft)")
    parser.add_argument("--shape", default=target_shape, choices=sorted({**SHAPES, **HYBRID_SHAPES}),
                        help="a random-weight target of this shape instead (timing only)")
    if draft:
        parser.add_argument("--draft-shape", default="qwen3-0.6b",
                            choices=sorted({**SHAPES, **HYBRID_SHAPES}),
                            help="with --shape: the random-weight draft's shape")


def add_run_arguments(parser: argparse.ArgumentParser, lengths: list, repeats: int,
                      one_length: bool = False, what: str = "prompt tokens",
                      repeats_what: str = "times each measurement runs (medians reported)") -> None:
    """--lengths, --repeats, --json."""
    parser.add_argument("--lengths", type=int, nargs=1 if one_length else "+", default=lengths,
                        help=what + (" (one length)" if one_length else ""))
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_what)
    parser.add_argument("--json", help="write the results here (with the command)")


def model_folders(args: argparse.Namespace) -> tuple:
    """(target, draft) folders for --model / --draft or --shape / --draft-shape; None
    for a model left to the engine's default (the demo pair)."""
    if getattr(args, "shape", None):
        draft = getattr(args, "draft_shape", None)
        return random_model_dir(args.shape), draft and random_model_dir(draft, seed=1)
    return args.model, getattr(args, "draft", None)


def write_json(path: Optional[str], payload) -> None:
    """The results with the command that made them."""
    if path:
        if isinstance(payload, dict):
            payload = {"command": " ".join(["python", *sys.argv]), **payload}
        Path(path).write_text(json.dumps(payload, indent=1))


# Random-weight models: Qwen3 shapes, saved with the demo tokenizer (vocabulary 4096) so
# every method, ours and mlx-lm's, decodes the same model; no hub downloads on a GPU host.
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
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=25600,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128),
}
# a Qwen3-Next-like hybrid: GatedDeltaNet layers with a gated attention layer every
# fourth, dense MLPs (no experts), partial rotary
_HYBRID = dict(linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
               decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[],
               moe_intermediate_size=0, partial_rotary_factor=0.25, full_attention_interval=4)
HYBRID_SHAPES = {
    "qwen3-next-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                          num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                          linear_num_value_heads=32, linear_num_key_heads=16,
                          linear_key_head_dim=128, linear_value_head_dim=128, **_HYBRID),
    # the same layout at CPU scale, next to the plain "qwen3-small" shape
    "qwen3-next-small": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             linear_num_value_heads=8, linear_num_key_heads=4,
                             linear_key_head_dim=64, linear_value_head_dim=64, **_HYBRID),
}


def random_model_dir(shape: str, seed: int = 0) -> str:
    """The model's folder, made once per machine (config.json is written last)."""
    common = dict(vocab_size=4096, rms_norm_eps=1e-6, max_position_embeddings=131072,
                  rope_theta=1e6, tie_word_embeddings=False)
    if shape in HYBRID_SHAPES:
        module, config = qwen3_next, dict(model_type="qwen3_next", **common, **HYBRID_SHAPES[shape])
    else:
        module, config = qwen3, {"model_type": "qwen3", "head_dim": 128, **common, **SHAPES[shape]}
    path = Path(tempfile.gettempdir()) / "specprefill-random" / f"{shape}-{seed}"
    if (path / "config.json").exists():  # made by an earlier run on this machine
        return str(path)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    save_model(path, model)
    copy_demo_tokenizer(path)
    save_config(config, path / "config.json")
    return str(path)


def copy_demo_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, Path(path) / name)


# The peers: vllm-mlx 0.6.0 pins mlx-lm < 0.32, so it gets its own virtual environment
# (`.bench-venv/vllm-mlx`, made on first use with pip: MLX, mlx-lm 0.31.3, and the
# vllm-mlx wheel without its server dependencies, which its SpecPrefill module does not
# import). Where pip cannot reach an index (a GPU host), pass a folder that already
# holds vllm_mlx and mlx_lm 0.31 (`site`): it goes first on PYTHONPATH.
ROOT = Path(__file__).resolve().parent.parent
VLLM_MLX_ENV = ROOT / ".bench-venv" / "vllm-mlx"
RUNNER = "import sys, vllm_mlx_runner; sys.exit(vllm_mlx_runner.main())"  # run in this folder


def _vllm_mlx_python() -> str:
    python = VLLM_MLX_ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_MLX_ENV)], check=True)
        mlx = "mlx[cpu]" if sys.platform.startswith("linux") else "mlx"
        pip = [str(python), "-m", "pip", "install", "-q"]
        for packages in ([f"{mlx}=={mx.__version__}", "mlx-lm==0.31.3"],
                         ["--no-deps", "vllm-mlx==0.6.0"]):
            install = subprocess.run(pip + packages, capture_output=True, text=True)
            if install.returncode != 0:
                raise OSError(f"installing {packages[-1]} failed: {install.stderr.strip()[-300:]}")
    return str(python)


def run_vllm_mlx(job: dict, site: Optional[str] = None) -> dict:
    """Run a job through vllm-mlx; returns its results or {"error": why}."""
    env = dict(os.environ)
    try:
        if site:
            python = sys.executable
            env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")])
        else:
            python = _vllm_mlx_python()
            env.pop("PYTHONPATH", None)
        blas = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
        if sys.platform.startswith("linux") and os.path.exists(blas) and not site:
            env["LD_PRELOAD"] = blas  # the same BLAS our side uses, for a fair timing
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(job, f)
        run = subprocess.run([python, "-c", RUNNER, f.name], capture_output=True, text=True,
                             env=env, cwd=Path(__file__).resolve().parent)
        os.unlink(f.name)
        if run.returncode != 0:
            return {"error": run.stderr.strip().splitlines()[-1] if run.stderr.strip() else
                    f"exit status {run.returncode}"}
        return json.loads(run.stdout)
    except (subprocess.CalledProcessError, OSError, json.JSONDecodeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


# A Mac, projected, not measured: What a benchmark row would take on a Mac: its token counts at published mlx-lm rates.
# 
# Projected, not measured. The reference is mlx-lm's own benchmark on an M3 Pro (18 GB)
# with Qwen3-4B-Instruct-2507 at 4 bits, `mlx_lm.benchmark -p 2048 -g 128`: prompt 615.28
# tok/s, generation 44.62 tok/s (mlx-lm PR #1569, mlx 0.32.0). Prefill is compute bound:
# a model's prefill of L tokens after C cached takes its FLOPs (`engine/policy.py`'s
# `Shape.flops`: weights and attention) at the FLOP rate that benchmark implies. Decode is
# bandwidth bound: a token takes the reference's seconds per token scaled by the weights'
# size. The same M3 Pro's prefill is ~14x slower than its decode per token (the H200's
# ~170x), which is why agent turns look so different there. Cross-check: mlx-lm PR #406,
# M4 Max, 2048-token prompts at 4 bits: Qwen3 0.6B 10,279 tok/s, Qwen3 30B-A3B 1,732.

MAC_REFERENCE = "M3 Pro, mlx-lm PR #1569 (Qwen3-4B 4-bit: 615.28 prompt / 44.62 generation tok/s)"
_QWEN3_4B = Shape(parameters=3_600_000_000, attention=36 * 32 * 128)  # outside the embedding
_PROMPT_TOK_S, _DECODE_TOK_S, _PROMPT = 615.28, 44.62, 2048
_FLOP_S = _PROMPT_TOK_S * sum(_QWEN3_4B.flops(_PROMPT, 0)) / _PROMPT


def mac_prefill_s(shape: Shape, tokens: int, cached: int = 0) -> float:
    return sum(shape.flops(tokens, cached)) / _FLOP_S if tokens > 0 else 0.0


def mac_decode_s(shape: Shape, tokens: int) -> float:
    return tokens * shape.parameters / (_QWEN3_4B.parameters * _DECODE_TOK_S)


def mac_turn_s(target: Shape, draft: Shape, row: dict) -> dict:
    """A turn's projected seconds from its counts: `draft_tokens` after `draft_cached`,
    `target_tokens` after `target_cached`, `reply_tokens` decoded."""
    scoring = mac_prefill_s(draft, row.get("draft_tokens", 0), row.get("draft_cached", 0))
    prefill = mac_prefill_s(target, row["target_tokens"], row.get("target_cached", 0))
    decode = mac_decode_s(target, row.get("reply_tokens", 0))
    return {"ttft": scoring + prefill, "decode": decode, "wall": scoring + prefill + decode}


def mac_ttft_rows(target: Shape, draft: Shape, lengths, keeps, kept=None) -> list:
    """Projected first-token seconds of one prompt: dense, and SpecPrefill at each keep
    (the draft's prefill of the whole prompt, then the target's of the kept tokens;
    `kept[(length, keep)]` where a run measured it, else keep * length)."""
    rows = []
    for length in lengths:
        dense = mac_prefill_s(target, length)
        rows.append({"length": length, "method": "dense", "ttft": dense})
        for keep in keeps:
            count = (kept or {}).get((length, keep), round(keep * length))
            ttft = mac_turn_s(target, draft, {"draft_tokens": length, "target_tokens": count})["ttft"]
            rows.append({"length": length, "method": f"keep {keep}", "kept": count,
                         "ttft": ttft, "speedup": dense / ttft})
    return rows
