"""Momentum-SAM: a sharpness-aware step at the cost of one gradient evaluation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.placement import check_not_in_multisteps
from optax_gsam._src.calls.placement import check_not_masked
from optax_gsam._src.calls.placement import check_placement
from optax_gsam._src.calls.user_functions import UpdateArguments
from optax_gsam._src.calls.user_functions import read_update_arguments
from optax_gsam._src.calls.user_functions import scalar_loss
from optax_gsam._src.core.arrays import all_finite
from optax_gsam._src.core.arrays import conform
from optax_gsam._src.core.arrays import numbers_as_arrays
from optax_gsam._src.core.arrays import zeros_accumulator
from optax_gsam._src.core.keywords import runtime_signature
from optax_gsam._src.core.validation import check_axis_name
from optax_gsam._src.core.validation import check_data_axis_is_set
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_params_leaves
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.core.validation import check_unit_interval
from optax_gsam._src.core.validation import check_update_inputs
from optax_gsam._src.directions import perturbation as pert
from optax_gsam._src.directions.ascent import MaskOrFn
from optax_gsam._src.directions.ascent import check_mask
from optax_gsam._src.directions.ascent import resolve_mask
from optax_gsam._src.directions.ascent import select_leaves
from optax_gsam._src.fine_tuning.frozen import FrozenOrFn
from optax_gsam._src.fine_tuning.frozen import check_frozen
from optax_gsam._src.fine_tuning.frozen import with_frozen
from optax_gsam._src.microbatches.microbatch_state import MicrobatchInputs
from optax_gsam._src.microbatches.microbatch_state import user_grad_fn
from optax_gsam._src.microbatches.microbatch_state import whole_batch_grad_fn
from optax_gsam._src.policies.schedules import value_at
from optax_gsam._src.step import step
from optax_gsam.typing import AxisName


class MomentumSAMState(NamedTuple):
  """State of :func:`momentum_sam`.

  Attributes:
    count: number of updates with a finite output; rho schedules read it.
    last_rho: the radius of the last update (named as in
      :class:`optax_gsam.GSAMState`).
    perturbed_loss: the loss at the perturbed weights of the last update.
    momentum: :math:`v_t`, the running sum of past outputs (params-shaped, in
      float32 at least). A non-finite gradient leaves it unchanged.
    fallback_count: how many updates had a rho schedule value that is not a
      finite number >= 0; those evaluate the gradient at the unperturbed
      weights (the clean gradient) and count.
  """

  count: jax.Array  # type: ignore[assignment]  # the field shadows tuple.count, as in optax
  last_rho: jax.Array
  perturbed_loss: jax.Array
  momentum: optax.Updates
  fallback_count: jax.Array


# What momentum_sam's update reads (perturb= only to refuse a step without the perturbation).
# Not value=: it has no clean pass whose loss to record.
_READS = ("loss_fn", "value_and_grad_fn", "perturb", "batch", "key", "model_state")


def _whole_batch_grad_fn(call: UpdateArguments, microbatches, inputs, axis_name) -> Callable:
  """The user's function, accumulated over micro-batches where ``microbatches`` is set."""
  if inputs.model_state is not None:
    raise ValueError(
      "momentum_sam does not read model_state=: its one pass is at the perturbed weights, so "
      "it has no clean pass whose state to keep. Close over the state in loss_fn."
    )
  grad_fn = user_grad_fn(call.loss_fn, call.value_and_grad_fn, inputs, microbatches, "momentum_sam")
  if microbatches is not None:
    return whole_batch_grad_fn(grad_fn, inputs, microbatches, axis_name)
  if inputs.given:
    raise ValueError(
      f"update() got {inputs.given[0]}=, which momentum_sam reads only with microbatches=k."
    )
  return grad_fn


