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
from optax_gsam._src.core.arrays import all_finite
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
  hyper: step.Hyperparams,
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


def _checked_before_use(gradient: optax.Updates) -> tuple[optax.Updates, jax.Array]:
  """The output and whether it is finite, the check ordered before the output's readers on CPU.

  XLA's CPU compiler may otherwise schedule the check's reduction after the stages of the chain
  that read the output, which then cannot write their results over it: one params-sized
  buffer more (SAM with micro-batches before SGD, tests/test_microbatches.py).
  """
  checked = (gradient, all_finite(gradient))
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
    hyper = step.hyperparams_at(rho, settings.policy, state.count, settings.alpha)
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
    gradient, counts = _checked_before_use(outcome.gradient)
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
    (two on the full steps of a ``cheap="reuse"`` policy such as
    :func:`optax_gsam.every_k_policy`, which also average the stored
    direction).
  * ``sync_perturbation=True``: :math:`g_c` is averaged before perturbing and
    :math:`g_p` before the decomposition, which equals single-device GSAM on
    the global batch. Two gradient-sized all-reduces.

  **Micro-batches.** With ``microbatches=k``, ``update(updates, state,
  params, loss_fn=..., batch=batch)`` takes ``loss_fn(params, microbatch)``
  (or ``value_and_grad_fn(params, microbatch)``) and splits every leaf of
  ``batch`` along its leading axis into k equal micro-batches, evaluated one
  at a time in a ``lax.scan`` (one micro-batch's activations and one
  params-sized sum live). Without ``batch``, the function receives the
  micro-batch index (an int32 scalar in ``[0, k)``). ``key=`` appends micro-batch
  i's key ``fold_in(key, i)`` (the same in both passes); ``model_state=`` carries
  state through the micro-batches (see :func:`optax_gsam.accumulate_value_and_grad`,
  which runs the clean pass and returns the new state). Two semantics:

  * whole batch (default): :math:`g_c` and :math:`g_p` are the means over the
    micro-batches, the weights are perturbed once along the whole batch's
    :math:`g_c`; the result is GSAM on the whole batch. ``updates=None`` lets
    the transform accumulate :math:`g_c` too (and the clean loss, for the
    surrogate gap); otherwise ``updates`` is the caller's whole-batch
    :math:`g_c`.
  * ``perturb_each_microbatch=True``: each micro-batch is perturbed along its
    own clean gradient (m-sharpness with m the micro-batch size) and the
    output is the mean of the micro-batches' GSAM gradients; the values of
    ``updates`` are not read (pass ``None``).

  Both work with ``axis_name`` (they split each device's batch). See
  docs/large_batches.md. ``optax.MultiSteps`` around the transform is
  refused (but for ``every_k_schedule=1``): it would perturb along the
  accumulated gradient but evaluate only the last micro-batch's ``loss_fn``.

  **The ascent stage.** ``ascent`` is an ``optax.GradientTransformation``
  mapping a gradient to a perturbation of radius 1 (the default is
  :func:`optax_gsam.normalized_ascent`; see :func:`optax_gsam.adaptive_ascent`,
  :func:`optax_gsam.friendly_ascent` and :func:`optax_gsam.vasso_ascent`);
  its state is ``GSAMState.ascent_state``. ``ascent_steps=n`` takes n steps
  of length :math:`\rho_t / n`, each along the direction of the gradient at
  the point reached; a stateful direction advances once, from :math:`g_c`.
  ``mask`` (a pytree of Python bools, or a function of the params returning
  one, as ``optax.masked`` takes) restricts the perturbation to the selected
  leaves; every leaf's gradient is still taken at the perturbed point. The
  transform must be the first stage of its ``optax.chain`` (a stage before
  it would be lost; this is refused, but for ``optax.identity()`` and
  :func:`optax_gsam.passthrough` stages), and not inside ``optax.masked``
  (use ``mask``). See docs/directions.md.

  **Frozen parameters.** ``frozen`` names the leaves that a later stage
  freezes (``optax.set_to_zero()`` in ``optax.partition``, ``optax.freeze``):
  the transform then runs on the trained leaves alone. A frozen leaf is not
  perturbed, takes no part in the norms and inner products, has no gradient
  in the perturbed pass (``loss_fn`` gets its value, held constant) and no
  state, and its output is zero. With ``frozen=None`` and ``mask=None``, a
  later partition or freeze that zeros leaves the transform perturbs is
  warned about while the update is traced. See docs/fine_tuning.md.

  **Cheap steps.** A ``policy`` (:class:`optax_gsam.SharpnessPolicy`) decides
  at each step between the full step above and a cheap one that needs only
  :math:`g_c`: the clean gradient itself (``cheap="clean"``, a plain
  base-optimizer step) or :math:`g_c + \lambda_t \|g_c\| v / \|v\|`, which
  adds back :math:`v = g^{\perp g_c}`, the part of the last full step's output
  orthogonal to the clean gradient (``cheap="reuse"``, LookSAM). For GSAM,
  :math:`v` also carries the surrogate-gap term. The policies:
  :func:`optax_gsam.every_step_policy` (the default),
  :func:`optax_gsam.every_k_policy` (LookSAM), :func:`optax_gsam.gradient_norm_policy`
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
  ``GSAMState.fallback_count`` counts it and ``GSAMState.last_rho`` shows the
  value. An injected alpha that is traced (``inject_hyperparams`` under
  ``jit``) is treated alike. A float rho or alpha, or a concrete array, is
  checked when the transform is built.

  Under ``optax.inject_hyperparams(optax_gsam.gsam)``, rho, alpha and eps
  become injectable; a ``mask`` function goes in ``static_args``, and
  ``policy`` and ``ascent`` stay static (schedule a policy's weight with
  ``every_k_policy(k, reuse_weight=schedule)``). Injected values take the params' dtype
  unless ``hyperparam_dtype`` is given, so with bfloat16 params pass
  ``hyperparam_dtype=jnp.float32``; a scheduled rho is then read at
  ``inject_hyperparams``' own count.

  Args:
    rho: the perturbation radius, a float >= 0 or any ``optax.Schedule`` (e.g.
      :func:`optax_gsam.rho_from_lr`), read at the transform's own step count.
    alpha: weight of the surrogate-gap term, >= 0.
    eps: :math:`\varepsilon` > 0, guards every division.
    minimize_fp: the decomposition branch (see above).
    sync_perturbation: average :math:`g_c` over ``axis_name`` before perturbing.
    axis_name: the data-parallel axis name, or ``None`` on a single device or
      under ``jax.jit`` with globally sharded arrays (gradients are global
      there, which behaves as synchronized).
    policy: when to take the full step (see above); ``None`` is
      :func:`optax_gsam.every_step_policy`.
    on_nonfinite: ``"propagate"`` or ``"clean"`` (see above).
    diagnostics: record each full step's gradient statistics (the state's
      ``cosine``, ``clean_grad_norm`` and ``perturbed_grad_norm``). ``False``
      leaves them 0 and does not compute them: :func:`sam` then reads the clean
      gradient only to perturb, so it is freed before the perturbed pass ends
      (one params-sized buffer less; GSAM's decomposition needs it anyway). The
      losses are always recorded.
    check_axis: with ``axis_name=None``, raise a ``ValueError`` when ``update``
      runs under a mapped axis (``jax.pmap``, ``jax.shard_map``, a named
      ``jax.vmap``), where each replica would perturb with its own gradient and
      nothing would average the outputs. Set ``False`` where that axis is not
      a data axis (a named ``jax.vmap`` over seeds, say), or where the
      gradients given to ``update`` are already global and identical on every
      replica, e.g. those of :func:`optax_gsam.cached_value_and_grad` with its
      own ``axis_name``.
    ascent: the ascent direction, an ``optax.GradientTransformation`` (see
      above); ``None`` is :func:`optax_gsam.normalized_ascent`.
    ascent_steps: the number of ascent steps n >= 1 (``None``: 1); a full step
      evaluates n gradients besides the clean one.
    mask: which params leaves are perturbed (see above); ``None``: all.
    frozen: which params leaves are frozen (see above), as ``optax.freeze``'s
      mask: a pytree of Python bools (True: frozen), a prefix of params, or a
      function params -> one, e.g.
      :func:`optax_gsam.frozen_leaves` of an ``optax.partition``. ``None``:
      every leaf is trained.
    microbatches: split ``batch=`` into this many micro-batches (see above).
    perturb_each_microbatch: one perturbation per micro-batch instead of one
      for the whole batch.
    adaptive: deprecated, ``ascent=optax_gsam.adaptive_ascent(adaptive, eps)``.
    perturb_every: deprecated, ``policy=optax_gsam.every_k_policy(k,
      reuse_weight=w)`` (``None`` or 1: the default policy).
    reuse_weight: deprecated, the ``w`` above (``None``: 0.7).
    num_groups: deprecated, ``microbatches=G, perturb_each_microbatch=True``.

  The four deprecated keywords still work as the replacements above; each call
  that gives one warns with a ``DeprecationWarning`` naming the replacement,
  and they will be removed after 1.0 (see CHANGELOG.md).

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
