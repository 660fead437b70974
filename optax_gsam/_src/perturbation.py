"""Pure pytree maths of sharpness-aware minimisation.

Nothing here holds optimizer state: these functions map gradient and parameter
pytrees to pytrees and scalars, so the optax transforms, the big_vision adapter
and the tests of every one of them share one implementation of the formulas.

Numerics. Norms and inner products are accumulated in at least float32 (float64
stays float64), whatever the leaf dtype, in one pass; only when that pass
overflowed or underflowed are they recomputed on the pytree rescaled by its
largest absolute entry. That keeps them exact in relative terms
for gradients as small as 1e-30 or as large as 1e30 in float32, where a naive
sum of squares would underflow to 0 or overflow to inf. Every division is
guarded: a zero gradient produces a zero perturbation and a finite output.
"""

from __future__ import annotations

import functools
from typing import Literal
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

Adaptive = Literal["gsam", "asam"] | None
ADAPTIVE_CHOICES = (None, "gsam", "asam")


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """The dtype reductions run in: float32 at least, float64 when given."""
  return jnp.promote_types(dtype, jnp.float32)


def _upcast(x: jax.Array) -> jax.Array:
  return jnp.asarray(x).astype(accumulation_dtype(jnp.asarray(x).dtype))


def _safe_inverse(x: jax.Array) -> jax.Array:
  """1/x where x > 0, else 0; never produces inf or nan from a zero."""
  positive = x > 0
  return jnp.where(positive, 1.0 / jnp.where(positive, x, 1.0), 0.0)


def max_abs(tree: optax.Params) -> jax.Array:
  """Largest absolute entry of a pytree, in the accumulation dtype (0 if empty)."""
  maxima = [jnp.max(jnp.abs(_upcast(x))) for x in jax.tree.leaves(tree) if jnp.size(x)]
  return functools.reduce(jnp.maximum, maxima, jnp.zeros((), jnp.float32))


def _scaled(tree: optax.Params, scale_inverse: jax.Array) -> optax.Params:
  return jax.tree.map(lambda x: _upcast(x) * scale_inverse.astype(_upcast(x).dtype), tree)


