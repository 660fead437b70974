"""A decoder-only transformer for ``sharded.py``: scanned, rematerialized blocks, FSDP layout.

Pre-LayerNorm blocks (causal multi-head attention, GELU MLP), learned positions, an untied
output projection, next-token cross-entropy. The blocks are one ``nn.scan`` over a stacked
``(depth, ...)`` parameter tree with ``nn.remat`` (only each block's input is kept for the
backward pass), as large-model trainers lay them out. Params are float32; ``dtype`` is the
compute dtype (bfloat16 is mixed precision: float32 params and gradients, bfloat16 matmuls).
Activations are constrained to the batch sharding after every block, so the compiler gathers
the FSDP-sharded weights rather than the activations.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  width: int
  depth: int
  heads: int
  mlp: int
  vocab: int
  seq: int


# 1.04B parameters: 18 blocks of 50.3M (12 width^2) and two 32768 x 2048 embeddings.
DECODER_1B = DecoderConfig(width=2048, depth=18, heads=16, mlp=8192, vocab=32768, seq=512)
DECODER_QUICK = DecoderConfig(width=128, depth=2, heads=4, mlp=512, vocab=512, seq=32)


def scanned_blocks(block: type[nn.Module], depth: int) -> Any:
  """``depth`` rematerialized copies of ``block`` in one ``nn.scan`` over stacked parameters
  (large-model trainers' layout: the backward pass keeps only each block's input)."""
  return nn.scan(
    nn.remat(block, prevent_cse=False),
    variable_axes={"params": 0},
    split_rngs={"params": True},
    length=depth,
  )


class Block(nn.Module):
  """Pre-LayerNorm block; returns ``(x, None)`` for ``nn.scan``."""

  config: DecoderConfig
  dtype: Any
  constrain: Any

  @nn.compact
  def __call__(self, x, _):
    c = self.config
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)
    y = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
    batch, seq, _ = y.shape
    head = c.width // c.heads
    split = lambda t: t.reshape(batch, seq, c.heads, head)
    q, k, v = (split(dense(c.width, n)(y)) for n in ("q", "k", "v"))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(self.dtype)
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
    weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, c.width)
    x = x + dense(c.width, "out")(attended)
    y = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
    x = x + dense(c.width, "down")(nn.gelu(dense(c.mlp, "up")(y)))
    return self.constrain(x), None


class Decoder(nn.Module):
  """Token and position embeddings, ``depth`` scanned blocks, final LayerNorm, output head."""

  config: DecoderConfig
  dtype: Any = jnp.float32
  constrain: Any = lambda x: x

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    x = nn.Embed(c.vocab, c.width, name="embed")(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (c.seq, c.width))
    x = self.constrain(x.astype(self.dtype))
    blocks = scanned_blocks(Block, c.depth)
    x, _ = blocks(c, self.dtype, self.constrain, name="blocks")(x, None)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(c.vocab, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def next_token_loss(model: Decoder, params, tokens) -> jax.Array:
  """Mean cross-entropy of predicting ``tokens[:, 1:]`` (the last position predicts nothing)."""
  logits = model.apply({"params": params}, tokens)[:, :-1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def param_count(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
