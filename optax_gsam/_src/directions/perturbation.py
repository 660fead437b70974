"""Pure pytree maths of sharpness-aware minimisation.

Nothing here holds optimizer state: these functions map gradient and parameter
pytrees to pytrees and scalars, so the optax transforms, the big_vision adapter
and the tests of every one of them share one implementation of the formulas.

Numerics. Norms and inner products accumulate in at least float32 (float64
stays float64) and are exact in relative terms for float32 gradients from
about 1e-30 to 1e30, with no conditional over the gradient trees: compiled
programs neither count a branch that never runs nor hold extra copies of the
gradients. Each backend gets the form it runs fastest, chosen when the step is
lowered (``jax.lax.platform_dependent``):

- On CPU, where a reduction is bound by its arithmetic, each tree is first
  scaled by the power of two that brings its largest entry into [0.5, 1): the
  scaling is exact, no square or product of scaled entries overflows, and the
  entries that underflow are too small to change a norm or a cosine. Two
  operations per entry, in two passes (the largest entry, then the sum).
- On TPU and GPU, where a reduction is bound by memory, one pass forms each sum
  three times: plainly, and with every entry scaled by :math:`2^{-72}` and by
  :math:`2^{72}`; scalar selects keep the plain sum unless it overflowed or
  may have lost entries to underflow, and fall back on the scaled sum that did
  not. One pass over the gradient instead of two: on the TPU compiler's
  ViT-B/32 step, 2.4 ms (f32) and 1.2 ms (bf16) less per step
  (benchmarks/README.md). GPUs get this form too, as memory-bound; that is not
  measured here.

Complex leaves count as pairs of reals: norms sum :math:`|x|^2` and inner
products are :math:`\\operatorname{Re}\\sum \\bar a b`, as optax's own complex
support does. Every division is guarded: a zero gradient produces a zero
perturbation and a finite output.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.core.arrays import real_dtype
from optax_gsam._src.core.arrays import upcast
from optax_gsam.typing import Adaptive

ADAPTIVE_CHOICES = (None, "gsam", "asam")
REUSE_SCALES = ("relative", "global", "per_leaf")
# The most a cheap step may enlarge the stored direction over the size its full step gave it
# (reuse_direction): never push it harder than the full step did. docs/policies.md has the
# measurements (2 still ended LookSAM's forms 8 to 18 points below the base optimizer).
DEFAULT_MAX_AMPLIFICATION = 1.0

# Each tree is scaled by the power of two that brings its largest entry into
# [0.5, 1). The exponent is clipped to +-120 so that the scale itself stays a
# normal float32.
_EXPONENT_LIMIT = 120
# A key beyond every clipped exponent (_scale's sort).
_ORDER_SENTINEL = 1000


def _safe_inverse(x: jax.Array) -> jax.Array:
  """1/x where x > 0, else 0; never produces inf or nan from a zero."""
  positive = x > 0
  return jnp.where(positive, 1.0 / jnp.where(positive, x, 1.0), 0.0)


def _real_parts(x: jax.Array) -> list[jax.Array]:
  """A leaf in its accumulation dtype; a complex one as its real and imaginary parts."""
  x = upcast(x)
  return [jnp.real(x), jnp.imag(x)] if jnp.iscomplexobj(x) else [x]


class _Scale(NamedTuple):
  """The power of two that scales a tree for the CPU's norms (:func:`_scale`)."""

  exponent: jax.Array  # int32 e, max |x| = m 2^e with m in [0.5, 1); clipped to +-120
  full: jax.Array  # float32 2^-e: the tree's largest entry in [0.5, 1)
  half: jax.Array  # float32 2^-(e+1): in [0.25, 0.5)


