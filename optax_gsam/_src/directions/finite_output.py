"""Whether GSAM's decomposed gradient is finite, read from the statistics it was built from.

A step checks its output before the state counts it (``optax.apply_if_finite`` then skips the
same steps). On a sharded gradient that check is a reduction over every shard: one more round of
all-reduces after the decomposition, which needs its own round for the statistics. The
statistics already hold what the check asks, so the decomposition's output needs no round of its
own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.directions.perturbation import GradientStats
from optax_gsam._src.directions.perturbation import projection_coefficient

# Below the largest finite value of the output's dtypes over this margin, no entry of the output,
# nor any value computed on the way, comes near that value: the factor covers the rounding of the
# norms and of the three operations per entry many times over.
_MARGIN = 16.0


def decomposed_is_finite(
  stats: GradientStats,
  alpha: jax.Array | float,
  *,
  minimize_fp: bool,
  eps: jax.Array | float,
  like: optax.Updates,
) -> jax.Array | None:
  r"""Whether every entry of :func:`optax_gsam.decompose`'s output is finite, or ``None``.

  With :math:`b` the gradient the decomposition keeps, :math:`o` the other and
  :math:`c` the projection's coefficient, each entry of the output is
  :math:`b_i \pm \alpha (o_i - c\, b_i)`, so

  .. math::

    |g_i| \le \|b\| + |\alpha| \left(\|o\| + |c|\, \|b\|\right),

  since no entry exceeds its tree's norm (and :math:`|o_i - c\, b_i|`, computed
  on the way, is at most the parenthesis). The norms are finite exactly when
  every entry of both gradients is (their sums propagate an infinity or a
  NaN), and an infinite or NaN entry of either makes the same output entry
  infinite or NaN. So where the statistics are finite and the bound is below
  the output dtype's largest value over 16 (:math:`2^{124}` for float32 and
  bfloat16), the output is finite; where a statistic is not finite, it is not.
  Above the bound (float32 gradients with norms near :math:`10^{37}`) the
  answer is ``False``, as for an output that overflowed: the step does not
  count and, with ``on_nonfinite="clean"``, outputs the clean gradient.

  Args:
    stats: the pair's :func:`optax_gsam.gradient_stats`.
    alpha: the decomposition's :math:`\alpha`.
    minimize_fp: which form of the decomposition.
    eps: its :math:`\varepsilon`.
    like: a tree with the output's dtypes.

  Returns:
    The verdict, a boolean scalar; ``None`` where a leaf's dtype is not one of
    float32's range (float16 overflows below the bound; float64's statistics
    overflow long before float64 does): the caller checks the output itself.
  """
  leaves = jax.tree.leaves(like)
  if not all(_float32s_range(x) for x in leaves):
    return None
  largest = min(float(jnp.finfo(jnp.result_type(x)).max) for x in leaves) if leaves else 1.0
  if minimize_fp:
    kept, other = stats.perturbed_norm, stats.clean_norm
  else:
    kept, other = stats.clean_norm, stats.perturbed_norm
  coefficient = projection_coefficient(stats, minimize_fp, eps)
  projected = other + jnp.abs(coefficient) * kept  # bounds o - c b, computed on the way
  bound = jnp.maximum(projected, kept + jnp.abs(alpha) * projected)
  statistics_finite = jnp.isfinite(stats.clean_norm) & jnp.isfinite(stats.perturbed_norm)
  return statistics_finite & jnp.isfinite(stats.cosine) & (bound < largest / _MARGIN)


def _float32s_range(leaf: Any) -> bool:
  """Whether ``leaf`` is a float with float32's range of exponents (float32, bfloat16,
  complex64). float16 overflows below the bound; float64's statistics, kept within float32's
  range, overflow long before float64 does."""
  dtype = jnp.result_type(leaf)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return False
  return 2.0**127 <= float(jnp.finfo(dtype).max) <= float(jnp.finfo(jnp.float32).max)
