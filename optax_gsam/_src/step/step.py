"""The stages of one gsam/sam update, in the order :func:`replicated_update` runs them.

1. the hyperparameters at the step (:func:`~optax_gsam._src.step.hyperparams.hyperparams_at`);
2. the policy's choice between the full and the cheap step (:func:`decide`,
   then :func:`choose`: a static branch or a ``lax.cond``);
3. the full step of one replica: the ascent (:func:`ascend`: the direction,
   the mask and the ascent steps), the perturbed pass, the decomposition
   (:func:`full_step`);
4. the cheap step of one replica (:func:`cheap_step`);
5. the reduction: a pmean over ``axis_name`` (:func:`reduce_over_axis`) or the
   average of a scan over micro-batches (:func:`grouped_update`), with the
   fallback to the clean gradient (:func:`fall_back_to_clean`);
6. what the new state keeps (:func:`keep_learned`, one rule for the stored
   direction and the ascent state); ``sharpness.py`` builds it.

A *replica* is one device under ``axis_name``, one micro-batch perturbed on
its own (``num_groups``, ``perturb_each_microbatch``), or the whole step on a
single device. :func:`grouped_update` is stage 2 to 5 for per-micro-batch
perturbation; whole-batch micro-batching is :func:`replicated_update` with an
accumulating gradient function (:mod:`optax_gsam._src.microbatches.microbatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.user_functions import ValueAndGradFn
from optax_gsam._src.calls.user_functions import scalar_loss
from optax_gsam._src.core.arrays import all_finite
from optax_gsam._src.core.arrays import conform
from optax_gsam._src.core.arrays import materialized_on_tpu
from optax_gsam._src.core.arrays import same_layout
from optax_gsam._src.core.validation import is_real_number
from optax_gsam._src.directions import perturbation as pert
from optax_gsam._src.directions.ascent import ascent_from_adaptive
from optax_gsam._src.directions.ascent import resolve_mask
from optax_gsam._src.directions.ascent import select_leaves
from optax_gsam._src.directions.finite_output import decomposed_is_finite
from optax_gsam._src.microbatches.microbatch import average_over
from optax_gsam._src.policies.policies import SharpnessPolicy
from optax_gsam._src.step.hyperparams import Hyperparams
from optax_gsam._src.step.isolation import isolated_on_gpu
from optax_gsam.typing import Adaptive
from optax_gsam.typing import AxisName


class Settings(NamedTuple):
  """The static configuration of one transform, validated by its factory."""

  alpha: float | jax.Array
  eps: float | jax.Array
  adaptive: Adaptive
  minimize_fp: bool
  sync_perturbation: bool
  axis_name: AxisName
  num_groups: int | None
  policy: SharpnessPolicy
  on_nonfinite: str
  # The ascent stage (stage 3a): the direction, how many ascent steps, which leaves move.
  ascent: optax.GradientTransformation | None = None  # None: the one ``adaptive`` names
  ascent_steps: int = 1
  mask: Any = None
  microbatches: int | None = None  # whole-batch semantics, accumulated over this many
  diagnostics: bool = True  # False: no gradient statistics, where the output does not need them

  @property
  def direction(self) -> optax.GradientTransformation:
    if self.ascent is not None:
      return self.ascent
    return ascent_from_adaptive(self.adaptive, self.eps)

  @property
  def split(self) -> int | None:
    """Into how many micro-batches ``update`` splits the batch, in either semantics."""
    return self.num_groups if self.num_groups is not None else self.microbatches

  @property
  def per_device(self) -> bool:
    return self.axis_name is not None and not self.sync_perturbation

  @property
  def synchronized(self) -> bool:
    return self.axis_name is not None and self.sync_perturbation

  @property
  def is_sam(self) -> bool:
    """alpha is statically 0 with ``minimize_fp``: the output is g_p, nothing to decompose."""
    return bool(is_real_number(self.alpha) and self.alpha == 0 and self.minimize_fp)


class Diagnostics(NamedTuple):
  """What a full step reports; float32 scalars, stored in :class:`optax_gsam.GSAMState`."""

  perturbed_loss: jax.Array
  surrogate_gap: jax.Array
  cosine: jax.Array
  clean_grad_norm: jax.Array
  perturbed_grad_norm: jax.Array


class BranchResult(NamedTuple):
  """What one replica's branch gives; ``None`` fields are not reduced (cheap steps).

  ``stored_direction`` and ``ascent_state`` are the state a full step learns;
  a cheap step leaves them ``None``, and :func:`keep_learned` keeps the
  previous ones where the step did not count.
  """

  gradient: optax.Updates  # the output g
  stored_direction: optax.Updates | None = None
  diagnostics: Diagnostics | None = None
  ascent_state: Any = None
  # Whether g and g_c are finite, where the statistics tell without a reduction of g's own.
  finite: jax.Array | None = None
  clean_finite: jax.Array | None = None


class Outcome(NamedTuple):
  """The reduced result of the branch taken, ready for the new state."""

  gradient: optax.Updates
  stored_direction: optax.Updates | None
  diagnostics: Diagnostics
  full: jax.Array  # bool: the full step ran
  fell_back: jax.Array  # bool: the output is the clean gradient instead of the full step's
  finite: jax.Array  # bool: every entry of the output is finite
  ascent_state: Any = None


def pmean(tree: Any, axis_name: AxisName) -> Any:
  try:
    return jax.lax.pmean(tree, axis_name)
  except NameError as error:
    raise ValueError(
      f"axis_name={axis_name!r} is not bound here. With axis_name set, call update inside "
      "jax.pmap, jax.shard_map or jax.vmap over that axis name; outside them, leave "
      "axis_name=None."
    ) from error


def pmean_inexact(tree: Any, axis_name: AxisName) -> Any:
  """The mean over ``axis_name`` of the float leaves; integer leaves (counts) are the same everywhere."""
  leaves, treedef = jax.tree.flatten(tree)
  inexact = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  means = pmean([leaves[i] for i in inexact], axis_name)
  for i, mean in zip(inexact, means, strict=True):
    leaves[i] = mean
  return jax.tree.unflatten(treedef, leaves)


def decide(
  policy: SharpnessPolicy,
  policy_state: Any,
  count: jax.Array,
  hyper: Hyperparams,
  clean_grads: optax.Updates,
  signal_axis: AxisName = None,
) -> tuple[bool | jax.Array, Any]:
  """Stage 2a: whether the policy wants the full step, and its next state.

  The answer must be the same on every replica, so a gradient-norm signal is
  averaged over ``signal_axis`` (the data axis of per-device perturbation).
  """
  grad_sq_norm = None
  if policy.uses_grad_norm:
    grad_sq_norm = pert.stable_global_norm(clean_grads) ** 2
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
  """Stage 2b: run one branch, fixed statically (``perturb``, a static ``due``) or by ``lax.cond``.

  The ``lax.cond`` is laid out so that XLA's buffer assignment gives it about
  the full step's peak memory (ViT-B/32 on the TPU compiler, float32: 3.61 GiB,
  the static full step's, instead of 6.14; see benchmarks/README.md):

  * the full step is branch 0. Buffer assignment reserves a conditional's
    output buffers from their first definition in its flattened schedule,
    where the branches follow in index order; a cheap branch 0 would define
    the outputs early and hold them through the full step's second backward
    pass.
  * the result passes an optimization barrier, so XLA does not move the ops
    that read it (parameter-sized broadcasts of scalars) into the branches,
    which turns them into more parameter-sized outputs.
  """
  if perturb is not None:
    return full() if perturb else cheap()
  if isinstance(due, bool):
    return full() if due else cheap()
  return jax.lax.optimization_barrier(jax.lax.cond(jnp.logical_not(due), cheap, full))


def ascend(
  settings: Settings,
  rho: jax.Array,
  clean_grads: optax.Updates,
  params: optax.Params,
  grad_fn: ValueAndGradFn,
  ascent_state: Any,
) -> tuple[Any, optax.Updates, Any]:
  r"""Stage 3a: ``ascent_steps`` ascent steps, then the gradient at the perturbed weights.

  With :math:`n` steps, :math:`g_0 = g_c` and the direction :math:`a`,

  .. math::

    \epsilon_i = \epsilon_{i-1} + (\rho / n)\, a(g_{i-1}), \qquad
    g_i = \nabla f(w + \epsilon_i),

  restricted to the leaves of the mask. A stateful direction advances once per
  step, from the clean gradient: :math:`a` is the direction at the state
  :math:`s_t` of the step's start for every ascent step, and the new state is
  the one the first call returns, :math:`s_{t+1} = \text{ascent.update}(g_c,
  s_t)`. Returns the value at the last point, :math:`g_p = g_n` and that state.
  """
  mask = resolve_mask(settings.mask, params)
  step_size = rho / settings.ascent_steps
  grads, epsilon, value, next_state = clean_grads, None, None, ascent_state
  for i in range(settings.ascent_steps):
    # The later steps only apply the direction; their gradients must not enter its averages.
    unit, state = settings.direction.update(select_leaves(mask, grads), ascent_state, params)
    next_state = state if i == 0 else next_state
    move = select_leaves(mask, unit)
    epsilon = move if epsilon is None else jax.tree.map(jnp.add, epsilon, move)
    perturbed = jax.tree.map(lambda w, e: w + (e * step_size).astype(w.dtype), params, epsilon)
    value, grads = isolated_on_gpu(grad_fn, perturbed)
    if settings.synchronized:
      grads = pmean(grads, settings.axis_name)
  return value, grads, next_state


def full_step(
  settings: Settings,
  rho: jax.Array,
  clean_grads: optax.Updates,
  params: optax.Params,
  grad_fn: ValueAndGradFn,
  clean_loss: jax.Array | None,
  ascent_state: Any = None,
) -> BranchResult:
  """Stage 3: one replica's GSAM gradient, stored direction, diagnostics and ascent state."""
  if ascent_state is None:
    ascent_state = settings.direction.init(params)
  perturbed_value, perturbed_grads, ascent_state = ascend(
    settings, rho, clean_grads, params, grad_fn, ascent_state
  )
  perturbed_loss = scalar_loss(perturbed_value)
  stats = None
  if settings.diagnostics or not settings.is_sam:  # GSAM's decomposition reads them too
    stats = pert.gradient_stats(clean_grads, perturbed_grads)
  if settings.is_sam:
    gradient = optax.tree.cast_like(perturbed_grads, clean_grads)
  else:
    gradient = pert.decompose(
      clean_grads,
      perturbed_grads,
      settings.alpha,
      minimize_fp=settings.minimize_fp,
      eps=settings.eps,
      stats=stats,
    )
  finite = clean_finite = None
  if stats is not None and not settings.is_sam:  # SAM checks g_p in the statistics' round
    finite = decomposed_is_finite(
      stats, settings.alpha, minimize_fp=settings.minimize_fp, eps=settings.eps, like=clean_grads
    )
    # Exact, and in the round of the ascent's norm: it reads g_c alone.
    clean_finite = all_finite(clean_grads)
  gap = perturbed_loss - clean_loss if clean_loss is not None else jnp.zeros([], jnp.float32)
  if not settings.diagnostics:
    # SAM then reads the clean gradient only in the ascent, so XLA frees it before the perturbed
    # pass ends (one params-sized buffer); the statistics stay 0.
    zero = jnp.zeros([], jnp.float32)
    stats = pert.GradientStats(zero, zero, zero)
  assert stats is not None  # computed above whenever the diagnostics are kept
  diagnostics = Diagnostics(
    perturbed_loss=perturbed_loss,
    surrogate_gap=gap,
    cosine=stats.cosine.astype(jnp.float32),
    clean_grad_norm=stats.clean_norm.astype(jnp.float32),
    perturbed_grad_norm=stats.perturbed_norm.astype(jnp.float32),
  )
  stored = None
  if settings.policy.stores_direction:
    stored = pert.reuse_component(gradient, clean_grads, eps=settings.eps)
  return BranchResult(gradient, stored, diagnostics, ascent_state, finite, clean_finite)


