"""Gradient caching: exact full-batch gradients of batch-coupled losses, chunk by chunk.

A contrastive loss couples every example of the batch with every other, so it
cannot be split into micro-batches whose gradients are averaged. Gradient
caching (Gao et al., 2021) factorises the chain rule instead::

  L(w) = loss(w, r(w)),   r = [embed(w, x_1); ...; embed(w, x_K)]
  dL/dw = d_w loss + sum_k (d embed(w, x_k) / dw)^T  dL/dr_k

1. embed every chunk without keeping activations (a scan);
2. evaluate the loss and its gradient with respect to the representations
   :math:`\\partial L/\\partial r` (small: one vector per example) and to the
   params;
3. re-embed each chunk under ``jax.vjp`` and pull :math:`\\partial L/\\partial
   r_k` back to the params, accumulating in float32 (a second scan).

Only one chunk's encoder activations are live at any time, and nothing is
approximated: the result is the full-batch gradient up to float re-association.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.core.arrays import join_rows
from optax_gsam._src.core.arrays import mark_varying
from optax_gsam._src.core.arrays import split_rows
from optax_gsam._src.core.arrays import zeros_accumulator
from optax_gsam._src.core.validation import check_axis_name
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam.typing import AxisName
from optax_gsam.typing import EmbeddingLossFn
from optax_gsam.typing import EmbedFn


def _as_varying(tree, axis_name):
  """Every leaf marked device-varying over ``axis_name``, so gradients are reduced explicitly, once."""
  return jax.tree.map(lambda x: mark_varying(x, axis_name), tree)


def _leading_size(tree, what: str) -> int:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError(f"{what} has no array leaves.")
  sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
  size = next(iter(sizes)) if len(sizes) == 1 else None
  if size is None:
    raise ValueError(
      f"Every leaf of {what} must have the examples on axis 0 with one common size; "
      f"got leading sizes {sorted(str(s) for s in sizes)}."
    )
  return size


class _Tower:
  """One embed function with its chunk size and key derivation."""

  def __init__(self, fn: EmbedFn, chunk_size: int, per_example_keys: bool, name: str = "batch"):
    self.fn = fn
    self.chunk_size = chunk_size
    self.per_example_keys = per_example_keys
    self.name = name

  def call(self, params, chunk, key, chunk_index, start, size):
    if key is None:
      return self.fn(params, chunk)
    if self.per_example_keys:
      keys = jax.vmap(jax.random.fold_in, (None, 0))(key, start + jnp.arange(size))
      return self.fn(params, chunk, keys)
    return self.fn(params, chunk, jax.random.fold_in(key, chunk_index))

  def layout(self, batch):
    n = _leading_size(batch, self.name)
    if self.chunk_size > n:
      raise ValueError(
        f"chunk_size={self.chunk_size} is larger than the {self.name}, which has {n} examples "
        "(the local shard under axis_name). Use a chunk_size between 1 and the number of "
        "examples; chunk_size equal to it computes the whole batch as one chunk."
      )
    return n, n // self.chunk_size, n % self.chunk_size

  def embed(self, params, batch, key, offsets):
    """Forward pass, chunk by chunk; returns the tower's representations."""
    n, num_full, rest = self.layout(batch)
    c = self.chunk_size
    chunk_base, example_base = offsets
    head, tail = split_rows(batch, c)
    head_reps = tail_reps = None
    if head is not None:

      def body(_, xs):
        chunk, i = xs
        return None, self.call(params, chunk, key, chunk_base + i, example_base + i * c, c)

      _, head_reps = jax.lax.scan(body, None, (head, jnp.arange(num_full)))
    if tail is not None:
      tail_reps = self.call(
        params, tail, key, chunk_base + num_full, example_base + num_full * c, rest
      )
    reps = join_rows(head_reps, tail_reps)
    reps_size = _leading_size(reps, "the representations returned by embed_fn")
    if reps_size != n:
      raise ValueError(
        f"embed_fn must return one representation per example on axis 0: a chunk of "
        f"{n} examples gave leading size {reps_size}."
      )
    return reps

  def backward(self, params, batch, key, offsets, reps_grads, accumulator):
    """Adds sum_k vjp(embed(., chunk_k))(dL/dr_k) to ``accumulator``."""
    _, num_full, rest = self.layout(batch)
    c = self.chunk_size
    chunk_base, example_base = offsets
    head, tail = split_rows(batch, c)
    grad_head, grad_tail = split_rows(reps_grads, c)

    def pull_back(acc, chunk, cotangent, chunk_index, start, size):
      _, vjp = jax.vjp(lambda p: self.call(p, chunk, key, chunk_index, start, size), params)
      (g,) = vjp(cotangent)
      return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g)

    if head is not None:

      def body(acc, xs):
        chunk, cotangent, i = xs
        return pull_back(acc, chunk, cotangent, chunk_base + i, example_base + i * c, c), None

      accumulator, _ = jax.lax.scan(body, accumulator, (head, grad_head, jnp.arange(num_full)))
    if tail is not None:
      accumulator = pull_back(
        accumulator, tail, grad_tail, chunk_base + num_full, example_base + num_full * c, rest
      )
    return accumulator