def _sum_of_products(a: optax.Params, b: optax.Params) -> jax.Array:
  """sum_i a_i b_i over a pytree, accumulated in at least float32."""
  terms = [
    jnp.sum(_upcast(x) * _upcast(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  ]
  return functools.reduce(jnp.add, terms, jnp.zeros((), jnp.float32))


def _is_accurate(sum_of_squares: jax.Array, size: int) -> jax.Array:
  """Whether a plain sum of squares neither overflowed nor lost entries to underflow.

  Entries whose squares fall below the smallest normal number are lost; they
  can contribute at most ``size * tiny``, which is below ``eps`` relative when
  the sum is at least ``size * tiny / eps``.
  """
  info = jnp.finfo(sum_of_squares.dtype)
  return jnp.isfinite(sum_of_squares) & (sum_of_squares >= size * (info.tiny / info.eps))


def _scaled_norm(tree: optax.Params) -> jax.Array:
  m = max_abs(tree)
  return m * optax.tree.norm(_scaled(tree, _safe_inverse(m)))


def global_norm(tree: optax.Params) -> jax.Array:
  r"""Overflow- and underflow-safe global L2 norm :math:`\|x\|_2` of a pytree.

  One pass computes the plain sum of squares in at least float32. Only when that
  overflowed or underflowed (gradients around 1e±19 and beyond in float32) does
  a ``lax.cond`` take the slow path, :math:`m \, \|x / m\|_2` with
  :math:`m = \max_i |x_i|`.
  """
  sum_of_squares = _sum_of_products(tree, tree)
  return jax.lax.cond(
    _is_accurate(sum_of_squares, optax.tree.size(tree)),
    lambda: jnp.sqrt(sum_of_squares),
    lambda: _scaled_norm(tree).astype(sum_of_squares.dtype),
  )


class GradientStats(NamedTuple):
  """Scalars that describe a clean/perturbed gradient pair.

  Attributes:
    clean_norm: :math:`\\|g_c\\|_2`.
    perturbed_norm: :math:`\\|g_p\\|_2`.
    cosine: :math:`\\langle g_c, g_p\\rangle / (\\|g_c\\| \\|g_p\\|)`, 0 when
      either gradient is zero.
  """

  clean_norm: jax.Array
  perturbed_norm: jax.Array
  cosine: jax.Array


def gradient_stats(clean_grads: optax.Updates, perturbed_grads: optax.Updates) -> GradientStats:
  """Norms of both gradients and the cosine between them, overflow-safe.

  The common case is one fused pass (two sums of squares and the inner
  product); rescaled sums run only when that pass overflowed or underflowed.
  """
  size = optax.tree.size(clean_grads)
  clean_sq = _sum_of_products(clean_grads, clean_grads)
  perturbed_sq = _sum_of_products(perturbed_grads, perturbed_grads)
  dot = _sum_of_products(clean_grads, perturbed_grads)
  accurate = _is_accurate(clean_sq, size) & _is_accurate(perturbed_sq, size) & jnp.isfinite(dot)

  def fast():
    clean_norm, perturbed_norm = jnp.sqrt(clean_sq), jnp.sqrt(perturbed_sq)
    cosine = dot * _safe_inverse(clean_norm) * _safe_inverse(perturbed_norm)
    return clean_norm, perturbed_norm, cosine

  def rescaled():
    clean_max, perturbed_max = max_abs(clean_grads), max_abs(perturbed_grads)
    clean_unit = _scaled(clean_grads, _safe_inverse(clean_max))
    perturbed_unit = _scaled(perturbed_grads, _safe_inverse(perturbed_max))
    clean_unit_norm = optax.tree.norm(clean_unit)
    perturbed_unit_norm = optax.tree.norm(perturbed_unit)
    cosine = optax.tree.vdot(clean_unit, perturbed_unit) * _safe_inverse(
      clean_unit_norm * perturbed_unit_norm
    )
    stats = (clean_max * clean_unit_norm, perturbed_max * perturbed_unit_norm, cosine)
    return tuple(x.astype(dot.dtype) for x in stats)

  return GradientStats(*jax.lax.cond(accurate, fast, rescaled))


def perturbation(
  grads: optax.Updates,
  params: optax.Params,
  rho: jax.Array | float,
  *,
  adaptive: Adaptive = None,
  eps: float = 1e-12,
) -> optax.Updates:
  r"""The ascent step :math:`\epsilon` added to the weights before the second pass.

  .. math::

    \epsilon = \begin{cases}
      \rho\, g / (\|g\| + \varepsilon) & \text{adaptive=None (SAM, GSAM)} \\
      \rho\, |w| \odot g / (\|g\| + \varepsilon) & \text{adaptive="gsam" (GSAM paper, big\_vision)} \\
      \rho\, w^2 \odot g / (\| |w| \odot g \| + \varepsilon) & \text{adaptive="asam" (Kwon et al., 2021)}
    \end{cases}

  Args:
    grads: the clean gradient :math:`g`.
    params: the weights :math:`w` (read only by the adaptive forms).
    rho: the perturbation radius.
    adaptive: ``None``, ``"gsam"`` or ``"asam"``.
    eps: :math:`\varepsilon`, guards the division.

  Returns:
    :math:`\epsilon`, with the dtype of each ``params`` leaf.
  """
  if adaptive not in ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {ADAPTIVE_CHOICES}, got {adaptive!r}.")
  if adaptive == "asam":
    direction = jax.tree.map(lambda g, w: _upcast(g) * jnp.abs(_upcast(w)), grads, params)
    weight = jax.tree.map(lambda w: jnp.abs(_upcast(w)), params)
  elif adaptive == "gsam":
    direction = grads
    weight = jax.tree.map(lambda w: jnp.abs(_upcast(w)), params)
  else:
    direction = grads
    weight = None
  scale = rho / (global_norm(direction) + eps)
  if weight is None:
    return jax.tree.map(lambda g, w: (_upcast(g) * scale).astype(w.dtype), grads, params)
  # With "asam", direction = |w| g, so |w| * direction = w^2 g.
  return jax.tree.map(
    lambda d, a, w: (_upcast(d) * a * scale).astype(w.dtype), direction, weight, params
  )


def decompose(
  clean_grads: optax.Updates,
  perturbed_grads: optax.Updates,
  alpha: jax.Array | float,
  *,
  minimize_fp: bool = True,
  eps: float = 1e-12,
  stats: GradientStats | None = None,
) -> optax.Updates:
  r"""GSAM's gradient decomposition.

  With :math:`g_c` the clean and :math:`g_p` the perturbed gradient:

  .. math::

    g = \begin{cases}
      g_p - \alpha \left(g_c - \frac{\langle g_c, g_p\rangle}{\|g_p\|(\|g_p\| + \varepsilon)} g_p\right)
        & \text{minimize\_fp=True} \\
      g_c + \alpha \left(g_p - \frac{\langle g_p, g_c\rangle}{\|g_c\|(\|g_c\| + \varepsilon)} g_c\right)
        & \text{minimize\_fp=False}
    \end{cases}

  The first form (the paper's) descends the perturbed loss :math:`f_p` and
  ascends the clean loss only along the direction orthogonal to
  :math:`\nabla f_p`, which lowers the surrogate gap :math:`h = f_p - f` without
  changing the descent of :math:`f_p`. The second keeps :math:`g_c` and adds the
  part of :math:`g_p` orthogonal to it. The inner product is evaluated as
  :math:`\|g_c\| \|g_p\| \cos`, so it is finite whenever the norms are, and the
  projection is zero when the gradient projected on is zero.

  Args:
    clean_grads: :math:`g_c`.
    perturbed_grads: :math:`g_p`.
    alpha: weight of the orthogonal component; 0 gives :math:`g_p` (SAM).
    minimize_fp: which of the two forms.
    eps: :math:`\varepsilon`.
    stats: precomputed :func:`gradient_stats` of the pair, to avoid recomputing.

  Returns:
    :math:`g`, with the dtype of each ``clean_grads`` leaf.
  """
  if stats is None:
    stats = gradient_stats(clean_grads, perturbed_grads)
  if minimize_fp:
    base, other = perturbed_grads, clean_grads
    coefficient = stats.clean_norm * stats.cosine / (stats.perturbed_norm + eps)

    def combine(b, o):
      return _upcast(b) - alpha * (_upcast(o) - coefficient * _upcast(b))

  else:
    base, other = clean_grads, perturbed_grads
    coefficient = stats.perturbed_norm * stats.cosine / (stats.clean_norm + eps)

    def combine(b, o):
      return _upcast(b) + alpha * (_upcast(o) - coefficient * _upcast(b))

  return jax.tree.map(lambda b, o, ref: combine(b, o).astype(ref.dtype), base, other, clean_grads)


def orthogonal_component(
  grads: optax.Updates, reference: optax.Updates, *, eps: float = 1e-12
) -> optax.Updates:
  r"""The part of ``grads`` orthogonal to ``reference``.

  .. math::

    g^{\perp} = g - \frac{\langle g, r\rangle}{\|r\|(\|r\| + \varepsilon)} r

  Returns ``grads`` unchanged when ``reference`` is zero.
  """
  stats = gradient_stats(reference, grads)
  coefficient = stats.perturbed_norm * stats.cosine / (stats.clean_norm + eps)
  return jax.tree.map(
    lambda g, r: (_upcast(g) - coefficient * _upcast(r)).astype(g.dtype), grads, reference
  )


def reuse_correction(
  clean_grads: optax.Updates,
  correction: optax.Updates,
  weight: jax.Array | float,
  *,
  eps: float = 1e-12,
) -> optax.Updates:
  r"""LookSAM's cheap step: the clean gradient plus a stored orthogonal direction.

  .. math::

    g = g_c + \lambda \frac{\|g_c\|}{\|v\| + \varepsilon} v

  where :math:`v` is the component, orthogonal to the clean gradient, of the
  last fully computed (G)SAM gradient and :math:`\lambda` the reuse weight.

  Returns:
    :math:`g`, with the dtype of each ``clean_grads`` leaf.
  """
  scale = weight * global_norm(clean_grads) / (global_norm(correction) + eps)
  return jax.tree.map(
    lambda g, v: (_upcast(g) + scale * _upcast(v)).astype(g.dtype), clean_grads, correction
  )
