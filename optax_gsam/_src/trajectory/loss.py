"""The trajectory term shared by SAF and MESA: a KL divergence to constant target outputs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_gsam._src.core.arrays import compute_dtype
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import with_fix

# The paper's temperature for SAF and MESA (its hyperparameter table, and the authors' scripts).
DEFAULT_TEMPERATURE = 5.0


def check_temperature(temperature: Any) -> None:
  """``temperature`` > 0, with the fix in the message."""
  fix = f"The softmax divides the logits by it: pass a number > 0 (the paper uses {DEFAULT_TEMPERATURE})."
  with_fix(fix, check_positive, "temperature", temperature)


def check_weight(weight: Any) -> None:
  """The trajectory term's weight lambda >= 0."""
  fix = (
    "It is the paper's lambda, the weight of the trajectory term: pass a number >= 0 "
    "(0 turns the term off)."
  )
  with_fix(fix, check_non_negative, "weight", weight)


def _check_shapes(logits: jax.Array, target_logits: jax.Array, where: Any) -> None:
  if jnp.ndim(logits) < 1 or jnp.shape(logits) != jnp.shape(target_logits):
    raise ValueError(
      f"logits and target_logits must have the same shape (..., classes), got "
      f"{jnp.shape(logits)} and {jnp.shape(target_logits)}. The target of each example is the "
      "output recorded for the same example (SAF) or the averaged model's output (MESA)."
    )
  if where is None:
    return
  batch_shape = jnp.shape(logits)[:-1]
  if jnp.shape(where) not in ((), batch_shape):
    raise ValueError(
      f"where must be a bool scalar or have the logits' batch shape {batch_shape}, got shape "
      f"{jnp.shape(where)}: one flag per example, True where its target is valid."
    )
  if jnp.asarray(where).dtype != jnp.bool_:
    raise ValueError(
      f"where must be a bool array, got dtype {jnp.asarray(where).dtype}: pass the `valid` "
      "flags of saf_targets, or a comparison such as epoch >= start_epoch."
    )


def trajectory_loss(
  logits: jax.Array,
  target_logits: jax.Array,
  *,
  temperature: float = DEFAULT_TEMPERATURE,
  weight: float = 1.0,
  where: jax.Array | None = None,
  temperature_squared: bool = True,
) -> jax.Array:
  r"""The trajectory loss of SAF and MESA: KL from past outputs to the current ones.

  With :math:`p_i = \mathrm{softmax}(\hat y_i / \tau)` the target distribution
  of example :math:`i` (its outputs :math:`\hat y_i` Ẽ epochs before for SAF,
  the output of the averaged weights for MESA) and
  :math:`q_i = \mathrm{softmax}(f_\theta(x_i) / \tau)` the current one,

  .. math::

    L_\mathrm{tra} = \lambda \, c_\tau \, \frac{1}{|V|} \sum_{i \in V}
      \mathrm{KL}(p_i \,\|\, q_i)
      = \lambda \, c_\tau \, \frac{1}{|V|} \sum_{i \in V} \sum_k
      p_{ik} (\log p_{ik} - \log q_{ik}),

  over the examples :math:`V` whose target is valid (``where``; all of them by
  default), and 0 where none is. The target is a constant: no gradient flows
  through ``target_logits``. :math:`c_\tau = \tau^2` with
  ``temperature_squared=True`` (the authors' released training scripts
  multiply by it, as knowledge distillation does, and the paper's
  :math:`\lambda` values were tuned with it), and 1 otherwise, the term as the
  paper's equation writes it. The KL is computed in float32 at least (float64
  for float64 inputs).

  The mean runs over the valid examples of this call: summed over
  micro-batches that each average their own examples, it equals the whole
  batch's term when every micro-batch has as many valid examples (as once
  the lag has passed and every example has been seen).

  Args:
    logits: the model's outputs :math:`f_\theta(x_i)`, shape ``(..., classes)``.
    target_logits: the targets' outputs :math:`\hat y_i`, the same shape.
    temperature: :math:`\tau` > 0 (the paper: 5).
    weight: :math:`\lambda` >= 0 (the paper, on ImageNet: 0.3 for SAF, 0.8 for
      MESA).
    where: bool flags of shape ``logits.shape[:-1]``, or a bool scalar: True
      where the example's target is valid.
    temperature_squared: multiply by :math:`\tau^2`.

  Returns:
    The term, a scalar.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> logits = jnp.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    >>> past = jnp.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> loss = optax_gsam.trajectory_loss(logits, past, temperature=1.0, weight=0.5)
    >>> round(float(loss), 4)
    0.0701
    >>> float(optax_gsam.trajectory_loss(logits, past, where=jnp.array([False, False])))
    0.0

  References:
    Du et al., `Sharpness-Aware Training for Free
    <https://arxiv.org/abs/2205.14083>`_, NeurIPS 2022 (the trajectory loss of
    SAF, and MESA's).
  """
  check_temperature(temperature)
  check_weight(weight)
  if not isinstance(temperature_squared, bool):
    raise ValueError(
      f"temperature_squared must be a bool, got {temperature_squared!r}: True for the "
      "authors' scale (their lambda values), False for the term without tau^2."
    )
  logits, target_logits = jnp.asarray(logits), jnp.asarray(target_logits)
  _check_shapes(logits, target_logits, where)
  for name, array in (("logits", logits), ("target_logits", target_logits)):
    if not jnp.issubdtype(array.dtype, jnp.floating):
      raise ValueError(
        f"{name} must be floating-point logits, got {array.dtype}: pass the model's outputs "
        "(or cast them, e.g. .astype(jnp.float32))."
      )
  dtype = compute_dtype(jnp.result_type(logits.dtype, target_logits.dtype))
  tau = jnp.asarray(temperature, dtype)
  log_q = jax.nn.log_softmax(logits.astype(dtype) / tau, axis=-1)
  log_p = jax.nn.log_softmax(jax.lax.stop_gradient(target_logits).astype(dtype) / tau, axis=-1)
  p = jnp.exp(log_p)
  kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0), axis=-1)
  valid = jnp.ones(kl.shape, bool) if where is None else jnp.broadcast_to(where, kl.shape)
  count = jnp.sum(valid).astype(dtype)
  mean = jnp.sum(jnp.where(valid, kl, 0)) / jnp.maximum(count, 1)
  scale = jnp.asarray(weight, dtype) * (tau**2 if temperature_squared else 1)
  return scale * mean