def _scale(tree: optax.Params) -> _Scale:
  """The exponent of ``tree``'s largest entry and its scales; e = 0 for a zero or non-finite max.

  The exponent is read from the bits of each leaf's largest entry, as ``jnp.frexp`` gives it
  for a normal number; a subnormal reads as the lowest normal exponent, clipped to -120 as
  frexp's. The leaves' figures are combined by a sort, not a max: XLA's CPU compiler unrolls a
  max over stacked scalars into a chain of maxima and copies that chain, and whatever scalar
  work follows it, into every fusion that scales a leaf, which grows the program with the square
  of the number of leaves (benchmarks/costs/compile_time.py). A sort is never copied into its
  consumers, and it carries the scales ready-made, so that each fusion only reads one.
  """
  maxima = [jnp.max(jnp.abs(p)) for x in jax.tree.leaves(tree) if x.size for p in _real_parts(x)]
  if not maxima:
    return _Scale(
      jnp.zeros((), jnp.int32), jnp.ones((), jnp.float32), jnp.full((), 0.5, jnp.float32)
    )
  largest = jax.lax.stop_gradient(jnp.stack(maxima))
  if largest.dtype == jnp.float64:
    bits, shift, field, bias = jnp.int64, 52, 0x7FF, 1022
  else:
    largest, bits, shift, field, bias = largest.astype(jnp.float32), jnp.int32, 23, 0xFF, 126
  raw = jax.lax.bitcast_convert_type(largest, bits)
  exponent = ((jnp.right_shift(raw, shift) & field) - bias).astype(jnp.int32)
  exponent = jnp.clip(exponent, -_EXPONENT_LIMIT, _EXPONENT_LIMIT)
  finite = jnp.isfinite(largest)
  # Keys ordered so that the last one decides: a non-finite leaf, else the largest exponent; a
  # zero leaf (raw bits 0; a subnormal is not 0, flushed or not) only when every leaf is zero.
  keys = jnp.where(finite, jnp.where(raw != 0, exponent, -_ORDER_SENTINEL), _ORDER_SENTINEL)
  exponent = jnp.where(finite & (raw != 0), exponent, 0)
  columns: tuple[jax.Array, ...] = (
    exponent,
    _power_of_two(-exponent),
    _power_of_two(-exponent - 1),
  )
  if len(maxima) > 1:
    columns = tuple(jax.lax.sort((keys, *columns), num_keys=1)[1:])
  return _Scale(*(column[-1] for column in columns))