def cheap_step(
  settings: Settings,
  weight: jax.Array | None,
  clean_grads: optax.Updates,
  stored_direction: optax.Updates | None,
) -> BranchResult:
  """Stage 4: the clean gradient, or with the stored direction added back."""
  policy = settings.policy
  if policy.cheap == "reuse":
    assert weight is not None and stored_direction is not None  # a reuse policy stores one
    return BranchResult(
      pert.reuse_direction(
        clean_grads,
        same_layout(stored_direction, clean_grads),
        weight,
        scale=policy.reuse_scale,
        max_amplification=policy.max_amplification,
        eps=settings.eps,
      )
    )
  return BranchResult(clean_grads)


def reduce_over_axis(settings: Settings, result: BranchResult) -> BranchResult:
  """Stage 5 over ``axis_name``: one collective for everything that differs per device."""
  if settings.axis_name is None:
    return result
  if settings.per_device:  # Output, stored direction, scalars and state: one all-reduce.
    # The verdicts are each device's own, of its own output.
    return pmean_inexact(result._replace(finite=None, clean_finite=None), settings.axis_name)
  # Synchronized: the gradients are global already; only the local losses differ.
  if result.diagnostics is None:
    return result
  return result._replace(diagnostics=pmean(result.diagnostics, settings.axis_name))