def _check_arguments(rho, momentum, eps, axis_name, check_axis, microbatches, mask, frozen):
  """Every argument of :func:`momentum_sam`, checked when it is called."""
  check_non_negative("rho", rho, allow_schedule=True)
  check_unit_interval("momentum", momentum, include_one=False)
  check_positive("eps", eps)
  check_axis_name(axis_name)
  check_positive_int("microbatches", microbatches, allow_none=True)
  check_mask(mask)
  check_frozen(frozen)
  if not isinstance(check_axis, bool):
    raise ValueError(f"check_axis must be a bool, got {check_axis!r}.")


def _checked_params(params: optax.Params) -> optax.Params:
  """``init``'s checks: not inside optax.MultiSteps, and params whose leaves are arrays."""
  check_not_in_multisteps("momentum_sam")
  params = numbers_as_arrays(params)
  check_params_leaves(params)
  return params


def _next_state(state, grads, loss, rho_t, rho_ok, momentum) -> MomentumSAMState:
  """A non-finite gradient does not count and leaves the momentum as it was."""
  finite = all_finite(grads)
  momentum_next = jax.tree.map(
    lambda v, g: jnp.where(finite, momentum * v + g, v),
    state.momentum,
    conform(grads, state.momentum),
  )
  increment = lambda count, flag: jnp.where(flag, optax.safe_increment(count), count)
  return MomentumSAMState(
    count=increment(state.count, finite),
    last_rho=rho_t.astype(jnp.float32),
    perturbed_loss=loss,
    momentum=momentum_next,
    fallback_count=increment(state.fallback_count, finite & ~rho_ok),
  )


