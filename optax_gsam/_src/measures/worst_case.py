"""Worst-case (m-)sharpness: how much the loss can rise within a ball, found by ascent.

The quantity SAM minimizes, measured the way the SAM paper measures it: per
group of ``m`` examples, a few steps of projected normalized-gradient ascent
on the perturbation, the largest rise seen, averaged over the groups.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable as Hashable  # MeasureOptions' types
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optax_gsam._src.core.arrays import upcast
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.directions.perturbation import stable_global_norm
from optax_gsam._src.measures.measuring import Batches
from optax_gsam._src.measures.measuring import LossFn
from optax_gsam._src.measures.measuring import MeasureOptions
from optax_gsam._src.measures.measuring import ParamView
from optax_gsam._src.measures.measuring import Progress
from optax_gsam._src.measures.measuring import measure_keywords
from optax_gsam._src.measures.measuring import report
from optax_gsam._src.measures.measuring import run_measure

if TYPE_CHECKING:  # PEP 692's Unpack is typing's own from Python 3.12
  from typing_extensions import Unpack


def _groups(batch: Any, m: int | None) -> Any:
  """The batch's rows as ``[batch // m, m, ...]`` groups (one group if ``m`` is None)."""
  size = jax.tree.leaves(batch)[0].shape[0]
  m = size if m is None else m
  if size % m:
    raise ValueError(f"m={m} must divide the (per-device) batch size {size}.")
  return jax.tree.map(lambda x: x.reshape(size // m, m, *x.shape[1:]), batch)


def _group_sharpness(
  loss_fn: LossFn, params: Any, group: Any, rho: Any, ascent_steps: int, scale: Any
) -> jax.Array:
  """max over the ascent's iterates of f(w + s * delta) - f(w), on one group (s=1 if scale is None)."""
  times = lambda tree: tree if scale is None else jax.tree.map(jnp.multiply, tree, scale)
  perturbed = lambda delta: jax.tree.map(
    lambda w, e: (upcast(w) + e).astype(w.dtype), params, times(delta)
  )
  value_and_grad = jax.value_and_grad(loss_fn)

  def ascend(delta, grads):
    # d/d delta of f(w + s * delta) is s * g; a normalized step of rho, then back into the ball.
    direction = times(jax.tree.map(upcast, grads))
    step = rho / (stable_global_norm(direction) + 1e-30)
    delta = jax.tree.map(lambda d, g: d + step * g, delta, direction)
    shrink = jnp.minimum(1.0, rho / (stable_global_norm(delta) + 1e-30))
    return jax.tree.map(lambda d: d * shrink, delta)

  def body(carry, _):
    delta, grads, best = carry
    delta = ascend(delta, grads)
    value, grads = value_and_grad(perturbed(delta), group)
    return (delta, grads, jnp.maximum(best, upcast(value))), None

  loss, grads = value_and_grad(params, group)
  # Laid out like the gradients the ascent adds to it (sharded parameters' gradients may
  # come back with another layout than the parameters have).
  zeros = jax.tree.map(lambda g: jnp.zeros_like(upcast(g)), grads)
  start = (zeros, grads, jnp.full([], -jnp.inf, upcast(loss).dtype))
  (delta, grads, best), _ = jax.lax.scan(body, start, length=ascent_steps - 1)
  last = upcast(loss_fn(perturbed(ascend(delta, grads)), group))
  return jnp.maximum(best, last) - upcast(loss)


class _Options(NamedTuple):
  """The static arguments of :func:`m_sharpness`: with ``loss_fn``, its cache key."""

  m: int | None
  ascent_steps: int
  adaptive: bool
  progress: Progress | None


def _m_sharpness(
  loss: LossFn, view: ParamView, batches: Batches, rho: jax.Array, axis_name, options: _Options
) -> jax.Array:
  """The measure of :func:`m_sharpness`, on the params' real view."""
  per_batch = lambda b: _groups(b, options.m)
  if batches.stacked:  # [rows, batches, ...] -> [batches * rows // m, m, ...]
    data = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), batches.data)
    groups = jax.vmap(per_batch)(data)
    groups = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), groups)
  else:
    groups = per_batch(batches.data)
  total = jax.tree.leaves(groups)[0].shape[0]
  # ASAM's |w|: a complex entry's modulus, for both parts of its pair (as the training transforms).
  scale = [upcast(s) for s in view.modulus()] if options.adaptive else None

  def one(args):
    i, group = args
    value = _group_sharpness(loss, view.leaves, group, rho, options.ascent_steps, scale)
    report(options.progress, i + 1, total)
    return value

  mean = jnp.mean(jax.lax.map(one, (jnp.arange(total), groups)))
  return mean if axis_name is None else jax.lax.pmean(mean, axis_name)


