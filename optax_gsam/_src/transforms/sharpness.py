"""GSAM and SAM as optax gradient transformations.

``update`` runs the stages of :mod:`optax_gsam._src.step.step` in order:
hyperparameters at the step, the policy's choice, the full or cheap step of
each replica, the reduction over ``axis_name`` or the micro-batches, and the
new state. The arguments' checks and deprecated aliases are in
:mod:`optax_gsam._src.transforms.gsam_arguments`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.placement import check_not_in_multisteps
from optax_gsam._src.calls.placement import check_placement
from optax_gsam._src.calls.user_functions import read_update_arguments
from optax_gsam._src.calls.user_functions import scalar_loss
from optax_gsam._src.core.arrays import numbers_as_arrays
from optax_gsam._src.core.keywords import takes_keywords
from optax_gsam._src.directions.ascent_checks import check_direction
from optax_gsam._src.fine_tuning.frozen import check_frozen
from optax_gsam._src.fine_tuning.frozen import with_frozen
from optax_gsam._src.microbatches import microbatch_state as micro
from optax_gsam._src.policies.policies import (
  SharpnessPolicy as SharpnessPolicy,  # SharpnessOptions' types
)
from optax_gsam._src.policies.policies import keep_unless_counted
from optax_gsam._src.policies.policies import policy_from_arguments
from optax_gsam._src.step import hyperparams
from optax_gsam._src.step import step
from optax_gsam._src.step.state import GSAMState
from optax_gsam._src.transforms.gsam_arguments import SHARPNESS_DEFAULTS
from optax_gsam._src.transforms.gsam_arguments import SharpnessOptions
from optax_gsam._src.transforms.gsam_arguments import check_call_arguments
from optax_gsam._src.transforms.gsam_arguments import check_update
from optax_gsam._src.transforms.gsam_arguments import microbatch_settings
from optax_gsam._src.transforms.gsam_arguments import validated
from optax_gsam._src.transforms.gsam_arguments import warn_deprecated
from optax_gsam.typing import Adaptive as Adaptive  # SharpnessOptions' types, as SharpnessPolicy
from optax_gsam.typing import AxisName as AxisName

if TYPE_CHECKING:  # PEP 692's Unpack is typing's own from Python 3.12
  from typing_extensions import Unpack


def _next_state(
  state: GSAMState,
  hyper: hyperparams.Hyperparams,
  outcome: step.Outcome,
  policy_state: Any,
  evaluations: tuple[int, int],
  counts: jax.Array,
) -> GSAMState:
  """Stage 6: a step whose output is not finite does not count.

  With the rest of the chain behind ``optax.apply_if_finite``, rho schedules
  then stay aligned with the optimizers after this one. ``evaluations`` is the
  number of whole-batch gradients a full and a cheap step evaluate; ``counts``
  whether the output is finite.
  """
  increment = lambda count, flag: jnp.where(flag, optax.safe_increment(count), count)
  perturbed_loss_ok = jnp.isfinite(outcome.diagnostics.perturbed_loss)
  evaluated = jnp.where(outcome.full, evaluations[0], evaluations[1]).astype(jnp.int32)
  return GSAMState(
    count=increment(state.count, counts),
    last_rho=hyper.rho.astype(jnp.float32),
    **outcome.diagnostics._asdict(),
    full_steps=increment(
      state.full_steps, outcome.full & counts & perturbed_loss_ok & ~outcome.fell_back
    ),
    fallback_count=increment(state.fallback_count, outcome.fell_back),
    gradient_evaluations=state.gradient_evaluations + evaluated,
    policy_state=keep_unless_counted(counts, policy_state, state.policy_state),
    stored_direction=step.keep_learned(outcome, outcome.stored_direction, state.stored_direction),
    ascent_state=step.keep_learned(outcome, outcome.ascent_state, state.ascent_state),
  )


def _run_stages(context, updates, params, grad_fn, clean_loss, perturb, inputs):
  """Stages 2 to 5 for the step's layout: whole batch, accumulated micro-batches, or one
  perturbation per micro-batch. Also returns how many whole-batch gradients a full and a
  cheap step evaluate."""
  settings = context.settings
  ascent_steps = settings.ascent_steps
  if settings.num_groups is not None:  # One perturbation per micro-batch.
    fns = micro.group_fns(grad_fn, inputs, settings.num_groups, settings.axis_name)
    like = params if updates is None else updates
    outcome, policy_state = step.grouped_update(context, like, params, fns, perturb)
    return outcome, policy_state, (1 + ascent_steps, 1)
  accumulating = 0
  if settings.microbatches is not None:  # Whole-batch semantics, one micro-batch live.
    grad_fn = micro.whole_batch_grad_fn(grad_fn, inputs, settings.microbatches, settings.axis_name)
    if updates is None:
      clean_loss, updates = grad_fn(params)
      accumulating = 1
  outcome, policy_state = step.replicated_update(
    context, updates, params, grad_fn, clean_loss, perturb
  )
  return outcome, policy_state, (ascent_steps + accumulating, accumulating)


def _checked_before_use(
  gradient: optax.Updates, finite: jax.Array
) -> tuple[optax.Updates, jax.Array]:
  """The output and whether it is finite, the check ordered before the output's readers on CPU.

  XLA's CPU compiler may otherwise schedule the check's reduction after the stages of the chain
  that read the output, which then cannot write their results over it: one params-sized
  buffer more (SAM with micro-batches before SGD, tests/test_microbatches.py).
  """
  checked = (gradient, finite)
  return jax.lax.platform_dependent(
    checked, cpu=jax.lax.optimization_barrier, default=lambda pair: pair
  )


def _initial_state(settings: step.Settings, params: optax.Params) -> GSAMState:
  check_not_in_multisteps("gsam/sam")
  # A fresh buffer per field: a donated state must not hold one buffer twice.
  zero = lambda: jnp.zeros([], jnp.float32)
  zero_count = lambda: jnp.zeros([], jnp.int32)
  policy = settings.policy
  check_direction(settings.ascent, settings.mask, params)  # descent or pass-through: refused
  return GSAMState(
    count=zero_count(),
    last_rho=zero(),
    **{name: zero() for name in step.Diagnostics._fields},
    full_steps=zero_count(),
    fallback_count=zero_count(),
    gradient_evaluations=zero_count(),
    policy_state=policy.init(),
    stored_direction=optax.tree.zeros_like(params) if policy.stores_direction else None,
    ascent_state=settings.direction.init(params),
  )


def _update_fn(settings: step.Settings, rho: optax.ScalarOrSchedule, check_axis: bool) -> Callable:
  """The ``update`` of :func:`gsam`: checks, then the stages of :mod:`optax_gsam._src.step.step`."""

  def update_fn(
    updates: optax.Updates | None,
    state: GSAMState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, GSAMState]:
    check_placement("gsam/sam")
    call = read_update_arguments(extra_args, "gsam/sam")
    params = numbers_as_arrays(params)
    inputs = micro.MicrobatchInputs(call.batch, call.key, call.model_state)
    check_update(updates, state, params, call.perturb, settings, check_axis, inputs)
    hyper = hyperparams.hyperparams_at(rho, settings.policy, state.count, settings.alpha)
    context = step.StepContext(
      settings,
      hyper,
      state.policy_state,
      state.count,
      state.stored_direction,
      state.diagnostics,
      state.ascent_state,
    )
    grad_fn = micro.user_grad_fn(call.loss_fn, call.value_and_grad_fn, inputs, settings.split)
    clean_loss = scalar_loss(call.value) if call.value is not None else None
    outcome, policy_state, evaluations = _run_stages(
      context, updates, params, grad_fn, clean_loss, call.perturb, inputs
    )
    gradient, counts = _checked_before_use(outcome.gradient, outcome.finite)
    outcome = outcome._replace(gradient=gradient)
    return gradient, _next_state(state, hyper, outcome, policy_state, evaluations, counts)

  return update_fn


@takes_keywords(SharpnessOptions, SHARPNESS_DEFAULTS)
def gsam(
  rho: optax.ScalarOrSchedule,
  alpha: float | jax.Array = 0.0,
  *,
  minimize_fp: bool = True,
  **options: Unpack[SharpnessOptions],
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

  ``update(updates, state, params, *, loss_fn=..., value=...)`` takes the
  loss function (params -> loss, or ``(loss, aux)``) or ``value_and_grad_fn``;
  ``value``, the clean loss, feeds the surrogate-gap diagnostic. The update
  call, data parallelism, micro-batches, ascent directions, frozen leaves,
  cheap-step policies, non-finite steps and ``inject_hyperparams`` are
  described option by option in docs/options.md.

  Args:
    rho: the perturbation radius, a float >= 0 or any ``optax.Schedule`` (e.g.
      :func:`optax_gsam.rho_from_lr`), read at the transform's own step count.
    alpha: weight of the surrogate-gap term, >= 0 (0 is SAM).
    minimize_fp: the decomposition branch of the maths above.
    **options: the keywords gsam and sam share: ``eps`` (> 0, guards every
      division), ``sync_perturbation``, ``axis_name``, ``check_axis``,
      ``policy``, ``on_nonfinite``, ``diagnostics``, ``ascent``,
      ``ascent_steps``, ``mask``, ``frozen``, ``microbatches`` and
      ``perturb_each_microbatch`` (docs/options.md, "Every argument").

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
  return _transform("gsam", rho, alpha, minimize_fp, options)


@takes_keywords(SharpnessOptions, SHARPNESS_DEFAULTS)
def sam(
  rho: optax.ScalarOrSchedule, **options: Unpack[SharpnessOptions]
) -> optax.GradientTransformationExtraArgs:
  r"""Sharpness-Aware Minimization (SAM): :func:`gsam` with ``alpha=0``.

  .. math::

    \epsilon = \rho_t \, g_c / (\|g_c\| + \varepsilon), \qquad
    g = \nabla f(w + \epsilon)

  The output is the gradient at the perturbed weights; the optimizer chained
  after it applies it to the unperturbed weights. ``ascent=adaptive_ascent("asam")``
  gives ASAM; ``policy=every_k_policy(k)`` gives LookSAM. Arguments and the ``update``
  protocol are those of :func:`gsam` (docs/options.md).

  Args:
    rho: the perturbation radius, a float >= 0 or any ``optax.Schedule``.
    **options: the keywords of :func:`gsam`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`GSAMState`.

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
  return _transform("sam", rho, 0.0, True, options)


