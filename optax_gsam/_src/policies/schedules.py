"""Schedules for the perturbation radius rho."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gsam._src.core.keywords import runtime_signature
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.core.validation import concrete_value


@runtime_signature
def schedule_extrema(schedule: optax.ScalarOrSchedule, num_steps: int) -> tuple[float, float]:
  """The peak of ``schedule`` over steps [0, num_steps] and its value at num_steps.

  The schedule is evaluated at every integer step, so warmup, cosine, piecewise
  and joined schedules are all handled exactly; a float is a constant schedule.
  It is evaluated at once, also inside a trace (``jax.eval_shape`` of a function
  that builds the optimizer, as Flax's checkpoint restore does).

  Args:
    schedule: a float or an ``optax.Schedule``.
    num_steps: the last step of training (inclusive).

  Returns:
    ``(peak, final)`` as Python floats.
  """
  if not callable(schedule):
    return float(schedule), float(schedule)
  # Evaluated now even under a trace (jax.eval_shape, nnx.eval_shape of an optimizer built
  # inside), where the schedule would otherwise be staged out and have no value.
  with jax.ensure_compile_time_eval():
    steps = jnp.arange(num_steps + 1, dtype=jnp.int32)
    values = jax.jit(jax.vmap(schedule))(steps)
  try:
    values = np.asarray(values, dtype=np.float64)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError) as error:
    raise ValueError(
      "schedule_extrema evaluates the schedule when the rho schedule is built, and this "
      "schedule depends on traced values; pass lr_max and lr_min to rho_from_lr instead."
    ) from error
  if not np.all(np.isfinite(values)):
    raise ValueError("lr_schedule returned a non-finite value within [0, num_steps].")
  return float(values.max()), float(values[-1])


@runtime_signature
def rho_from_lr(
  lr_schedule: optax.ScalarOrSchedule,
  rho_max: float | jax.Array,
  rho_min: float | jax.Array,
  *,
  num_steps: int | None = None,
  lr_max: float | None = None,
  lr_min: float | None = None,
  clamp: bool = True,
) -> optax.Schedule:
  r"""A rho schedule that follows the learning-rate schedule, as in GSAM.

  .. math::

    \rho_t = \rho_{\min} + (\rho_{\max} - \rho_{\min})
             \frac{\eta_t - \eta_{\min}}{\eta_{\max} - \eta_{\min}}

  where :math:`\eta_t` is the learning rate at step :math:`t`. When ``lr_max``
  or ``lr_min`` is not given it is read off the schedule itself: ``lr_max`` is
  its peak over ``[0, num_steps]`` and ``lr_min`` its value at ``num_steps``.
  Configs therefore no longer repeat the learning rate, which is how a relative
  schedule once got mixed with absolute bounds and blew the perturbation up by
  300x. A constant learning rate gives :math:`\rho_{\max}` at every step.

  With ``clamp=True`` (default) rho stays in :math:`[\rho_{\min}, \rho_{\max}]`;
  the raw formula drops below :math:`\rho_{\min}`, even below zero, while the
  learning rate warms up from below ``lr_min``. ``clamp=False`` reproduces the
  legacy big_vision formula exactly.

  Args:
    lr_schedule: the learning rate, a float or any ``optax.Schedule`` (the same
      object given to the optimizer, so both read the same step).
    rho_max: rho at the peak learning rate, a number or a scalar array. A
      traced scalar (a sweep over rho under ``jax.vmap``) is accepted; only
      concrete values can be checked here (finite, ``rho_max >= rho_min >= 0``).
    rho_min: rho at the final learning rate, likewise.
    num_steps: total training steps; needed unless both ``lr_max`` and
      ``lr_min`` are given.
    lr_max: override for the peak learning rate.
    lr_min: override for the final learning rate.
    clamp: keep rho within ``[rho_min, rho_max]``.

  Returns:
    An ``optax.Schedule`` mapping the step count to rho.

  Example:
    >>> import optax, optax_gsam
    >>> lr = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000, end_value=1e-5)
    >>> rho = optax_gsam.rho_from_lr(lr, rho_max=0.6, rho_min=0.1, num_steps=1000)
    >>> round(float(rho(100)), 4), round(float(rho(1000)), 4)
    (0.6, 0.1)

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.
  """
  check_non_negative("rho_max", rho_max)  # a traced scalar (a sweep under jax.vmap) passes
  check_non_negative("rho_min", rho_min)
  low, high = concrete_value(rho_min), concrete_value(rho_max)  # None where traced
  if low is not None and high is not None and low > high:
    raise ValueError(f"rho_min ({rho_min}) must be <= rho_max ({rho_max}).")
  if not isinstance(clamp, bool):
    raise ValueError(f"clamp must be a bool, got {clamp!r}.")
  check_non_negative("lr_schedule", lr_schedule, allow_schedule=True)
  for name, value in (("lr_max", lr_max), ("lr_min", lr_min)):
    if value is not None:
      check_non_negative(name, value)
  check_positive_int("num_steps", num_steps, allow_none=True)

  if lr_max is None or lr_min is None:
    if callable(lr_schedule) and num_steps is None:
      raise ValueError(
        "rho_from_lr needs num_steps to derive lr_max/lr_min from the schedule; "
        "pass num_steps, or both lr_max and lr_min."
      )
    peak, final = schedule_extrema(lr_schedule, num_steps or 0)
    lr_max = peak if lr_max is None else lr_max
    lr_min = final if lr_min is None else lr_min
  lr_max, lr_min = float(lr_max), float(lr_min)
  if lr_min > lr_max:
    raise ValueError(f"lr_min ({lr_min}) must be <= lr_max ({lr_max}).")
  lr_range = lr_max - lr_min
  rho_range = rho_max - rho_min

  def schedule(count):
    if lr_range == 0.0:  # Constant learning rate: the peak radius throughout.
      return jnp.full(jnp.shape(count), rho_max, jnp.float32)
    lr = lr_schedule(count) if callable(lr_schedule) else lr_schedule
    lr = jnp.asarray(lr)
    lr = lr.astype(jnp.promote_types(lr.dtype, jnp.float32))
    rho = rho_min + rho_range * (lr - lr_min) / lr_range
    return (jnp.clip(rho, rho_min, rho_max) if clamp else rho).astype(lr.dtype)

  return schedule


def value_at(hyperparameter: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
  """A float-or-schedule hyperparameter at step ``count``, as an array."""
  return jnp.asarray(hyperparameter(count) if callable(hyperparameter) else hyperparameter)
