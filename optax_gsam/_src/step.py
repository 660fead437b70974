"""The stages of one gsam/sam update, each a module-level function.

1. hyperparameters at the step: :func:`hyperparams_at`;
2. the policy's choice between the full and the cheap step: :func:`decide`
   and :func:`choose`;
3. the full step of one replica (perturb, evaluate the loss, decompose):
   :func:`full_replica`;
4. the cheap step of one replica: :func:`cheap_replica`;
5. the reduction: a pmean over ``axis_name`` (:func:`reduce_replica`) or the
   average of a scan over ``num_groups`` (:func:`average_groups`);
6. the new state, after :func:`guard_nonfinite` (in ``sharpness.py``).

A *replica* is one device under ``axis_name``, one emulated group under
``num_groups``, or the whole step on a single device.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from collections.abc import Hashable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src import perturbation as pert
from optax_gsam._src.policies import SharpnessPolicy
from optax_gsam._src.user_functions import ValueAndGradFn
from optax_gsam._src.user_functions import scalar_loss

NUM_DIAGNOSTICS = 5  # perturbed_loss, surrogate_gap, cosine, clean_grad_norm, perturbed_grad_norm


class Settings(NamedTuple):
  """The static configuration of one transform, validated by its factory."""

  alpha: Any
  eps: Any
  adaptive: pert.Adaptive
  minimize_fp: bool
  sync_perturbation: bool
  axis_name: Hashable | tuple[Hashable, ...] | None
  num_groups: int | None
  policy: SharpnessPolicy
  on_nonfinite: str

  @property
  def per_device(self) -> bool:
    return self.axis_name is not None and not self.sync_perturbation

  @property
  def synchronized(self) -> bool:
    return self.axis_name is not None and self.sync_perturbation


class StepHyperparams(NamedTuple):
  """Stage 1: the hyperparameters at this step."""

  rho: jax.Array
  rho_positive: bool | jax.Array  # a Python bool when rho is a static number
  reuse_weight: jax.Array | None  # only for policies that reuse a stored direction


class ReplicaResult(NamedTuple):
  """What one replica contributes; ``None`` fields are not reduced (cheap steps)."""

  direction: optax.Updates
  correction: optax.Updates | None = None
  diagnostics: jax.Array | None = None


class Outcome(NamedTuple):
  """The reduced result of the branch taken."""

  direction: optax.Updates
  correction: optax.Updates | None
  diagnostics: jax.Array
  full: jax.Array  # bool: the full step ran


def value_at(hyperparameter: optax.ScalarOrSchedule, count: jax.Array) -> jax.Array:
  return jnp.asarray(hyperparameter(count) if callable(hyperparameter) else hyperparameter)


def pmean(tree: Any, axis_name: Hashable | tuple[Hashable, ...]) -> Any:
  try:
    return jax.lax.pmean(tree, axis_name)
  except NameError as error:
    raise ValueError(
      f"axis_name={axis_name!r} is not bound here. With axis_name set, call update inside "
      "jax.pmap, jax.shard_map or jax.vmap over that axis name; outside them, leave "
      "axis_name=None."
    ) from error


def all_finite(tree: Any) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def hyperparams_at(
  rho: optax.ScalarOrSchedule, policy: SharpnessPolicy, count: jax.Array
) -> StepHyperparams:
  """Stage 1: rho_t and, for reuse policies, the reuse weight (0 where rho_t is 0)."""
  rho_t = value_at(rho, count)
  static = isinstance(rho, numbers.Real) and not isinstance(rho, bool)
  rho_positive = bool(rho > 0) if static else rho_t > 0
  weight = None
  if policy.stores_direction:
    weight = value_at(policy.reuse_weight, count)
    if policy.skip_zero_rho:  # At radius 0 the full step's output is g_c itself.
      weight = jnp.where(rho_positive, weight, jnp.zeros_like(weight))
  return StepHyperparams(rho=rho_t, rho_positive=rho_positive, reuse_weight=weight)


def decide(
  policy: SharpnessPolicy,
  policy_state: Any,
  count: jax.Array,
  hyper: StepHyperparams,
  clean_grads: optax.Updates,
  signal_axis: Hashable | tuple[Hashable, ...] | None = None,
) -> tuple[bool | jax.Array, Any]:
  """Stage 2a: whether the policy wants the full step, and its next state.

  The answer must be the same on every replica, so a gradient-norm signal is
  averaged over ``signal_axis`` (the data axis of per-device perturbation).
  """
  grad_sq_norm = None
  if policy.uses_grad_norm:
    grad_sq_norm = pert.global_norm(clean_grads) ** 2
    if signal_axis is not None:
      grad_sq_norm = pmean(grad_sq_norm, signal_axis)
  due, policy_state = policy.decide(policy_state, count, grad_sq_norm)
  if policy.skip_zero_rho:
    positive = hyper.rho_positive
    if isinstance(positive, bool):  # A static rho is decided while tracing.
      due = due if positive else False
    elif due is True:
      due = positive
    else:
      due = due & positive
  return due, policy_state


def choose(
  due: bool | jax.Array,
  full: Callable[[], Outcome],
  cheap: Callable[[], Outcome],
  perturb: bool | None,
) -> Outcome:
  """Stage 2b: run one branch, fixed statically (``perturb``, a static ``due``) or by ``lax.cond``."""
  if perturb is not None:
    return full() if perturb else cheap()
  if isinstance(due, bool):
    return full() if due else cheap()
  return jax.lax.cond(due, full, cheap)


def full_replica(
  settings: Settings,
  clean_grads: optax.Updates,
  params: optax.Params,
  grad_fn: ValueAndGradFn,
  rho_t: jax.Array,
  clean_loss: jax.Array | None,
) -> ReplicaResult:
  """Stage 3: one replica's GSAM gradient, stored direction and diagnostics."""
  epsilon = pert.perturbation(
    clean_grads, params, rho_t, adaptive=settings.adaptive, eps=settings.eps
  )
  perturbed_value, perturbed_grads = grad_fn(optax.apply_updates(params, epsilon))
  perturbed_loss = scalar_loss(perturbed_value)
  if settings.synchronized:
    perturbed_grads = pmean(perturbed_grads, settings.axis_name)
  stats = pert.gradient_stats(clean_grads, perturbed_grads)
  sam = isinstance(settings.alpha, numbers.Real) and settings.alpha == 0 and settings.minimize_fp
  if sam:  # No decomposition to do.
    direction = optax.tree.cast_like(perturbed_grads, clean_grads)
  else:
    direction = pert.decompose(
      clean_grads,
      perturbed_grads,
      settings.alpha,
      minimize_fp=settings.minimize_fp,
      eps=settings.eps,
      stats=stats,
    )
  gap = perturbed_loss - clean_loss if clean_loss is not None else jnp.zeros([], jnp.float32)
  diagnostics = jnp.stack(
    [perturbed_loss, gap]
    + [x.astype(jnp.float32) for x in (stats.cosine, stats.clean_norm, stats.perturbed_norm)]
  )
  correction = None
  if settings.policy.stores_direction:
    correction = pert.orthogonal_component(direction, clean_grads, eps=settings.eps)
  return ReplicaResult(direction, correction, diagnostics)


