import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# a folder of real weights converted earlier (SPECPREFILL_TEST_MODELS, read only):
# converting the 1.5B model again takes minutes; without it they convert into the
# session's own cache directory
TEST_MODELS = os.environ.get("SPECPREFILL_TEST_MODELS")
# what the engine keeps across processes (the policy's observed costs) starts empty here,
# so no test depends on what an earlier run measured; removed when the process ends (it
# holds the real models converted for the session: gigabytes)
os.environ["SPECPREFILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="specprefill-tests-")
atexit.register(shutil.rmtree, os.environ["SPECPREFILL_CACHE_DIR"], ignore_errors=True)
# pytest-xdist's workers share the machine's cores: each BLAS gets its share of them, so
# the workers' matmul threads do not take turns on the same cores (read as BLAS loads)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))

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


def convert_real(name: str) -> Path:
    """`gguf.convert(name)`: a real model's folder, taken from SPECPREFILL_TEST_MODELS when
    converted there, else converted into the session's cache directory; skips when the
    `real` extra or the model's packages are missing."""
    from specprefill_engine import gguf

    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the `real` extra (the gguf package) is not installed")
    if name in gguf.MODELS and TEST_MODELS:
        folder = Path(TEST_MODELS) / gguf.MODELS[name].folder
        if (folder / "model.safetensors").is_file():
            return folder
    try:
        return gguf.convert(name)
    except gguf.MissingPackageError as error:
        pytest.skip(f"{name}: {error}")


@pytest.fixture
def converted():
    return convert_real
