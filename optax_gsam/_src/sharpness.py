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
from optax_gsam._src.validation import check_axis_name
from optax_gsam._src.validation import check_non_negative
from optax_gsam._src.validation import check_positive

LossFn = Callable[[optax.Params], jax.Array]
ValueAndGradFn = Callable[[optax.Params], tuple[Any, optax.Updates]]


class GSAMState(NamedTuple):
  """State of :func:`gsam` and :func:`sam`.

  Every diagnostic describes the last update (zeros before the first one) and
  is averaged over ``axis_name`` when one is set. Read them with
  ``optax.tree.get(opt_state, "surrogate_gap")``.

  Attributes:
    count: number of updates with a finite output so far; rho schedules are
      evaluated at it. Starts at 0 and is never reset, so it stays aligned with
      the step counts of the optimizers chained after the transform when they
      sit behind ``optax.apply_if_finite``, which skips the same non-finite
      steps. A chain that repairs non-finite updates instead (e.g.
      ``optax.zero_nans()``) advances its optimizers on such a step while this
      count stays, which delays rho by one step per such step.
    rho: the radius used by the last update.
    perturbed_loss: :math:`f_p = f(w + \\epsilon)`.
    surrogate_gap: :math:`h = f_p - f`, when the clean loss was passed as
      ``value=``; 0 otherwise.
    cosine: cosine between the clean and the perturbed gradient.
    clean_grad_norm: :math:`\\|g_c\\|`.
    perturbed_grad_norm: :math:`\\|g_p\\|`.
    correction: with ``perturb_every > 1``, the stored direction :math:`v`
      reused on cheap steps (params-shaped); ``None`` otherwise. A step whose
      gradients or perturbed loss are not finite keeps the previous one.
  """

  count: jax.Array
  rho: jax.Array
  perturbed_loss: jax.Array
  surrogate_gap: jax.Array
  cosine: jax.Array
  clean_grad_norm: jax.Array
  perturbed_grad_norm: jax.Array
  correction: optax.Updates | None = None


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


def _shape_mismatches(a, b) -> list[str]:
  """'path: shape vs shape' for every leaf pair of two same-structure pytrees whose shapes differ."""
  paths_a = jax.tree_util.tree_flatten_with_path(a)[0]
  return [
    f"{jax.tree_util.keystr(path)}: {jnp.shape(x)} vs {jnp.shape(y)}"
    for (path, x), y in zip(paths_a, jax.tree.leaves(b), strict=True)
    if jnp.shape(x) != jnp.shape(y)
  ]


def _check_structures(updates, params, correction=None) -> None:
  if params is None:
    raise ValueError("gsam/sam need params: call tx.update(grads, opt_state, params, loss_fn=...).")
  updates_structure, params_structure = jax.tree.structure(updates), jax.tree.structure(params)
  if updates_structure != params_structure:
    raise ValueError(
      "The gradient and params pytrees differ in structure: "
      f"{updates_structure} vs {params_structure}."
    )
  mismatches = _shape_mismatches(updates, params)
  if mismatches:
    raise ValueError(
      "The gradient and params pytrees differ in leaf shapes (gradient vs params): "
      + "; ".join(mismatches[:5])
      + "."
    )
  if correction is None:
    return
  if jax.tree.structure(correction) != params_structure or _shape_mismatches(correction, params):
    raise ValueError(
      "The optimizer state was initialised for other params: its stored direction "
      "(GSAMState.correction) does not match the structure and shapes of params. Call "
      "tx.init(params) with these params, or restore the checkpoint into tx.init(params)."
    )


def _is_static_zero(value) -> bool:
  return isinstance(value, numbers.Real) and value == 0


