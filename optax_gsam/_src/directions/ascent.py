r"""Ascent directions: where the weights move before the perturbed pass.

An ascent direction is an ``optax.GradientTransformation`` whose
``update(grads, state, params)`` maps a gradient to an *ascent* direction of
radius 1, and the sharpness stage scales it by :math:`\rho_t`:

.. math::

  (a_t, s_{t+1}) = \text{ascent.update}(g, s_t, w), \qquad \epsilon = \rho_t \, a_t,
  \qquad \langle a_t, g\rangle \ge 0 .

That is the sign of a gradient, not of an optimizer's update: an optax
optimizer outputs the negated (descent) direction, which ``optax.contrib.sam``
negates back for its adversarial optimizer and this package does not. Port
such an optimizer with its negation and at radius 1:
``optax.chain(optax.contrib.normalize(), optax.sgd(1.0), optax.scale(-1.0))``
is :func:`normalized_ascent`. A direction given as ``ascent=`` is run once at
``init`` on a probe gradient, and a descent direction, or one that passes a
leaf's gradient through unchanged (``optax.masked`` outside its mask), is
refused there with the fix (see :mod:`optax_gsam._src.directions.ascent_checks`).

SAM's normalized gradient, the adaptive forms of GSAM and ASAM, Friendly-SAM
and VaSSO are directions here; any optax transformation that ends in a
normalization is one too (``optax.chain(optax.scale_by_adam(),
optax_gsam.normalized_ascent())``). The state is carried in
``GSAMState.ascent_state``, kept on cheap and non-finite steps, and averaged
over the data axis with per-device perturbation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gsam._src.core.arrays import compute_dtype
from optax_gsam._src.core.arrays import upcast
from optax_gsam._src.core.arrays import zeros_accumulator
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import check_unit_interval
from optax_gsam._src.directions.perturbation import stable_global_norm
from optax_gsam.typing import Adaptive

# The update functions of this module's directions, which the probe at init need not check.
KNOWN_DIRECTIONS: weakref.WeakSet = weakref.WeakSet()


def _known(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  KNOWN_DIRECTIONS.add(tx.update)
  return tx


def _scaled(tree: optax.Updates, scale: jax.Array, like: optax.Params) -> optax.Updates:
  """``tree * scale`` in at least float32 (``like``'s dtype, promoted): rho multiplies it next."""
  return jax.tree.map(
    lambda x, w: (upcast(x) * scale).astype(compute_dtype(jnp.result_type(w))), tree, like
  )


def _unit(direction: optax.Updates, eps: float | jax.Array, like: optax.Params) -> optax.Updates:
  """:math:`d / (\\|d\\| + \\varepsilon)`, zero for a zero ``d``."""
  return _scaled(direction, 1.0 / (stable_global_norm(direction) + eps), like)


def _moving_average(average: optax.Updates, grads: optax.Updates, decay) -> optax.Updates:
  r""":math:`\lambda m + (1 - \lambda) g`, kept in the average's (float32 at least) dtype."""
  return jax.tree.map(lambda m, g: decay * m + (1.0 - decay) * g.astype(m.dtype), average, grads)


def _averaged_direction(
  state_type: Callable[[optax.Updates], Any],
  decay: float,
  eps: float | jax.Array,
  direction_of: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> optax.GradientTransformation:
  """A direction read from :math:`m`, a moving average of the gradients, kept in ``state_type``.

  The unit vector of ``direction_of(g, m)`` leaf by leaf, or of :math:`m` itself.
  """

  def init_fn(params):
    return state_type(jax.tree.map(zeros_accumulator, params))

  def update_fn(grads, state, params=None):
    average = _moving_average(state[0], grads, decay)
    direction = average if direction_of is None else jax.tree.map(direction_of, grads, average)
    return _unit(direction, eps, grads if params is None else params), state_type(average)

  return _known(optax.GradientTransformation(init_fn, update_fn))


def normalized_ascent(eps: float | jax.Array = 1e-12) -> optax.GradientTransformation:
  r"""SAM's ascent direction: the normalized gradient.

  .. math::

    a = g / (\|g\| + \varepsilon)

  Args:
    eps: :math:`\varepsilon` > 0, guards the division (a zero gradient gives
      no perturbation).

  Returns:
    An ``optax.GradientTransformation`` for ``gsam(..., ascent=...)``, stateless.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> ascent = optax_gsam.normalized_ascent()
    >>> a, _ = ascent.update(jnp.array([3.0, 4.0]), ascent.init(jnp.zeros(2)), jnp.zeros(2))
    >>> a.round(6)  # rounded: the last digit of a norm depends on the CPU's kernels
    Array([0.6, 0.8], dtype=float32)

  References:
    Foret et al., `Sharpness-Aware Minimization for Efficiently Improving
    Generalization <https://arxiv.org/abs/2010.01412>`_, ICLR 2021.
  """
  check_positive("eps", eps)

  def update_fn(grads, state, params=None):
    return _unit(grads, eps, grads if params is None else params), state

  return _known(optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn))


def adaptive_ascent(kind: Adaptive, eps: float | jax.Array = 1e-12) -> optax.GradientTransformation:
  r"""The scale-invariant ascent directions of GSAM's paper and of ASAM.

  .. math::

    a = \begin{cases}
      |w| \odot g / (\|g\| + \varepsilon) & \text{kind="gsam" (GSAM paper, big\_vision)} \\
      w^2 \odot g / (\| |w| \odot g \| + \varepsilon) & \text{kind="asam" (Kwon et al., 2021)}
    \end{cases}

  Args:
    kind: ``"gsam"`` or ``"asam"``.
    eps: :math:`\varepsilon` > 0.

  Returns:
    A stateless ``optax.GradientTransformation`` that needs ``params``.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> ascent = optax_gsam.adaptive_ascent("gsam")
    >>> w = jnp.array([2.0, 0.5])
    >>> a, _ = ascent.update(jnp.array([3.0, 4.0]), ascent.init(w), w)
    >>> a.round(6)
    Array([1.2, 0.4], dtype=float32)

  References:
    Kwon et al., `ASAM: Adaptive Sharpness-Aware Minimization
    <https://arxiv.org/abs/2102.11600>`_, ICML 2021.
  """
  if kind not in ("gsam", "asam"):
    raise ValueError(f"kind must be 'gsam' or 'asam', got {kind!r}.")
  check_positive("eps", eps)

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError(f"adaptive_ascent({kind!r}) scales by |w|: pass params to update.")
    weight = jax.tree.map(lambda w: jnp.abs(upcast(w)), params)
    direction = grads  # asam normalizes |w| g, and its w^2 g is |w| (|w| g)
    if kind == "asam":
      direction = jax.tree.map(lambda g, a: upcast(g) * a, grads, weight)
    scale = 1.0 / (stable_global_norm(direction) + eps)
    return _scaled(jax.tree.map(jnp.multiply, direction, weight), scale, params), state

  return _known(optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn))


