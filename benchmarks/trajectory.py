"""SAF's and MESA's trajectory term in the benchmarks' train steps (docs/trajectory.md).

A contender with a :class:`Trajectory` adds the term to its loss. Its step also takes the
batch's example ids and the epoch, and SAF's store rides through the training scan beside the
parameters and the optimizer state. The term composes with a sharpness-aware transform placed
first in the contender's chain: the step then passes the loss with the term as ``loss_fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import optax_gsam
from optax_gsam import demo


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """SAF's or MESA's trajectory term, added to the loss of a contender's step.

  Attributes:
    kind: ``"saf"`` (a store of each example's logits, recorded ``lag_epochs`` epochs before,
      carried through the training scan and indexed by the batch's example ids) or
      ``"mesa"`` (the logits of the EMA weights: one extra forward pass a step).
    weight: lambda: ``"rho"`` or ``"alpha"`` (the run's value of that slot, traced per run),
      or a number. SAF's and MESA's own rows tune it in ``"rho"``; beside a sharpness-aware
      transform, whose radius takes ``rho``, SAF's is ``"alpha"`` and MESA's a number (its
      ``alpha`` is the EMA decay, read by the contender's ``make``).
    lag_epochs: SAF's Ẽ, static (the store's shape).
    start: E_start as a fraction of the epochs: the term applies from epoch
      ``int(start * epochs)`` on.
    temperature: tau (the authors: 5, untuned).
  """

  kind: Literal["saf", "mesa"]
  weight: Literal["rho", "alpha"] | float = "rho"
  lag_epochs: int = 3
  start: float = 0.1
  temperature: float = 5.0

  def weight_of(self, rho: Any, alpha: Any) -> Any:
    """Lambda for a run whose slots hold ``rho`` and ``alpha``."""
    if self.weight == "rho":
      return rho
    return alpha if self.weight == "alpha" else self.weight


def trajectory_step(
  model: nn.Module,
  tx: optax.GradientTransformation,
  trajectory: Trajectory,
  weight: Any,
  start_epoch: Any,
  protocol: str = "plain",
  perturb: bool | None = None,
) -> Callable:
  """``(params, opt_state, store, x, y, ids, epoch) -> (params, opt_state, store, loss)``.

  The loss returned is the cross-entropy alone. SAF reads the batch's targets from ``store``
  (an ``optax_gsam.SAFStore``) and records the step's clean logits in it; MESA reads the EMA
  weights from ``opt_state`` (``store`` is ``()``, passed through) and adds one forward pass
  at them. ``protocol`` is the contender's (``harness.Contender``): ``"plain"`` passes
  nothing to ``tx.update``; ``"loss_fn"`` passes the loss with the term (the targets fixed for
  the step) and its value, and ``perturb`` when not ``None``; ``"no_clean"`` (momentum-SAM)
  passes zeros for the gradient and takes no clean gradient, so SAF records the logits of one
  extra forward pass at the clean weights.
  """
  saf = trajectory.kind == "saf"

  def step(params, opt_state, store, x, y, ids, epoch):
    if saf:
      targets, valid = optax_gsam.saf_targets(store, ids, epoch, start_epoch=start_epoch)
    else:
      ema = optax.tree.get(opt_state, "ema_params")
      targets, valid = optax_gsam.mesa_targets(model.apply, ema, x), epoch >= start_epoch

    def loss_fn(p):
      logits = model.apply(p, x)
      ce = demo.cross_entropy(logits, y)
      term = optax_gsam.trajectory_loss(
        logits, targets, temperature=trajectory.temperature, weight=weight, where=valid
      )
      return ce + term, (ce, logits)

    extra: dict[str, Any] = {}
    if protocol == "no_clean":  # the transform's one gradient is at its perturbed weights
      grads = optax.tree.zeros_like(params)
      logits = model.apply(params, x) if saf else None
      loss = demo.cross_entropy(logits, y) if saf else jnp.zeros([], jnp.float32)
      extra = {"loss_fn": loss_fn}
    else:
      (total, (loss, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      if protocol != "plain":
        extra = {"loss_fn": loss_fn, "value": total}
    if perturb is not None:
      extra["perturb"] = perturb
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    if saf:
      store = optax_gsam.saf_record(store, ids, logits, epoch)
    return optax.apply_updates(params, updates), opt_state, store, loss

  return step


def trajectory_store(trajectory: Trajectory, num_examples: int, num_classes: int) -> Any:
  """SAF's empty store of past logits; ``()`` for MESA, which keeps its EMA in ``opt_state``."""
  if trajectory.kind != "saf":
    return ()
  return optax_gsam.saf_store(num_examples, num_classes, lag_epochs=trajectory.lag_epochs)


def timed_trajectory(
  model: nn.Module,
  tx: optax.GradientTransformation,
  trajectory: Trajectory,
  protocol: str,
  params: Any,
  opt_state: Any,
  x: jax.Array,
) -> tuple[Callable, tuple]:
  """The step as ``make_step(perturb)`` of ``(params, state, x, y) -> (params, state, loss)``.

  For timing (``harness.compile_step``): ``state`` holds the optimizer state, the store (its
  examples: the batch), the ids and the epoch, all traced as in training; the epoch (past
  ``start``) keeps the term on.
  """
  classes = jax.eval_shape(model.apply, params, x[:1]).shape[-1]
  store = trajectory_store(trajectory, len(x), classes)
  ids = jnp.arange(len(x), dtype=jnp.int32)
  state = (opt_state, store, ids, jnp.asarray(trajectory.lag_epochs, jnp.int32))

  def make_step(perturb):
    inner = trajectory_step(model, tx, trajectory, 0.3, 0, protocol, perturb)

    def step(params, state, x, y):
      opt_state, store, ids, epoch = state
      params, opt_state, store, loss = inner(params, opt_state, store, x, y, ids, epoch)
      return params, (opt_state, store, ids, epoch), loss

    return step

  return make_step, state
