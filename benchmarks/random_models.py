"""Random-weight Qwen3-shaped (and Qwen3-Next-like hybrid) models saved with the demo
tokenizer, for timing benchmarks on a GPU (no hub downloads there). The vocabulary is the demo
tokenizer's 4096 so every method, ours and mlx-lm's, decodes the same model."""

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.models import qwen3, qwen3_next
from mlx_lm.utils import save_config, save_model

from gpu_ttft import SHAPES
from specprefill_engine.loading import DEMO_TARGET


# a Qwen3-Next-like hybrid of ~8B parameters: GatedDeltaNet layers with a gated
# attention layer every fourth, dense MLPs (no experts), partial rotary
HYBRID_SHAPES = {
    "qwen3-next-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
                          num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                          linear_num_value_heads=32, linear_num_key_heads=16,
                          linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
                          decoder_sparse_step=1, shared_expert_intermediate_size=0,
                          mlp_only_layers=[], moe_intermediate_size=0,
                          partial_rotary_factor=0.25, full_attention_interval=4),
    # the same layout at CPU scale, next to gpu_ttft's "qwen3-small" plain shape
    "qwen3-next-small": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             linear_num_value_heads=8, linear_num_key_heads=4,
                             linear_key_head_dim=64, linear_value_head_dim=64,
                             linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
                             decoder_sparse_step=1, shared_expert_intermediate_size=0,
                             mlp_only_layers=[], moe_intermediate_size=0,
                             partial_rotary_factor=0.25, full_attention_interval=4),
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
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    save_config(config, path / "config.json")
    return str(path)


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """--target-shape / --draft-shape: a random-weight pair instead of the demo pair."""
    parser.add_argument("--target-shape", help="random-weight shape for the target (GPU "
                        "timing; answers are meaningless): e.g. qwen3-8b, qwen3-next-8b")
    parser.add_argument("--draft-shape", default="qwen3-0.6b")


def random_pair(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """(target, draft) folders for --target-shape, or (None, None): the demo pair."""
    if not args.target_shape:
        return None, None
    return random_model_dir(args.target_shape), random_model_dir(args.draft_shape, seed=1)
