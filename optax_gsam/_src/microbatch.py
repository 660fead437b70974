"""Micro-batches: a batch split along its leading axis, its gradient accumulated in a scan.

One micro-batch's activations are live at a time: :func:`accumulated` scans
over the micro-batches and keeps one params-sized running sum (in float32 at
least), so the compiled step's temporary memory does not grow with their number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.arrays import zeros_accumulator
from optax_gsam._src.user_functions import ValueAndGradFn
from optax_gsam._src.user_functions import ValueAndGradWithArgsFn
from optax_gsam._src.user_functions import scalar_loss

# ``index -> (params -> (value, grads))``: the value and gradient of micro-batch ``index``.
MicrobatchFn = Callable[[jax.Array], ValueAndGradFn]


def check_batch(batch: Any, num_microbatches: int) -> None:
  """Every leaf of ``batch`` is an array whose leading axis the micro-batches divide."""
  leaves = jax.tree.leaves(batch)
  if not leaves:
    raise ValueError("batch has no arrays to split into micro-batches.")
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] % num_microbatches:
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} has shape {shape}: with microbatches="
        f"{num_microbatches}, every leaf of batch needs a leading (example) axis divisible by "
        f"{num_microbatches}. Pad or drop the remainder, or choose a divisor of the batch size."
      )


def microbatch_fns(
  grad_fn: ValueAndGradWithArgsFn, batch: Any, num_microbatches: int
) -> MicrobatchFn:
  """``index -> (params -> grad_fn(params, microbatch))``; without a batch, the index itself."""
  if batch is None:  # The user's function takes the micro-batch (group) index.
    return lambda index: lambda params: grad_fn(params, index)
  check_batch(batch, num_microbatches)

  def slice_of(index):
    def take(x):
      size = x.shape[0] // num_microbatches
      return jax.lax.dynamic_slice_in_dim(x, index * size, size)

    return jax.tree.map(take, batch)

  return lambda index: lambda params: grad_fn(params, slice_of(index))


def average_over(num_microbatches: int, result_of: Callable[[jax.Array], Any]) -> Any:
  """The mean of ``result_of(i)`` over ``i < num_microbatches``, one ``i`` live at a time.

  A ``lax.scan`` whose carry is the running sum, in float32 at least; the mean
  is divided once at the end.
  """
  indices = jnp.arange(num_microbatches, dtype=jnp.int32)

  def body(total, index):
    result = result_of(index)
    return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, result), None

  shapes = jax.eval_shape(result_of, indices[0])
  initial = jax.tree.map(zeros_accumulator, shapes)
  total, _ = jax.lax.scan(body, initial, indices)
  return jax.tree.map(lambda t: t / num_microbatches, total)


def accumulated(fns: MicrobatchFn, num_microbatches: int) -> ValueAndGradFn:
  """``params -> (mean loss, mean gradient)`` over the micro-batches: the whole batch's.

  With equal micro-batches and a loss that is a mean over examples, this is
  the whole batch's loss and gradient up to rounding (float64 to ~1e-15).
  """

  def value_and_grad(params: optax.Params) -> tuple[jax.Array, optax.Updates]:
    def of(index):
      value, grads = fns(index)(params)
      return scalar_loss(value), grads

    loss, grads = average_over(num_microbatches, of)
    return loss, optax.tree.cast_like(grads, params)

  return value_and_grad