def rho_unusable(hyper: Hyperparams) -> bool | jax.Array:
  """rho_t is not a finite number >= 0 (a Python bool for a static rho)."""
  return not hyper.rho_ok if isinstance(hyper.rho_ok, bool) else ~hyper.rho_ok


def needs_fallback(
  settings: Settings, hyper: Hyperparams, result: BranchResult, any_axis: AxisName = None
) -> bool | jax.Array:
  """Whether a full step must output the clean gradient instead.

  Always where rho_t is not a finite number >= 0 (a schedule's NaN must not
  stall training); with ``on_nonfinite="clean"`` also where the output or the
  perturbed loss is not finite, on any replica of ``any_axis``.
  """
  flag = rho_unusable(hyper)
  if settings.on_nonfinite == "clean":
    assert result.diagnostics is not None
    bad = ~(gradient_finite(result) & jnp.isfinite(result.diagnostics.perturbed_loss))
    if any_axis is not None:  # one verdict for all replicas (int32: every backend reduces it)
      bad = jax.lax.pmax(bad.astype(jnp.int32), any_axis) > 0
    flag = flag | bad
  return flag


def outputs_clean(hyper: Hyperparams, fallback: bool | jax.Array) -> bool | jax.Array:
  """Where a full step outputs g_c: where it falls back, and where rho_t is 0.

  At radius 0 the full step's output is g_c up to rounding (the cosine of a
  gradient with itself rounds to 1 +- 1e-7); selecting g_c makes it exact, so a
  step at rho 0 equals the base optimizer's step bitwise.
  """
  positive = hyper.rho_positive
  not_positive = (not positive) if isinstance(positive, bool) else ~positive
  if isinstance(fallback, bool) and isinstance(not_positive, bool):
    return fallback or not_positive
  return jnp.logical_or(fallback, not_positive)


