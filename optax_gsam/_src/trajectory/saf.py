"""SAF's store of past outputs: each example's logits, recorded over the last Ẽ epochs."""

from __future__ import annotations

import numbers
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optax_gsam._src.core.arrays import explicit_sharding
from optax_gsam._src.core.validation import check_positive_int

# The recorded epoch of an entry never written. Not -1: at epoch Ẽ - 1 the target epoch is -1.
NEVER = int(jnp.iinfo(jnp.int32).min)

# The authors' released SAF script reads the logits of this many epochs before.
DEFAULT_LAG_EPOCHS = 3


class SAFStore(NamedTuple):
  """The outputs that SAF compares against, per example (:func:`saf_store`).

  Attributes:
    outputs: ``(num_examples, lag_epochs, num_classes)``: the logits of example
      ``i`` recorded in epoch ``e`` sit in ``outputs[i, e % lag_epochs]``.
    recorded_epoch: ``(num_examples, lag_epochs)`` int32: the epoch each entry
      was recorded in, or the int32 minimum where it never was.
  """

  outputs: jax.Array
  recorded_epoch: jax.Array


def saf_store(
  num_examples: int,
  num_classes: int,
  *,
  lag_epochs: int = DEFAULT_LAG_EPOCHS,
  dtype: Any = jnp.float32,
  sharding: jax.sharding.Sharding | None = None,
) -> SAFStore:
  r"""An empty store of past outputs for SAF, indexed by example id.

  SAF's target for example :math:`i` in epoch :math:`e` is its output
  :math:`\hat y_i^{(e - \tilde E)}`, recorded when the example was seen
  :math:`\tilde E` epochs before. The store keeps the last :math:`\tilde E`
  epochs of outputs in a ring: epoch :math:`e` reads and then overwrites slot
  :math:`e \bmod \tilde E` of each of its examples (read the targets with
  :func:`saf_targets` before the step, record with :func:`saf_record` after
  it), so a target is exact: it is valid only where the entry was recorded in
  epoch :math:`e - \tilde E` exactly.

  Memory: ``num_examples * lag_epochs * num_classes`` values of ``dtype`` plus
  ``num_examples * lag_epochs`` int32. ImageNet-1k with
  :math:`\tilde E = 3` in float32 is 1.28M x 3 x 1000 x 4 B = 15.4 GB
  (7.7 GB in bfloat16): shard it over the data axis (``sharding=``), which
  splits it between the devices by example.

  Ids: every batch carries ``batch["id"]``, an int array of the examples'
  indices in ``[0, num_examples)``, the same for an example in every epoch
  (its index in the data set, before shuffling and augmentation), and unique
  within a batch.

  Args:
    num_examples: N, the training set's size.
    num_classes: the logits' last dimension.
    lag_epochs: :math:`\tilde E` >= 1, how many epochs back the targets are.
    dtype: the stored outputs' dtype (``jnp.bfloat16`` halves the memory).
    sharding: where to put the arrays (e.g. a ``NamedSharding`` that splits
      the first, example, axis over the data axis); default device otherwise.

  Returns:
    A :class:`SAFStore` with nothing recorded.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> store = optax_gsam.saf_store(6, 3, lag_epochs=2)
    >>> store.outputs.shape, store.recorded_epoch.shape
    ((6, 2, 3), (6, 2))

  References:
    Du et al., `Sharpness-Aware Training for Free
    <https://arxiv.org/abs/2205.14083>`_, NeurIPS 2022.
  """
  check_positive_int("num_examples", num_examples)
  check_positive_int("num_classes", num_classes)
  check_positive_int("lag_epochs", lag_epochs)
  if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    raise ValueError(
      f"dtype must be a float dtype for the stored logits, got {dtype!r}: jnp.float32, or "
      "jnp.bfloat16 to halve the store."
    )
  outputs = jnp.zeros((num_examples, lag_epochs, num_classes), dtype, device=sharding)
  recorded = jnp.full((num_examples, lag_epochs), NEVER, jnp.int32, device=sharding)
  return SAFStore(outputs, recorded)


def _check_store(store: Any) -> None:
  if not isinstance(store, SAFStore):
    raise ValueError(
      f"store must be an optax_gsam.SAFStore (from optax_gsam.saf_store), got {type(store)}."
    )


