"""Contrastive losses (CLIP softmax InfoNCE, SigLIP sigmoid) in dense and tiled form.

Once the encoders are chunked (see :func:`optax_gsam.cached_value_and_grad`),
the ``B x B`` logits matrix is the memory wall. With ``tile_size`` set, both
losses walk over blocks of ``tile_size`` rows, so value and gradient need
``O(tile_size * B)`` memory rather than ``O(B^2)``:

* CLIP: a streaming log-sum-exp. One pass over the row tiles gives every row's
  log-sum-exp and, through a running (max, sum of exponentials) per column,
  every column's; a custom VJP recomputes each tile's logits from the saved
  log-sum-exps in the backward pass.
* SigLIP: the loss is a sum of elementwise terms; each tile is checkpointed.

With ``axis_name`` (inside ``jax.shard_map``), each device holds its shard of
the pairs, gathers the other modality and computes its own rows; the result is
the loss of the global batch, the same on every device, and gradients flow to
the local shards. Under ``shard_map`` with ``check_vma=True`` (JAX's default)
the per-device gradients are then already the global ones. Under ``jax.pmap``
or ``check_vma=False`` (as in :func:`optax_gsam.data_parallel`) each device's
gradient is its term of a sum taken over devices: average them with
``jax.lax.pmean`` (which ``gsam(..., axis_name=...)`` does), never ``psum``.
With a batch-coupled loss like these, per-device perturbation mixes
embeddings computed at differently perturbed weights; prefer
``sync_perturbation=True`` there, or the gradient cache's own ``axis_name``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from optax_gsam._src.core.arrays import join_rows
from optax_gsam._src.core.arrays import mark_varying
from optax_gsam._src.core.arrays import split_rows
from optax_gsam._src.core.arrays import upcast
from optax_gsam._src.core.arrays import varying_axes
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam.typing import AxisName


def _check_pair(image_embeddings, text_embeddings) -> None:
  for name, x in (("image_embeddings", image_embeddings), ("text_embeddings", text_embeddings)):
    if jnp.ndim(x) != 2:
      raise ValueError(f"{name} must have shape [batch, dim], got shape {jnp.shape(x)}.")
  if jnp.shape(image_embeddings) != jnp.shape(text_embeddings):
    raise ValueError(
      "image_embeddings and text_embeddings must have the same shape (one pair per row), got "
      f"{jnp.shape(image_embeddings)} and {jnp.shape(text_embeddings)}."
    )


def _check_scalar(name: str, x) -> None:
  if jnp.ndim(x) != 0:
    raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}.")


def _varying_like(x, *refs):
  """``x`` marked device-varying over every axis any of ``refs`` varies over (scan carries)."""
  return mark_varying(x, frozenset().union(*(varying_axes(r) for r in refs)))


# Streaming log-sum-exp of L = exp(t) q k^T over rows and over columns.


def _lse_forward_pass(q, k, t, tile):
  scale = jnp.exp(t)
  num_cols = k.shape[0]

  def step(carry, q_rows):
    col_max, col_sum = carry
    logits = scale * (q_rows @ k.T)
    row_lse = jax.nn.logsumexp(logits, axis=1)
    new_max = jnp.maximum(col_max, jnp.max(logits, axis=0))
    rescale = jnp.where(jnp.isneginf(col_max), 0.0, jnp.exp(col_max - new_max))
    col_sum = col_sum * rescale + jnp.sum(jnp.exp(logits - new_max), axis=0)
    return (new_max, col_sum), row_lse

  carry = tuple(
    _varying_like(c, q, k, t)
    for c in (jnp.full((num_cols,), -jnp.inf, q.dtype), jnp.zeros((num_cols,), q.dtype))
  )
  head, tail = split_rows(q, tile)
  head_rows = tail_rows = None
  if head is not None:
    carry, head_rows = jax.lax.scan(step, carry, head)
  if tail is not None:
    carry, tail_rows = step(carry, tail)
  col_max, col_sum = carry
  return join_rows(head_rows, tail_rows), col_max + jnp.log(col_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _streaming_lse(q, k, t, tile):
  return _lse_forward_pass(q, k, t, tile)


def _streaming_lse_fwd(q, k, t, tile):
  row_lse, col_lse = _lse_forward_pass(q, k, t, tile)
  return (row_lse, col_lse), (q, k, t, row_lse, col_lse)


def _streaming_lse_bwd(tile, residuals, cotangents):
  q, k, t, row_lse, col_lse = residuals
  row_ct, col_ct = cotangents
  scale = jnp.exp(t)

  # d lse_i / d L_ij = softmax over row i; d lse_j / d L_ij = softmax over column j.
  def step(carry, xs):
    dk, dt = carry
    q_rows, rows_lse, rows_ct = xs
    logits = scale * (q_rows @ k.T)
    dlogits = rows_ct[:, None] * jnp.exp(logits - rows_lse[:, None]) + col_ct[None, :] * jnp.exp(
      logits - col_lse[None, :]
    )
    dq_rows = scale * (dlogits @ k)
    return (dk + scale * (dlogits.T @ q_rows), dt + jnp.sum(dlogits * logits)), dq_rows

  refs = (q, k, t, row_ct, col_ct)
  carry = (_varying_like(jnp.zeros_like(k), *refs), _varying_like(jnp.zeros_like(t), *refs))
  blocks = [split_rows(x, tile) for x in (q, row_lse, row_ct)]
  head_dq = tail_dq = None
  if blocks[0][0] is not None:
    carry, head_dq = jax.lax.scan(step, carry, tuple(b[0] for b in blocks))
  if blocks[0][1] is not None:
    carry, tail_dq = step(carry, tuple(b[1] for b in blocks))
  dk, dt = carry
  return join_rows(head_dq, tail_dq), dk, dt


_streaming_lse.defvjp(_streaming_lse_fwd, _streaming_lse_bwd)


def _lse_both_ways(q, k, t, tile_size):
  """(log-sum-exp of each row, of each column) of L = exp(t) q k^T."""
  if tile_size is None:
    logits = jnp.exp(t) * (q @ k.T)
    return jax.nn.logsumexp(logits, axis=1), jax.nn.logsumexp(logits, axis=0)
  # Under shard_map the custom VJP needs inputs of one type; casting the
  # replicated ones to varying lets JAX sum their cotangents across devices.
  q, k, t = (_varying_like(a, q, k, t) for a in (q, k, t))
  return _streaming_lse(q, k, t, tile_size)


def _softplus_sum(q, k, t, b, tile_size):
  """sum_ij softplus(exp(t) q_i . k_j + b), tile by tile with checkpointed tiles."""

  def block(q_rows):
    return jnp.sum(jax.nn.softplus(jnp.exp(t) * (q_rows @ k.T) + b))

  if tile_size is None:
    return block(q)
  head, tail = split_rows(q, tile_size)
  total = _varying_like(jnp.zeros((), q.dtype), q, k, t, b)
  if head is not None:
    checkpointed = jax.checkpoint(block)
    total, _ = jax.lax.scan(lambda acc, rows: (acc + checkpointed(rows), None), total, head)
  if tail is not None:
    total = total + block(tail)
  return total


def _gather(x, axis_name):
  return jax.lax.all_gather(x, axis_name, tiled=True)


def _local_slice(x, local_size, axis_name):
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * local_size, local_size)


def clip_loss(
  image_embeddings: jax.Array,
  text_embeddings: jax.Array,
  logit_scale: jax.Array | float,
  *,
  tile_size: int | None = None,
  axis_name: AxisName = None,
) -> jax.Array:
  r"""CLIP's symmetric softmax InfoNCE loss, dense or tiled.

  With :math:`L_{ij} = e^{t}\, x_i \cdot y_j` for images :math:`x` and texts
  :math:`y` (pass them L2-normalised, as CLIP does) and :math:`t` the learnable
  log inverse temperature:

  .. math::

    \ell = \frac{1}{2B} \sum_{i=1}^{B} \Big(
      \log\sum_j e^{L_{ij}} - L_{ii} \Big)
      + \frac{1}{2B} \sum_{j=1}^{B} \Big( \log\sum_i e^{L_{ij}} - L_{jj} \Big)

  Args:
    image_embeddings: ``[B, d]``; row ``i`` pairs with text ``i``.
    text_embeddings: ``[B, d]``.
    logit_scale: :math:`t`, a scalar; the logits are scaled by :math:`e^{t}`
      (CLIP initialises it to :math:`\log(1/0.07)`).
    tile_size: ``None`` for the dense ``B x B`` form; an int for the tiled form
      (streaming log-sum-exp with a custom VJP), ``O(tile_size * B)`` memory,
      the same value and gradients. ``B`` need not be a multiple of it.
    axis_name: inside ``jax.shard_map`` over this axis, the embeddings are the
      local shards of the global batch (same size on every device); the loss is
      that of the global batch. Each device computes its rows against the
      gathered other modality. See the module notes for how to average the
      resulting gradients under ``pmap`` or ``check_vma=False``.

  Returns:
    The scalar loss, in at least float32.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> x = jax.random.normal(jax.random.key(0), (10, 4))
    >>> y = x + 0.1 * jax.random.normal(jax.random.key(1), (10, 4))
    >>> dense = optax_gsam.clip_loss(x, y, 0.5)
    >>> tiled = optax_gsam.clip_loss(x, y, 0.5, tile_size=3)
    >>> bool(jnp.allclose(dense, tiled))
    True

  References:
    Radford et al., `Learning Transferable Visual Models From Natural Language
    Supervision <https://arxiv.org/abs/2103.00020>`_, ICML 2021.
  """
  check_positive_int("tile_size", tile_size, allow_none=True)
  _check_pair(image_embeddings, text_embeddings)
  _check_scalar("logit_scale", logit_scale)
  x, y = upcast(image_embeddings), upcast(text_embeddings)
  t = upcast(logit_scale).astype(x.dtype)
  local_size = x.shape[0]
  diagonal = jnp.exp(t) * jnp.sum(x * y, axis=1)
  if axis_name is None:
    row_lse, col_lse = _lse_both_ways(x, y, t, tile_size)
    return 0.5 * (jnp.mean(row_lse - diagonal) + jnp.mean(col_lse - diagonal))
  # Rows: local images against all texts. Columns: each device holds a partial
  # log-sum-exp of every column over its own image rows; combine them.
  row_lse, partial_col_lse = _lse_both_ways(x, _gather(y, axis_name), t, tile_size)
  top = jax.lax.pmax(jax.lax.stop_gradient(partial_col_lse), axis_name)
  col_lse = top + jnp.log(jax.lax.psum(jnp.exp(partial_col_lse - top), axis_name))
  local_col_lse = _local_slice(col_lse, local_size, axis_name)
  total = jax.lax.psum(jnp.sum(row_lse - diagonal) + jnp.sum(local_col_lse - diagonal), axis_name)
  global_size = jax.lax.psum(local_size, axis_name)
  return 0.5 * total / global_size


def siglip_loss(
  image_embeddings: jax.Array,
  text_embeddings: jax.Array,
  logit_scale: jax.Array | float,
  logit_bias: jax.Array | float,
  *,
  tile_size: int | None = None,
  axis_name: AxisName = None,
) -> jax.Array:
  r"""SigLIP's pairwise sigmoid loss, dense or tiled.

  With :math:`L_{ij} = e^{t}\, x_i \cdot y_j + b` and :math:`z_{ij} = 1` for
  the matching pair (:math:`i = j`), :math:`-1` otherwise:

  .. math::

    \ell = -\frac{1}{B} \sum_{i=1}^{B}\sum_{j=1}^{B} \log \sigma(z_{ij} L_{ij})
         = \frac{1}{B} \Big( \sum_{i,j} \operatorname{softplus}(L_{ij})
           - \sum_i L_{ii} \Big)

  Args:
    image_embeddings: ``[B, d]``; row ``i`` pairs with text ``i``.
    text_embeddings: ``[B, d]``.
    logit_scale: :math:`t`, a scalar (SigLIP initialises it to
      :math:`\log 10`).
    logit_bias: :math:`b`, a scalar (SigLIP initialises it to -10).
    tile_size: ``None`` for the dense form; an int for the tiled form
      (checkpointed row tiles), ``O(tile_size * B)`` memory.
    axis_name: as in :func:`clip_loss`: local shards in, global loss out.

  Returns:
    The scalar loss, in at least float32.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> x = jax.random.normal(jax.random.key(0), (10, 4))
    >>> dense = optax_gsam.siglip_loss(x, x, 1.0, -2.0)
    >>> bool(jnp.allclose(dense, optax_gsam.siglip_loss(x, x, 1.0, -2.0, tile_size=4)))
    True

  References:
    Zhai et al., `Sigmoid Loss for Language Image Pre-Training
    <https://arxiv.org/abs/2303.15343>`_, ICCV 2023.
  """
  check_positive_int("tile_size", tile_size, allow_none=True)
  _check_pair(image_embeddings, text_embeddings)
  _check_scalar("logit_scale", logit_scale)
  _check_scalar("logit_bias", logit_bias)
  x, y = upcast(image_embeddings), upcast(text_embeddings)
  t = upcast(logit_scale).astype(x.dtype)
  b = upcast(logit_bias).astype(x.dtype)
  positives = jnp.sum(jnp.exp(t) * jnp.sum(x * y, axis=1) + b)
  if axis_name is None:
    return (_softplus_sum(x, y, t, b, tile_size) - positives) / x.shape[0]
  local = _softplus_sum(x, _gather(y, axis_name), t, b, tile_size) - positives
  return jax.lax.psum(local, axis_name) / jax.lax.psum(x.shape[0], axis_name)
