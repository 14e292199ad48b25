"""Load models through mlx-lm, with the bundled demo pair as the default."""

from pathlib import Path
from typing import Optional

import mlx.core as mx

ASSETS = Path(__file__).parent / "assets"
DEMO_TARGET = ASSETS / "demo-target"
DEMO_DRAFT = ASSETS / "demo-draft"


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


def load_model(name: Optional[str] = None, default: Path = DEMO_TARGET, dtype="auto"):
    """Return (model, tokenizer) for a path, a hub id, or the demo default."""
    from mlx_lm import load

    source = resolve_model_path(name, default)
    try:
        model, tokenizer = load(source)
    except Exception as error:
        raise ModelLoadError(f"could not load model {source!r}: {error}") from error
    # Prompt length is checked against the model's context by the engine; the HF
    # tokenizer's own "sequence longer than model_max_length" warning would only
    # repeat it, so mark that warning as already given.
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    dtype = default_dtype() if dtype == "auto" else dtype
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """A draft scores tokens by id, so its vocabulary must match the target's."""
    target_vocab = target_tokenizer.get_vocab()
    if draft_tokenizer.get_vocab() != target_vocab:
        raise ModelLoadError(
            "the draft model's tokenizer differs from the target's; SpecPrefill needs "
            "a draft that shares the target's tokenizer"
        )


