import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
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
