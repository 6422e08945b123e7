"""common.stepmodel: the step-time formulas, their fit, and the scheduler's prior made of it."""

from __future__ import annotations

import pytest

from common.stepmodel import decode_s, fit, formula_points, mixed_error, prefill_s, serving, step_model, summary

FIT = {"prefill": {"a": 0.004, "b": 6e-4, "b2": 1e-7}, "decode": {"c": 0.02, "d": 5e-4, "e": 2e-7}}
PREFILL_GRID = [(1, 32), (1, 512), (1, 2048), (4, 128), (4, 1024), (16, 64)]
DECODE_GRID = [(n, k) for k in (64, 512) for n in (1, 4, 16)]


def test_the_fit_recovers_the_formulas_it_is_fed() -> None:
    found = fit(formula_points(FIT, PREFILL_GRID, DECODE_GRID))
    for part, terms in FIT.items():
        for name, value in terms.items():
            assert found[part][name] == pytest.approx(value, rel=1e-6), (part, name)
    assert found["noise_cv"] == pytest.approx(0.0, abs=1e-9)


def test_the_prior_maps_each_term_once_with_attention_apart() -> None:
    prior = step_model(FIT, max_batch=8, step_tokens=256)
    assert prior["prefill_launch"] == FIT["prefill"]["a"] and prior["prefill_token"] == FIT["prefill"]["b"]
    assert prior["prefill_attention"] == FIT["prefill"]["b2"]
    assert (prior["decode_launch"], prior["decode_seq"], prior["kv_token"]) == (0.02, 5e-4, 2e-7)
    # a decode step of 4 sequences of 100 KV tokens, as the prior prices it and as the formula does
    step = prior["decode_launch"] + prior["decode_seq"] * 4 + prior["kv_token"] * 400
    assert mixed_error(prior, [[0, 4, 400, step + FIT["prefill"]["a"]]]) == pytest.approx(0.0, abs=1e-12)
    assert step == pytest.approx(decode_s(FIT, 4, 100))


def test_the_operators_figures() -> None:
    figures = summary(FIT)
    assert figures["prefill_tokens_per_s"] == pytest.approx(512 / prefill_s(FIT, 1, 512))
    assert figures["decode_step_ms"] == pytest.approx(1000 * decode_s(FIT, 1, 256))


def test_a_profile_as_served_prices_steps_as_the_live_fit_does() -> None:
    measured = {"name": "cpu-x", "pool": "cpu", "fit": {**FIT, "noise_cv": 0.07}, "step_model": {"step_tokens": 64}}
    learnt = {"decode_launch": 0.05, "decode_seq": 1e-3, "kv_token": 4e-7, "prefill_launch": 0.01,
              "prefill_token": 9e-4, "prefill_attention": 2e-7}
    served = serving(measured, learnt, 1200)
    step = learnt["decode_launch"] + learnt["decode_seq"] * 4 + learnt["kv_token"] * 4 * 100
    assert decode_s(served["fit"], 4, 100) == pytest.approx(step)
    prompt = learnt["prefill_launch"] + learnt["prefill_token"] * 300 + learnt["prefill_attention"] * 300**2
    assert prefill_s(served["fit"], 1, 300) == pytest.approx(prompt)
    assert decode_s(measured["fit"], 4, 100) != pytest.approx(step)  # (the measured one prices it otherwise)
    # what the simulator reads besides the formulas stays the measured profile's
    assert served["fit"]["noise_cv"] == 0.07 and served["step_model"] == {"step_tokens": 64}
    assert served["pool"] == "cpu" and served["learnt_steps"] == 1200 and "1200 live steps" in served["source"]
