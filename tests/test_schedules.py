"""rho_from_lr against the formula, with derived and explicit lr bounds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gsam


def legacy_rho(lr, rho_max, rho_min, lr_max, lr_min):
  """big_vision's unclamped linear map of the absolute learning rate."""
  return rho_min + (rho_max - rho_min) * (lr - lr_min) / (lr_max - lr_min)


SCHEDULES = {
  "warmup_linear": (
    optax.join_schedules(
      [optax.linear_schedule(0.0, 3e-3, 100), optax.linear_schedule(3e-3, 3e-5, 900)], [100]
    ),
    3e-3,
    3e-5,
  ),
  "warmup_cosine": (optax.warmup_cosine_decay_schedule(1e-5, 1e-3, 50, 1000, 2e-5), 1e-3, 2e-5),
  "cosine_no_warmup": (optax.cosine_decay_schedule(0.1, 1000, alpha=0.01), 0.1, 0.001),
  "piecewise": (optax.piecewise_constant_schedule(0.1, {300: 0.1, 600: 0.1}), 0.1, 0.1 * 0.01),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_derived_bounds_equal_explicit_bounds(name):
  schedule, lr_max, lr_min = SCHEDULES[name]
  derived = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000, clamp=False)
  explicit = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, lr_max=lr_max, lr_min=lr_min, clamp=False)
  steps = jnp.arange(0, 1001, 7)
  np.testing.assert_allclose(
    jax.vmap(derived)(steps), jax.vmap(explicit)(steps), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("clamp", [True, False])
def test_rho_follows_formula(name, clamp):
  schedule, lr_max, lr_min = SCHEDULES[name]
  rho = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000, clamp=clamp)
  for step in (0, 1, 25, 100, 101, 500, 999, 1000):
    lr = float(schedule(step))
    expected = legacy_rho(lr, 0.6, 0.1, lr_max, lr_min)
    if clamp:
      expected = min(max(expected, 0.1), 0.6)
    assert float(rho(step)) == pytest.approx(expected, rel=1e-5, abs=1e-6), step


def test_peak_and_end_values():
  schedule, _, _ = SCHEDULES["warmup_linear"]
  rho = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000)
  assert float(rho(100)) == pytest.approx(0.6)
  assert float(rho(1000)) == pytest.approx(0.1)


def test_unclamped_goes_below_rho_min_during_warmup_and_clamped_does_not():
  schedule, _, _ = SCHEDULES["warmup_linear"]
  raw = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000, clamp=False)
  clamped = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000)
  assert float(raw(0)) < 0.1  # lr=0 is below lr_min.
  assert float(clamped(0)) == pytest.approx(0.1)
  # With rho_min=0 the legacy formula gives a negative radius: an ascent turned descent.
  raw = optax_gsam.rho_from_lr(schedule, 0.6, 0.0, num_steps=1000, clamp=False)
  assert float(raw(0)) < 0.0


@pytest.mark.parametrize("lr", [1e-3, optax.constant_schedule(1e-3)])
def test_constant_lr_gives_rho_max(lr):
  rho = optax_gsam.rho_from_lr(lr, 0.6, 0.1, num_steps=50)
  np.testing.assert_allclose(jax.vmap(rho)(jnp.arange(60)), 0.6)


def test_float_lr_needs_no_num_steps():
  assert float(optax_gsam.rho_from_lr(3e-3, 0.5, 0.1)(7)) == pytest.approx(0.5)


def test_one_bound_explicit_other_derived():
  schedule, lr_max, _ = SCHEDULES["warmup_cosine"]
  rho = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000, lr_min=0.0, clamp=False)
  assert float(rho(50)) == pytest.approx(0.6)
  assert float(rho(1000)) == pytest.approx(legacy_rho(2e-5, 0.6, 0.1, lr_max, 0.0), rel=1e-5)


def test_schedule_extrema():
  schedule, lr_max, lr_min = SCHEDULES["warmup_linear"]
  peak, final = optax_gsam.schedule_extrema(schedule, 1000)
  assert peak == pytest.approx(lr_max, rel=1e-5) and final == pytest.approx(lr_min, rel=1e-5)


def test_works_as_gsam_rho_under_jit():
  schedule, _, _ = SCHEDULES["warmup_cosine"]
  rho = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000)
  assert float(jax.jit(rho)(jnp.int32(50))) == pytest.approx(0.6)


def test_a_sweep_over_rho_max_under_vmap_equals_separate_schedules():
  """GSAM's schedule vmapped over rho_max (and a train step built on it) used to stop with "rho_max
  and rho_min must be numbers"; each lane is the schedule built with that rho_max alone."""
  schedule, lr_max, lr_min = SCHEDULES["warmup_linear"]
  sweep, rho_min = (0.05, 0.1, 0.6), 0.02
  steps = jnp.array([0, 1, 50, 100, 101, 500, 999, 1000])

  def rho_values(rho_max):
    return jax.vmap(optax_gsam.rho_from_lr(schedule, rho_max, rho_min, num_steps=1000))(steps)

  swept = jax.jit(jax.vmap(rho_values))(jnp.asarray(sweep))
  one = jax.jit(rho_values)
  for row, rho_max in zip(swept, sweep, strict=True):
    np.testing.assert_allclose(row, one(rho_max), rtol=1e-6)
    lrs = [float(schedule(step)) for step in steps]
    expected = [
      min(max(legacy_rho(lr, rho_max, rho_min, lr_max, lr_min), rho_min), rho_max) for lr in lrs
    ]
    np.testing.assert_allclose(row, expected, rtol=1e-5, atol=1e-7)

  # A whole SAM step, swept over rho_max: the same updates as one step per value.
  lr = optax.cosine_decay_schedule(0.1, 1000, alpha=0.01)  # the peak at step 0: rho_0 = rho_max
  w = jnp.array([0.3, -1.2, 0.8])
  loss_fn = lambda w: jnp.sum(jnp.cos(w) * w**2)

  def sam_updates(rho_max):
    tx = optax.chain(
      optax_gsam.sam(optax_gsam.rho_from_lr(lr, rho_max, 0.0, num_steps=1000)), optax.sgd(lr)
    )
    return tx.update(jax.grad(loss_fn)(w), tx.init(w), w, loss_fn=loss_fn)[0]

  swept = jax.jit(jax.vmap(sam_updates))(jnp.asarray(sweep))
  one = jax.jit(sam_updates)
  for row, rho_max in zip(swept, sweep, strict=True):
    np.testing.assert_allclose(row, one(rho_max), rtol=1e-6)
    g = jax.grad(loss_fn)(w)  # SAM's update from its formula: -lr * grad f(w + rho g / |g|)
    np.testing.assert_allclose(
      row, -0.1 * jax.grad(loss_fn)(w + rho_max * g / jnp.linalg.norm(g)), rtol=1e-5
    )


