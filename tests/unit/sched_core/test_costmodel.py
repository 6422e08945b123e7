"""The step-time model and its online fit (pure logic: no scheduler, no files)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sched_core.costmodel import COEFFICIENTS, DRIFT_FACTOR, StepModel, step_features
from sched_core.types import PathConfig, SchedulerConfig

# A GPU-like prior: launch-bound, cheap marginal tokens (the magnitudes of the derived profile).
PRIOR = PathConfig(decode_launch=0.01, decode_seq=4e-5, kv_token=3e-8, prefill_launch=0.01,
                   prefill_token=1e-6, max_batch=64, step_tokens=256)
CONFIG = SchedulerConfig(cpu=PRIOR, gpu=PRIOR)

Record = tuple[int, int, int, float]


def truth(theta: tuple[float, ...], prefill: int, seqs: int, kv: int) -> float:
    return sum(t * x for t, x in zip(theta, step_features(prefill, seqs, kv), strict=True))


def mixed_steps(rng: random.Random, theta: tuple[float, ...], n: int, noise: float = 0.0) -> list[Record]:
    """Steps of a busy worker: decode-only, prefill-only and mixed, of varied sizes."""
    out = []
    for _ in range(n):
        seqs = rng.choice((0, 1, 4, 16, 64)) if rng.random() < 0.8 else 0
        prefill = rng.choice((0, 32, 256)) if seqs else rng.choice((16, 100, 256))
        kv = seqs * rng.randint(16, 2048)
        out.append((prefill, seqs, kv, truth(theta, prefill, seqs, kv) * (1.0 + noise * rng.gauss(0, 1))))
    return out


def prior_theta(p: PathConfig = PRIOR) -> tuple[float, ...]:
    return tuple(getattr(p, name) for name in COEFFICIENTS)


def test_the_prior_alone_is_the_fit() -> None:
    model = StepModel(PRIOR, CONFIG)
    assert model.coefficients() == prior_theta()
    assert model.observations == 0
    assert model.predict(0, 2, 100) == pytest.approx(0.01 + 8e-5 + 3e-6)


def test_step_features_follow_the_two_forwards() -> None:
    assert step_features(0, 0, 0) == (0.0, 0.0, 0.0, 0.0, 0.0)
    assert step_features(200, 3, 900) == (1.0, 3.0, 900.0, 1.0, 200.0)
    assert step_features(0, 3, 900)[3:] == (0.0, 0.0)


@given(theta=st.tuples(*[st.floats(0.0, 1.0) for _ in COEFFICIENTS]), seed=st.integers(0, 2**16))
@example(theta=(1.0, 0.0, 0.0, 0.0, 0.0), seed=3)  # solves used to alternate between two fits here
def test_noiseless_data_from_any_non_negative_coefficients_are_recovered(
        theta: tuple[float, ...], seed: int) -> None:
    # Scale to realistic magnitudes: launches up to 50 ms, per-seq 5 ms, per-token 10 µs.
    theta = tuple(t * s for t, s in zip(theta, (0.05, 5e-3, 1e-7, 0.05, 1e-5), strict=True))
    if sum(theta) == 0.0:
        return
    model = StepModel(PRIOR, SchedulerConfig(cpu=PRIOR, gpu=PRIOR, prior_weight=1e-6, fit_forgetting=1.0))
    rng = random.Random(seed)
    records = [r for r in mixed_steps(rng, theta, 400) if r[3] > 0.0]
    for i in range(0, len(records), 50):
        model.observe_many(records[i:i + 50])
    seen_prefill = any(r[0] and not r[1] for r in records)  # a forward seen on its own
    seen_decode = any(r[1] and not r[0] for r in records)
    for prefill, seqs, kv in ((0, 1, 50), (256, 0, 0), (64, 32, 32 * 1000), (0, 64, 64 * 2000)):
        if (prefill and not seen_prefill) or (seqs and not seen_decode):
            continue  # a forward that alone takes no time left no record of itself
        expect = truth(theta, prefill, seqs, kv)
        assert model.predict(prefill, seqs, kv) == pytest.approx(expect, rel=1e-3, abs=1e-5)
    # (abs: a forward whose true time is exactly 0 is fitted to a few µs, because relative
    # errors are measured against at least 1e-3 of the prior's prediction.)


def test_same_shape_steps_move_only_what_they_identify() -> None:
    # A quiet worker: always one sequence decoding, no prefill, 50% slower than the prior says.
    model = StepModel(PRIOR, CONFIG)
    y = 1.5 * truth(prior_theta(), 0, 1, 300)
    model.observe_many([(0, 1, 300, y)] * 2000)
    fitted = dict(zip(COEFFICIENTS, model.coefficients(), strict=True))
    assert model.predict(0, 1, 300) == pytest.approx(y, rel=1e-2)
    # The intercept takes the difference; the slopes stay near their priors. The KV slope moves
    # most (~19%): its term is only 4% of a typical full decode step, so ten typical steps hold
    # it loosely (docs/scheduling.md §4, "Limits").
    assert fitted["decode_launch"] > 1.45 * PRIOR.decode_launch
    assert fitted["decode_seq"] == pytest.approx(PRIOR.decode_seq, rel=0.05)
    assert fitted["kv_token"] == pytest.approx(PRIOR.kv_token, rel=0.25)
    # ...and the prefill forward, never seen, stays exactly at its prior.
    assert fitted["prefill_launch"] == pytest.approx(PRIOR.prefill_launch, rel=1e-9)
    assert fitted["prefill_token"] == pytest.approx(PRIOR.prefill_token, rel=1e-9)


def test_many_identical_steps_do_not_turn_a_slope_into_an_intercept() -> None:
    # Full batches of one shape, with noise, that agree with the prior on average: however many
    # arrive, the per-sequence slope must not drift into the launch cost (or the reverse).
    rng = random.Random(7)
    model = StepModel(PRIOR, CONFIG)
    y = truth(prior_theta(), 0, 64, 64 * 512)
    for _ in range(40):
        model.observe_many([(0, 64, 64 * 512, y * (1.0 + 0.1 * rng.gauss(0, 1))) for _ in range(500)])
    fitted = dict(zip(COEFFICIENTS, model.coefficients(), strict=True))
    assert model.observations == 20_000
    for name in ("decode_launch", "decode_seq", "kv_token"):
        assert fitted[name] == pytest.approx(getattr(PRIOR, name), rel=0.05), name
    # The same with one sequence: a one-sequence step cannot tell launch from slope either.
    model = StepModel(PRIOR, CONFIG)
    y = truth(prior_theta(), 0, 1, 512)
    for _ in range(40):
        model.observe_many([(0, 1, 512, y * (1.0 + 0.1 * rng.gauss(0, 1))) for _ in range(500)])
    fitted = dict(zip(COEFFICIENTS, model.coefficients(), strict=True))
    assert fitted["decode_seq"] == pytest.approx(PRIOR.decode_seq, rel=0.05)
    assert fitted["decode_launch"] == pytest.approx(PRIOR.decode_launch, rel=0.05)


def test_a_step_twenty_times_slower_than_predicted_barely_moves_the_fit() -> None:
    rng = random.Random(3)
    theta = (0.02, 6e-5, 5e-8, 0.015, 2e-6)  # the truth differs from the prior
    model = StepModel(PRIOR, CONFIG)
    for _ in range(10):
        model.observe_many(mixed_steps(rng, theta, 50, noise=0.05))
    shapes = ((0, 1, 300), (0, 64, 64 * 1000), (256, 0, 0), (192, 64, 64 * 500))
    before = [model.predict(*s) for s in shapes]
    slow = 20.0 * model.predict(0, 16, 16 * 800)
    model.observe(0, 16, 16 * 800, slow)  # a GC pause
    after = [model.predict(*s) for s in shapes]
    for b, a in zip(before, after, strict=True):
        assert a == pytest.approx(b, rel=0.01)
    # Whereas a plain least-squares fit would have moved by ~20/500 of the outlier: 4%.
    assert model.predict(0, 16, 16 * 800) < 1.01 * slow / 20.0


def test_a_persistent_change_is_learned_despite_the_outlier_guard() -> None:
    # The worker becomes 3× slower for good (a slower device behind the same pool): that is no
    # outlier, and the fit follows it as fast as it forgets (memory ≈ 1000 steps: after 8000,
    # 0.999**8000 ≈ 3e-4 of the old worker's weight is left).
    rng = random.Random(5)
    model = StepModel(PRIOR, CONFIG)
    theta = prior_theta()
    for _ in range(20):
        model.observe_many(mixed_steps(rng, theta, 100, noise=0.05))
    slower = tuple(3.0 * t for t in theta)
    for _ in range(80):
        model.observe_many(mixed_steps(rng, slower, 100, noise=0.05))
    for shape in ((0, 1, 300), (0, 64, 64 * 1000), (256, 0, 0)):
        assert model.predict(*shape) == pytest.approx(truth(slower, *shape), rel=0.05)


def test_coefficients_stay_non_negative() -> None:
    model = StepModel(PRIOR, SchedulerConfig(cpu=PRIOR, gpu=PRIOR, prior_weight=1e-3))
    # Steps that get faster with more sequences: the per-sequence slope clamps at zero.
    model.observe_many([(0, n, n * 100, max(1e-4, 0.05 - 0.0007 * n)) for n in range(1, 65)] * 20)
    theta = model.coefficients()
    assert min(theta) >= 0.0
    assert theta[1] == 0.0 and theta[0] > 0.0


@given(st.lists(st.tuples(st.integers(0, 512), st.integers(0, 64), st.integers(0, 10**5),
                          st.floats(0.0, 10.0)), max_size=80))
def test_any_records_leave_finite_non_negative_coefficients(records: list[Record]) -> None:
    records = [(p, n, kv if n else 0, y) for p, n, kv, y in records]
    model = StepModel(PRIOR, CONFIG)
    model.observe_many(records)
    assert all(0.0 <= t < float("inf") for t in model.coefficients())
    assert model.observations == sum(1 for p, n, _, _ in records if p or n)


def test_empty_steps_are_skipped_and_bad_records_refused() -> None:
    model = StepModel(PRIOR, CONFIG)
    model.observe(0, 0, 0, 0.5)
    assert model.observations == 0 and model.coefficients() == prior_theta()
    for bad in ((-1, 1, 10, 0.1), (0, 1, 10, -0.1), (0, 1, 10, float("nan")), (0, 1, -5, 0.1),
                (10, 0, 5, 0.1)):
        with pytest.raises(ValueError, match="bad step record"):
            model.observe(*bad)


def test_the_fit_is_deterministic() -> None:
    records = mixed_steps(random.Random(11), (0.02, 6e-5, 5e-8, 0.015, 2e-6), 300, noise=0.2)
    a, b = StepModel(PRIOR, CONFIG), StepModel(PRIOR, CONFIG)
    for i in range(0, 300, 64):
        a.observe_many(records[i:i + 64])
        b.observe_many(records[i:i + 64])
    assert a.coefficients() == b.coefficients()


def test_a_refit_of_64_records_is_cheap() -> None:
    # Measured ≈ 0.2 ms per call on a shared 2-core VM (CPython 3.11); the bound leaves room.
    records = mixed_steps(random.Random(2), (0.02, 6e-5, 5e-8, 0.015, 2e-6), 64, noise=0.1)
    model = StepModel(PRIOR, CONFIG)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        model.observe_many(records)
        best = min(best, time.perf_counter() - t0)
    assert best < 1e-3


def test_path_config_validates_its_priors() -> None:
    with pytest.raises(ValueError, match="must take time"):
        PathConfig(0.0, 0.0, 1e-8, 0.01, 1e-6, max_batch=4)
    with pytest.raises(ValueError, match="must take time"):
        PathConfig(0.01, 1e-5, 1e-8, 0.0, 0.0, max_batch=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        PathConfig(-0.01, 1e-5, 1e-8, 0.01, 1e-6, max_batch=4)
    with pytest.raises(ValueError, match="at least 1"):
        PathConfig(0.01, 1e-5, 1e-8, 0.01, 1e-6, max_batch=4, step_tokens=0)
    assert PathConfig(0.0, 1e-5, 1e-8, 0.0, 1e-6, max_batch=1).step_tokens == 256


def test_a_new_prior_moves_the_fit_and_keeps_the_data() -> None:
    """A worker that measured itself re-seeds the model: alone, the prior is the fit; with
    records, the directions they identify stay where the data put them."""
    model = StepModel(PRIOR, CONFIG)
    measured = PathConfig(decode_launch=0.02, decode_seq=8e-5, kv_token=6e-8, prefill_launch=0.03,
                          prefill_token=2e-6, max_batch=64, step_tokens=256)
    model.reprior(measured)
    assert model.coefficients() == (0.02, 8e-5, 6e-8, 0.03, 2e-6)
    model = StepModel(PRIOR, CONFIG)
    model.observe_many([(0, 32, 32 * 512, 0.05)] * 200)  # one decode shape, many times
    before = model.predict(0, 32, 32 * 512)
    model.reprior(measured)
    assert model.predict(0, 32, 32 * 512) == pytest.approx(before, rel=0.05)
    assert model.coefficients()[3:] == pytest.approx((0.03, 2e-6), rel=0.05)  # prefill: the new prior


def _history(model: StepModel, rng: random.Random, theta: tuple[float, ...], steps: int,
             noise: float = 0.05) -> None:
    for _ in range(steps // 50):
        model.observe_many(mixed_steps(rng, theta, 50, noise=noise))


def _worst_error(model: StepModel, theta: tuple[float, ...]) -> float:
    shapes = ((0, 1, 300), (0, 64, 64 * 1000), (256, 0, 0), (192, 64, 64 * 500))
    return max(abs(model.predict(*s) / truth(theta, *s) - 1.0) for s in shapes)


def test_a_worker_whose_speed_moves_as_a_whole_is_followed_within_tens_of_steps() -> None:
    """Another program takes the CPU (2.2x slower), then leaves it: after a long history at one
    speed, the model is re-anchored within a few telemetry entries each way, where forgetting
    alone would take thousands of steps."""
    rng = random.Random(17)
    model = StepModel(PRIOR, CONFIG)
    theta = prior_theta()
    _history(model, rng, theta, 3000)
    assert model.scale == 1.0 and _worst_error(model, theta) < 0.05
    slow = tuple(2.2 * t for t in theta)
    for _ in range(3):
        model.observe_many(mixed_steps(rng, slow, 16, noise=0.05))
    assert model.scale == pytest.approx(2.2, rel=0.1)
    assert _worst_error(model, slow) < 0.12
    for _ in range(3):
        model.observe_many(mixed_steps(rng, theta, 16, noise=0.05))
    assert model.scale == pytest.approx(1.0, rel=0.1)
    assert _worst_error(model, theta) < 0.12


def test_noise_without_a_change_never_re_anchors() -> None:
    rng = random.Random(23)
    model = StepModel(PRIOR, CONFIG)
    theta = (0.02, 6e-5, 5e-8, 0.015, 2e-6)  # not the prior: the fit moves there by itself
    _history(model, rng, theta, 400, noise=0.2)
    anchored = model.scale
    _history(model, rng, theta, 5000, noise=0.2)
    assert model.scale == anchored
    assert _worst_error(model, theta) < 0.1


def test_re_anchoring_keeps_the_shape_the_fit_learnt() -> None:
    # The fit learnt that prefill is cheaper than its prior; the machine then slows down 3x on
    # decode steps alone (all it runs for a while): the learnt prefill is scaled with the rest.
    rng = random.Random(29)
    model = StepModel(PRIOR, CONFIG)
    theta = (0.01, 4e-5, 3e-8, 0.005, 5e-7)
    _history(model, rng, theta, 2000)
    prefill = model.predict(256, 0, 0)
    assert prefill == pytest.approx(truth(theta, 256, 0, 0), rel=0.05)
    for _ in range(2):
        model.observe_many([(0, 16, 16 * 500, 3.0 * truth(theta, 0, 16, 16 * 500))] * 16)
    assert model.scale == pytest.approx(3.0, rel=0.05)
    assert model.predict(256, 0, 0) == pytest.approx(3.0 * prefill, rel=0.05)


def test_a_new_prior_that_the_latest_steps_contradict_is_re_anchored_at_once() -> None:
    """A restart on a profile measured while the machine was busy: the worker's warm-up steps
    say it runs 17x faster, and the model follows them whatever order they come in."""
    slow = PathConfig(**{**{name: 17.0 * getattr(PRIOR, name) for name in COEFFICIENTS},
                         "max_batch": PRIOR.max_batch, "step_tokens": PRIOR.step_tokens})
    steps = [(32, 0, 0, truth(prior_theta(), 32, 0, 0))] + [(0, 1, 32 + i, truth(prior_theta(), 0, 1, 32 + i))
                                                           for i in range(16)]
    first = StepModel(slow, CONFIG)
    first.observe_many(steps)  # the steps, then...
    assert 1 / 17 / DRIFT_FACTOR < first.scale < DRIFT_FACTOR / 17
    second = StepModel(PRIOR, CONFIG)
    second.observe_many(steps)
    second.reprior(slow)  # ...or the slow profile after them
    for model in (first, second):
        assert model.predict(0, 1, 40) == pytest.approx(truth(prior_theta(), 0, 1, 40), rel=0.1)
        assert model.predict(256, 0, 0) == pytest.approx(truth(prior_theta(), 256, 0, 0), rel=0.1)


def test_a_prior_held_loosely_gives_way_to_the_data_sooner() -> None:
    measured = PathConfig(decode_launch=0.02, decode_seq=8e-5, kv_token=6e-8, prefill_launch=0.03,
                          prefill_token=2e-6, max_batch=64, step_tokens=256)
    firm, loose = StepModel(PRIOR, CONFIG), StepModel(PRIOR, CONFIG)
    firm.reprior(measured)
    loose.reprior(measured, trust=0.1)
    y = 1.2 * truth(prior_theta(measured), 0, 8, 8 * 256)  # 20 % slower: no drift, the fit's own
    for model in (firm, loose):
        model.observe_many([(0, 8, 8 * 256, y)] * 5)
    assert abs(loose.predict(0, 8, 8 * 256) / y - 1) < abs(firm.predict(0, 8, 8 * 256) / y - 1)
    with pytest.raises(ValueError, match="trust"):
        firm.reprior(measured, trust=0.0)


def test_a_whole_prompt_s_attention_is_priced_apart_and_scales_with_the_worker() -> None:
    prior = PathConfig(decode_launch=0.01, decode_seq=1e-3, kv_token=1e-6, prefill_launch=0.02,
                       prefill_token=1e-3, max_batch=8, step_tokens=64, prefill_attention=2e-7)
    model = StepModel(prior, SchedulerConfig(cpu=prior, gpu=prior))
    assert model.attention == 2e-7
    alone = 0.02 + 1e-3 * 2048 + 2e-7 * 2048**2  # the prior's whole 2,048-token prompt: exact
    model.observe_many([(2048, 0, 0, alone)] * 20)
    assert model.scale == 1.0
    assert model.predict(2048, 0, 0) == pytest.approx(alone - 2e-7 * 2048**2, rel=1e-6)
    model.observe_many([(2048, 0, 0, 2.0 * alone)] * 16)  # twice as slow, attention included
    assert model.scale == pytest.approx(2.0, rel=0.05)
    assert model.attention == pytest.approx(4e-7, rel=0.05)
