"""GSAM and SAM as optax gradient transformations."""

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
from optax_gsam._src.schedules import check_non_negative

LossFn = Callable[[optax.Params], jax.Array]
ValueAndGradFn = Callable[[optax.Params], tuple[Any, optax.Updates]]


class GSAMState(NamedTuple):
  """State of :func:`gsam` and :func:`sam`.

  Every diagnostic describes the last update (zeros before the first one) and
  is averaged over ``axis_name`` when one is set. Read them with
  ``optax.tree.get(opt_state, "surrogate_gap")``.

  Attributes:
    count: number of updates so far; rho schedules are evaluated at it. Starts
      at 0 and is never reset, so it stays aligned with the step counts of the
      optimizers chained after the transform.
    rho: the radius used by the last update.
    perturbed_loss: :math:`f_p = f(w + \\epsilon)`.
    surrogate_gap: :math:`h = f_p - f`, when the clean loss was passed as
      ``value=``; 0 otherwise.
    cosine: cosine between the clean and the perturbed gradient.
    clean_grad_norm: :math:`\\|g_c\\|`.
    perturbed_grad_norm: :math:`\\|g_p\\|`.
  """

  count: jax.Array
  rho: jax.Array
  perturbed_loss: jax.Array
  surrogate_gap: jax.Array
  cosine: jax.Array
  clean_grad_norm: jax.Array
  perturbed_grad_norm: jax.Array


def _check_axis_name(axis_name) -> None:
  if axis_name is None:
    return
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, Hashable) and n is not None for n in names):
    raise ValueError(
      f"axis_name must be None, a hashable axis name or a tuple of them, got {axis_name!r}."
    )


def _pmean(tree, axis_name):
  try:
    return jax.lax.pmean(tree, axis_name)
  except NameError as error:
    raise ValueError(
      f"axis_name={axis_name!r} is not bound here. With axis_name set, call update inside "
      "jax.pmap, jax.shard_map or jax.vmap over that axis name; outside them, leave "
      "axis_name=None."
    ) from error


def _grad_fn_from(loss_fn, value_and_grad_fn) -> ValueAndGradFn:
  if (loss_fn is None) == (value_and_grad_fn is None):
    raise ValueError(
      "Pass exactly one of loss_fn (params -> scalar loss) or value_and_grad_fn "
      "(params -> (value, grads)) to update(); got "
      f"loss_fn={'set' if loss_fn is not None else None}, "
      f"value_and_grad_fn={'set' if value_and_grad_fn is not None else None}."
    )
  fn = loss_fn if loss_fn is not None else value_and_grad_fn
  if not callable(fn):
    name = "loss_fn" if loss_fn is not None else "value_and_grad_fn"
    raise ValueError(f"{name} must be callable, got {type(fn).__name__}.")
  return jax.value_and_grad(loss_fn) if loss_fn is not None else value_and_grad_fn


def _scalar_loss(value) -> jax.Array:
  if isinstance(value, (tuple, list)):  # (loss, aux) from a has_aux function.
    value = value[0]
  value = jnp.asarray(value)
  if value.shape != ():
    raise ValueError(f"The loss must be a scalar, got shape {value.shape}.")
  return value.astype(jnp.float32)


def _check_structures(updates, params) -> None:
  if params is None:
    raise ValueError("gsam/sam need params: call tx.update(grads, opt_state, params, loss_fn=...).")
  updates_structure, params_structure = jax.tree.structure(updates), jax.tree.structure(params)
  if updates_structure != params_structure:
    raise ValueError(
      "The gradient and params pytrees differ in structure: "
      f"{updates_structure} vs {params_structure}."
    )


def _is_static_zero(value) -> bool:
  return isinstance(value, numbers.Real) and value == 0


