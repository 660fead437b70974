"""The perturbed pass as a computation of its own, where a compiler would share its buffers.

When a step runs two passes of one model whose layers are a ``lax.scan``, the buffers of both
passes that start as zeros (the stacked activations a scan saves for its backward pass, the
layers' gradient accumulators) are one constant to the compiler: StableHLO's canonicalization
folds each ``broadcast`` of 0 into a splat constant and keeps one per shape. XLA's GPU compiler
then copies that constant for the second pass before the first pass writes over it (both
copies in one fused kernel), so the second pass's buffers are live through the first: one more
copy of the saved activations, and of the stacked weight gradients, per step. On a ViT-L/16
over 8 H100s (FSDP, 128 images per GPU) that is 2.6 GiB per GPU, for optax.contrib.sam and a
formula-written SAM alike (``python -m benchmarks.compiled.sharded --topology 8xh100 --model vit``).

A branch of a conditional is a computation of its own, whose constants stay its own. On the
platforms of :data:`ISOLATED_PLATFORMS` the perturbed pass runs as the taken branch of a
conditional whose predicate is ``True`` behind an optimization barrier, so the compiler cannot
fold it away; the other branch, never taken, returns zeros. Elsewhere (the CPU and the TPU,
whose compilers hold no such copy) the pass is inlined as a plain call would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from optax_gsam._src.core.arrays import mark_varying
from optax_gsam._src.core.arrays import varying_axes

# The platforms whose compiler gets the perturbed pass as a conditional branch. Measured: CUDA.
ISOLATED_PLATFORMS: tuple[str, ...] = ("cuda",)


def isolated_on_gpu(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)``, compiled as a conditional branch of its own on :data:`ISOLATED_PLATFORMS`.

  ``fn`` is traced once, to a jaxpr, whichever platform the step is compiled for (its Python
  runs once, as a plain call's would). A pass that runs no loop is called as it is. Inside the
  branch, each output with the type of an
  operand (a gradient and its parameter) is laid out like that operand (``shard_alike``):
  otherwise the partitioner, which does not carry the conditional's output shardings into the
  branch, kept an FSDP model's gradients whole inside it and all-reduced them (48 MiB per step
  on the ViT-L/16 above) instead of reduce-scattering them.
  """
  closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
  run = jax.extend.core.jaxpr_as_fun(closed)
  if not _has_loop(closed.jaxpr):  # nothing a loop would carry: no buffer to copy early
    return jax.tree.unflatten(jax.tree.structure(shapes), list(run(*jax.tree.leaves(args))))

  def isolated(*operands: Any) -> list[Any]:
    always = jax.lax.optimization_barrier(jnp.asarray(True))
    taken = lambda *a: _laid_out_like(list(run(*a)), a)
    never_taken = lambda *_: [_zeros_like_aval(aval) for aval in closed.out_avals]
    return jax.lax.cond(always, taken, never_taken, *operands)

  branches = dict.fromkeys(ISOLATED_PLATFORMS, isolated)
  plain = lambda *a: list(run(*a))
  outputs = jax.lax.platform_dependent(*jax.tree.leaves(args), **branches, default=plain)
  return jax.tree.unflatten(jax.tree.structure(shapes), outputs)


def _has_loop(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` runs a ``scan`` or ``while`` loop, at any depth.

  The shared constant is copied for a loop's carry, which the loop then writes in place. A pass
  with no loop has nothing to isolate, and a conditional around it would cost memory: its
  operands live until it ends, where an unrolled model's perturbed weights are freed layer by
  layer (a residual MLP of 16 unrolled blocks on 8 H100s: +0.5 parameter shards).
  """
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("scan", "while"):
      return True
  return any(_has_loop(sub) for sub in jax.extend.core.subjaxprs(jaxpr))


def _laid_out_like(outputs: list[Any], operands: tuple) -> list[Any]:
  """Each output laid out like the first unused operand of its type, where the partitioner
  chooses layouts (Auto mesh axes); as they are under explicit or manual axes."""
  from jax.experimental.shard_alike import shard_alike

  unused = list(operands)
  laid_out = []
  for out in outputs:
    same = [i for i, x in enumerate(unused) if _same_type(x, out)]
    if same and _partitioner_lays_out(out):
      out, _ = shard_alike(out, unused.pop(same[0]))
    laid_out.append(out)
  return laid_out


def _same_type(a: Any, b: Any) -> bool:
  # Arrays, or the Python scalars a jaxpr may return.
  return (jnp.shape(a), jnp.result_type(a), varying_axes(a)) == (
    jnp.shape(b),
    jnp.result_type(b),
    varying_axes(b),
  )


def _partitioner_lays_out(x: Any) -> bool:
  """Whether ``x``'s layout is the partitioner's choice: no explicit or manual mesh axes."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  auto = jax.sharding.AxisType.Auto
  return not varying_axes(x) and all(kind == auto for kind in axis_types)


def _zeros_like_aval(aval: Any) -> Any:
  """Zeros of ``aval``'s type: shape, dtype, explicit sharding and device-varying axes."""
  if aval.dtype == jax.dtypes.float0:
    return np.zeros(aval.shape, aval.dtype)
  sharding = getattr(aval, "sharding", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  explicit = any(kind == jax.sharding.AxisType.Explicit for kind in axis_types)
  zeros = jnp.zeros(aval.shape, aval.dtype, out_sharding=sharding if explicit else None)
  varying: frozenset = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return mark_varying(zeros, varying) if varying else zeros