def _check_ids(ids: Any, store: SAFStore, batch: int | None) -> jax.Array:
  """``ids``: a 1-d int array, one per example of the batch, in range where it is concrete."""
  dtype = getattr(ids, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
      f"ids must be an int array of example indices, got {dtype or type(ids).__name__}: pass "
      "the batch's ids, e.g. batch['id'] (an index into the data set, the same in every epoch)."
    )
  if jnp.ndim(ids) != 1 or (batch is not None and jnp.shape(ids)[0] != batch):
    raise ValueError(
      f"ids must have one entry per example of the batch ({batch} rows of logits), got shape "
      f"{jnp.shape(ids)}: pass the ids of exactly this batch's examples, in the same order."
    )
  num_examples = store.outputs.shape[0]
  if not isinstance(ids, jax.core.Tracer) and jnp.size(ids):
    low, high = int(jnp.min(ids)), int(jnp.max(ids))
    if low < 0 or high >= num_examples:
      raise ValueError(
        f"ids must be in [0, num_examples) = [0, {num_examples}), got values in "
        f"[{low}, {high}]: the store was made for {num_examples} examples; build it with "
        "saf_store(len(dataset), ...) and number the examples from 0. (Under jax.jit, where "
        "ids cannot be checked, an id out of range is masked and dropped: pad a last, partial "
        "batch there.)"
      )
    if len(set(jnp.asarray(ids).tolist())) != jnp.size(ids):
      raise ValueError(
        "ids must be unique within a batch: an example seen twice in one step would record "
        "one of its two outputs, whichever the scatter keeps. Draw the batch without "
        "replacement (a permutation of the data set)."
      )
  return jnp.asarray(ids)


def _check_epoch(name: str, epoch: Any) -> None:
  if isinstance(epoch, jax.core.Tracer):
    if not jnp.issubdtype(epoch.dtype, jnp.integer) or epoch.shape != ():
      raise ValueError(
        f"{name} must be an int scalar, got {epoch.dtype}{list(epoch.shape)}: pass the epoch "
        "as an int (or jnp.int32(epoch)), counting from 0."
      )
    return
  value = epoch.item() if hasattr(epoch, "item") and jnp.ndim(epoch) == 0 else epoch
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
    raise ValueError(f"{name} must be an int >= 0 (epochs count from 0), got {epoch!r}.")


