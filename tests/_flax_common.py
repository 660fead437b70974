"""What the Flax tests share: the optimizers, a small batch and a tree comparison."""

import jax
import jax.numpy as jnp
import optax

import optax_gsam

LR = 0.1
# Shared so that the jitted steps compile once per optimizer.
RHO_TINY = 1e-5
TX_TINY = optax.chain(optax_gsam.gsam(RHO_TINY, 0.5), optax.sgd(LR))
TX_GSAM = optax.chain(optax_gsam.gsam(0.5, 0.3), optax.sgd(LR))
TX_PLAIN = optax.sgd(LR)


def data(n=16, d=4):
  x = jax.random.normal(jax.random.key(10), (n, d))
  y = jax.nn.one_hot(jax.random.randint(jax.random.key(11), (n,), 0, 3), 3)
  return x, y


def max_tree_diff(a, b):
  return max(jax.tree.leaves(jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)))
