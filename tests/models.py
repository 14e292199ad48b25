"""Tiny random-weight models built from mlx-lm's own ModelArgs, for tests."""

import importlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import save_config, save_model

from specprefill_engine.core.positions import PositionedRoPE
from specprefill_engine.core.scoring import QueryCapture
from specprefill_engine.loading import DEMO_TARGET

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    head_dim=16,
    rope_theta=10000.0,
)


def save_with_demo_tokenizer(case: tuple, path: Path) -> Path:
    """Write a random-weight model of `case` with the demo tokenizer, loadable by path."""
    model_type, overrides = case
    overrides = {"vocab_size": 4096, **overrides}
    save_model(path, tiny_model(model_type, **overrides))
    save_config({"model_type": model_type, **BASE, **overrides}, path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    return path


def tiny_model(model_type: str, seed: int = 0, **overrides) -> nn.Module:
    """A float32 mlx-lm model of `model_type` with random weights."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {"model_type": model_type, **BASE, **overrides}
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def kept_chunks(length: int, every: int = 3) -> mx.array:
    """Every third 32-token chunk, plus the first and the last: a sparse selection."""
    chunks = sorted({0, (length - 1) // 32} | set(range(1, -(-length // 32), every)))
    return mx.array([i for c in chunks for i in range(c * 32, min(c * 32 + 32, length))])


def random_tokens(length: int, vocab: int = 128, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return mx.random.randint(5, vocab, (length,))


ROPE_CASES = {
    "llama": ("llama", {}),
    "llama-traditional": ("llama", {"rope_traditional": True}),
    "llama-linear": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}),
    "yarn": ("llama", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 32, "beta_slow": 1}}),
    "longrope": ("phi3", {"rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.5] * 8,
        "original_max_position_embeddings": 256}}),
    "dynamic-ntk": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}),
    # sliding-window layers first; windows larger than the test prompts so keys line up
    "gemma3": ("gemma3_text", {"sliding_window": 512, "sliding_window_pattern": 2,
                               "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0}),
    "gpt_oss": ("gpt_oss", {"sliding_window": 512, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "rope_scaling": None,
                            "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v3-mla": ("deepseek_v3", {
        "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "qk_nope_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}),
}

HYBRID_CASES = {
    # Qwen3-Next: GatedDeltaNet layers first, gated attention (double-width q_proj,
    # q_norm, partial rotary) every second layer
    "qwen3_next": ("qwen3_next", {
        "num_hidden_layers": 4, "full_attention_interval": 2, "partial_rotary_factor": 0.5,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 32,
        "moe_intermediate_size": 32, "mlp_only_layers": []}),
    # Nemotron-H: Mamba2, attention without RoPE, and MLP blocks that hold no cache
    "nemotron_h": ("nemotron_h", {
        "hybrid_override_pattern": "M*-M", "num_hidden_layers": 4, "mamba_num_heads": 4,
        "mamba_head_dim": 16, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "attention_bias": False,
        "mamba_proj_bias": False, "use_conv_bias": True, "time_step_limit": (0.0, float("inf")),
        "layer_norm_epsilon": 1e-5, "use_bias": False, "mlp_bias": False}),
    "gemma3-small-window": ("gemma3_text", {
        "sliding_window": 64, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0}),
}

MAMBA = ("mamba", {"state_size": 16, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
                   "time_step_rank": 8})


def build(case: tuple, seed: int = 0, bits: int = 0) -> nn.Module:
    """A model from a (model_type, overrides) case, quantized when `bits` is given."""
    model_type, overrides = case
    model = tiny_model(model_type, seed, **overrides)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        mx.eval(model.parameters())
    return model


def save_vlm_with_demo_tokenizer(path: Path) -> Path:
    """A random-weight tiny Qwen2-VL (vision tower included) saved as mlx-vlm loads it."""
    from mlx.utils import tree_flatten
    from mlx_vlm.models.qwen2_vl import config, qwen2_vl

    text = {**BASE, "model_type": "qwen2_vl", "vocab_size": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    vision = {"model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": 64,
              "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "in_channels": 3}
    tokens = {"image_token_id": 4000, "video_token_id": 4001, "vision_start_token_id": 4002}
    model = qwen2_vl.Model(config.ModelConfig(
        text_config=config.TextConfig.from_dict(text),
        vision_config=config.VisionConfig.from_dict(vision), model_type="qwen2_vl",
        vocab_size=4096, **tokens))
    mx.eval(model.parameters())
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(
        {**text, "vision_config": vision, **tokens, "eos_token_id": 4, "bos_token_id": None}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    return path


def wrappers_left(model: nn.Module) -> list:
    """Names of position or query-capture wrappers still on a model (none should be
    between calls)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, (PositionedRoPE, QueryCapture))]


def save_long_context_model(path: Path, context: int = 65536, every: int = 4) -> Path:
    """A tiny random-weight llama with the demo tokenizer (its chat template with tools,
    without the think block: a model that does not think) and a `context`-token window,
    for agent CLIs whose prompts pass the demo pair's 16K. Its greedy replies end
    within a few tokens: one token in `every` (not whitespace) carries a large constant
    in its embedding, which the untied output head reads into EOS's logit alone, so
    once the model writes one of them EOS follows. One attention head (of 64): on this
    CPU a prefill's cost at these lengths is the attention's, per head."""
    overrides = {"vocab_size": 4096, "max_position_embeddings": context,
                 "tie_word_embeddings": False, "eos_token_id": 4, "num_attention_heads": 1,
                 "num_key_value_heads": 1, "head_dim": 64}
    model = tiny_model("llama", **overrides)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TARGET / "tokenizer.json"))
    blank = [i for i in range(overrides["vocab_size"]) if not tokenizer.decode([i]).strip()]
    ending = mx.array([i % every == 1 and i >= 5 and i not in blank
                       for i in range(overrides["vocab_size"])])
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = embed.at[:, 0].add(
        mx.where(ending, 4.0, 0.0) - embed[:, 0])
    head = model.lm_head.weight
    head = head.at[:, 0].add(-head[:, 0])
    model.lm_head.weight = head.at[4, 0].add(1.0)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config({"model_type": "llama", **BASE, **overrides}, path / "config.json")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(DEMO_TARGET / name, path / name)
    config = json.loads((DEMO_TARGET / "tokenizer_config.json").read_text())
    think = "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
    assert think in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(think, "")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
