import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# converted real weights stay where the caller's cache directory keeps them: they are
# checked against recorded values, and converting them again takes minutes
CALLER_CACHE_DIR = os.environ.get("SPECPREFILL_CACHE_DIR")
# what the engine keeps across processes (the policy's observed costs) starts empty here,
# so no test depends on what an earlier run measured
os.environ["SPECPREFILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="specprefill-tests-")

import specprefill_engine  # noqa: E402,F401  (loads the optimized BLAS before MLX)


@pytest.fixture(scope="session")
def demo_pair():
    from specprefill_engine.loading import DEMO_DRAFT, load_model

    target, tokenizer = load_model()
    draft, _ = load_model(default=DEMO_DRAFT)
    return target, draft, tokenizer


@pytest.fixture
def fresh_cache_dir(tmp_path, monkeypatch):
    """A cache folder of this test's own (what the engine keeps across processes)."""
    monkeypatch.setenv("SPECPREFILL_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def converted():
    """`gguf.convert(name)`: the folder of a real model, converted on first use into the
    caller's SPECPREFILL_CACHE_DIR (the session's own without one); skips when the
    `real` extra or the model's packages are missing."""
    from specprefill_engine import gguf

    def convert(name: str) -> Path:
        if importlib.util.find_spec("gguf") is None:
            pytest.skip("the `real` extra (the gguf package) is not installed")
        with pytest.MonkeyPatch.context() as patch:
            if CALLER_CACHE_DIR:
                patch.setenv("SPECPREFILL_CACHE_DIR", CALLER_CACHE_DIR)
            try:
                return gguf.convert(name)
            except gguf.MissingPackageError as error:
                pytest.skip(f"{name}: {error}")

    return convert
