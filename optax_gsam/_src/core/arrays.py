"""Array helpers shared by the transforms, the gradient cache and the losses.

Dtypes: arithmetic runs in at least float32 (``compute_dtype``; float64 and
complex stay as they are) and reductions accumulate in the matching real dtype
(``real_dtype``). Layout: a batch split into equal row blocks and a remainder,
and back. Sharding: buffers that keep the shardings of the values they stand
beside (under explicit mesh axes, ``jnp.where``, ``lax.cond`` and scan carries
refuse operands of different shardings), and values marked device-varying
under ``jax.shard_map``. Finiteness of a tree as one fused sum per leaf, and the barrier that
ends the clean pass when a step is compiled for TPU.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def compute_dtype(dtype: Any) -> np.dtype:
  """Float32 at least for inexact dtypes (complex stays complex); others unchanged."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.promote_types(dtype, jnp.float32)
  return dtype


def real_dtype(dtype: Any) -> np.dtype:
  """The real dtype that sums of squares and inner products of ``dtype`` accumulate in."""
  return jnp.finfo(compute_dtype(dtype)).dtype


def upcast(x: Any) -> jax.Array:
  """``x`` as an array in its :func:`compute_dtype`."""
  x = jnp.asarray(x)
  return x.astype(compute_dtype(x.dtype))


def zeros_accumulator(x: Any) -> jax.Array:
  """Zeros with the shape and sharding of ``x`` (an array or ``jax.ShapeDtypeStruct``), in its
  :func:`compute_dtype`: a running sum or a state buffer that lives beside ``x``.

  ``jnp.zeros(shape)`` would be replicated; under explicit mesh axes a scan
  carry or a select that meets the sharded ``x`` then fails, and under Auto
  axes it can hold a full copy of a sharded parameter on every device.
  """
  return jnp.zeros_like(x, dtype=compute_dtype(x.dtype))


def explicit_sharding(x: Any) -> Any:
  """The sharding of ``x`` where its mesh has explicit axes, else None (Auto, no mesh)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
  if not any(kind == jax.sharding.AxisType.Explicit for kind in axis_types):
    return None
  return sharding


def same_layout(tree: Any, like: Any) -> Any:
  """``tree`` resharded, leaf by leaf, to the explicit shardings of ``like`` where they differ.

  Under explicit mesh axes a ``jnp.where``, an arithmetic op or a ``lax.cond``
  refuses operands of different shardings; a state kept in another layout than
  the parameters (replicated, say) is legitimate, so values that meet it take
  its layout. Under Auto axes and without a mesh nothing changes.
  """

  def reshard(x: Any, reference: Any) -> Any:
    target = explicit_sharding(reference)
    current = explicit_sharding(x)
    if target is None or current is None or current.spec == target.spec:
      return x
    return jax.sharding.reshard(x, target)

  return jax.tree.map(reshard, tree, like)


def conform(tree: Any, like: Any) -> Any:
  """``tree`` with the dtypes of ``like`` (``optax.tree.cast_like``) and its layout."""
  return same_layout(optax.tree.cast_like(tree, like), like)


def numbers_as_arrays(tree: Any) -> Any:
  """``tree`` with its Python int, float and complex leaves as (weakly typed) arrays.

  A params pytree may hold plain numbers (``{"scale": 0.3, "w": w}``), which
  JAX differentiates like 0-d arrays; the transforms read ``.dtype`` and
  ``.shape`` of every leaf.
  """
  is_number = lambda x: isinstance(x, (int, float, complex)) and not isinstance(x, bool)
  return jax.tree.map(lambda x: jnp.asarray(x) if is_number(x) else x, tree)


def split_rows(tree: Any, size: int) -> tuple[Any, Any]:
  """Every leaf's rows as ``([n, size, ...] blocks or None, the remaining rows or None)``.

  All leaves must share the leading size.
  """
  total = jax.tree.leaves(tree)[0].shape[0]
  num_blocks, whole = total // size, (total // size) * size

  def blocks(x):
    x = x if x.shape[0] == whole else x[:whole]
    shape = (num_blocks, size, *x.shape[1:])
    return jax.lax.reshape(x, shape, out_sharding=_blocks_sharding(x, size))

  head = jax.tree.map(blocks, tree) if num_blocks else None
  tail = jax.tree.map(lambda x: x[whole:], tree) if total > whole else None
  return head, tail


def _full_spec(sharding: Any, ndim: int) -> tuple:
  """A sharding's partition spec with one entry per dimension (None for the trailing ones)."""
  return (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))


