"""The state that gsam and sam carry from one update to the next."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import optax

from optax_gsam._src.step.step import Diagnostics


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
    last_rho: the radius :math:`\\rho_t` of the last update, in float32. (Not
      named ``rho``, so that the state holds no second ``rho`` beside the
      hyperparameter of ``optax.inject_hyperparams(optax_gsam.gsam)``. With a
      scheduled rho, optax keeps the schedule's state under ``rho`` too, and
      ``optax.tree.get(opt_state, "rho")`` raises ``KeyError: Found multiple
      values``; ``optax.tree.get(opt_state, "rho", filtering=lambda path,
      value: isinstance(value, jax.Array))`` returns the injected rho for a
      float and for a schedule alike, as does ``hyperparams["rho"]`` of the
      ``inject_hyperparams`` state.)
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
    gradient_evaluations: how many gradients of the whole batch the
      transform has evaluated itself: ``ascent_steps`` per full step (one
      per ascent step, the last at the perturbed weights), plus one per
      update whose clean gradient it accumulated over micro-batches. The
      caller's clean pass is not counted.
    policy_state: the state of the cheap-step policy (see
      :class:`optax_gsam.SharpnessPolicy`).
    stored_direction: for policies with ``cheap="reuse"`` (e.g.
      ``every_k_policy(k)``), the stored direction :math:`v` reused on cheap
      steps (params-shaped): the part of the last full step's output
      orthogonal to its clean gradient, divided by that gradient's norm.
      ``None`` otherwise. A step whose gradients or perturbed loss are not
      finite, or that fell back to the clean gradient, keeps the previous one.
    ascent_state: the state of the ascent direction (``optax.EmptyState()``
      for SAM's and the adaptive ones; the moving averages of
      :func:`optax_gsam.friendly_ascent` and :func:`optax_gsam.vasso_ascent`).
      Replaced only by a full step that counted, by the same rule as
      ``stored_direction``; averaged over ``axis_name`` per device.
  """

  count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's states do
  last_rho: jax.Array
  perturbed_loss: jax.Array
  surrogate_gap: jax.Array
  cosine: jax.Array
  clean_grad_norm: jax.Array
  perturbed_grad_norm: jax.Array
  full_steps: jax.Array
  fallback_count: jax.Array
  gradient_evaluations: jax.Array
  policy_state: Any = optax.EmptyState()
  stored_direction: optax.Updates | None = None
  ascent_state: Any = optax.EmptyState()

  @property
  def diagnostics(self) -> Diagnostics:
    """The five diagnostics of the last full step, as one NamedTuple."""
    return Diagnostics(*(getattr(self, name) for name in Diagnostics._fields))