def _towers_from(embed_fn, chunk_size, per_example_keys: bool):
  """The towers of one embed function, or of a tuple/list/dict of them, and their container."""
  if not callable(embed_fn):
    leaves, towers_def = jax.tree.flatten(embed_fn)
    if not leaves or not all(callable(f) for f in leaves):
      raise ValueError(
        "embed_fn must be callable, or a tuple/list/dict of callables (one per tower); "
        f"got {type(embed_fn).__name__}."
      )
    if isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool):
      sizes = [int(chunk_size)] * len(leaves)
    else:
      try:
        sizes = towers_def.flatten_up_to(chunk_size)
      except (ValueError, TypeError) as error:
        raise ValueError(
          "chunk_size must be an int or a container matching embed_fn's towers "
          f"({towers_def}); got {chunk_size!r}."
        ) from error
    for size in sizes:
      check_positive_int("chunk_size", size)
    names = [
      f"batch of tower {jax.tree_util.keystr(path)}"
      for path, _ in jax.tree_util.tree_flatten_with_path(embed_fn)[0]
    ]
    towers = [
      _Tower(f, s, per_example_keys, name) for f, s, name in zip(leaves, sizes, names, strict=True)
    ]
    return towers, towers_def
  check_positive_int("chunk_size", chunk_size)
  return [_Tower(embed_fn, chunk_size, per_example_keys)], None


def _tower_batches(towers_def, batch) -> list:
  if towers_def is None:
    return [batch]
  try:
    return towers_def.flatten_up_to(batch)
  except (ValueError, TypeError) as error:
    raise ValueError(
      f"batch must have the top-level container of embed_fn ({towers_def}), one "
      "sub-batch per tower."
    ) from error


def _combine(value, accumulator, loss_grads, axis_name, has_aux):
  """The encoders' accumulated gradient plus the loss's own, reduced over devices once."""
  if axis_name is None:
    return value, jax.tree.map(lambda a, lg: a + lg.astype(a.dtype), accumulator, loss_grads)
  # The encoder parts are partial sums over the local examples; the loss part is
  # the same on every device (every device evaluates the global loss), so it
  # enters the one all-reduce divided by the device count.
  num_devices = jax.lax.psum(1, axis_name)
  total = jax.lax.psum(
    jax.tree.map(lambda a, lg: a + lg.astype(a.dtype) / num_devices, accumulator, loss_grads),
    axis_name,
  )
  if has_aux:
    return (jax.lax.pmean(value[0], axis_name), value[1]), total
  return jax.lax.pmean(value, axis_name), total


