"""Load models through mlx-lm, with the bundled demo pair as the default."""

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

ASSETS = Path(__file__).parent / "assets"
DEMO_TARGET = ASSETS / "demo-target"
DEMO_DRAFT = ASSETS / "demo-draft"


def cache_dir() -> Path:
    """Where the package keeps files across processes (converted models, the policy's
    observed costs): $SPECPREFILL_CACHE_DIR, else $XDG_CACHE_HOME/specprefill-engine,
    else ~/.cache/specprefill-engine."""
    explicit = os.environ.get("SPECPREFILL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specprefill-engine"


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message says which and why."""


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~", "/"))


def resolve_model_path(name: Optional[str], default: Path) -> str:
    """A local directory, a Hugging Face id, or the default; a clear error otherwise."""
    if name is None:
        return str(default)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{name}: not a model directory (no config.json)")
        return str(path)
    if _looks_like_hub_id(str(name)):
        return str(name)
    raise ModelLoadError(f"model path does not exist: {name}")


def default_dtype() -> Optional[mx.Dtype]:
    """float32 on the CPU (faster than bfloat16 there); the stored dtype on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def resolve_dtype(dtype):
    """`dtype` as the weights take it: "auto" (`default_dtype()` when loading), None
    (the stored dtype), or one of DTYPES given by name or as the `mx` dtype."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be 'auto', None, or one of {', '.join(map(repr, DTYPES))} "
                     f"(a name or the mx dtype), got {dtype!r}")


class TextOnly(nn.Module):
    """The language model of an mlx-vlm model, called as mlx-lm calls its models
    (returns logits). Text-only requests run through it; its `language_model` holds
    the rope-delta carrier the core sets for decode."""

    def __init__(self, language_model: nn.Module):
        super().__init__()
        self.language_model = language_model

    @property
    def layers(self):
        return self.language_model.layers

    @property
    def args(self):
        return self.language_model.args

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        output = self.language_model(inputs, cache=cache, **kwargs)
        return output if isinstance(output, mx.array) else output.logits


def is_vision_model(source: str) -> bool:
    config = Path(source) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def _load(source: str):
    """mlx-lm for language models; mlx-vlm (the `vlm` extra) for vision-language ones."""
    from mlx_lm import load
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if not is_vision_model(source):
        return load(source)
    try:
        from mlx_vlm.utils import load as load_vlm
    except ImportError:
        raise ModelLoadError(f"{source} is a vision-language model: install the `vlm` extra "
                             "(pip install 'specprefill-engine[vlm]')") from None
    model, _ = load_vlm(source)
    return TextOnly(model.language_model), load_tokenizer(Path(source))


def check_shardable(model: nn.Module, source: str, ranks: int) -> None:
    """Tensor parallelism splits heads, KV heads and the MLP's width over the ranks:
    refuse a model they do not divide (checked on the lazily loaded model, before
    any weight is read)."""
    if not hasattr(model, "shard"):
        raise ModelLoadError(f"{source}: mlx-lm cannot shard this model ({type(model).__module__} "
                             "has no shard()); run it on one machine")
    args = getattr(model, "args", None)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value % ranks:
            raise ModelLoadError(f"{source}: {name} = {value} is not divisible by {ranks} "
                                 f"ranks; the target cannot be sharded {ranks} ways")


def _load_sharded(source: str, group):
    """mlx-lm's lazy load, a check, then this rank's shard (`Model.shard`)."""
    from mlx_lm import load

    if is_vision_model(source):
        raise ModelLoadError(f"{source}: vision-language models cannot run sharded")
    model, tokenizer = load(source, lazy=True)
    check_shardable(model, source, group.size())
    model.shard(group)
    return model, tokenizer


def load_model(name: Optional[str] = None, default: Path = DEMO_TARGET, dtype="auto",
               group=None):
    """Return (model, tokenizer) for a path, a hub id, or the demo default; with a
    distributed `group`, this rank's tensor-parallel shard of the model."""
    source = resolve_model_path(name, default)
    dtype = resolve_dtype(dtype)
    try:
        model, tokenizer = _load(source) if group is None else _load_sharded(source, group)
    except ModelLoadError:
        raise
    except Exception as error:
        raise ModelLoadError(f"could not load model {source!r}: {error}") from error
    # Prompt length is checked against the model's context by the engine; the HF
    # tokenizer's own "sequence longer than model_max_length" warning would only
    # repeat it, so mark that warning as already given.
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    dtype = default_dtype() if isinstance(dtype, str) else dtype  # "auto"
    if dtype is not None:
        model.set_dtype(dtype)
    if group is not None:
        mx.eval(model.parameters())  # read this rank's weights only, once sharded
    return model, tokenizer


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """A draft scores tokens by id, so its vocabulary must match the target's."""
    target_vocab = target_tokenizer.get_vocab()
    if draft_tokenizer.get_vocab() != target_vocab:
        raise ModelLoadError(
            "the draft model's tokenizer differs from the target's; SpecPrefill needs "
            "a draft that shares the target's tokenizer"
        )




def save_json(path: Path, data, what: str) -> None:
    """Write `data` as JSON atomically (never a half-written file for another process);
    a folder that cannot be written is logged, never raised: `what` names the contents."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            file.write(json.dumps(data))
        os.replace(file.name, path)
    except OSError as error:
        logging.getLogger(__name__).info("could not save %s to %s: %r", what, path, error)
