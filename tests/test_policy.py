"""The automatic policy (specprefill=None): engage only where the predicted gain
beats the margin, from the models' shapes refined by the prefills the engine runs."""

import pytest

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.engine.policy import CostModel, Shape, predict
from specprefill_engine.loading import DEMO_TARGET

pytestmark = pytest.mark.timeout(600)


def test_the_cost_fit_recovers_a_weights_plus_attention_law():
    target, draft = Shape(8_000_000_000, 36 * 32 * 128), Shape(600_000_000, 28 * 16 * 128)
    costs = CostModel(target, draft, warm={"target", "draft"})

    def law(shape, rate_w, rate_a, tokens, cached):
        weights, attention = shape.flops(tokens, cached)
        return rate_w * weights + rate_a * attention

    for tokens, cached in ((128, 0), (512, 0), (2048, 2048), (8192, 0)):
        costs.observe("target", tokens, cached, law(target, 1e-14, 3e-14, tokens, cached))
        costs.observe("draft", tokens, cached, law(draft, 5e-14, 9e-14, tokens, cached))
    expected = law(target, 1e-14, 3e-14, 32768, 0)
    assert costs.predict("target", 32768) == pytest.approx(expected, rel=1e-6)
    prediction = predict(costs, 32768, 0, 0, 3277)
    assert prediction.dense_s > prediction.specprefill_s
    # with most of the prompt cached for the target only, dense wins
    assert predict(costs, 32768, 32000, 0, 3277).gain < 1


def test_before_any_prefill_the_flop_ratio_decides():
    costs = CostModel(Shape(1_000_000, 0), Shape(100_000, 0))
    assert predict(costs, 4000, 0, 0, 1000).gain == pytest.approx(1 / (0.1 + 0.25))
    costs.observe("target", 1000, 0, 60.0)  # a first prefill (a GPU compiles): not counted
    assert predict(costs, 4000, 0, 0, 1000).gain == pytest.approx(1 / (0.1 + 0.25))
    costs.observe("target", 1000, 0, 2.0)  # one observation sets the rate of both models
    assert costs.predict("draft", 1000) == pytest.approx(0.2)


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


def test_the_first_request_runs_no_prefill_of_its_own_beyond_a_later_ones(demo_pair):
    """No calibration on the request path: the target runs as many forwards for a
    process's first request under the policy as for the same request later (counted
    through the target's calls; on 0945836 the first ran the timed calibration too)."""
    _, _, tokenizer = demo_pair
    messages = make_case(tokenizer, 33, "passkey", 2000).messages
    with Engine() as engine:
        model = engine._scheduler.runtime.model
        calls = []
        forward = type(model).__call__

        def counted(self, *args, **kwargs):
            if self is model:
                calls.append(1)
            return forward(self, *args, **kwargs)

        type(model).__call__ = counted
        try:
            first = engine.generate_sync(messages, max_tokens=4, ignore_eos=True,
                                         cache_prompt=False)
            on_first, calls[:] = len(calls), []
            later = engine.generate_sync(messages, max_tokens=4, ignore_eos=True,
                                         cache_prompt=False)
        finally:
            type(model).__call__ = forward
    assert first.specprefill.engaged == later.specprefill.engaged
    assert on_first == len(calls) > 0
