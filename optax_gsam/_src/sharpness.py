"""GSAM and SAM as optax gradient transformations.

``update`` runs the stages of :mod:`optax_gsam._src.step` in order:
hyperparameters at the step, the policy's choice, the full or cheap step of
each replica, the reduction over ``axis_name`` or ``num_groups``, and the new
state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src import perturbation as pert
from optax_gsam._src import step
from optax_gsam._src.arrays import numbers_as_arrays
from optax_gsam._src.policies import REUSE_WEIGHT_NOT_GIVEN
from optax_gsam._src.policies import SharpnessPolicy
from optax_gsam._src.policies import keep_unless_counted
from optax_gsam._src.policies import policy_from_arguments
from optax_gsam._src.user_functions import check_extra_args
from optax_gsam._src.user_functions import group_value_and_grad
from optax_gsam._src.user_functions import scalar_loss
from optax_gsam._src.user_functions import value_and_grad_from
from optax_gsam._src.validation import check_axis_name
from optax_gsam._src.validation import check_data_axis_is_set
from optax_gsam._src.validation import check_non_negative
from optax_gsam._src.validation import check_positive
from optax_gsam._src.validation import check_positive_int
from optax_gsam._src.validation import check_update_inputs
from optax_gsam.typing import Adaptive
from optax_gsam.typing import AxisName

ON_NONFINITE_CHOICES = ("propagate", "clean")


class GSAMState(NamedTuple):
  """State of :func:`gsam` and :func:`sam`.

  Every diagnostic describes the last full step (zeros before the first one)
  and is averaged over ``axis_name`` when one is set. Read them with
  ``optax.tree.get(opt_state, "surrogate_gap")``.

  Attributes:
    count: number of updates with a finite output so far; rho schedules are
      evaluated at it. Starts at 0 and is never reset, so it stays aligned with
      the step counts of the optimizers chained after the transform when they
      sit behind ``optax.apply_if_finite``, which skips the same non-finite
      steps. A chain that repairs non-finite updates instead (e.g.
      ``optax.zero_nans()``) advances its optimizers on such a step while this
      count stays, which delays rho by one step per such step.
    rho: the radius :math:`\\rho_t` of the last update.
    perturbed_loss: :math:`f_p = f(w + \\epsilon)`.
    surrogate_gap: :math:`h = f_p - f`, when the clean loss was passed as
      ``value=``; 0 otherwise.
    cosine: cosine between the clean and the perturbed gradient.
    clean_grad_norm: :math:`\\|g_c\\|`.
    perturbed_grad_norm: :math:`\\|g_p\\|`.
    full_steps: how many of the counted updates output the full (perturbed)
      step's result (a finite perturbed loss, no fallback); with a cheap policy, ``full_steps / count`` is the fraction of
      steps whose output came from a full step.
    fallback_count: with ``on_nonfinite="clean"``, how many full steps had a
      non-finite perturbed loss or gradient and output the clean gradient
      instead. Never reset.
    policy_state: the state of the cheap-step policy (see
      :class:`optax_gsam.SharpnessPolicy`).
    stored_direction: for policies with ``cheap="reuse"`` (e.g.
      ``perturb_every > 1``), the stored direction :math:`v` reused on cheap
      steps (params-shaped): the part of the last full step's output
      orthogonal to its clean gradient. ``None`` otherwise. A step whose
      gradients or perturbed loss are not finite, or that fell back to the
      clean gradient, keeps the previous one.
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's states do
  rho: jax.Array
  perturbed_loss: jax.Array
  surrogate_gap: jax.Array
  cosine: jax.Array
  clean_grad_norm: jax.Array
  perturbed_grad_norm: jax.Array
  full_steps: jax.Array
  fallback_count: jax.Array
  policy_state: Any = optax.EmptyState()
  stored_direction: optax.Updates | None = None

  @property
  def diagnostics(self) -> step.Diagnostics:
    """The five diagnostics of the last full step, as one NamedTuple."""
    return step.Diagnostics(*(getattr(self, name) for name in step.Diagnostics._fields))


