"""The models and data sets the benchmarks train (the digits MLP and data are optax_gsam.demo's)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from optax_gsam import demo


class EncoderBlock(nn.Module):
  """Pre-LayerNorm transformer block: self-attention and a GELU MLP."""

  width: int
  heads: int
  mlp_ratio: int = 4

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
    y = nn.LayerNorm()(x)
    y = nn.Dense(self.width * self.mlp_ratio)(y)
    return x + nn.Dense(self.width)(nn.gelu(y))


class ViT(nn.Module):
  """A small Vision Transformer: patch embedding, learned positions, mean pooling."""

  patch: int = 4
  width: int = 96
  depth: int = 4
  heads: int = 3
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch, padding="VALID")(x)
    x = x.reshape(x.shape[0], -1, self.width)
    x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.width))
    for _ in range(self.depth):
      x = EncoderBlock(self.width, self.heads)(x)
    x = nn.LayerNorm()(x).mean(axis=1)
    return nn.Dense(self.num_classes)(x)


class ResidualBlock(nn.Module):
  """Two 3x3 convolutions with GroupNorm; a 1x1 projection when the shape changes."""

  features: int
  stride: int = 1

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    groups = min(8, self.features)
    y = nn.Conv(self.features, (3, 3), strides=self.stride, use_bias=False)(x)
    y = nn.relu(nn.GroupNorm(groups)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
    y = nn.GroupNorm(groups)(y)
    if x.shape != y.shape:
      x = nn.Conv(self.features, (1, 1), strides=self.stride, use_bias=False)(x)
      x = nn.GroupNorm(groups)(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """A small ResNet: a 3x3 stem and one residual block per stage (GroupNorm: no batch stats)."""

  stages: tuple[int, ...] = (16, 32, 64)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
    x = nn.relu(nn.GroupNorm(min(8, self.stages[0]))(x))
    for i, features in enumerate(self.stages):
      x = ResidualBlock(features, stride=1 if i == 0 else 2)(x)
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class NormMLP(nn.Module):
  """The demo's MLP with a LayerNorm after each hidden layer, before its GELU (for SAM-ON)."""

  hidden: int = 256
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for _ in range(2):
      x = nn.gelu(nn.LayerNorm()(nn.Dense(self.hidden)(x)))
    return nn.Dense(self.num_classes)(x)


class PatchConv1D(nn.Module):
  """A 1-D convolution as patch extraction + ``nn.Dense``: ``nn.Conv``'s function, matmuls only.

  Input ``(batch, length, channels)``; zero padding ``padding`` on both sides. With
  ``kernel = conv_kernel.reshape(kernel_size * channels, features)`` it equals
  ``nn.Conv(features, (kernel_size,), strides=stride, padding=padding)``. XLA's CPU
  backend runs real convolutions inside loops and conditionals through a slow path
  (jax-ml/jax#12868), and ``vmap`` over parameters turns them into grouped convolutions.
  """

  features: int
  kernel_size: int
  stride: int = 1
  padding: int = 0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    length = x.shape[1]
    x = jnp.pad(x, ((0, 0), (self.padding, self.padding), (0, 0)))
    out = (length + 2 * self.padding - self.kernel_size) // self.stride + 1
    span = self.stride * (out - 1) + 1
    # Strided slices, not a gather: a gather's gradient is a scatter, slow on CPU.
    patches = jnp.concatenate(
      [x[:, j : j + span : self.stride] for j in range(self.kernel_size)], axis=-1
    )  # (batch, out, kernel_size * channels), kernel-offset major like nn.Conv's kernel
    return nn.Dense(self.features)(patches)


class CNN1D(nn.Module):
  """Greydanus's MNIST-1D CNN: three stride-2 convolutions (25 channels), ReLU, a linear head.

  ``norm=True`` puts a LayerNorm after each convolution, before its ReLU, so that SAM-ON
  (which perturbs only normalization parameters) has something to perturb.
  """

  channels: int = 25
  num_classes: int = 10
  norm: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim == 2:
      x = x[..., None]
    for kernel_size in (5, 3, 3):
      x = PatchConv1D(self.channels, kernel_size, stride=2, padding=1)(x)
      x = nn.relu(nn.LayerNorm()(x) if self.norm else x)
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


@functools.lru_cache(maxsize=2)
def _mnist1d(num_samples: int) -> dict:
  from mnist1d.data import get_dataset_args
  from mnist1d.data import make_dataset

  args = get_dataset_args()
  args.num_samples = num_samples
  return make_dataset(args)  # generated locally; never mnist1d's downloading get_dataset


def load_mnist1d(label_noise: float, seed: int, num_samples: int = 5000) -> demo.Digits:
  """MNIST-1D (Greydanus, 2020) made locally, 80/20 split, with the demo's label noise.

  A ``label_noise`` share of the training labels is replaced by a different random
  class (drawn from ``seed``); the test labels stay clean.
  """
  data = _mnist1d(num_samples)
  rng = np.random.default_rng(seed)
  y_train = np.asarray(data["y"], np.int32).copy()
  noisy = rng.random(len(y_train)) < label_noise
  y_train[noisy] = (y_train[noisy] + rng.integers(1, 10, noisy.sum())) % 10
  return demo.Digits(
    np.asarray(data["x"], np.float32),
    y_train,
    np.asarray(data["x_test"], np.float32),
    np.asarray(data["y_test"], np.int32),
  )
