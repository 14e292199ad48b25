"""The automatic policy (specprefill=None): engage only where the predicted gain
beats the margin, from costs measured on this machine."""

import pytest

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.policy import CostModel, predict
from specprefill_engine.loading import DEMO_TARGET

pytestmark = pytest.mark.timeout(600)


def test_the_cost_fit_recovers_a_linear_plus_quadratic_law():
    costs = CostModel()
    for length in (128, 512, 2048, 8192):
        costs.observe("target", length, 2e-4 * length + 3e-8 * length**2)
        costs.observe("draft", length, 4e-5 * length + 1e-8 * length**2)
    assert costs.predict("target", 32768) == pytest.approx(2e-4 * 32768 + 3e-8 * 32768**2, rel=1e-6)
    prediction = predict(costs, 32768, 0, 0, 3277)
    assert prediction.dense_s > prediction.specprefill_s
    # with most of the prompt cached for the target only, dense wins
    assert predict(costs, 32768, 32000, 0, 3277).gain < 1


def test_on_this_cpu_the_policy_engages_at_2k_and_says_why(demo_pair):
    _, _, tokenizer = demo_pair
    with Engine() as engine:
        result = engine.generate_sync(make_case(tokenizer, 30, "passkey", 2000).messages,
                                      max_tokens=6)
    report = result.specprefill
    assert report.engaged and report.reason.startswith("policy: predicted")
    assert report.predicted_dense_s > report.predicted_specprefill_s > 0


def test_a_draft_as_costly_as_the_target_is_never_engaged(demo_pair):
    _, _, tokenizer = demo_pair
    with Engine(model=str(DEMO_TARGET), draft=str(DEMO_TARGET)) as engine:
        result = engine.generate_sync(make_case(tokenizer, 31, "passkey", 1500).messages,
                                      max_tokens=6)
        forced = engine.generate_sync(make_case(tokenizer, 32, "passkey", 1500).messages,
                                      max_tokens=6, specprefill=True)
    assert not result.specprefill.engaged
    assert "policy" in result.specprefill.reason and "<" in result.specprefill.reason
    assert forced.specprefill.engaged and forced.specprefill.reason == "requested"