def _next_state(
  state: GSAMState, hyper: step.Hyperparams, outcome: step.Outcome, policy_state: Any
) -> GSAMState:
  """Stage 6: a step whose output is not finite does not count.

  With the rest of the chain behind ``optax.apply_if_finite``, rho schedules
  then stay aligned with the optimizers after this one.
  """
  increment = lambda count, flag: jnp.where(flag, optax.safe_increment(count), count)
  counts = step.all_finite(outcome.gradient)
  perturbed_loss_ok = jnp.isfinite(outcome.diagnostics.perturbed_loss)
  return GSAMState(
    count=increment(state.count, counts),
    rho=hyper.rho.astype(jnp.float32),
    **outcome.diagnostics._asdict(),
    full_steps=increment(
      state.full_steps, outcome.full & counts & perturbed_loss_ok & ~outcome.fell_back
    ),
    fallback_count=increment(state.fallback_count, outcome.fell_back),
    policy_state=keep_unless_counted(counts, policy_state, state.policy_state),
    stored_direction=step.keep_finite_direction(outcome, state.stored_direction),
  )


def _check_update(updates, state, params, perturb, extra_args, policy, check_axis, axis_name):
  """Everything ``update`` can refuse before tracing anything, each with the fix."""
  check_extra_args(extra_args)
  _check_perturb(perturb, policy)
  check_update_inputs(updates, params, state.stored_direction)
  if check_axis:
    check_data_axis_is_set(axis_name)


def _check_perturb(perturb, policy: SharpnessPolicy) -> None:
  if perturb is not None and not isinstance(perturb, bool):
    raise ValueError(
      f"perturb must be None or a Python bool (static; not an array), got {perturb!r}."
    )
  if perturb is False and policy.always_full:
    raise ValueError(
      "perturb=False takes the cheap step, which the default policy never takes: set "
      "perturb_every=k or policy= (e.g. optax_gsam.every_step_policy(skip_zero_rho=True) "
      "for a plain base step at rho_t == 0)."
    )


def _initial_state(policy: SharpnessPolicy, params: optax.Params) -> GSAMState:
  # A fresh buffer per field: a donated state must not hold one buffer twice.
  zero = lambda: jnp.zeros([], jnp.float32)
  zero_count = lambda: jnp.zeros([], jnp.int32)
  return GSAMState(
    count=zero_count(),
    rho=zero(),
    **{name: zero() for name in step.Diagnostics._fields},
    full_steps=zero_count(),
    fallback_count=zero_count(),
    policy_state=policy.init(),
    stored_direction=optax.tree.zeros_like(params) if policy.stores_direction else None,
  )


def _check_call_arguments(rho, num_groups, perturb_every, check_axis) -> None:
  """The arguments of gsam that do not go into :class:`step.Settings`."""
  check_non_negative("rho", rho, allow_schedule=True)
  check_positive_int("num_groups", num_groups, allow_none=True)
  check_positive_int("perturb_every", perturb_every, allow_none=True)
  if not isinstance(check_axis, bool):
    raise ValueError(f"check_axis must be a bool, got {check_axis!r}.")


def _validated(settings: step.Settings) -> step.Settings:
  """Validates gsam's static arguments eagerly; every error names its argument."""
  check_non_negative("alpha", settings.alpha)
  check_positive("eps", settings.eps)
  if settings.adaptive not in pert.ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {pert.ADAPTIVE_CHOICES}, got {settings.adaptive!r}.")
  for name, flag in (
    ("minimize_fp", settings.minimize_fp),
    ("sync_perturbation", settings.sync_perturbation),
  ):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}.")
  check_axis_name(settings.axis_name)
  if settings.sync_perturbation and settings.axis_name is None:
    raise ValueError(
      "sync_perturbation=True needs axis_name: it averages the clean gradient over that axis."
    )
  if settings.num_groups is not None and settings.axis_name is not None:
    raise ValueError(
      "num_groups emulates devices on one device; it cannot be combined with axis_name."
    )
  if settings.num_groups is not None and settings.policy.uses_grad_norm:
    raise ValueError(
      f"policy={settings.policy.name!r} reads the clean gradient's norm, which num_groups never forms "
      "before its per-group passes; use it with axis_name, or pick another policy."
    )
  if settings.on_nonfinite not in ON_NONFINITE_CHOICES:
    raise ValueError(
      f"on_nonfinite must be one of {ON_NONFINITE_CHOICES}, got {settings.on_nonfinite!r}."
    )
  return settings