def _slot_rows(store: SAFStore, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Whether each id is in range, and the ids with those out of range made N (dropped)."""
  num_examples = store.outputs.shape[0]
  in_range = (ids >= 0) & (ids < num_examples)
  return in_range, jnp.where(in_range, ids, num_examples)


def _gather(array: jax.Array, rows: jax.Array, slot: jax.Array) -> jax.Array:
  """``array[rows, slot]``, laid out as the ids are under explicit mesh axes (by example)."""
  sharding = explicit_sharding(rows)
  if sharding is None:
    return array[rows, slot]
  spec = jax.sharding.PartitionSpec(sharding.spec[0], *([None] * (array.ndim - 2)))
  return array.at[rows, slot].get(out_sharding=sharding.update(spec=spec))


def _scatter(array: jax.Array, rows: jax.Array, slot: jax.Array, values: jax.Array) -> jax.Array:
  """``array`` with ``array[rows, slot] = values`` (rows out of range dropped), in its layout."""
  return array.at[rows, slot].set(values, mode="drop", out_sharding=explicit_sharding(array))


def saf_targets(
  store: SAFStore, ids: jax.Array, epoch: Any, *, start_epoch: int = 0
) -> tuple[jax.Array, jax.Array]:
  r"""SAF's targets for a batch: the outputs its examples had :math:`\tilde E` epochs before.

  Reads slot :math:`e \bmod \tilde E` of each example. An example's target is
  valid where that entry was recorded in epoch :math:`e - \tilde E` and
  :math:`e \ge` ``start_epoch`` (the paper's :math:`E_\mathrm{start}`); an
  example never seen, or not seen in that epoch (as in the first
  :math:`\tilde E` epochs) has none. Pass both to
  :func:`optax_gsam.trajectory_loss` as ``target_logits`` and ``where``.

  Under ``jax.jit`` the ids' range cannot be checked: an id out of range gets
  no valid target (and :func:`saf_record` drops it).

  Args:
    store: the :class:`SAFStore`.
    ids: the batch's example ids, int, shape ``(batch,)``.
    epoch: the current epoch :math:`e`, counting from 0 (an int or an int
      scalar array).
    start_epoch: the first epoch whose steps use the term. The authors' scripts
      start at the 0-based epoch after :math:`E_\mathrm{start}` = 5, that is
      ``start_epoch=6``.

  Returns:
    ``(target_logits, valid)``: the stored outputs ``(batch, num_classes)``
    in the store's dtype (zeros where invalid), and bool flags ``(batch,)``.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> store = optax_gsam.saf_store(4, 2, lag_epochs=1)
    >>> ids = jnp.array([3, 1])
    >>> store = optax_gsam.saf_record(store, ids, jnp.array([[1.0, 2.0], [3.0, 4.0]]), epoch=0)
    >>> targets, valid = optax_gsam.saf_targets(store, jnp.array([1, 0]), epoch=1)
    >>> targets.tolist(), valid.tolist()
    ([[3.0, 4.0], [0.0, 0.0]], [True, False])
  """
  _check_store(store)
  _check_epoch("epoch", epoch)
  _check_epoch("start_epoch", start_epoch)
  ids = _check_ids(ids, store, None)
  lag = store.outputs.shape[1]
  in_range, rows = _slot_rows(store, ids)
  rows = jnp.minimum(rows, store.outputs.shape[0] - 1)  # a safe row to read; masked below
  slot = jnp.asarray(epoch) % lag
  recorded = _gather(store.recorded_epoch, rows, slot)
  valid = in_range & (recorded == jnp.asarray(epoch) - lag) & (jnp.asarray(epoch) >= start_epoch)
  targets = jnp.where(valid[:, None], _gather(store.outputs, rows, slot), 0)
  return targets, valid


def saf_record(store: SAFStore, ids: jax.Array, logits: jax.Array, epoch: Any) -> SAFStore:
  r"""Records a batch's outputs in epoch :math:`e`, for the step :math:`\tilde E` epochs later.

  Writes ``stop_gradient(logits)`` (cast to the store's dtype) into slot
  :math:`e \bmod \tilde E` of each example, in place where the store is
  donated (``jax.jit(..., donate_argnums=...)``). These are the logits the
  step's clean forward pass computed, so SAF needs no extra pass. Call it
  after :func:`saf_targets` in the same step: it overwrites the entries that
  were the targets.

  Args:
    store: the :class:`SAFStore`.
    ids: the batch's example ids, int, shape ``(batch,)``, unique.
    logits: the batch's outputs, ``(batch, num_classes)``.
    epoch: the current epoch, counting from 0.

  Returns:
    The updated :class:`SAFStore`.

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> store = optax_gsam.saf_store(3, 2, lag_epochs=2)
    >>> store = optax_gsam.saf_record(store, jnp.array([2]), jnp.array([[0.5, -0.5]]), epoch=1)
    >>> store.recorded_epoch[2].tolist()
    [-2147483648, 1]
  """
  _check_store(store)
  _check_epoch("epoch", epoch)
  logits = jnp.asarray(logits)
  if logits.ndim != 2 or logits.shape[1] != store.outputs.shape[2]:
    raise ValueError(
      f"logits must be (batch, num_classes) with num_classes = {store.outputs.shape[2]}, the "
      f"store's, got shape {logits.shape}: build the store with saf_store(num_examples, "
      f"{logits.shape[-1] if logits.ndim else '...'}) for these logits."
    )
  ids = _check_ids(ids, store, logits.shape[0])
  _, rows = _slot_rows(store, ids)
  slot = jnp.asarray(epoch) % store.outputs.shape[1]
  values = jax.lax.stop_gradient(logits).astype(store.outputs.dtype)
  epochs = jnp.full(rows.shape, epoch, jnp.int32)
  outputs = _scatter(store.outputs, rows, slot, values)
  recorded_epoch = _scatter(store.recorded_epoch, rows, slot, epochs)
  return SAFStore(outputs, recorded_epoch)