def fall_back_to_clean(
  flag: bool | jax.Array, clean_grads: optax.Updates, result: BranchResult
) -> BranchResult:
  """Stage 5: the clean gradient where ``flag`` holds; selects, so no tree enters a conditional."""
  if flag is False:
    return result
  gradient = jax.tree.map(
    lambda c, g: jnp.where(flag, c, g), conform(clean_grads, result.gradient), result.gradient
  )
  finite = None
  if result.finite is not None and result.clean_finite is not None:
    finite = jnp.where(flag, result.clean_finite, result.finite)
  return result._replace(gradient=gradient, finite=finite)


def gradient_finite(result: BranchResult) -> jax.Array:
  """Whether ``result``'s gradient is finite: its verdict where known, else a check of it."""
  return all_finite(result.gradient) if result.finite is None else result.finite


class StepContext(NamedTuple):
  """What every stage of one update reads: the settings, the step's hyperparameters, the state."""

  settings: Settings
  hyper: Hyperparams
  policy_state: Any
  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, like GSAMState
  stored_direction: optax.Updates | None
  diagnostics: Diagnostics
  ascent_state: Any = None


def _outcome(
  result: BranchResult,
  full: bool,
  fallback: bool | jax.Array,
  context: StepContext,
  like: optax.Updates,
) -> Outcome:
  """A reduced branch result, completed with what a cheap step leaves as it was."""
  previous_stored, previous_diagnostics = context.stored_direction, context.diagnostics
  stored = result.stored_direction
  if stored is None:
    stored = previous_stored
  elif previous_stored is not None:
    stored = conform(stored, previous_stored)
  diagnostics = previous_diagnostics if result.diagnostics is None else result.diagnostics
  ascent_state = context.ascent_state if result.ascent_state is None else result.ascent_state
  if context.ascent_state is not None:
    ascent_state = conform(ascent_state, context.ascent_state)
  gradient = conform(result.gradient, like)
  finite = gradient_finite(result._replace(gradient=gradient))
  fell_back = jnp.asarray(fallback) & finite
  return Outcome(gradient, stored, diagnostics, jnp.asarray(full), fell_back, finite, ascent_state)


def replicated_update(
  context: StepContext,
  updates: optax.Updates,
  params: optax.Params,
  grad_fn: ValueAndGradFn,
  clean_loss: jax.Array | None,
  perturb: bool | None,
) -> tuple[Outcome, Any]:
  """Stages 2 to 5 on one device, or on one replica under ``axis_name``.

  Returns the outcome and the policy's new state.
  """
  settings, hyper = context.settings, context.hyper
  if settings.axis_name is None or settings.microbatches is not None:
    # The clean pass ends here, whole (materialized_on_tpu). Per device, whole-batch, the TPU
    # compiler packs the step worse behind it (ViT-B/32 on a v3-64, bf16: +0.19 GiB).
    updates, params, clean_loss = materialized_on_tpu((updates, params, clean_loss))
  clean_grads = pmean(updates, settings.axis_name) if settings.synchronized else updates
  signal_axis = settings.axis_name if settings.per_device else None
  due, policy_state = decide(
    settings.policy, context.policy_state, context.count, hyper, clean_grads, signal_axis
  )

  def full() -> Outcome:
    result = full_step(
      settings, hyper.safe_rho, clean_grads, params, grad_fn, clean_loss, context.ascent_state
    )
    return _full_with_fallback(context, result, clean_grads, updates)

  def cheap() -> Outcome:
    result = cheap_step(settings, hyper.reuse_weight, clean_grads, context.stored_direction)
    result = reduce_over_axis(settings, result)
    return _outcome(result, False, rho_unusable(hyper), context, updates)

  return choose(due, full, cheap, perturb), policy_state