@measure_keywords
def m_sharpness(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  *,
  rho: float,
  m: int | None = None,
  ascent_steps: int = 5,
  adaptive: bool = False,
  **data: Unpack[MeasureOptions],
) -> jax.Array:
  r"""Worst-case m-sharpness: the mean over groups of m examples of the largest rise in the ball.

  .. math::

    S^{\rho}_m(w) = \frac{1}{|G|} \sum_{g \in G} \max_{\|\delta\|_2 \le \rho}
      f_g(w + s \odot \delta) - f_g(w),
    \qquad s = \begin{cases} 1 & \text{(plain)} \\ |w| & \text{(adaptive)} \end{cases}

  where :math:`f_g` is the loss on group :math:`g` of ``m`` consecutive examples.
  The maximum is found by ``ascent_steps`` steps of projected normalized-gradient
  ascent from :math:`\delta = 0` (each step moves :math:`\delta` by :math:`\rho` along
  :math:`s \odot \nabla f_g / \|s \odot \nabla f_g\|`, then projects it onto the ball) and is the largest loss seen at the iterates, so it
  never overshoots the true maximum. One step gives SAM's first-order surrogate
  :math:`f_g(w + \rho\, g / \|g\|) - f_g(w)` (with ``adaptive``, ASAM's
  :math:`f_g(w + \rho\, w^2 \odot g / \||w| \odot g\|) - f_g(w)`).

  Plain sharpness depends on the parameters' scale; the adaptive form (the ball
  measured relative to :math:`|w|`, elementwise) does not change under a rescaling
  that leaves the network's function unchanged (e.g. :math:`c` times a ReLU unit's
  input weights and :math:`1/c` times its output weights).

  Needs no PRNG key: the ascent starts at 0 and the groups are consecutive examples.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, a mean over the batch's examples.
    params: the weights :math:`w`, any pytree of arrays. Complex leaves count as
      (real, imaginary) pairs (:math:`\|\delta\|^2` sums :math:`|\delta_i|^2`, and
      the adaptive :math:`s` is the modulus :math:`|w_i|`); int and bool leaves
      are held fixed.
    batch: a fixed batch, or an iterator of equal-sized batches (with ``num_batches``);
      every leaf's leading axis is the examples.
    rho: the radius :math:`\rho` > 0.
    m: examples per group; must divide the (per-device) batch size. ``None``: the
      whole (per-device) batch is one group.
    ascent_steps: gradient evaluations per group (one more loss evaluation).
    adaptive: measure the ball relative to :math:`|w|` (scale-invariant sharpness).
    num_batches, axis_name, mesh, progress: as :func:`optax_gsam.hessian_eigenvalues`
      takes them; under ``axis_name`` the groups are formed within each device's
      shard, and ``progress`` is called after each group.

  Returns:
    :math:`S^{\rho}_m(w)`, a scalar (float32 at least).

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> x = jnp.eye(4)
    >>> # Each group of 2 rows has f = (w_i^2 + w_j^2) / 2: the rise is (1 + 0.1 / sqrt(2))^2 - 1.
    >>> round(float(optax_gsam.m_sharpness(loss_fn, jnp.ones(4), x, rho=0.1, m=2)), 4)
    0.1464

  References:
    Foret et al., *Sharpness-aware minimization for efficiently improving
    generalization*, ICLR 2021 (m-sharpness, section 4.1); Kwon et al., *ASAM*, ICML
    2021; Andriushchenko et al., *A modern look at the relationship between sharpness
    and generalization*, ICML 2023.
  """
  check_positive("rho", rho)
  check_positive_int("m", m, allow_none=True)
  check_positive_int("ascent_steps", ascent_steps)

  options = _Options(m, ascent_steps, adaptive, data["progress"])
  return run_measure(_m_sharpness, loss_fn, options, params, batch, jnp.asarray(rho), data)
