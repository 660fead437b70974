"""The GSAM paper's ViT-B/32 (and a small one for quick runs) as ``tpu_compile.py`` compiles it.

Patch embedding, learned positions, pre-LayerNorm encoder blocks and a global-average-pool
head, with the activations' dtype as a field (params stay float32). ``ScannedViT`` lays the
same blocks out as big_vision does for large models (``scan_layers``, ``remat_policy``): one
``nn.scan`` over stacked block parameters, each block rematerialized, so the backward pass keeps
only each block's input; ``sharded.py --model vit`` compiles it (ViT-L/16) for FSDP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from benchmarks.compiled.decoder import scanned_blocks


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  patch: int
  width: int
  depth: int
  heads: int
  mlp: int
  image: int
  classes: int


VIT_B32 = ViTConfig(patch=32, width=768, depth=12, heads=12, mlp=3072, image=224, classes=1000)
VIT_QUICK = ViTConfig(patch=8, width=64, depth=1, heads=2, mlp=256, image=32, classes=10)
VIT_L16 = ViTConfig(patch=16, width=1024, depth=24, heads=16, mlp=4096, image=224, classes=1000)
VIT_SCANNED_QUICK = ViTConfig(patch=8, width=64, depth=4, heads=2, mlp=256, image=32, classes=10)


class Block(nn.Module):
  """Pre-LayerNorm encoder block: multi-head self-attention and a GELU MLP."""

  config: ViTConfig
  dtype: Any

  @nn.compact
  def __call__(self, x):
    c = self.config
    y = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=c.heads, dtype=self.dtype)(y, y)
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = nn.Dense(c.width, dtype=self.dtype)(nn.gelu(nn.Dense(c.mlp, dtype=self.dtype)(y)))
    return x + y


class ViT(nn.Module):
  """Vision Transformer: patch embedding, learned positions, encoder, GAP head."""

  config: ViTConfig
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, images):
    c = self.config
    x = nn.Conv(c.width, (c.patch, c.patch), strides=c.patch, padding="VALID", dtype=self.dtype)(
      images
    )
    x = x.reshape(x.shape[0], -1, c.width)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], c.width))
    for _ in range(c.depth):
      x = Block(c, self.dtype)(x)
    x = nn.LayerNorm(dtype=self.dtype)(x).mean(axis=1)
    return nn.Dense(c.classes, dtype=self.dtype)(x).astype(jnp.float32)


class ScannedBlock(Block):
  """A :class:`Block` shaped for ``nn.scan``: ``(x, None) -> (x, None)``, the batch laid out."""

  constrain: Any = None

  def __call__(self, x, _):  # type: ignore[override]
    x = super().__call__(x)
    return (x if self.constrain is None else self.constrain(x)), None


class ScannedViT(nn.Module):
  """:class:`ViT` with its blocks in one rematerialized ``nn.scan`` (big_vision's large models).

  ``constrain`` lays out the activations after the embedding and every block (the batch
  sharding), so the compiler gathers the FSDP-sharded weights rather than the activations.
  """

  config: ViTConfig
  dtype: Any = jnp.float32
  constrain: Any = None

  @nn.compact
  def __call__(self, images):
    c = self.config
    keep = (lambda x: x) if self.constrain is None else self.constrain
    x = nn.Conv(c.width, (c.patch, c.patch), strides=c.patch, padding="VALID", dtype=self.dtype)(
      images
    )
    x = x.reshape(x.shape[0], -1, c.width)
    x = keep(x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], c.width)))
    blocks = scanned_blocks(ScannedBlock, c.depth)
    x, _ = blocks(c, self.dtype, self.constrain, name="blocks")(x, None)
    x = nn.LayerNorm(dtype=self.dtype)(x).mean(axis=1)
    return nn.Dense(c.classes, dtype=self.dtype)(x).astype(jnp.float32)
