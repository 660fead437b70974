"""A residual MLP for ``sharded.py --model mlp``: FSDP's second shape, no scan and no remat.

``depth`` blocks ``x <- x + relu(x W_in) W_out`` of square ``width x width`` matrices, each block
its own parameters (the loop is unrolled: nothing is scanned or rematerialized, so the compiler
schedules every gathered weight and every activation itself), and a squared error against the
input reversed along its features. The default, 16 blocks of width 4096, has 537M parameters in
32 matrices of 64 MiB; FSDP shards their rows over the data axis. Params are float32;
``dtype`` is the compute dtype (bfloat16: float32 params and gradients, bfloat16 matmuls).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MLPConfig:
  width: int
  depth: int


MLP_537M = MLPConfig(width=4096, depth=16)
MLP_QUICK = MLPConfig(width=256, depth=4)


def init(config: MLPConfig, key: jax.Array) -> dict[str, Any]:
  """``{"blocks": [{"w_in", "w_out"}] * depth}``, each ``width x width``, scaled by 1/sqrt(width)."""
  keys = jax.random.split(key, 2 * config.depth).reshape(config.depth, 2)
  scale = config.width**-0.5
  matrix = lambda k: scale * jax.random.normal(k, (config.width, config.width), jnp.float32)
  return {"blocks": [{"w_in": matrix(k[0]), "w_out": matrix(k[1])} for k in keys]}


def loss(params, inputs: jax.Array, dtype: Any, constrain=lambda x: x) -> jax.Array:
  """The mean squared error of the MLP's output against ``inputs`` reversed along features.

  ``constrain`` lays out the activations after every block (the batch sharding), so the
  compiler gathers the FSDP-sharded weights rather than the activations.
  """
  x = inputs.astype(dtype)
  for block in params["blocks"]:
    hidden = jax.nn.relu(x @ block["w_in"].astype(dtype))
    x = constrain(x + hidden @ block["w_out"].astype(dtype))
  error = x.astype(jnp.float32) - inputs[:, ::-1]
  return jnp.mean(error**2)
