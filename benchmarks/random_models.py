"""Random-weight Qwen3-shaped models saved with the demo tokenizer, for timing
benchmarks on a GPU (no hub downloads there). The vocabulary is the demo
tokenizer's 4096 so every method, ours and mlx-lm's, decodes the same model."""

import shutil
import tempfile
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.models import qwen3
from mlx_lm.utils import save_config, save_model

from gpu_ttft import SHAPES
from specprefill_engine.loading import DEMO_TARGET


def random_model_dir(shape: str, seed: int = 0) -> str:
    config = dict(model_type="qwen3", vocab_size=4096, rms_norm_eps=1e-6,
                  max_position_embeddings=131072, head_dim=128, rope_theta=1e6,
                  tie_word_embeddings=False, **SHAPES[shape])
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    path = Path(tempfile.mkdtemp()) / shape
    save_model(path, model)
    save_config(config, path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    return str(path)
