"""Shared test problems with hand-written (non-autodiff) gradients.

The references in the tests are written from the formulas in numpy float64;
they use these analytic gradients so that nothing in a reference goes through
the package, or even through JAX's autodiff.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam


def make_problem(seed: int = 0, n: int = 16, d: int = 5, k: int = 3):
  """A smooth non-quadratic loss on params {"w": (d, k), "b": (k,)}.

  f(w, b) = mean(softplus(X w + b) * T) + 0.25 * sum(w ** 4)
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d))
  t = rng.normal(size=(n, k))
  params = {"w": rng.normal(size=(d, k)) * 0.7, "b": rng.normal(size=(k,)) * 0.3}

  def loss_jax(p):
    z = jnp.asarray(x, p["w"].dtype) @ p["w"] + p["b"]
    return jnp.mean(jnp.logaddexp(0.0, z) * jnp.asarray(t, z.dtype)) + 0.25 * jnp.sum(p["w"] ** 4)

  def loss_np(p):
    z = x @ p["w"] + p["b"]
    return float(np.mean(np.logaddexp(0.0, z) * t) + 0.25 * np.sum(p["w"] ** 4))

  def grad_np(p):
    z = x @ p["w"] + p["b"]
    s = t / (1.0 + np.exp(-z)) / z.size
    return {"w": x.T @ s + p["w"] ** 3, "b": s.sum(axis=0)}

  return params, loss_jax, loss_np, grad_np


def float32_problem(seed: int = 0, **kwargs):
  """:func:`make_problem`'s params in float32, with its JAX loss: ``(params, loss_jax)``."""
  params, loss_jax, _, _ = make_problem(seed=seed, **kwargs)
  return {name: jnp.asarray(value, jnp.float32) for name, value in params.items()}, loss_jax


def flatten(tree) -> np.ndarray:
  return np.concatenate([np.ravel(tree["b"]), np.ravel(tree["w"])])


def unflatten(vector: np.ndarray, like) -> dict:
  nb = np.size(like["b"])
  return {
    "b": vector[:nb].reshape(np.shape(like["b"])),
    "w": vector[nb:].reshape(np.shape(like["w"])),
  }


def all_finite(tree) -> bool:
  return all(bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in jax.tree.leaves(tree))


def assert_trees_equal(a, b) -> None:
  """Bitwise equality, structure included."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def make_step(tx, loss_fn):
  """A jitted train step with the clean gradient, the loss and the clean loss value."""

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state

  return step


# A 20-step cosine schedule, and rho following it: the schedules the reliability tests train with.
LR = optax.cosine_decay_schedule(0.05, 20, alpha=0.1)
RHO = optax_gsam.rho_from_lr(LR, rho_max=0.2, rho_min=0.05, num_steps=20)


def mixed_params(params):
  """``w`` in bfloat16, ``b`` as it is."""
  return {"w": params["w"].astype(jnp.bfloat16), "b": params["b"]}


def in_float32(loss_fn, params):
  """``loss_fn`` evaluated on a float32 copy of ``params``."""
  return loss_fn(jax.tree.map(lambda x: x.astype(jnp.float32), params))


# Gradient scales from zero through float32's extremes.
SCALES = [0.0, 1e-30, 1e-20, 1.0, 1e20, 1e30]


def runtime_conditionals(fn, *args) -> int:
  """How many ``lax.cond``/``lax.switch`` the CPU program of ``fn(*args)`` runs as such.

  A ``jax.lax.platform_dependent`` choice (the norms' form, the GPU's conditional around the
  perturbed pass) is a ``cond`` on a ``platform_index`` in the jaxpr, with every platform's
  branch, but it is resolved when the step is compiled: the CPU's program holds its own branch
  alone, so only the conditionals that run on the CPU are counted.
  """
  return jax.jit(fn).lower(*args).compile().as_text().count(" conditional(")


def optimization_barriers(step, *args) -> dict[str, int]:
  """optimization_barrier ops in ``step`` lowered for CPU and for TPU (no TPU needed), those
  that hide a scalar constant from XLA's simplifier aside (the accelerators' range sums)."""
  traced = jax.jit(step).trace(*args)

  def count(text):
    hidden_scalar = re.compile(r"optimization_barrier %cst(_\d+)? : tensor<f32>$")
    barriers = [line.rstrip() for line in text.splitlines() if "optimization_barrier" in line]
    return sum(not hidden_scalar.search(line) for line in barriers)

  return {
    platform: count(traced.lower(lowering_platforms=(platform,)).as_text())
    for platform in ("cpu", "tpu")
  }