def gsam(
  rho: optax.ScalarOrSchedule,
  alpha: float | jax.Array = 0.0,
  *,
  eps: float = 1e-12,
  adaptive: Adaptive = None,
  minimize_fp: bool = True,
  sync_perturbation: bool = False,
  axis_name: AxisName = None,
  num_groups: int | None = None,
  perturb_every: int | None = None,
  reuse_weight: optax.ScalarOrSchedule = REUSE_WEIGHT_NOT_GIVEN,
  policy: SharpnessPolicy | None = None,
  on_nonfinite: str = "propagate",
  check_axis: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Surrogate Gap Guided Sharpness-Aware Minimization (GSAM).

  Put it first in an ``optax.chain``. Its input ``updates`` is the clean
  gradient :math:`g_c = \nabla f(w)`; it calls the loss once more at the
  perturbed weights and outputs the GSAM gradient, which flows into the rest of
  the chain:

  .. math::

    \epsilon &= \rho_t \, g_c / (\|g_c\| + \varepsilon), \qquad
    g_p = \nabla f(w + \epsilon) \\
    g &= g_p - \alpha \, g_c^{\perp}, \qquad
    g_c^{\perp} = g_c - \frac{\langle g_c, g_p\rangle}{\|g_p\|^2} g_p
    \quad\text{(minimize\_fp=True)} \\
    g &= g_c + \alpha \, g_p^{\perp}, \qquad
    g_p^{\perp} = g_p - \frac{\langle g_p, g_c\rangle}{\|g_c\|^2} g_c
    \quad\text{(minimize\_fp=False)}

  (see :func:`optax_gsam.perturbation` for the adaptive forms of
  :math:`\epsilon`, and :func:`optax_gsam.decompose` for how every division is
  guarded). Descending :math:`g` minimises the perturbed loss :math:`f_p` while
  ascending the clean loss along the direction orthogonal to
  :math:`\nabla f_p`, which shrinks the surrogate gap :math:`h = f_p - f`, a
  measure of sharpness. ``alpha=0`` is SAM.

  ``update(updates, state, params, *, loss_fn=None, value_and_grad_fn=None,
  value=None, perturb=None, **extra_args)`` takes exactly one of ``loss_fn``
  (params -> scalar loss, or ``(loss, aux)`` as Flax and big_vision losses
  return; the first element is the loss) or ``value_and_grad_fn`` (params -> (value, grads), where value
  may be ``(loss, aux)``; e.g. :func:`optax_gsam.cached_value_and_grad`).
  ``value``, optax's name for the clean loss, is used for the surrogate gap
  diagnostic. Other extra args are ignored.

  **Data parallelism (m-sharpness).** With ``axis_name`` set, ``update`` runs
  inside ``jax.pmap``/``jax.shard_map``/``jax.vmap`` over that axis, ``updates``
  is the device's local clean gradient and ``loss_fn`` the local-shard loss.
  The output is always averaged over the axis (do not ``pmean`` it again):

  * ``sync_perturbation=False`` (the paper's setting): each device perturbs
    with its own :math:`g_c` and decomposes its own gradients; the resulting
    :math:`g` is averaged. One gradient-sized all-reduce, as in a base step
    (two on the full steps of ``perturb_every > 1``, which also average the
    stored direction).
  * ``sync_perturbation=True``: :math:`g_c` is averaged before perturbing and
    :math:`g_p` before the decomposition, which equals single-device GSAM on
    the global batch. Two gradient-sized all-reduces.

  ``num_groups=G`` emulates G devices with per-device perturbation on one
  device, sequentially (a ``lax.scan`` over groups, so memory stays that of one
  group). ``update`` then takes ``loss_fn(params, group)`` (or
  ``value_and_grad_fn(params, group)``), the loss of group ``group`` (an int32
  scalar in ``[0, G)``), computes each group's clean and perturbed gradient
  itself and ignores the values in ``updates`` (only their structure and dtypes
  are read: pass ``optax.tree.zeros_like(params)`` to skip a clean pass).

  **Cheap steps.** A ``policy`` (:class:`optax_gsam.SharpnessPolicy`) decides
  at each step between the full step above and a cheap one that needs only
  :math:`g_c`: the clean gradient itself (``cheap="clean"``, a plain
  base-optimizer step) or :math:`g_c + \lambda_t \|g_c\| v / \|v\|`, which
  adds back :math:`v = g^{\perp g_c}`, the part of the last full step's output
  orthogonal to the clean gradient (``cheap="reuse"``, LookSAM). For GSAM,
  :math:`v` also carries the surrogate-gap term. The policies:
  :func:`optax_gsam.every_step_policy` (the default),
  :func:`optax_gsam.every_k_policy` (``perturb_every=k`` with
  ``reuse_weight`` is this one), :func:`optax_gsam.gradient_norm_policy`
  (AE-SAM) and :func:`optax_gsam.random_policy`. Every policy but the default
  takes the cheap step where :math:`\rho_t = 0`. Inside one jitted step the
  choice is a ``lax.cond``; ``update(..., perturb=True|False)``, a static
  Python bool, fixes the branch at trace time instead (the policy's state
  still advances): jit one step function per branch and pick it in Python,
  with :func:`optax_gsam.full_step_due` for the policy's answer. That avoids
  XLA CPU's slow convolutions inside conditionals (jax-ml/jax#12868), where a
  ``lax.cond`` full step can cost many times a plain one. Under ``jax.vmap``
  the ``lax.cond`` stays a conditional while the state is not batched (as in
  :func:`optax_gsam.emulate_devices`); vmapping over optimizer states turns it
  into a select that runs both branches. The diagnostics keep the values of
  the last full step; ``GSAMState.full_steps`` counts the full steps.

  **Non-finite steps.** With ``on_nonfinite="propagate"`` a non-finite
  perturbed gradient reaches the output (put ``optax.apply_if_finite`` after
  the transform to skip such steps); a perturbed loss that overflows while
  its gradient stays finite is only seen in the ``perturbed_loss``
  diagnostic. With ``on_nonfinite="clean"``, a full step whose perturbed loss
  or output is not finite while the clean gradient is finite outputs the
  clean gradient (averaged like the output), so the chain takes a plain base
  step; ``GSAMState.fallback_count`` counts those steps. Either way such a
  step never replaces the stored direction.

  **Unusable rho values.** A rho schedule (or injected rho) whose value at a
  step is NaN, infinite or negative makes that step output the clean gradient,
  whatever ``on_nonfinite`` says; the step counts (so the schedule moves on),
  ``GSAMState.fallback_count`` counts it and ``GSAMState.rho`` shows the
  value. An injected alpha that is traced (``inject_hyperparams`` under
  ``jit``) is treated alike. A float rho or alpha, or a concrete array, is
  checked when the transform is built.

  Under ``optax.inject_hyperparams(optax_gsam.gsam)``, rho, alpha, eps and
  reuse_weight become injectable; static options (``perturb_every``,
  ``num_groups``) go in ``static_args``. Injected values take the params' dtype
  unless ``hyperparam_dtype`` is given, so with bfloat16 params pass
  ``hyperparam_dtype=jnp.float32``; a scheduled rho is then read at
  ``inject_hyperparams``' own count.

  Args:
    rho: the perturbation radius, a float >= 0 or any ``optax.Schedule`` (e.g.
      :func:`optax_gsam.rho_from_lr`), read at the transform's own step count.
    alpha: weight of the surrogate-gap term, >= 0.
    eps: :math:`\varepsilon` > 0, guards every division.
    adaptive: ``None``; ``"gsam"`` for :math:`\epsilon = \rho |w| g_c / \|g_c\|`
      (GSAM paper, big_vision's ``adaptive_perturbation``); ``"asam"`` for
      :math:`\epsilon = \rho w^2 g_c / \| |w| g_c \|` (Kwon et al., 2021).
    minimize_fp: the decomposition branch (see above).
    sync_perturbation: average :math:`g_c` over ``axis_name`` before perturbing.
    axis_name: the data-parallel axis name, or ``None`` on a single device or
      under ``jax.jit`` with globally sharded arrays (gradients are global
      there, which behaves as synchronized).
    num_groups: emulate this many devices sequentially on one (see above).
    perturb_every: shorthand for ``policy=every_k_policy(perturb_every,
      reuse_weight=reuse_weight)`` (``None`` or 1: every step). A static int.
    reuse_weight: :math:`\lambda` of ``perturb_every``, a float >= 0 or a
      schedule (0.7 when not given).
    policy: when to take the full step (see above); ``None`` is
      :func:`optax_gsam.every_step_policy`. Not together with
      ``perturb_every``/``reuse_weight``.
    on_nonfinite: ``"propagate"`` or ``"clean"`` (see above).
    check_axis: with ``axis_name=None``, raise a ``ValueError`` when ``update``
      runs under a mapped axis (``jax.pmap``, ``jax.shard_map``, a named
      ``jax.vmap``), where each replica would perturb with its own gradient and
      nothing would average the outputs. Set ``False`` where that axis is not
      a data axis (a named ``jax.vmap`` over seeds, say), or where the
      gradients given to ``update`` are already global and identical on every
      replica, e.g. those of :func:`optax_gsam.cached_value_and_grad` with its
      own ``axis_name``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`GSAMState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> def loss_fn(w):
    ...   return jnp.sum((w - 1.0) ** 4)
    >>> tx = optax.chain(optax_gsam.gsam(rho=0.05, alpha=0.3), optax.sgd(0.1))
    >>> w = jnp.zeros(3)
    >>> state = tx.init(w)
    >>> loss, grads = jax.value_and_grad(loss_fn)(w)
    >>> updates, state = tx.update(grads, state, w, loss_fn=loss_fn, value=loss)
    >>> w = optax.apply_updates(w, updates)
    >>> bool(optax.tree.get(state, "surrogate_gap") > 0)  # the ascent step raised the loss
    True

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.

    Foret et al., `Sharpness-Aware Minimization for Efficiently Improving
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021.

    Kwon et al., `ASAM: Adaptive Sharpness-Aware Minimization
    <https://arxiv.org/abs/2102.11600>`_, ICML 2021.

    Liu et al., `Towards Efficient and Scalable Sharpness-Aware Minimization
    <https://arxiv.org/abs/2203.02714>`_, CVPR 2022.
  """
  _check_call_arguments(rho, num_groups, perturb_every, check_axis)
  policy = policy_from_arguments(policy, perturb_every, reuse_weight)
  settings = _validated(
    step.Settings(
      alpha=alpha,
      eps=eps,
      adaptive=adaptive,
      minimize_fp=minimize_fp,
      sync_perturbation=sync_perturbation,
      axis_name=axis_name,
      num_groups=num_groups,
      policy=policy,
      on_nonfinite=on_nonfinite,
    )
  )

  init_fn = functools.partial(_initial_state, policy)

  def update_fn(
    updates: optax.Updates,
    state: GSAMState,
    params: optax.Params | None = None,
    *,
    loss_fn: Callable | None = None,
    value_and_grad_fn: Callable | None = None,
    value: jax.Array | None = None,
    perturb: bool | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, GSAMState]:
    params = numbers_as_arrays(params)
    _check_update(updates, state, params, perturb, extra_args, policy, check_axis, axis_name)
    hyper = step.hyperparams_at(rho, policy, state.count, alpha)
    context = step.StepContext(
      settings, hyper, state.policy_state, state.count, state.stored_direction, state.diagnostics
    )
    if num_groups is None:
      grad_fn = value_and_grad_from(loss_fn, value_and_grad_fn)
      clean_loss = scalar_loss(value) if value is not None else None
      outcome, policy_state = step.replicated_update(
        context, updates, params, grad_fn, clean_loss, perturb
      )
    else:
      group_fn = group_value_and_grad(loss_fn, value_and_grad_fn)
      outcome, policy_state = step.grouped_update(context, updates, params, group_fn, perturb)
    return outcome.gradient, _next_state(state, hyper, outcome, policy_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sam(
  rho: optax.ScalarOrSchedule,
  *,
  eps: float = 1e-12,
  adaptive: Adaptive = None,
  sync_perturbation: bool = False,
  axis_name: AxisName = None,
  num_groups: int | None = None,
  perturb_every: int | None = None,
  reuse_weight: optax.ScalarOrSchedule = REUSE_WEIGHT_NOT_GIVEN,
  policy: SharpnessPolicy | None = None,
  on_nonfinite: str = "propagate",
  check_axis: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Sharpness-Aware Minimization (SAM): :func:`gsam` with ``alpha=0``.

  .. math::

    \epsilon = \rho_t \, g_c / (\|g_c\| + \varepsilon), \qquad
    g = \nabla f(w + \epsilon)

  The output is the gradient at the perturbed weights; the optimizer chained
  after it applies it to the unperturbed weights. ``adaptive="asam"`` gives
  ASAM; ``perturb_every=k`` gives LookSAM. Arguments and the ``update``
  protocol are those of :func:`gsam`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> loss_fn = lambda w: jnp.sum(jnp.cos(w))
    >>> tx = optax.chain(optax_gsam.sam(rho=0.05), optax.adam(1e-3))
    >>> w = jnp.ones(4)
    >>> grads = jax.grad(loss_fn)(w)
    >>> updates, state = tx.update(grads, tx.init(w), w, loss_fn=loss_fn)

  References:
    Foret et al., `Sharpness-Aware Minimization for Efficiently Improving
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021.
  """
  return gsam(
    rho,
    0.0,
    eps=eps,
    adaptive=adaptive,
    minimize_fp=True,
    sync_perturbation=sync_perturbation,
    axis_name=axis_name,
    num_groups=num_groups,
    perturb_every=perturb_every,
    reuse_weight=reuse_weight,
    policy=policy,
    on_nonfinite=on_nonfinite,
    check_axis=check_axis,
  )


def _find_state(opt_state: Any) -> GSAMState:
  found = [
    leaf
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, GSAMState))
    if isinstance(leaf, GSAMState)
  ]
  if len(found) != 1:
    raise ValueError(
      f"opt_state must hold exactly one GSAMState (the state of gsam or sam), found {len(found)}."
    )
  return found[0]


def full_step_due(
  opt_state: Any,
  grads: optax.Updates,
  *,
  policy: SharpnessPolicy | None = None,
  rho: optax.ScalarOrSchedule,
  axis_name: AxisName = None,
) -> jax.Array:
  r"""Whether the next ``update`` would take the full step: the policy's answer, ahead of it.

  For the static protocol: jit one step per branch (``update(...,
  perturb=True)`` and ``perturb=False``) and pick it in Python with this
  function, so no ``lax.cond`` is traced. It evaluates the policy's decision
  (and :math:`\rho_t > 0`) at the state's step without changing the state;
  the ``update`` that follows advances the policy's state as usual.

  Args:
    opt_state: the optimizer state holding one :class:`GSAMState`, e.g. a
      chain's (unreplicated: one device's copy under ``pmap``).
    grads: the clean gradient of this step, read by
      :func:`optax_gsam.gradient_norm_policy` only.
    policy: the policy given to :func:`gsam` (``None``: the default; with
      ``perturb_every=k``, pass ``every_k_policy(k)``).
    rho: the ``rho`` given to :func:`gsam`.
    axis_name: for per-device perturbation, the transform's ``axis_name``:
      call this inside the mapped function with each device's own ``grads``,
      and it averages the squared gradient norms over the axis exactly as
      ``update`` does. With synchronized perturbation, or on one device, leave
      it ``None`` and pass the global gradient.

  Returns:
    A bool scalar array.

  Raises:
    ValueError: if ``policy`` is not the one the state was built with (its
      state or its stored direction does not match).

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> policy = optax_gsam.every_k_policy(3)
    >>> tx = optax.chain(optax_gsam.sam(0.05, policy=policy), optax.sgd(0.1))
    >>> state = tx.init(jnp.ones(2))
    >>> bool(optax_gsam.full_step_due(state, jnp.ones(2), policy=policy, rho=0.05))
    True
  """
  policy = policy_from_arguments(policy, None, None)
  state = _find_state(opt_state)
  same_state = jax.tree.structure(policy.init()) == jax.tree.structure(state.policy_state)
  if not same_state or policy.stores_direction != (state.stored_direction is not None):
    raise ValueError(
      f"policy ({policy.name!r}) is not the policy this optimizer state was built with: pass "
      "full_step_due the policy given to gsam/sam (every_k_policy(k) for perturb_every=k)."
    )
  hyper = step.hyperparams_at(rho, policy, state.count)
  due, _ = step.decide(policy, state.policy_state, state.count, hyper, grads, axis_name)
  return jnp.asarray(due)