class FriendlyAscentState(NamedTuple):
  """State of :func:`friendly_ascent`.

  Attributes:
    gradient_average: :math:`m_t`, the exponential moving average of the
      gradients the direction has seen (params-shaped, float32 at least): the
      estimate of the full-batch gradient that Friendly-SAM removes.
  """

  gradient_average: optax.Updates


def friendly_ascent(
  sigma: float = 1.0, decay: float = 0.9, *, eps: float = 1e-12
) -> optax.GradientTransformation:
  r"""Friendly-SAM's ascent direction: the gradient minus its running full-batch estimate.

  .. math::

    m_t = \lambda m_{t-1} + (1 - \lambda) g_t, \qquad
    d_t = g_t - \sigma m_t, \qquad
    a_t = d_t / (\|d_t\| + \varepsilon)

  with :math:`m_0 = 0`. The paper finds that the full-gradient component of
  SAM's perturbation does not help generalization, and keeps only the
  batch-specific part. ``sigma=0`` is SAM.

  Args:
    sigma: :math:`\sigma` >= 0, how much of the estimate is removed.
    decay: :math:`\lambda` in [0, 1), the moving average's decay.
    eps: :math:`\varepsilon` > 0.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`FriendlyAscentState`.

  Example:
    >>> import jax.numpy as jnp, optax, optax_gsam
    >>> tx = optax.chain(
    ...   optax_gsam.sam(0.05, ascent=optax_gsam.friendly_ascent(sigma=1.0, decay=0.9)),
    ...   optax.sgd(0.1),
    ... )

  References:
    Li et al., `Friendly Sharpness-Aware Minimization
    <https://arxiv.org/abs/2403.12350>`_, CVPR 2024.
  """
  check_non_negative("sigma", sigma)
  check_unit_interval("decay", decay, include_one=False)
  check_positive("eps", eps)

  noise = lambda g, m: upcast(g) - sigma * m
  return _averaged_direction(FriendlyAscentState, decay, eps, direction_of=noise)


class VassoState(NamedTuple):
  """State of :func:`vasso_ascent`.

  Attributes:
    smoothed_gradient: :math:`d_t`, the smoothed gradient the perturbation
      follows (params-shaped, float32 at least).
  """

  smoothed_gradient: optax.Updates