@runtime_signature
def momentum_sam(
  rho: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  *,
  eps: float = 1e-12,
  axis_name: AxisName = None,
  check_axis: bool = True,
  microbatches: int | None = None,
  mask: MaskOrFn = None,
  frozen: FrozenOrFn = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Momentum-SAM (MSAM): perturb along past gradients, evaluate one gradient.

  SAM spends a gradient evaluation on finding the ascent direction. MSAM uses
  the direction the optimizer has been moving in instead: with the running
  momentum :math:`v_t` of the gradients this transform has output,

  .. math::

    \tilde w_t = w_t - \rho_t \, v_t / (\|v_t\| + \varepsilon), \qquad
    g_t = \nabla f(\tilde w_t), \qquad
    v_{t+1} = \mu v_t + g_t,

  and :math:`g_t` is the output, which the optimizer after the transform
  applies to :math:`w_t`. ``optax.chain(momentum_sam(rho, mu),
  optax.sgd(lr, momentum=mu))`` is the paper's SGD-MSAM; with Adam, use
  ``mu = b1`` (the perturbation is normalized, so :math:`v_t` and Adam's first
  moment give the same direction).

  Each step evaluates ``loss_fn`` once, at :math:`\tilde w_t`: the values of
  the input ``updates`` are not read (only their structure is checked), so a
  train step skips its clean pass and passes
  ``optax.tree.zeros_like(params)``. That is where the 1x cost comes from; the
  price is one params-sized buffer and no clean loss or gradient (no
  surrogate-gap diagnostic). ``update(updates, state, params, *, loss_fn=None,
  value_and_grad_fn=None, **extra_args)`` takes the loss function as
  :func:`optax_gsam.gsam` does. With ``axis_name``, the gradient and the loss
  are averaged over that axis; :math:`v_t` is then the same on every device.

  Args:
    rho: the radius :math:`\rho_t` >= 0, a float or a schedule.
    momentum: :math:`\mu` in [0, 1).
    eps: :math:`\varepsilon` > 0, guards the normalization (a zero :math:`v`,
      as at the first step, gives no perturbation).
    axis_name: the data-parallel axis name, or ``None``.
    check_axis: as in :func:`optax_gsam.gsam`: with ``axis_name=None``, raise
      under a mapped axis unless this is ``False``.
    microbatches: as in :func:`optax_gsam.gsam`: ``update(..., batch=batch)``
      with ``loss_fn(params, microbatch)`` evaluates the perturbed gradient of
      the whole batch as the mean over this many micro-batches, one live at a
      time; ``update(..., key=key)`` gives micro-batch i the key
      ``jax.random.fold_in(key, i)`` as ``loss_fn``'s last argument.
    mask: as in :func:`optax_gsam.gsam`: only the selected leaves are moved,
      along :math:`m \odot v_t / \|m \odot v_t\|`; the gradient of every leaf
      is taken at the perturbed point, and :math:`v_t` keeps every leaf.
    frozen: as in :func:`optax_gsam.gsam`: the frozen leaves are not
      perturbed and not differentiated, :math:`v_t` has no entries for them,
      and their output is zero.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`MomentumSAMState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> loss_fn = lambda w: jnp.sum((w - 1.0) ** 2)
    >>> tx = optax.chain(optax_gsam.momentum_sam(0.05), optax.sgd(0.1, momentum=0.9))
    >>> w = jnp.zeros(3)
    >>> state = tx.init(w)
    >>> for _ in range(3):
    ...   updates, state = tx.update(optax.tree.zeros_like(w), state, w, loss_fn=loss_fn)
    ...   w = optax.apply_updates(w, updates)
    >>> bool(jnp.all(w > 0))
    True

  References:
    Becker et al., `Momentum-SAM: Sharpness Aware Minimization without
    Computational Overhead <https://arxiv.org/abs/2401.12033>`_, 2024.
  """
  _check_arguments(rho, momentum, eps, axis_name, check_axis, microbatches, mask, frozen)

  def init_fn(params: optax.Params) -> MomentumSAMState:
    params = _checked_params(params)
    return MomentumSAMState(  # One buffer per field, so that the state can be donated.
      count=jnp.zeros([], jnp.int32),
      last_rho=jnp.zeros([], jnp.float32),
      perturbed_loss=jnp.zeros([], jnp.float32),
      # Accumulated in float32 at least: bfloat16 would lose the sum's small terms.
      momentum=jax.tree.map(zeros_accumulator, params),
      fallback_count=jnp.zeros([], jnp.int32),
    )

  def update_fn(
    updates: optax.Updates | None,
    state: MomentumSAMState,
    params: optax.Params | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, MomentumSAMState]:
    check_placement("momentum_sam")
    call = read_update_arguments(extra_args, "momentum_sam", _READS)
    if call.perturb is not None and call.perturb is not True:
      raise ValueError(
        f"update() got perturb={call.perturb!r}, which momentum_sam does not take: it perturbs "
        "at every step (leave perturb= out). Cheap steps are gsam/sam's (policy=)."
      )
    params = numbers_as_arrays(params)
    check_not_masked(params, "momentum_sam")
    check_update_inputs(params if updates is None else updates, params, state.momentum)
    if check_axis:
      check_data_axis_is_set(axis_name)
    inputs = MicrobatchInputs(call.batch, call.key, call.model_state)
    grad_fn = _whole_batch_grad_fn(call, microbatches, inputs, axis_name)
    rho_t = value_at(rho, state.count)
    rho_ok = jnp.isfinite(rho_t) & (rho_t >= 0)  # else the clean gradient, counted
    safe_rho = jnp.where(rho_ok, rho_t, jnp.zeros_like(rho_t))
    direction = select_leaves(resolve_mask(mask, params), state.momentum)
    scale = -safe_rho / (pert.stable_global_norm(direction) + eps)
    perturbed = jax.tree.map(lambda w, v: w + (scale * v).astype(w.dtype), params, direction)
    value, grads = grad_fn(perturbed)
    loss = scalar_loss(value)
    if axis_name is not None:
      grads, loss = step.pmean((grads, loss), axis_name)
    grads = optax.tree.cast_like(grads, params if updates is None else updates)
    return grads, _next_state(state, grads, loss, rho_t, rho_ok, momentum)

  transform = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  return with_frozen(transform, "momentum_sam", frozen, mask)
