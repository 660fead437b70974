"""The reference steps the benchmarks measure the package against, built one way everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def contrib_sam(base: optax.GradientTransformation, rho: float) -> optax.GradientTransformation:
  """``optax.contrib.sam`` in opaque mode: its adversary is the normalized gradient times rho.

  Its ``update`` takes ``grad_fn=`` (params, step) -> gradient, as the scripts call it.
  """
  adversary = optax.chain(optax.contrib.normalize(), optax.sgd(rho))
  return optax.contrib.sam(base, adversary, opaque_mode=True)


def plain_gsam_gradient(loss_fn, params, g_c, rho, alpha, axis):
  """GSAM from the paper's formulas: per-device perturbation, one pmean of the result.

  e = rho g_c / |g_c|, g_p = grad f(w + e),
  g = g_p - alpha (g_c - <g_c, g_p> / |g_p|^2 g_p), averaged over ``axis``.
  """
  dot = lambda a, b: sum(
    jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
  scale = rho / jnp.sqrt(dot(g_c, g_c))
  perturbed = jax.tree.map(lambda w, g: w + scale * g, params, g_c)
  g_p = jax.grad(loss_fn)(perturbed)
  projection = dot(g_c, g_p) / dot(g_p, g_p)
  g = jax.tree.map(lambda gp, gc: gp - alpha * (gc - projection * gp), g_p, g_c)
  return jax.lax.pmean(g, axis)