def _power_of_two(exponent: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
  r""":math:`2^e` in ``dtype`` (float32 or float64), exact for :math:`|e| \le 126`.

  Built from the bits of a normal float32 (the exponents here are clipped to
  +-120): a handful of ops, where ``jnp.ldexp`` compiles to some sixty, once
  for every leaf it scaled.
  """
  bits = jnp.left_shift(jnp.asarray(exponent, jnp.int32) + 127, 23)
  return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _scaled_dot(
  a: optax.Params, b: optax.Params, scale_a: jax.Array, scale_b: jax.Array
) -> jax.Array:
  """The inner product of ``a`` times ``scale_a`` and ``b`` times ``scale_b`` (powers of two)."""
  scales: dict[tuple[int, Any], jax.Array] = {}

  def scale(which: int, factor: jax.Array, dtype: Any) -> jax.Array:
    key = (which, jnp.dtype(dtype))  # one scalar per tree and dtype, not one per leaf
    if key not in scales:
      scales[key] = factor.astype(dtype)
    return scales[key]

  total = jnp.zeros((), jnp.float32)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    for p, q in zip(_real_parts(x), _real_parts(y), strict=True):
      total = total + jnp.sum((p * scale(0, scale_a, p.dtype)) * (q * scale(1, scale_b, q.dtype)))
  return total


def _scaled_norm(tree: optax.Params, factor: jax.Array) -> jax.Array:
  """The norm of ``tree`` times ``factor`` (a power of two)."""
  return jnp.sqrt(_scaled_dot(tree, tree, factor, factor))


def _unscale(value: jax.Array, exponent: jax.Array) -> jax.Array:
  return value * _power_of_two(exponent, value.dtype)


def stable_global_norm(tree: optax.Params) -> jax.Array:
  r"""Global L2 norm :math:`\|x\|_2` of a pytree, exact across float32's whole range.

  Unlike ``optax.tree.norm``, it accumulates bfloat16 and float16 leaves in
  float32 and neither overflows nor underflows: on CPU the sum of squares is
  taken with every entry scaled by the power of two that brings the largest
  one into [0.5, 1); on TPU and GPU three sums (plain, and scaled by
  :math:`2^{\mp 72}`) are formed in one pass and the exact one kept (see the
  module notes). Complex leaves contribute :math:`|x|^2`.

  Args:
    tree: a pytree of arrays.

  Returns:
    A scalar in the accumulation dtype (float32 at least; float64 for float64
    leaves); 0 for an empty or all-zero tree.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> big = {"a": jnp.full(4, 2.0**100), "b": jnp.zeros(2)}  # squares overflow float32
    >>> float(optax_gsam.stable_global_norm(big)) == 2.0**101
    True
  """
  return jax.lax.platform_dependent(tree, cpu=_two_pass_norm, default=_one_pass_norm)


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


def _pair_stats(a: optax.Updates, b: optax.Updates) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(|a|, |b|, cos(a, b))`` in the form of the backend the step is lowered for."""
  return jax.lax.platform_dependent(a, b, cpu=_two_pass_pair_stats, default=_one_pass_pair_stats)


# ----------------------------------------------------------------------------- the CPU's form


def _two_pass_norm(tree: optax.Params) -> jax.Array:
  """The norm of ``tree``, scaled first by the power of two of its largest entry."""
  scale = _scale(tree)  # at half the scale: see _two_pass_pair_stats
  return _unscale(_scaled_norm(tree, scale.half), scale.exponent + 1)


def _two_pass_pair_stats(a: optax.Updates, b: optax.Updates) -> tuple[jax.Array, ...]:
  """``(|a|, |b|, cos(a, b))``, each tree scaled by a power of two near its largest entry.

  ``a``'s norm is taken at half the scale of its inner product with ``b`` (exact), as
  :func:`stable_global_norm` takes it: for the clean gradient that norm is the ascent's, taken
  before the perturbed pass, and it then shares no scaled copy of ``a`` with the inner product
  after that pass. Shared, XLA's CPU compiler keeps the copy, a params-sized buffer, through
  the whole perturbed pass.
  """
  scale_a, scale_b = _scale(a), _scale(b)
  half_a, half_b = _scaled_norm(a, scale_a.half), _scaled_norm(b, scale_b.half)
  dot = _scaled_dot(a, b, scale_a.full, scale_b.full)
  cosine = dot * _safe_inverse(2 * half_a) * _safe_inverse(2 * half_b)
  return _unscale(half_a, scale_a.exponent + 1), _unscale(half_b, scale_b.exponent + 1), cosine


# ----------------------------------------------------------------------------- TPU's and GPU's form

# The fallback sums scale every entry by 2^-72 and 2^72: squares of float32 values up to the
# largest finite one stay finite after 2^-72, and those down to about 1e-38 stay normal after 2^72.
_RANGE_SCALE = 2.0**72


class _RangeSums(NamedTuple):
  """:math:`\\sum_i \\operatorname{Re}(\\bar a_i b_i)` plainly, and with both factors scaled down or up."""

  plain: jax.Array
  down: jax.Array  # the sum times 2^-144
  up: jax.Array  # the sum times 2^144


def _opaque_scale() -> jax.Array:
  """2^72 as a value XLA cannot see: its simplifier folds ``(p * c) * (q * c)`` of scalars into
  ``p * q * c^2``, and 2^144 overflows float32 (2^-144 flushes to 0)."""
  return jax.lax.optimization_barrier(jnp.float32(_RANGE_SCALE))


def _range_sums(a: optax.Params, b: optax.Params) -> _RangeSums:
  """:class:`_RangeSums` over two trees of one structure: three sums of each leaf, in one pass."""
  plain = down = up = jnp.zeros((), jnp.float32)
  scale = _opaque_scale()
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    for p, q in zip(_real_parts(x), _real_parts(y), strict=True):
      c = scale.astype(p.dtype)
      plain = plain + jnp.sum(p * q)
      down = down + jnp.sum((p / c) * (q / c))
      up = up + jnp.sum((p * c) * (q * c))
  return _RangeSums(plain, down, up)


def _underflow_floor(*trees: optax.Params) -> float:
  """Below this, a plain sum may have lost entries to underflow beyond ``eps`` relative.

  Each of its products (two per complex entry) loses at most the smallest normal number
  (flushed to zero or not), so the sum is accurate when it is at least ``products * tiny /
  eps`` of the narrowest accumulation dtype in the trees.
  """
  leaves = [x for tree in trees for x in jax.tree.leaves(tree)]
  if not leaves:
    return 0.0
  worst = max(
    float(info.tiny / info.eps) for info in (jnp.finfo(real_dtype(x.dtype)) for x in leaves)
  )
  products = lambda tree: sum(
    x.size * (2 if jnp.iscomplexobj(x) else 1) for x in jax.tree.leaves(tree)
  )
  return float(max(products(tree) for tree in trees)) * worst


def _norm_from(sums: _RangeSums, floor: float) -> jax.Array:
  """The square root of a sum of squares, from whichever of its three forms is exact."""
  rescaled = jnp.where(
    jnp.isfinite(sums.plain),
    jnp.sqrt(sums.up) / _RANGE_SCALE,  # underflowed
    jnp.sqrt(sums.down) * _RANGE_SCALE,  # overflowed, or not finite at all
  )
  accurate = jnp.isfinite(sums.plain) & (sums.plain >= floor)
  return jnp.where(accurate, jnp.sqrt(sums.plain), rescaled)


# The one-pass forms differentiate as the two-pass ones: the sums a select leaves out would
# otherwise put 0 * inf in the gradient (the square root of an underflowed sum, an overflowed
# product), where the two-pass forms' derivatives are finite.
@jax.custom_jvp
def _one_pass_norm(tree: optax.Params) -> jax.Array:
  return _norm_from(_range_sums(tree, tree), _underflow_floor(tree))


@jax.custom_jvp
def _one_pass_pair_stats(a: optax.Updates, b: optax.Updates) -> tuple[jax.Array, ...]:
  """``(|a|, |b|, cos(a, b))``: the three range sums of each, in one pass over both trees."""
  floor = _underflow_floor(a, b)
  norm_a = _norm_from(_range_sums(a, a), floor)
  norm_b = _norm_from(_range_sums(b, b), floor)
  dot = _range_sums(a, b)
  inverse_a, inverse_b = _safe_inverse(norm_a), _safe_inverse(norm_b)
  # The scaled sums carry 2^-144 or 2^144; each norm's inverse absorbs half of it.
  c = _opaque_scale()
  rescaled = jnp.where(
    jnp.isfinite(dot.plain),
    (dot.up * (inverse_a / c)) * (inverse_b / c),
    (dot.down * (inverse_a * c)) * (inverse_b * c),
  )
  accurate = jnp.isfinite(dot.plain) & (norm_a * norm_b >= floor)
  cosine = jnp.where(accurate, dot.plain * inverse_a * inverse_b, rescaled)
  # A zero tree's scaled sums can hold 0 * inf (the other tree's entries over 2^56 times 2^72).
  return norm_a, norm_b, jnp.where((inverse_a > 0) & (inverse_b > 0), cosine, 0.0)


@_one_pass_norm.defjvp
def _one_pass_norm_jvp(primals, tangents):
  return _one_pass_norm(*primals), jax.jvp(_two_pass_norm, primals, tangents)[1]


@_one_pass_pair_stats.defjvp
def _one_pass_pair_stats_jvp(primals, tangents):
  return _one_pass_pair_stats(*primals), jax.jvp(_two_pass_pair_stats, primals, tangents)[1]


def gradient_stats(clean_grads: optax.Updates, perturbed_grads: optax.Updates) -> GradientStats:
  """Norms of both gradients and the cosine between them, exact across float32's range.

  The two sums of squares and the inner product come from one pass over both
  trees (see :func:`stable_global_norm` for how overflow is avoided).

  Args:
    clean_grads: :math:`g_c`.
    perturbed_grads: :math:`g_p`, with the structure of ``clean_grads``.

  Returns:
    A :class:`GradientStats`.
  """
  return GradientStats(*_pair_stats(clean_grads, perturbed_grads))


def perturbation(
  grads: optax.Updates,
  params: optax.Params,
  rho: jax.Array | float,
  *,
  adaptive: Adaptive = None,
  eps: float | jax.Array = 1e-12,
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

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> optax_gsam.perturbation(jnp.array([3.0, 4.0]), jnp.zeros(2), 0.5).round(6)
    Array([0.3, 0.4], dtype=float32)
  """
  if adaptive not in ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {ADAPTIVE_CHOICES}, got {adaptive!r}.")
  if adaptive == "asam":
    direction = jax.tree.map(lambda g, w: upcast(g) * jnp.abs(upcast(w)), grads, params)
    weight = jax.tree.map(lambda w: jnp.abs(upcast(w)), params)
  elif adaptive == "gsam":
    direction = grads
    weight = jax.tree.map(lambda w: jnp.abs(upcast(w)), params)
  else:
    direction = grads
    weight = None
  scale = rho / (stable_global_norm(direction) + eps)
  if weight is None:
    return jax.tree.map(lambda g, w: (upcast(g) * scale).astype(w.dtype), grads, params)
  # With "asam", direction = |w| g, so |w| * direction = w^2 g.
  return jax.tree.map(
    lambda d, a, w: (upcast(d) * a * scale).astype(w.dtype), direction, weight, params
  )


def decompose(
  clean_grads: optax.Updates,
  perturbed_grads: optax.Updates,
  alpha: jax.Array | float,
  *,
  minimize_fp: bool = True,
  eps: float | jax.Array = 1e-12,
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

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> g = optax_gsam.decompose(jnp.array([1.0, 1.0]), jnp.array([2.0, 0.0]), 0.5)
    >>> [round(float(x), 6) for x in g]  # g_p - 0.5 * (the part of g_c orthogonal to g_p)
    [2.0, -0.5]
  """
  if stats is None:
    stats = gradient_stats(clean_grads, perturbed_grads)
  base, other = (perturbed_grads, clean_grads) if minimize_fp else (clean_grads, perturbed_grads)
  coefficient = projection_coefficient(stats, minimize_fp, eps)
  sign = -1.0 if minimize_fp else 1.0

  def combine(b, o, like):
    b = upcast(b)
    return (b + sign * alpha * (upcast(o) - coefficient * b)).astype(like.dtype)

  return jax.tree.map(combine, base, other, clean_grads)


def projection_coefficient(stats: GradientStats, minimize_fp: bool, eps: Any) -> jax.Array:
  """:func:`decompose`'s :math:`c`, the other gradient's projection on the kept one."""
  if minimize_fp:
    return stats.clean_norm * stats.cosine / (stats.perturbed_norm + eps)
  return stats.perturbed_norm * stats.cosine / (stats.clean_norm + eps)


def orthogonal_component(
  grads: optax.Updates, reference: optax.Updates, *, eps: float | jax.Array = 1e-12
) -> optax.Updates:
  r"""The part of ``grads`` orthogonal to ``reference``.

  .. math::

    g^{\perp} = g - \frac{\langle g, r\rangle}{\|r\|(\|r\| + \varepsilon)} r

  Returns ``grads`` unchanged when ``reference`` is zero.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> optax_gsam.orthogonal_component(jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]))
    Array([0., 2.], dtype=float32)
  """
  reference_norm, grads_norm, cosine = _pair_stats(reference, grads)
  coefficient = grads_norm * cosine / (reference_norm + eps)
  return jax.tree.map(
    lambda g, r: (upcast(g) - coefficient * upcast(r)).astype(g.dtype), grads, reference
  )


def reuse_component(
  gradient: optax.Updates, clean_grads: optax.Updates, *, eps: float | jax.Array = 1e-12
) -> optax.Updates:
  r"""What a full step stores for reuse: its output's orthogonal part, over the clean norm.

  .. math::

    u = \frac{g^{\perp g_c}}{\|g_c\|}

  (0 where :math:`g_c = 0`), so that :math:`\|u\|` is the size of the full
  step's orthogonal component relative to its clean gradient.
  """
  orthogonal = orthogonal_component(gradient, clean_grads, eps=eps)
  inverse = _safe_inverse(stable_global_norm(clean_grads))
  return jax.tree.map(lambda v: (upcast(v) * inverse).astype(v.dtype), orthogonal)


def _reused_part(
  clean_grads: optax.Updates,
  stored_direction: optax.Updates,
  weight: jax.Array | float,
  scale: str,
  eps: float | jax.Array,
) -> tuple[optax.Updates, jax.Array]:
  """What :func:`reuse_direction` adds to ``clean_grads``, and its amplification."""
  clean_norm, stored_norm = stable_global_norm(clean_grads), stable_global_norm(stored_direction)
  if scale == "relative":  # never more than LookSAM's share: u / max(|u|, 1)
    factor = weight * clean_norm / jnp.maximum(stored_norm, 1.0)
    added = jax.tree.map(lambda u: factor * upcast(u), stored_direction)
    return added, weight / jnp.maximum(stored_norm, 1.0)
  amplification = weight * _safe_inverse(stored_norm)
  if scale == "global":
    factor = weight * clean_norm / (stored_norm + eps)
    return jax.tree.map(lambda u: factor * upcast(u), stored_direction), amplification
  per_leaf = lambda g, u: weight * stable_global_norm(g) * upcast(u) / (stable_global_norm(u) + eps)
  return jax.tree.map(per_leaf, clean_grads, stored_direction), amplification


def reuse_direction(
  clean_grads: optax.Updates,
  stored_direction: optax.Updates,
  weight: jax.Array | float,
  *,
  scale: str = "relative",
  max_amplification: float | None = DEFAULT_MAX_AMPLIFICATION,
  eps: float | jax.Array = 1e-12,
) -> optax.Updates:
  r"""LookSAM's cheap step: the clean gradient plus the stored direction, rescaled.

  The stored direction is :math:`u = v / \|g_c^{(s)}\|`, where :math:`v` is the
  component, orthogonal to its clean gradient :math:`g_c^{(s)}`, of the last
  fully computed (G)SAM gradient; :math:`\|u\|` is
  how large that component was relative to the clean gradient. With the reuse
  weight :math:`\lambda`:

  .. math::

    g = \begin{cases}
      g_c + \lambda \|g_c\|\, u / \max(\|u\|, 1)
        & \text{scale="relative"} \\
      g_c + \lambda \|g_c\|\, u / (\|u\| + \varepsilon)
        & \text{scale="global" (LookSAM)} \\
      g_{c,i} + \lambda \|g_{c,i}\|\, u_i / (\|u_i\| + \varepsilon) \ \text{per leaf } i
        & \text{scale="per\_leaf" (LookSAM's layer-wise form)}
    \end{cases}

  The relative form keeps the share of the gradient the full step gave the
  component (times :math:`\lambda`, and at most LookSAM's share
  :math:`\lambda`). LookSAM's forms enlarge it :math:`a = \lambda / \|u\|` times
  (the relative form: :math:`a = \lambda / \max(\|u\|, 1)`). Where :math:`a >`
  ``max_amplification`` the output is :math:`g_c`: a stored component much
  smaller than the share it would be pushed at is mostly minibatch noise.

  Args:
    clean_grads: :math:`g_c`.
    stored_direction: :math:`u` (without the guard, LookSAM's forms read only
      its direction, so the unnormalized :math:`v` gives the same result).
    weight: :math:`\lambda \ge 0`.
    scale: ``"relative"``, ``"global"`` or ``"per_leaf"``.
    max_amplification: the largest :math:`a` that reuses; ``None``: no limit.
    eps: :math:`\varepsilon`, guards the divisions.

  Returns:
    :math:`g`, with the dtype of each ``clean_grads`` leaf.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> g_c, u = jnp.array([3.0, 0.0]), jnp.array([0.0, 0.8])
    >>> optax_gsam.reuse_direction(g_c, u, 0.5).round(6)  # 0.5 * 3 * 0.8
    Array([3. , 1.2], dtype=float32)
    >>> optax_gsam.reuse_direction(g_c, u, 0.5, scale="global").round(6)  # 0.5 * 3; a = 0.625
    Array([3. , 1.5], dtype=float32)
    >>> optax_gsam.reuse_direction(g_c, u / 4, 0.5, scale="global").round(6)  # a = 2.5 > 1
    Array([3., 0.], dtype=float32)

  References:
    Liu et al., `Towards Efficient and Scalable Sharpness-Aware Minimization
    <https://arxiv.org/abs/2203.02714>`_, CVPR 2022.
  """
  if scale not in REUSE_SCALES:
    raise ValueError(f"scale must be one of {REUSE_SCALES}, got {scale!r}.")
  added, amplification = _reused_part(clean_grads, stored_direction, weight, scale, eps)
  # A zero stored direction (nothing stored, or a zero clean gradient) reuses nothing either way.
  reuse = jnp.asarray(True) if max_amplification is None else amplification <= max_amplification
  return jax.tree.map(
    lambda g, a: jnp.where(reuse, upcast(g) + a, upcast(g)).astype(g.dtype), clean_grads, added
  )
