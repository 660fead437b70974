"""Micro-batches: a batch split along its leading axis, its gradient accumulated in a scan.

One micro-batch's activations are live at a time: :func:`accumulated` scans
over the micro-batches and keeps one params-sized running sum (in float32 at
least), so the compiled step's temporary memory does not grow with their number.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.user_functions import ValueAndGradFn
from optax_gsam._src.calls.user_functions import ValueAndGradWithArgsFn
from optax_gsam._src.calls.user_functions import scalar_loss
from optax_gsam._src.core.arrays import conform
from optax_gsam._src.core.arrays import split_rows
from optax_gsam._src.core.arrays import zeros_accumulator

# ``index -> (params -> (value, grads))``: the value and gradient of micro-batch ``index``.
MicrobatchFn = Callable[[jax.Array], ValueAndGradFn]


def check_batch(batch: Any, num_microbatches: int, axis_name: Any = None) -> None:
  """Every leaf of ``batch`` is an array with one leading size that the micro-batches divide.

  ``axis_name`` is the transform's: with it set, ``batch`` is one device's shard,
  and the error says so.
  """
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError("batch has no arrays to split into micro-batches.")
  for path, leaf in leaves:
    if not jnp.shape(leaf):
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} is a scalar: with microbatches={num_microbatches}, "
        "every leaf of batch is split along its leading (example) axis. Close over per-batch "
        "constants in loss_fn instead of passing them in batch."
      )
  # The examples' size is the most common leading size; a leaf of another is named.
  size = collections.Counter(jnp.shape(leaf)[0] for _, leaf in leaves).most_common(1)[0][0]
  if size == 0:
    raise ValueError(
      f"batch has no examples (leading size 0): with microbatches={num_microbatches}, each "
      "micro-batch would be empty and its mean loss undefined. Skip the step for an empty batch."
    )
  first_path, first = next((p, x) for p, x in leaves if jnp.shape(x)[0] == size)
  for path, leaf in leaves:
    if jnp.shape(leaf)[0] != size:
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, whose leading size "
        f"differs from batch{jax.tree_util.keystr(first_path)}'s {size}: with microbatches="
        f"{num_microbatches}, every leaf of batch is cut into {num_microbatches} pieces along "
        "its leading (example) axis, so a per-batch constant (class weights, a mask over "
        "classes) would be cut too. Close over such constants in loss_fn instead of passing "
        "them in batch."
      )
  if size % num_microbatches:
    where = ""
    if axis_name is not None:
      where = (
        f" This is one device's shard of the batch (axis_name={axis_name!r}): the global batch "
        "is divided over the devices first, then each device's shard into micro-batches, so "
        f"the global batch size must be a multiple of {num_microbatches} times the number of "
        "devices (or use fewer micro-batches)."
      )
    raise ValueError(
      f"batch{jax.tree_util.keystr(first_path)} has shape {jnp.shape(first)}: with microbatches="
      f"{num_microbatches}, every leaf of batch needs a leading (example) axis divisible by "
      f"{num_microbatches}. Pad or drop the remainder, or choose a divisor of the batch size."
      + where
    )


def microbatch_fns(
  grad_fn: ValueAndGradWithArgsFn, batch: Any, num_microbatches: int, axis_name: Any = None
) -> MicrobatchFn:
  """``index -> (params -> grad_fn(params, microbatch))``; without a batch, the index itself."""
  if batch is None:  # The user's function takes the micro-batch (group) index.
    return lambda index: lambda params: grad_fn(params, index)
  check_batch(batch, num_microbatches, axis_name)
  microbatch = microbatch_of(batch, num_microbatches)
  return lambda index: lambda params: grad_fn(params, microbatch(index))


def microbatch_of(batch: Any, num_microbatches: int) -> Callable[[jax.Array], Any]:
  """``index -> rows [index * n, (index + 1) * n)`` of every leaf of ``batch`` (n: the size).

  The batch is reshaped into ``[num_microbatches, n, ...]`` blocks once, outside the loop
  (:func:`~optax_gsam._src.core.arrays.split_rows`), and a micro-batch is the block picked
  along that new leading axis. A slice at a traced offset along the rows themselves, which a
  data-parallel sharding splits over the devices, made XLA gather the whole batch onto every
  device first, under any axes: on the GPU compiler, a ViT-L/16 step at 128 images per GPU
  kept a second, global copy of the images (1024 of them in float32, 588 MiB per GPU). Under
  explicit axes the blocks keep the batch's row layout, so only each device's share of a
  micro-batch moves (an all-to-all); under Auto axes XLA chooses, from the loss's own
  constraint on its input where there is one (without it, it may gather a few blocks).
  """
  size = jax.tree.leaves(batch)[0].shape[0] // num_microbatches
  blocks, _ = split_rows(batch, size)
  take = lambda block, index: jax.lax.dynamic_index_in_dim(block, index, keepdims=False)
  return lambda index: jax.tree.map(lambda block: take(block, index), blocks)


def mean_and_state(
  num_microbatches: int,
  result_of: Callable[[jax.Array, Any], tuple[Any, Any]],
  state: Any = None,
  like: Any = None,
) -> tuple[Any, Any]:
  """The mean of ``result_of(i, s_i)[0]`` over ``i < num_microbatches``, and the last state.

  ``result_of(index, state) -> (result, new_state)``, one ``index`` live at a
  time: a ``lax.scan`` whose carry is the running sum (float32 at least; the
  mean is divided once at the end) and the state, which passes through the
  micro-batches in order and keeps the dtypes and layout it came in with.

  ``like``, a tree of arrays shaped like the result (the params, for a
  gradient), gives the sum's buffer: the carry starts as ``like`` and is zeroed
  in the first step, so its values are never read. Started from constant
  zeros instead, two such scans in one program (the clean and the perturbed
  pass) would share one broadcast, which XLA then keeps, a params-sized
  buffer, from the first scan to the second.
  """
  indices = jnp.arange(num_microbatches, dtype=jnp.int32)
  shapes, _ = jax.eval_shape(result_of, indices[0], state)
  initial = jax.tree.map(zeros_accumulator, shapes)
  if like is not None:
    initial = jax.tree.map(conform, like, initial)

  def body(carry, index):
    total, state = carry
    result, new_state = result_of(index, state)
    if like is not None:
      total = jax.tree.map(lambda t: jnp.where(index == 0, jnp.zeros_like(t), t), total)
    total = jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, result)
    return (total, conform(new_state, state)), None

  (total, state), _ = jax.lax.scan(body, (initial, state), indices)
  return jax.tree.map(lambda t: t / num_microbatches, total), state


def average_over(
  num_microbatches: int, result_of: Callable[[jax.Array], Any], like: Any = None
) -> Any:
  """The mean of ``result_of(i)`` over ``i < num_microbatches``: :func:`mean_and_state` without
  a state."""
  return mean_and_state(num_microbatches, lambda index, _: (result_of(index), None), None, like)[0]


def accumulated(fns: MicrobatchFn, num_microbatches: int) -> ValueAndGradFn:
  """``params -> (mean loss, mean gradient)`` over the micro-batches: the whole batch's.

  With equal micro-batches and a loss that is a mean over examples, this is
  the whole batch's loss and gradient up to rounding (float64 to ~1e-15). The
  loss is summed and returned in its compute dtype (float32 at least, float64
  as it is), the gradient in the params' dtypes.
  """

  def value_and_grad(params: optax.Params) -> tuple[jax.Array, optax.Updates]:
    def of(index):
      value, grads = fns(index)(params)
      return scalar_loss(value, None), grads

    loss, grads = average_over(num_microbatches, of, like=(jnp.zeros([]), params))
    return loss, optax.tree.cast_like(grads, params)

  return value_and_grad