def test_concrete_array_bounds_are_read_and_checked_as_numbers():
  """Scalar arrays used to be refused; concrete ones are now checked as the numbers are."""
  schedule, _, _ = SCHEDULES["warmup_cosine"]
  arrays = optax_gsam.rho_from_lr(schedule, jnp.float32(0.6), np.float64(0.1), num_steps=1000)
  numbers = optax_gsam.rho_from_lr(schedule, 0.6, 0.1, num_steps=1000)
  steps = jnp.arange(0, 1001, 50)
  np.testing.assert_allclose(jax.vmap(arrays)(steps), jax.vmap(numbers)(steps), rtol=1e-6)
  assert jax.vmap(arrays)(steps).dtype == jnp.float32
  for rho_max, rho_min, match in [
    (jnp.float32(0.1), jnp.float32(0.6), r"rho_min \(.*\) must be <= rho_max"),
    (jnp.float32(-0.1), 0.0, "rho_max must be a finite number >= 0"),
    (jnp.float32(jnp.nan), 0.0, "rho_max must be a finite number >= 0"),
    (0.6, jnp.float32(jnp.inf), "rho_min must be a finite number >= 0"),
    (jnp.ones(2), 0.0, "rho_max must be a finite number >= 0 or a scalar array"),
  ]:
    with pytest.raises(ValueError, match=match):
      optax_gsam.rho_from_lr(schedule, rho_max, rho_min, num_steps=1000)


BAD = [
  (dict(rho_max=0.1, rho_min=0.6, num_steps=10), "rho_min"),
  (dict(rho_max=-0.1, rho_min=0.0, num_steps=10), "rho_max"),
  (dict(rho_max=0.6, rho_min=-0.1, num_steps=10), "rho_min"),
  (dict(rho_max=0.6, rho_min=0.1), "num_steps"),
  (dict(rho_max=0.6, rho_min=0.1, lr_max=1e-3), "num_steps"),
  (dict(rho_max=0.6, rho_min=0.1, num_steps=0), "num_steps"),
  (dict(rho_max=0.6, rho_min=0.1, num_steps=10.5), "num_steps"),
  (dict(rho_max=0.6, rho_min=0.1, lr_max=1e-4, lr_min=1e-3), "lr_min"),
  (dict(rho_max=0.6, rho_min=0.1, lr_max=-1.0, lr_min=-2.0), "lr_max"),
  (dict(rho_max=0.6, rho_min=0.1, num_steps=10, clamp="yes"), "clamp"),
]


@pytest.mark.parametrize("kwargs,name", BAD, ids=str)
def test_bad_arguments(kwargs, name):
  with pytest.raises(ValueError, match=name):
    optax_gsam.rho_from_lr(optax.linear_schedule(1e-3, 0.0, 10), **kwargs)


def test_non_finite_schedule_is_rejected():
  with pytest.raises(ValueError, match="non-finite"):
    optax_gsam.rho_from_lr(lambda c: jnp.log(c * 0.0), 0.6, 0.1, num_steps=10)


def test_rho_from_lr_with_num_steps_is_built_inside_a_trace():
  """Flax's abstract restore builds the optimizer inside jax.eval_shape / nnx.eval_shape."""
  lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50, end_value=1e-4)
  eager = optax_gsam.rho_from_lr(lr, 0.1, 0.02, num_steps=50)

  def build_and_init(w):
    tx = optax.chain(
      optax_gsam.gsam(optax_gsam.rho_from_lr(lr, 0.1, 0.02, num_steps=50)), optax.sgd(lr)
    )
    return tx.init(w)

  shapes = jax.eval_shape(build_and_init, jnp.ones(3))
  assert jax.tree.structure(shapes) == jax.tree.structure(build_and_init(jnp.ones(3)))
  inside_jit = jax.jit(lambda c: optax_gsam.rho_from_lr(lr, 0.1, 0.02, num_steps=50)(c))
  for count in (0, 5, 27, 50):
    assert float(inside_jit(count)) == pytest.approx(float(eager(count)), rel=1e-6)
  # A schedule that depends on traced values cannot be read when it is built: say what to do.
  with pytest.raises(ValueError, match="pass lr_max and lr_min"):
    jax.jit(lambda s: optax_gsam.rho_from_lr(lambda c: s * lr(c), 0.1, 0.02, num_steps=50)(0))(
      jnp.float32(1.0)
    )
  traced_ok = jax.jit(
    lambda s: optax_gsam.rho_from_lr(lambda c: s * lr(c), 0.1, 0.02, lr_max=1e-2, lr_min=1e-4)(5)
  )
  assert float(traced_ok(jnp.float32(1.0))) == pytest.approx(0.1, rel=1e-6)