def _transform(factory, rho, alpha, minimize_fp, options):
  """The transform of ``factory``'s arguments, validated; the aliases read as their replacements.

  ``options`` holds every keyword of :class:`SharpnessOptions` (the defaults filled in).
  """
  # Counted from warn_deprecated: _transform, gsam or sam, the wrapper of takes_keywords, then
  # the caller the warning names.
  warn_deprecated(factory, options, stacklevel=4)
  arguments = dict(options)
  check_axis, num_groups = arguments.pop("check_axis"), arguments.pop("num_groups")
  perturb_every, reuse_weight = arguments.pop("perturb_every"), arguments.pop("reuse_weight")
  check_call_arguments(rho, num_groups, perturb_every, check_axis)
  policy = policy_from_arguments(arguments.pop("policy"), perturb_every, reuse_weight)
  num_groups, whole_batch_microbatches = microbatch_settings(
    arguments.pop("microbatches"),
    arguments.pop("perturb_each_microbatch"),
    num_groups,
    arguments["sync_perturbation"],
  )
  ascent_steps = arguments.pop("ascent_steps")
  frozen = arguments.pop("frozen")
  check_frozen(frozen)
  settings = validated(
    step.Settings(
      alpha=alpha,
      minimize_fp=minimize_fp,
      num_groups=num_groups,
      policy=policy,
      ascent_steps=1 if ascent_steps is None else ascent_steps,
      microbatches=whole_batch_microbatches,
      **arguments,
    )
  )
  transform = optax.GradientTransformationExtraArgs(
    functools.partial(_initial_state, settings), _update_fn(settings, rho, check_axis)
  )
  return with_frozen(transform, factory, frozen, settings.mask)