def _blocks_sharding(x: jax.Array, size: int) -> Any:
  """Under explicit axes, the layout of ``x``'s rows as ``[blocks, size, ...]``; else None.

  The blocks axis is scanned over, so it stays whole; the rows of each block
  are sharded as the rows of ``x`` were (each block spread over the devices,
  which then work on it in parallel), where the block size allows.
  """
  sharding = explicit_sharding(x)
  if sharding is None:
    return None
  spec = _full_spec(sharding, x.ndim)
  rows, rest = spec[0], spec[1:]
  axes = rows if isinstance(rows, tuple) else () if rows is None else (rows,)
  devices = int(np.prod([sharding.mesh.shape[a] for a in axes]))
  within = rows if axes and size % devices == 0 else None
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, within, *rest))


def _merge_blocks(x: jax.Array) -> jax.Array:
  """``[blocks, size, ...]`` back to rows; under explicit axes, rows sharded as the blocks' rows."""
  sharding = explicit_sharding(x)
  out = None
  if sharding is not None:
    spec = _full_spec(sharding, x.ndim)
    out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
  return jax.lax.reshape(x, (x.shape[0] * x.shape[1], *x.shape[2:]), out_sharding=out)


def join_rows(head: Any, tail: Any) -> Any:
  """The inverse of :func:`split_rows`."""
  if head is not None:
    head = jax.tree.map(_merge_blocks, head)
  if head is None or tail is None:
    return tail if head is None else head
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), head, tail)


def varying_axes(x: Any) -> frozenset:
  """The mesh axes ``x`` varies over inside ``jax.shard_map`` (empty elsewhere)."""
  return getattr(getattr(jax.typeof(x), "mat", None), "varying", frozenset())


def mark_varying(x: Any, axes: Hashable | tuple[Hashable, ...] | frozenset) -> jax.Array:
  """``x`` marked device-varying over ``axes`` (those it does not vary over already).

  Inside ``jax.shard_map``, differentiating with respect to a replicated value
  inserts an implicit sum over devices, and a scan carry that starts as a
  constant changes type once its updates vary; marking them varying avoids
  both. Outside ``shard_map`` this returns ``x`` unchanged.
  """
  x = jnp.asarray(x)
  if not isinstance(axes, (tuple, frozenset)):
    axes = (axes,)
  missing = tuple(sorted(set(axes) - varying_axes(x), key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def materialized_on_tpu(tree: Any) -> Any:
  """``tree`` behind an optimization barrier when compiled for TPU; as it is elsewhere.

  For :func:`optax_gsam._src.step.step.replicated_update`, whose perturbed pass must not overlap the
  clean one: the clean gradient, its loss and the params pass the barrier together, so the TPU compiler finishes the clean pass, reductions and losses
  included, before it forms the perturbed weights. Without it, on an FSDP decoder (1.04B
  parameters on a v4-64, benchmarks/compiled/sharded.py) the compiler deferred the clean loss's last
  reduction past the perturbed pass and held the clean logits and the whole embedding and head
  gradients through it (GSAM +13.8 parameter shards over AdamW; +4.4 with the barrier); with
  micro-batches it folded the clean mean's division into each late reader and held two
  params-sized buffers through the perturbed pass instead of one. XLA's CPU compiler lowers the
  barrier before it fuses, so there it only reorders the step and packs its buffers worse; other
  backends are not measured and are left as they are.
  """
  return jax.lax.platform_dependent(tree, tpu=jax.lax.optimization_barrier, default=lambda t: t)


def all_finite(tree: Any) -> jax.Array:
  """Whether every entry of ``tree`` is finite, as one sum per leaf.

  ``x - x`` is 0 for a finite entry and NaN for an infinite or NaN one, and a sum of zeros
  cannot overflow, so the sum is finite exactly when every entry is. Unlike
  ``jnp.all(jnp.isfinite(x))``, which XLA's CPU compiler materializes as a boolean array (a
  quarter of a float32 parameter buffer) before reducing it, the difference fuses into the sum.
  (A maximum of ``|x|`` would not do: the CPU's vectorized maximum drops NaNs.) The TPU keeps
  the form it was measured with, ``x * 0``: elsewhere the parameter-shaped zero it multiplies
  by is one constant with every other zero of that shape (StableHLO's canonicalization), among
  them a backward pass's gradient accumulators, and the CPU and GPU compilers then hold a copy
  of it through the perturbed pass (the GPU: one parameter buffer on a scanned model; the CPU:
  0.3 trained-leaf buffers of an NNX LoRA step).
  """
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.asarray(True)
  return jax.lax.platform_dependent(leaves, tpu=_all_finite_by_products, default=_all_finite)


def _all_finite(leaves: list[Any]) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x - x)) for x in leaves]))


def _all_finite_by_products(leaves: list[Any]) -> jax.Array:
  return jnp.all(jnp.stack([jnp.isfinite(jnp.sum(x * 0)) for x in leaves]))