def cached_value_and_grad(
  embed_fn: EmbedFn | Any,
  loss_fn: EmbeddingLossFn,
  *,
  chunk_size: int | Any,
  has_aux: bool = False,
  axis_name: AxisName = None,
  per_example_keys: bool = False,
) -> Callable[..., tuple[Any, optax.Updates]]:
  r"""Exact ``value_and_grad`` of ``loss_fn(params, embed_fn(params, batch))``, chunk by chunk.

  The returned ``fn(params, batch, key=None) -> (value, grads)`` equals

  .. code-block:: python

    jax.value_and_grad(lambda p: loss_fn(p, embed_fn(p, batch)), has_aux=has_aux)(params)

  up to float re-association, with the encoder's activations of a single chunk
  in memory at a time (gradient caching, Gao et al., 2021):

  .. math::

    \frac{dL}{dw} = \frac{\partial\,\mathrm{loss}}{\partial w}
      + \sum_k \Big(\frac{\partial\, \mathrm{embed}(w, x_k)}{\partial w}\Big)^{\!\top}
        \frac{\partial\,\mathrm{loss}}{\partial r_k}

  The representations :math:`r_k` of every chunk are computed first (a scan
  that keeps no activations), then the loss and its gradient with respect to
  ``params`` and to the representations, then each chunk is re-embedded under
  ``jax.vjp`` (a second scan) and its gradient accumulated in float32 (float64
  stays float64), so bfloat16 params do not lose gradient mass over many
  chunks. Grads come back in the dtype of each param.

  * ``batch``: any pytree whose leaves hold the examples on axis 0. A size that
    is not a multiple of ``chunk_size`` is handled exactly: the last, smaller
    chunk is embedded on its own (nothing is padded). A ``chunk_size`` larger
    than the batch (or the local shard) raises a ``ValueError`` at call time.
  * Towers with their own chunk sizes: pass ``embed_fn`` as a tuple/list/dict
    of per-tower functions, ``batch`` with the same top-level container (one
    sub-batch per tower; towers may hold different numbers of examples, e.g.
    one query to several passages) and ``chunk_size`` as an int or the same
    container of ints. ``loss_fn`` then receives that container of per-tower
    representations.
  * Randomness: when ``key`` is given, ``embed_fn`` is called as
    ``embed_fn(params, chunk, key)`` with ``fold_in(key, c)`` for chunk number
    ``c``, and the backward re-computation of a chunk receives exactly the
    key of its forward pass (dropout masks are replayed, bitwise). With
    ``per_example_keys=True`` it receives instead an array of keys, one per
    example, ``fold_in(key, i)`` for example index ``i``, so results do not
    depend on ``chunk_size`` (vmap your model over them). In the multi-tower
    form tower ``t`` uses ``fold_in(key, t)`` in place of ``key``. Chunk and
    example indices count over the global batch under ``axis_name``.
  * ``axis_name``: call ``fn`` inside ``jax.shard_map``/``jax.pmap`` with the
    local shard of the batch. The representations are all-gathered (tiled,
    device order) so ``loss_fn`` sees the global batch; encoder gradients are
    summed over the axis. ``value`` and ``grads`` are the global-batch ones,
    identical on every device (replicated under ``shard_map``); do not
    ``psum`` them again (a ``pmean`` is harmless). ``aux`` is returned as
    ``loss_fn`` computed it on the gathered batch.

  Args:
    embed_fn: ``(params, chunk) -> representations`` (or ``(params, chunk,
      key)``): any pytree whose leaves have the chunk's examples on axis 0; or
      a tuple/list/dict of such functions, one per tower.
    loss_fn: ``(params, representations) -> scalar`` for the whole batch, or
      ``(scalar, aux)`` with ``has_aux``. It gets ``params`` so that loss-only
      parameters (a logit scale or bias) get their gradients.
    chunk_size: examples per chunk, a positive int, or a container matching a
      multi-tower ``embed_fn``.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``value`` is then that pair.
    axis_name: data-parallel axis over which the contrastive batch is global.
    per_example_keys: derive one key per example instead of one per chunk.

  Returns:
    ``fn(params, batch, key=None) -> (value, grads)``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> embed = lambda p, x: jnp.tanh(x @ p["w"])
    >>> loss = lambda p, r: jnp.mean(jax.nn.logsumexp(p["s"] * r @ r.T, axis=1))
    >>> params = {"w": jnp.ones((3, 2)) / 3, "s": jnp.float32(2.0)}
    >>> x = jnp.arange(30.0).reshape(10, 3) / 30
    >>> value, grads = optax_gsam.cached_value_and_grad(embed, loss, chunk_size=4)(params, x)
    >>> ref_value, ref_grads = jax.value_and_grad(lambda p: loss(p, embed(p, x)))(params)
    >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(grads["w"], ref_grads["w"]))
    (True, True)

  References:
    Gao et al., `Scaling Deep Contrastive Learning Batch Size under Memory
    Limited Setup <https://arxiv.org/abs/2101.06983>`_, RepL4NLP 2021.
  """
  towers, towers_def = _towers_from(embed_fn, chunk_size, per_example_keys)
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  for name, flag in (("has_aux", has_aux), ("per_example_keys", per_example_keys)):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}.")
  check_axis_name(axis_name)

  def value_and_grad_fn(params: optax.Params, batch: Any, key: jax.Array | None = None):
    batches = _tower_batches(towers_def, batch)
    keys = [key] * len(towers)
    if key is not None and towers_def is not None:
      keys = [jax.random.fold_in(key, t) for t in range(len(towers))]
    device = jax.lax.axis_index(axis_name) if axis_name is not None else 0
    if axis_name is not None:
      params = _as_varying(params, axis_name)
    offsets = []
    for tower, tower_batch in zip(towers, batches, strict=True):
      n, num_full, rest = tower.layout(tower_batch)
      offsets.append((device * (num_full + (rest > 0)), device * n))
    reps = [
      tower.embed(params, b, k, o)
      for tower, b, k, o in zip(towers, batches, keys, offsets, strict=True)
    ]
    if axis_name is not None:
      reps = jax.tree.map(lambda r: jax.lax.all_gather(r, axis_name, tiled=True), reps)
    structured = reps[0] if towers_def is None else towers_def.unflatten(reps)
    value, (loss_grads, reps_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)(
      params, structured
    )
    reps_grads = [reps_grads] if towers_def is None else towers_def.flatten_up_to(reps_grads)
    accumulator = jax.tree.map(zeros_accumulator, params)
    if axis_name is not None:
      accumulator = _as_varying(accumulator, axis_name)
    for tower, b, k, o, g in zip(towers, batches, keys, offsets, reps_grads, strict=True):
      if axis_name is not None:
        local = tower.layout(b)[0]
        g = jax.tree.map(lambda x, n=local: jax.lax.dynamic_slice_in_dim(x, device * n, n), g)
      accumulator = tower.backward(params, b, k, o, g, accumulator)
    value, total = _combine(value, accumulator, loss_grads, axis_name, has_aux)
    return value, jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), total, params)

  return value_and_grad_fn