def cheap_replica(
  settings: Settings,
  clean_grads: optax.Updates,
  correction: optax.Updates | None,
  weight: jax.Array | None,
) -> ReplicaResult:
  """Stage 4: the clean gradient, or with the stored direction added back."""
  if settings.policy.cheap == "reuse":
    return ReplicaResult(pert.reuse_correction(clean_grads, correction, weight, eps=settings.eps))
  return ReplicaResult(clean_grads)


def reduce_replica(settings: Settings, result: ReplicaResult) -> ReplicaResult:
  """Stage 5 over ``axis_name``: one collective for everything that differs per device."""
  if settings.axis_name is None:
    return result
  if settings.per_device:  # Output, stored direction and scalars ride in one all-reduce.
    return pmean(result, settings.axis_name)
  # Synchronized: the gradients are global already; only the local losses differ.
  if result.diagnostics is None:
    return result
  return result._replace(diagnostics=pmean(result.diagnostics, settings.axis_name))


def _accumulator(shapes: Any) -> Any:
  """Zeros shaped like ``shapes`` in the accumulation dtype (float32 at least)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, pert.accumulation_dtype(s.dtype)), shapes)


def average_groups(num_groups: int, group_result: Callable[[jax.Array], Any]) -> Any:
  """Stage 5 over ``num_groups``: the mean of ``group_result(g)``, one group live at a time."""
  groups = jnp.arange(num_groups, dtype=jnp.int32)

  def body(total, group):
    result = group_result(group)
    return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, result), None

  initial = _accumulator(jax.eval_shape(group_result, groups[0]))
  total, _ = jax.lax.scan(body, initial, groups)
  return jax.tree.map(lambda t: t / num_groups, total)


def guard_nonfinite(
  settings: Settings,
  outcome: Outcome,
  previous_correction: optax.Updates | None,
  clean_average: Callable[[], optax.Updates],
) -> tuple[Outcome, jax.Array]:
  """Stage 6a: keep non-finite steps out of the state; ``on_nonfinite="clean"`` falls back.

  The stored direction is never replaced by a step whose gradients or
  perturbed loss are not finite. With ``on_nonfinite="clean"``, a full step
  whose output or perturbed loss is not finite outputs ``clean_average()``
  instead (the clean gradient, averaged like the output); the returned flag
  says whether that happened with a finite clean gradient.
  """
  perturbed_loss_ok = ~outcome.full | jnp.isfinite(outcome.diagnostics[0])
  correction = outcome.correction
  if correction is not None:
    keep = all_finite(correction) & perturbed_loss_ok
    correction = jax.tree.map(
      lambda new, old: jnp.where(keep, new, old), correction, previous_correction
    )
  direction, fell_back = outcome.direction, jnp.asarray(False)
  if settings.on_nonfinite == "clean":

    def fall_back():
      clean = optax.tree.cast_like(clean_average(), direction)
      return clean, all_finite(clean)

    direction, fell_back = jax.lax.cond(
      all_finite(direction) & perturbed_loss_ok, lambda: (direction, jnp.asarray(False)), fall_back
    )
  return outcome._replace(direction=direction, correction=correction), fell_back