def _full_with_fallback(
  context: StepContext,
  result: BranchResult,
  clean_grads: optax.Updates | None,
  like: optax.Updates,
) -> Outcome:
  """Stage 5 of a full step: the fallback to ``clean_grads`` and the reduction, in either order.

  Per device, the fallback is selected on each device before the mean, so it
  needs no all-reduce of its own; ``clean_grads=None`` means no fallback can
  happen (the grouped path does not keep the clean gradients then).
  """
  settings, hyper = context.settings, context.hyper
  fallback: bool | jax.Array = False
  if settings.per_device:
    if clean_grads is not None:
      fallback = needs_fallback(settings, hyper, result, settings.axis_name)
      result = fall_back_to_clean(outputs_clean(hyper, fallback), clean_grads, result)
    result = reduce_over_axis(settings, result)
  else:
    result = reduce_over_axis(settings, result)
    if clean_grads is not None:
      fallback = needs_fallback(settings, hyper, result)
      result = fall_back_to_clean(outputs_clean(hyper, fallback), clean_grads, result)
  return _outcome(result, True, fallback, context, like)


def grouped_update(
  context: StepContext,
  updates: optax.Updates,
  params: optax.Params,
  group_fn: Callable[[jax.Array], ValueAndGradFn],
  perturb: bool | None,
) -> tuple[Outcome, Any]:
  """Stages 2 to 5 for per-micro-batch perturbation: a scan over micro-batches (groups).

  Each group is perturbed along its own clean gradient; the results are
  averaged, then averaged over ``axis_name`` per device. Where a fallback to
  the clean gradient can happen, the scan also averages the groups' clean
  gradients, so no group is evaluated twice.
  """
  settings, hyper = context.settings, context.hyper
  num_groups = settings.num_groups
  assert num_groups is not None
  due, policy_state = decide(settings.policy, context.policy_state, context.count, hyper, updates)
  keep_clean = settings.on_nonfinite == "clean" or hyper.rho_positive is not True

  def clean_of(group):
    value, grads = group_fn(group)(params)
    return scalar_loss(value), optax.tree.cast_like(grads, updates)

  def full_of(group):
    clean_loss, clean_grads = clean_of(group)
    result = full_step(
      settings,
      hyper.safe_rho,
      clean_grads,
      params,
      group_fn(group),
      clean_loss,
      context.ascent_state,
    )
    # The groups' mean is checked as a whole: one group's verdicts do not carry over to it.
    return result._replace(finite=None, clean_finite=None), (clean_grads if keep_clean else None)

  def full() -> Outcome:
    result, clean_average = average_over(num_groups, full_of)
    return _full_with_fallback(context, result, clean_average, updates)

  def cheap_of(group):
    return cheap_step(settings, hyper.reuse_weight, clean_of(group)[1], context.stored_direction)

  def cheap() -> Outcome:
    result = reduce_over_axis(settings, average_over(num_groups, cheap_of))
    return _outcome(result, False, rho_unusable(hyper), context, updates)

  return choose(due, full, cheap, perturb), policy_state


def keep_learned(outcome: Outcome, learned: Any, previous: Any) -> Any:
  """Stage 6, one rule for all a full step learns (stored direction, ascent state).

  ``learned`` replaces ``previous`` only where a full step ran, its gradients
  and perturbed loss were finite, and it did not fall back; otherwise (cheap
  steps, non-finite steps) the previous value is kept.
  """
  if learned is None or not jax.tree.leaves(learned):
    return learned
  perturbed_loss_ok = jnp.isfinite(outcome.diagnostics.perturbed_loss)
  keep = outcome.full & all_finite(learned) & perturbed_loss_ok & ~outcome.fell_back
  keep = keep & outcome.finite
  learned = conform(learned, previous)
  return jax.tree.map(lambda new, old: jnp.where(keep, new, old), learned, previous)