def gsam(
  rho: optax.ScalarOrSchedule,
  alpha: float | jax.Array = 0.0,
  *,
  eps: float = 1e-12,
  adaptive: pert.Adaptive = None,
  minimize_fp: bool = True,
  sync_perturbation: bool = False,
  axis_name: Hashable | tuple[Hashable, ...] | None = None,
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
  value=None, **extra_args)`` takes exactly one of ``loss_fn`` (params ->
  scalar loss) or ``value_and_grad_fn`` (params -> (value, grads), where value
  may be ``(loss, aux)``; e.g. :func:`optax_gsam.cached_value_and_grad`).
  ``value``, optax's name for the clean loss, is used for the surrogate gap
  diagnostic. Other extra args are ignored.

  Data parallelism. With ``axis_name`` set, ``update`` runs inside
  ``jax.pmap``/``jax.shard_map``/``jax.vmap`` over that axis, ``updates`` is
  the device's local clean gradient and ``loss_fn`` the local-shard loss. The
  output is always averaged over the axis (do not ``pmean`` it again):

  * ``sync_perturbation=False`` (the paper's m-sharpness setting): each device
    perturbs with its own :math:`g_c` and decomposes its own gradients; the
    resulting :math:`g` is averaged. One gradient-sized all-reduce, as in a
    base step.
  * ``sync_perturbation=True``: :math:`g_c` is averaged before perturbing and
    :math:`g_p` before the decomposition, which equals single-device GSAM on
    the global batch. Two gradient-sized all-reduces.

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
  """
  if not callable(rho):
    check_non_negative("rho", rho)
  check_non_negative("alpha", alpha)
  if isinstance(eps, numbers.Real) and not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps!r}.")
  if adaptive not in pert.ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {pert.ADAPTIVE_CHOICES}, got {adaptive!r}.")
  for name, flag in (("minimize_fp", minimize_fp), ("sync_perturbation", sync_perturbation)):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}.")
  _check_axis_name(axis_name)
  if sync_perturbation and axis_name is None:
    raise ValueError(
      "sync_perturbation=True needs axis_name: it averages the clean gradient over that axis."
    )

  def rho_at(count):
    return jnp.asarray(rho(count) if callable(rho) else rho)

  def init_fn(params: optax.Params) -> GSAMState:
    del params
    zero = jnp.zeros([], jnp.float32)
    return GSAMState(
      count=jnp.zeros([], jnp.int32),
      rho=zero,
      perturbed_loss=zero,
      surrogate_gap=zero,
      cosine=zero,
      clean_grad_norm=zero,
      perturbed_grad_norm=zero,
    )

  def update_fn(
    updates: optax.Updates,
    state: GSAMState,
    params: optax.Params | None = None,
    *,
    loss_fn: LossFn | None = None,
    value_and_grad_fn: ValueAndGradFn | None = None,
    value: jax.Array | None = None,
    **extra_args: Any,
  ) -> tuple[optax.Updates, GSAMState]:
    del extra_args
    grad_fn = _grad_fn_from(loss_fn, value_and_grad_fn)
    _check_structures(updates, params)
    synchronized = axis_name is not None and sync_perturbation

    clean_grads = _pmean(updates, axis_name) if synchronized else updates
    rho_t = rho_at(state.count)
    epsilon = pert.perturbation(clean_grads, params, rho_t, adaptive=adaptive, eps=eps)
    perturbed_value, perturbed_grads = grad_fn(optax.apply_updates(params, epsilon))
    perturbed_loss = _scalar_loss(perturbed_value)
    if synchronized:
      perturbed_grads = _pmean(perturbed_grads, axis_name)

    stats = pert.gradient_stats(clean_grads, perturbed_grads)
    if _is_static_zero(alpha) and minimize_fp:  # SAM: skip the decomposition.
      new_updates = optax.tree.cast_like(perturbed_grads, updates)
    else:
      new_updates = pert.decompose(
        clean_grads, perturbed_grads, alpha, minimize_fp=minimize_fp, eps=eps, stats=stats
      )
    surrogate_gap = (
      perturbed_loss - _scalar_loss(value) if value is not None else jnp.zeros([], jnp.float32)
    )
    diagnostics = jnp.stack(
      [
        perturbed_loss,
        surrogate_gap,
        stats.cosine.astype(jnp.float32),
        stats.clean_norm.astype(jnp.float32),
        stats.perturbed_norm.astype(jnp.float32),
      ]
    )
    if axis_name is not None:
      if not synchronized:
        new_updates = _pmean(new_updates, axis_name)
      diagnostics = _pmean(diagnostics, axis_name)
    new_state = GSAMState(
      count=optax.safe_increment(state.count),
      rho=rho_t.astype(jnp.float32),
      perturbed_loss=diagnostics[0],
      surrogate_gap=diagnostics[1],
      cosine=diagnostics[2],
      clean_grad_norm=diagnostics[3],
      perturbed_grad_norm=diagnostics[4],
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sam(
  rho: optax.ScalarOrSchedule,
  *,
  eps: float = 1e-12,
  adaptive: pert.Adaptive = None,
  sync_perturbation: bool = False,
  axis_name: Hashable | tuple[Hashable, ...] | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Sharpness-Aware Minimization (SAM): :func:`gsam` with ``alpha=0``.

  .. math::

    \epsilon = \rho_t \, g_c / (\|g_c\| + \varepsilon), \qquad
    g = \nabla f(w + \epsilon)

  The output is the gradient at the perturbed weights; the optimizer chained
  after it applies it to the unperturbed weights. ``adaptive="asam"`` gives
  ASAM. Arguments and the ``update`` protocol are those of :func:`gsam`.

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
  )
