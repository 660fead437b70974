"""MESA's teacher: an exponential moving average of the weights, kept by an optax transform."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.placement import check_last_in_chain
from optax_gsam._src.core.arrays import compute_dtype
from optax_gsam._src.core.validation import check_unit_interval
from optax_gsam._src.core.validation import with_fix

# The EMA decay of the authors' released MESA script (timm's model EMA default).
DEFAULT_DECAY = 0.9998

LAST_FIX = (
  "It averages params + updates, the new weights, so a stage after it would change the "
  "updates after the average read them, and the teacher would drift from the weights "
  "trained. Put it after the optimizer: optax.chain(optax.adamw(1e-3), "
  "optax_gsam.mesa_ema(0.9998)) (docs/trajectory.md)."
)


class MESAState(NamedTuple):
  """State of :func:`mesa_ema`.

  Attributes:
    count: the number of updates.
    ema_params: :math:`v_t`, the averaged weights (params-shaped, in float32
      at least). Read them from a chain's state with
      ``optax.tree.get(opt_state, "ema_params")``.
  """

  count: jax.Array  # type: ignore[assignment]  # the field shadows tuple.count, as in optax
  ema_params: optax.Params


def check_decay(decay: Any) -> None:
  fix = (
    f"It is MESA's EMA decay beta: the average keeps beta of itself each step (the authors "
    f"use {DEFAULT_DECAY}); 1 would never move."
  )
  with_fix(fix, check_unit_interval, "decay", decay, include_one=False)


def mesa_ema(decay: float = DEFAULT_DECAY) -> optax.GradientTransformation:
  r"""Keeps MESA's teacher, the exponential moving average of the weights; the last in a chain.

  With :math:`\theta_{t+1}` the weights after step :math:`t` (``params +
  updates``, which is why the transform goes last in ``optax.chain``, after
  the optimizer),

  .. math::

    v_0 = \theta_0, \qquad v_{t+1} = \beta v_t + (1 - \beta) \theta_{t+1},

  computed with ``optax.incremental_update``. The updates pass through
  unchanged. The teacher's outputs at :math:`v_t` are the targets of
  MESA's trajectory term (:func:`mesa_targets`,
  :func:`optax_gsam.trajectory_loss`); the paper applies the term from epoch
  :math:`E_\mathrm{start}` on while the average runs from the first step.
  Memory: one params-sized buffer in float32 at least.

  Args:
    decay: :math:`\beta` in [0, 1) (the authors: 0.9998); a float or a scalar
      array (``optax.inject_hyperparams``).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`MESAState`.

  Example:
    >>> import jax.numpy as jnp, optax, optax_gsam
    >>> tx = optax.chain(optax.sgd(0.5), optax_gsam.mesa_ema(0.9))
    >>> w = jnp.array([1.0])
    >>> state = tx.init(w)
    >>> updates, state = tx.update(jnp.array([2.0]), state, w)
    >>> w = optax.apply_updates(w, updates)  # 1 - 0.5 * 2 = 0
    >>> round(float(optax.tree.get(state, "ema_params")[0]), 4)  # 0.9 * 1 + 0.1 * 0
    0.9

  References:
    Du et al., `Sharpness-Aware Training for Free
    <https://arxiv.org/abs/2205.14083>`_, NeurIPS 2022 (MESA).
  """
  check_decay(decay)

  def init_fn(params: optax.Params) -> MESAState:
    # A copy, not the params' own buffers: the state can then be donated beside them.
    ema = jax.tree.map(lambda p: jnp.array(p, compute_dtype(jnp.asarray(p).dtype)), params)
    return MESAState(count=jnp.zeros([], jnp.int32), ema_params=ema)

  def update_fn(
    updates: optax.Updates, state: MESAState, params: optax.Params | None = None
  ) -> tuple[optax.Updates, MESAState]:
    if params is None:
      raise ValueError(
        "mesa_ema needs params: call tx.update(grads, opt_state, params), with mesa_ema last "
        "in the chain so that params + updates are the new weights."
      )
    check_last_in_chain("mesa_ema", LAST_FIX)
    new_params = optax.apply_updates(params, updates)
    # 1 - decay in Python where decay is a float: in float32, 1 - 0.9998 is 1.3e-4 off.
    step_size = 1.0 - decay if isinstance(decay, float) else 1 - jnp.asarray(decay)
    ema = optax.incremental_update(new_params, state.ema_params, step_size)
    ema = optax.tree.cast_like(ema, state.ema_params)
    return updates, MESAState(optax.safe_increment(state.count), ema)

  return optax.GradientTransformation(init_fn, update_fn)


def mesa_targets(apply_fn: Callable[..., Any], ema_params: optax.Params, *args, **kwargs) -> Any:
  r"""The teacher's outputs :math:`f_{v_t}(x)`: ``apply_fn`` at the averaged weights, constant.

  ``stop_gradient(apply_fn(ema_params, *args, **kwargs))``: MESA's one extra
  forward pass, whose outputs are the targets of
  :func:`optax_gsam.trajectory_loss`. Pass ``where=epoch >= start_epoch``
  there for the paper's start; under ``jax.jit`` the pass runs before it too
  (branch with ``jax.lax.cond``, or jit the two steps apart, to skip it).

  Args:
    apply_fn: the model, ``apply_fn(params, *args, **kwargs)`` -> logits.
    ema_params: :math:`v_t`, e.g. ``optax.tree.get(opt_state, "ema_params")``
      (in float32 at least: cast it where the model wants its params' dtypes).
    *args: the model's inputs.
    **kwargs: its keyword arguments.

  Returns:
    The teacher's outputs, with no gradient.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> apply_fn = lambda w, x: x @ w
    >>> optax_gsam.mesa_targets(apply_fn, jnp.eye(2), jnp.array([[1.0, 2.0]])).tolist()
    [[1.0, 2.0]]
  """
  return jax.lax.stop_gradient(apply_fn(ema_params, *args, **kwargs))