def _check_static_count(name: str, value, minimum: int) -> None:
  if value is None:
    return
  if isinstance(value, jax.Array):  # e.g. made an array by optax.inject_hyperparams.
    raise ValueError(
      f"{name} must be a static Python int; with optax.inject_hyperparams pass "
      f"static_args=({name!r},)."
    )
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}.")


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _accumulator(tree):
  """Zeros shaped like ``tree`` in the accumulation dtype (float32 at least)."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, pert.accumulation_dtype(x.dtype)), tree)


def _tree_accumulate(total, tree):
  return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, tree)


NUM_DIAGNOSTICS = 5  # perturbed_loss, surrogate_gap, cosine, clean_grad_norm, perturbed_grad_norm


def gsam(
  rho: optax.ScalarOrSchedule,
  alpha: float | jax.Array = 0.0,
  *,
  eps: float = 1e-12,
  adaptive: pert.Adaptive = None,
  minimize_fp: bool = True,
  sync_perturbation: bool = False,
  axis_name: Hashable | tuple[Hashable, ...] | None = None,
  num_groups: int | None = None,
  perturb_every: int | None = None,
  reuse_weight: optax.ScalarOrSchedule = 0.7,
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

  **Cheap steps (LookSAM).** With ``perturb_every=k`` the perturbed gradient is
  evaluated only at steps :math:`t \equiv 0 \pmod k`; a ``lax.cond`` skips the
  work on the other steps. On full steps the transform stores
  :math:`v = g^{\perp g_c}`, the part of its output orthogonal to the clean
  gradient; in between it outputs
  :math:`g_c + \lambda_t \|g_c\| v / \|v\|` with :math:`\lambda_t` =
  ``reuse_weight``. For SAM this is LookSAM (Liu et al., 2022); for GSAM,
  :math:`v` also carries the surrogate-gap term, so both corrections are
  reused. ``update(..., perturb=True|False)``, a static Python bool, fixes the
  branch at trace time instead of the ``lax.cond``: jit one step function per
  branch and pick it in Python (e.g. ``step % k == 0``). That avoids XLA CPU's
  slow convolutions inside conditionals (jax-ml/jax#12868), where a ``lax.cond``
  full step can cost many times a plain one. Under ``jax.vmap`` the ``lax.cond``
  stays a conditional while the state is not batched (as in
  :func:`optax_gsam.emulate_devices`); vmapping over optimizer states turns it
  into a select that runs both branches. The diagnostics keep the values of the
  last full step.

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
    perturb_every: evaluate the perturbed gradient every this many steps
      (``None`` or 1: every step). A static int.
    reuse_weight: :math:`\lambda`, a float >= 0 or schedule; read only with
      ``perturb_every > 1``.

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
  if not callable(rho):
    check_non_negative("rho", rho, schedule=True)
  check_non_negative("alpha", alpha)
  if not callable(reuse_weight):
    check_non_negative("reuse_weight", reuse_weight, schedule=True)
  check_positive("eps", eps)
  if adaptive not in pert.ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {pert.ADAPTIVE_CHOICES}, got {adaptive!r}.")
  for name, flag in (("minimize_fp", minimize_fp), ("sync_perturbation", sync_perturbation)):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}.")
  check_axis_name(axis_name)
  if sync_perturbation and axis_name is None:
    raise ValueError(
      "sync_perturbation=True needs axis_name: it averages the clean gradient over that axis."
    )
  _check_static_count("num_groups", num_groups, 1)
  _check_static_count("perturb_every", perturb_every, 1)
  if num_groups is not None and axis_name is not None:
    raise ValueError(
      "num_groups emulates devices on one device; it cannot be combined with axis_name."
    )
  cheap = perturb_every is not None and perturb_every > 1

  def value_at(hyperparameter, count):
    return jnp.asarray(hyperparameter(count) if callable(hyperparameter) else hyperparameter)

  def init_fn(params: optax.Params) -> GSAMState:
    zero = jnp.zeros([], jnp.float32)
    return GSAMState(
      count=jnp.zeros([], jnp.int32),
      rho=zero,
      perturbed_loss=zero,
      surrogate_gap=zero,
      cosine=zero,
      clean_grad_norm=zero,
      perturbed_grad_norm=zero,
      correction=optax.tree.zeros_like(params) if cheap else None,
    )

  def full_replica(clean_grads, params, grad_fn, rho_t, clean_loss, sync_axis):
    """One device's (or group's) GSAM gradient and its diagnostics."""
    epsilon = pert.perturbation(clean_grads, params, rho_t, adaptive=adaptive, eps=eps)
    perturbed_value, perturbed_grads = grad_fn(optax.apply_updates(params, epsilon))
    perturbed_loss = _scalar_loss(perturbed_value)
    if sync_axis is not None:
      perturbed_grads = _pmean(perturbed_grads, sync_axis)
    stats = pert.gradient_stats(clean_grads, perturbed_grads)
    if _is_static_zero(alpha) and minimize_fp:  # SAM: skip the decomposition.
      direction = optax.tree.cast_like(perturbed_grads, clean_grads)
    else:
      direction = pert.decompose(
        clean_grads, perturbed_grads, alpha, minimize_fp=minimize_fp, eps=eps, stats=stats
      )
    gap = perturbed_loss - clean_loss if clean_loss is not None else jnp.zeros([], jnp.float32)
    diagnostics = jnp.stack(
      [
        perturbed_loss,
        gap,
        stats.cosine.astype(jnp.float32),
        stats.clean_norm.astype(jnp.float32),
        stats.perturbed_norm.astype(jnp.float32),
      ]
    )
    return direction, diagnostics

  def cheap_replica(clean_grads, correction, weight):
    return pert.reuse_correction(clean_grads, correction, weight, eps=eps)

  def stored_correction(direction, clean_grads, like):
    correction = pert.orthogonal_component(direction, clean_grads, eps=eps)
    return optax.tree.cast_like(correction, like)

  def previous_diagnostics(state):
    return jnp.stack(
      [
        state.perturbed_loss,
        state.surrogate_gap,
        state.cosine,
        state.clean_grad_norm,
        state.perturbed_grad_norm,
      ]
    )

  def choose_branch(full, reuse, count, perturb):
    """The perturbed pass on every k-th step (lax.cond), or as the caller fixes it statically."""
    if perturb is None:
      return jax.lax.cond(count % perturb_every == 0, full, reuse, None)
    return full(None) if perturb else reuse(None)

  def data_parallel_update(updates, state, params, grad_fn, value, rho_t, weight, perturb):
    """Single device, or one replica under axis_name."""
    synchronized = axis_name is not None and sync_perturbation
    per_device = axis_name is not None and not sync_perturbation
    clean_grads = _pmean(updates, axis_name) if synchronized else updates
    clean_loss = _scalar_loss(value) if value is not None else None
    sync_axis = axis_name if synchronized else None

    def full(_):
      direction, diagnostics = full_replica(
        clean_grads, params, grad_fn, rho_t, clean_loss, sync_axis
      )
      correction = stored_correction(direction, clean_grads, state.correction) if cheap else None
      if per_device:  # One collective for the output, the correction and the scalars.
        return _pmean((direction, correction, diagnostics), axis_name)
      if axis_name is not None:
        diagnostics = _pmean(diagnostics, axis_name)
      return direction, correction, diagnostics

    if not cheap:
      direction, _, diagnostics = full(None)
      return direction, None, diagnostics

    def reuse(_):
      direction = cheap_replica(clean_grads, state.correction, weight)
      if per_device:
        direction = _pmean(direction, axis_name)
      return direction, state.correction, previous_diagnostics(state)

    return choose_branch(full, reuse, state.count, perturb)

  def grouped_update(updates, state, params, group_fn, rho_t, weight, perturb):
    """num_groups emulation: a scan over groups, each perturbed with its own gradient."""
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    accumulation = _accumulator(updates)

    def scan_groups(body, carry):
      total, _ = jax.lax.scan(lambda c, g: (body(c, g), None), carry, groups)
      return jax.tree.map(lambda t: t / num_groups, total)

    def full(_):
      def body(total, group):
        clean_value, clean_grads = group_fn(group)(params)
        clean_grads = optax.tree.cast_like(clean_grads, updates)
        direction, diagnostics = full_replica(
          clean_grads, params, group_fn(group), rho_t, _scalar_loss(clean_value), None
        )
        correction = stored_correction(direction, clean_grads, state.correction) if cheap else None
        return _tree_accumulate(total, (direction, correction, diagnostics))

      initial = (
        accumulation,
        _accumulator(state.correction),
        jnp.zeros([NUM_DIAGNOSTICS], jnp.float32),
      )
      direction, correction, diagnostics = scan_groups(body, initial)
      if cheap:
        correction = optax.tree.cast_like(correction, state.correction)
      return direction, correction, diagnostics

    if not cheap:
      direction, _, diagnostics = full(None)
      return direction, None, diagnostics

    def reuse(_):
      def body(total, group):
        _, clean_grads = group_fn(group)(params)
        clean_grads = optax.tree.cast_like(clean_grads, updates)
        return _tree_accumulate(total, cheap_replica(clean_grads, state.correction, weight))

      return scan_groups(body, accumulation), state.correction, previous_diagnostics(state)

    return choose_branch(full, reuse, state.count, perturb)

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
    del extra_args
    if perturb is not None and not isinstance(perturb, bool):
      raise ValueError(
        f"perturb must be None or a Python bool (static; not an array), got {perturb!r}."
      )
    if perturb is False and not cheap:
      raise ValueError(
        "perturb=False reuses a stored direction, which only perturb_every > 1 keeps."
      )
    _check_structures(updates, params, state.correction if cheap else None)
    rho_t = value_at(rho, state.count)
    weight = value_at(reuse_weight, state.count) if cheap else None
    if num_groups is None:
      grad_fn = _grad_fn_from(loss_fn, value_and_grad_fn)
      direction, correction, diagnostics = data_parallel_update(
        updates, state, params, grad_fn, value, rho_t, weight, perturb
      )
    else:
      _grad_fn_from(loss_fn, value_and_grad_fn)  # Validates the arguments.
      if loss_fn is not None:
        group_fn = lambda group: jax.value_and_grad(lambda p: loss_fn(p, group))
      else:
        group_fn = lambda group: lambda p: value_and_grad_fn(p, group)
      direction, correction, diagnostics = grouped_update(
        updates, state, params, group_fn, rho_t, weight, perturb
      )
    direction = optax.tree.cast_like(direction, updates)
    if cheap:
      # A non-finite step (its gradients or its perturbed loss) never replaces the stored
      # direction.
      finite = _all_finite(correction) & jnp.isfinite(diagnostics[0])
      correction = jax.tree.map(
        lambda new, old: jnp.where(finite, new, old), correction, state.correction
      )
    # A step whose output is not finite does not count: with the rest of the chain behind
    # optax.apply_if_finite, rho schedules stay aligned with the optimizers after this one.
    count = jnp.where(_all_finite(direction), optax.safe_increment(state.count), state.count)
    new_state = GSAMState(
      count=count,
      rho=rho_t.astype(jnp.float32),
      perturbed_loss=diagnostics[0],
      surrogate_gap=diagnostics[1],
      cosine=diagnostics[2],
      clean_grad_norm=diagnostics[3],
      perturbed_grad_norm=diagnostics[4],
      correction=correction,
    )
    return direction, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sam(
  rho: optax.ScalarOrSchedule,
  *,
  eps: float = 1e-12,
  adaptive: pert.Adaptive = None,
  sync_perturbation: bool = False,
  axis_name: Hashable | tuple[Hashable, ...] | None = None,
  num_groups: int | None = None,
  perturb_every: int | None = None,
  reuse_weight: optax.ScalarOrSchedule = 0.7,
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
  )