def vasso_ascent(theta: float = 0.4, *, eps: float = 1e-12) -> optax.GradientTransformation:
  r"""VaSSO's ascent direction: a variance-suppressed (smoothed) gradient.

  .. math::

    d_t = (1 - \theta) d_{t-1} + \theta g_t, \qquad
    a_t = d_t / (\|d_t\| + \varepsilon)

  with :math:`d_0 = 0`. Averaging over steps lowers the variance of the
  stochastic ascent direction, which makes the sharpness estimate more stable;
  the paper reports the gain to be largest under label noise. ``theta=1`` is
  SAM.

  Args:
    theta: :math:`\theta` in (0, 1], the weight of the new gradient.
    eps: :math:`\varepsilon` > 0.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`VassoState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> loss_fn = lambda w: jnp.sum(w**2)
    >>> gsam = optax_gsam.gsam(0.05, 0.3, ascent=optax_gsam.vasso_ascent(theta=0.4))
    >>> tx, w = optax.chain(gsam, optax.sgd(0.1)), jnp.ones(2)
    >>> _, state = tx.update(jax.grad(loss_fn)(w), tx.init(w), w, loss_fn=loss_fn)
    >>> optax.tree.get(state, "smoothed_gradient")  # d_1 = theta g_1, with g_1 = 2 w
    Array([0.8, 0.8], dtype=float32)

  References:
    Li and Giannakis, `Enhancing Sharpness-Aware Optimization Through Variance
    Suppression <https://arxiv.org/abs/2309.15639>`_, NeurIPS 2023.
  """
  check_positive("theta", theta)
  check_unit_interval("theta", theta, include_one=True)
  check_positive("eps", eps)

  return _averaged_direction(VassoState, 1.0 - theta, eps)


def ascent_from_adaptive(
  adaptive: Adaptive, eps: float | jax.Array
) -> optax.GradientTransformation:
  """The direction of ``gsam(ascent=None)``: the default, or the one the deprecated ``adaptive`` names."""
  return normalized_ascent(eps) if adaptive is None else adaptive_ascent(adaptive, eps)


MaskOrFn = Any  # a pytree of Python bools (a prefix of params), or params -> such a pytree


_INJECTED_MASK_FIX = (
  "optax.inject_hyperparams calls a function it is given as a schedule, with the step count, "
  "so a mask function arrives evaluated on a scalar: pass static_args=('mask',) to "
  "optax.inject_hyperparams."
)


def is_function(tree: Any) -> bool:
  """Whether a mask (or ``frozen``) is a function of the params, by ``optax.masked``'s rule.

  A pytree of bools can itself be callable (an Equinox module is): it is a
  function only where its leaves are.
  """
  callable_leaves = jax.tree.leaves(jax.tree.map(callable, tree))
  return bool(callable_leaves) and all(callable_leaves)


def check_mask(mask: MaskOrFn) -> None:
  """A mask is None, a callable, or a pytree whose leaves are Python bools (static).

  A bare bool is refused: ``None`` already means every leaf, and a bare bool is
  what a mask function gives when ``optax.inject_hyperparams`` evaluates it as
  a schedule on the step count.
  """
  if mask is None or is_function(mask):
    return
  if isinstance(mask, (bool, np.bool_)):
    raise ValueError(
      f"mask is the bare bool {mask!r}, not a pytree of bools over params. "
      + _INJECTED_MASK_FIX
      + " To perturb every leaf, leave mask=None."
    )
  leaves = jax.tree.leaves(mask)
  bad = [leaf for leaf in leaves if not isinstance(leaf, (bool, np.bool_))]
  if bad:
    raise ValueError(
      "mask must be a pytree of Python bools (True: perturb the leaf) with the structure of "
      "params or a prefix of it, or a function params -> such a pytree, as optax.masked takes; "
      f"got a leaf {bad[0]!r}. Arrays are not accepted: the mask decides the program's shape. "
      "If a mask function was given to optax.inject_hyperparams: " + _INJECTED_MASK_FIX
    )
  if leaves and not any(bool(leaf) for leaf in leaves):
    raise ValueError("mask selects no leaf: nothing would be perturbed. Use the base optimizer.")


def resolve_mask(mask: MaskOrFn, params: optax.Params) -> Any:
  """The mask as a pytree of bools for these params (None: every leaf)."""
  if mask is None:
    return None
  function = is_function(mask)
  tree = mask(params) if function else mask
  if function:
    check_mask(tree)
  try:
    jax.tree.map(lambda selected, subtree: None, tree, params)
  except ValueError as error:
    raise ValueError(
      "mask does not match params: it must have the structure of params, or of a prefix of "
      f"it, with a bool at each of its leaves ({error})."
    ) from error
  return tree


def select_leaves(mask_tree: Any, tree: optax.Updates) -> optax.Updates:
  """``tree`` with every leaf the mask leaves out replaced by zeros (a constant)."""
  if mask_tree is None:
    return tree
  keep = lambda selected, sub: sub if selected else jax.tree.map(jnp.zeros_like, sub)
  return jax.tree.map(keep, mask_tree, tree)
