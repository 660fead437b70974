"""Equinox train steps with GSAM, written the way Equinox users write them (docs/equinox.md).

The checks are a user's: the step trains; at rho = 0 it is the plain step (to float rounding:
two compiled programs); at a tiny rho with SGD it is the plain step to O(rho) (the perturbed pass
then runs within 1e-5 of the clean weights and must reproduce the clean gradient, which rho = 0
does not exercise: there the transform outputs the clean gradient); both passes draw the same
dropout mask; and BatchNorm's state comes from the clean pass only. Each check has a wrong variant
beside it that it catches.
"""

import functools
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gsam
from optax_gsam._src.calls import user_functions

LR = 0.1
SGD = optax.sgd(LR)
RHO_TINY = 1e-5
GSAM_TINY_SGD = optax.chain(optax_gsam.gsam(RHO_TINY, 0.3), optax.sgd(LR))
GSAM_SGD = optax.chain(optax_gsam.gsam(0.2, 0.3), optax.sgd(LR))


def data(n=16, d=4):
  x = jax.random.normal(jax.random.key(0), (n, d))
  return x, jnp.sin(x.sum(axis=1, keepdims=True))


class Net(eqx.Module):
  """Dropout and an ema-mode BatchNorm: the forward pass reads the running statistics."""

  hidden: eqx.nn.Linear
  norm: eqx.nn.BatchNorm
  dropout: eqx.nn.Dropout
  out: eqx.nn.Linear

  def __init__(self, key, mode="ema"):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(4, 8, key=k1)
    self.norm = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.5, mode=mode)
    self.dropout = eqx.nn.Dropout(0.5)
    self.out = eqx.nn.Linear(8, 1, key=k2)

  def __call__(self, x, state, key):
    h, state = self.norm(self.hidden(x), state)
    return self.out(self.dropout(jax.nn.relu(h), key=key)), state


def loss(model, state, x, y, key):
  keys = jax.random.split(key, x.shape[0])
  batched = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))
  pred, state = batched(x, state, keys)
  return jnp.mean((pred - y) ** 2), state


VARIANTS = {"right": 0, "rebound_state": 1, "fresh_key": 2}


def select(flag, a, b):
  """a where flag else b, leaf by leaf (keys through their data): one compile for every variant."""
  pick = lambda u, v: jnp.where(flag, u, v)
  if isinstance(b, jax.Array) and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(pick(jax.random.key_data(a), jax.random.key_data(b)))
  return jax.tree.map(pick, a, b)


@functools.cache
def make_step(tx):
  """One step in Equinox's shape; `variant` switches on the mistakes the docs warn about."""

  @eqx.filter_jit
  def step(model, state, opt_state, x, y, key, variant):
    value_and_grad = eqx.filter_value_and_grad(loss, has_aux=True)
    (loss_value, new_state), grads = value_and_grad(model, state, x, y, key)
    params = eqx.filter(model, eqx.is_inexact_array)
    # `(loss, state), grads = ...` rebinds `state`, and a loss_fn closed over it reads the new one.
    perturbed_state = select(variant == VARIANTS["rebound_state"], new_state, state)
    perturbed_key = select(variant == VARIANTS["fresh_key"], jax.random.fold_in(key, 1), key)
    updates, opt_state = tx.update(
      grads,
      opt_state,
      params,
      loss_fn=lambda p: loss(eqx.combine(p, model), perturbed_state, x, y, perturbed_key),
      value=loss_value,
    )
    return eqx.apply_updates(model, updates), new_state, opt_state, loss_value

  return step


def run(tx, variant="right", steps=2, seed=1, fixed_key=False):
  model, state = eqx.nn.make_with_state(Net)(jax.random.key(seed))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  step = make_step(tx)
  x, y = data()
  losses = []
  for i in range(steps):
    model, state, opt_state, loss_value = step(
      model,
      state,
      opt_state,
      x,
      y,
      jax.random.key(100 + (0 if fixed_key else i)),
      VARIANTS[variant],
    )
    losses.append(float(loss_value))
  return eqx.filter(model, eqx.is_inexact_array), state, opt_state, losses


def max_diff(a, b):
  diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)
  return max(jax.tree.leaves(diffs))


def state_arrays(state):
  return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.inexact)]


def test_tiny_rho_step_is_the_plain_step_and_catches_the_two_mistakes():
  plain = run(SGD)
  right = run(GSAM_TINY_SGD)
  assert max_diff(right[0], plain[0]) < 1e-5
  assert max_diff(state_arrays(right[1]), state_arrays(plain[1])) < 1e-6
  assert float(optax.tree.get(right[2], "cosine")) > 0.9999
  # The perturbed pass with the rebound (clean pass's) state, or with a new dropout key: the
  # step is no longer the plain step, and the gradients of the two passes disagree.
  rebound, fresh = run(GSAM_TINY_SGD, "rebound_state"), run(GSAM_TINY_SGD, "fresh_key")
  assert max_diff(rebound[0], plain[0]) > 1e-3
  assert max_diff(fresh[0], plain[0]) > 1e-3
  assert float(optax.tree.get(fresh[2], "cosine")) < 0.999


def test_gsam_step_trains_and_the_state_comes_from_the_clean_pass():
  _, _, opt_state, losses = run(GSAM_SGD, steps=6, fixed_key=True)
  assert losses[-1] < losses[0]
  assert float(optax.tree.get(opt_state, "last_rho")) == pytest.approx(0.2)
  # One step by hand: the state returned is the clean pass's, not the perturbed pass's.
  model, state0 = eqx.nn.make_with_state(Net)(jax.random.key(1))
  x, y = data()
  key = jax.random.key(100)
  _, one_state, _, _ = make_step(GSAM_SGD)(
    model, state0, GSAM_SGD.init(eqx.filter(model, eqx.is_inexact_array)), x, y, key, jnp.int32(0)
  )

  @jax.jit
  def clean_and_perturbed_states(p):
    model = eqx.combine(p, static)
    grads = jax.grad(lambda p: loss(eqx.combine(p, static), state0, x, y, key)[0])(p)
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    perturbed = jax.tree.map(lambda w, g: w + 0.2 * g / norm, p, grads)
    clean_state = loss(model, state0, x, y, key)[1]
    return clean_state, loss(eqx.combine(perturbed, static), state0, x, y, key)[1]

  params, static = eqx.partition(model, eqx.is_inexact_array)
  clean_state, perturbed_state = clean_and_perturbed_states(params)
  assert max_diff(state_arrays(one_state), state_arrays(clean_state)) < 1e-6
  assert max_diff(state_arrays(clean_state), state_arrays(perturbed_state)) > 1e-3


def test_rho_zero_makes_the_adam_step_plain():
  plain = run(optax.adam(1e-2))
  at_zero = run(optax.chain(optax_gsam.gsam(0.0, 0.3), optax.adam(1e-2)))
  # Two compiled programs: equal up to float32 rounding, which depends on how XLA compiles the
  # clean pass in each (and on the CPU's kernels); a mistake would move the params by O(lr).
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  jax.tree.map(close, at_zero[0], plain[0])
  jax.tree.map(close, state_arrays(at_zero[1]), state_arrays(plain[1]))


# --- item 1: the errors of a first conversion name the fix ----------------------------------


def mlp_and_loss():
  model = eqx.nn.MLP(4, 1, width_size=8, depth=1, key=jax.random.key(2))
  x, y = data()
  return model, lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)


def test_filtered_model_called_as_the_model_names_partition_and_combine():
  model, mse = mlp_and_loss()
  params = eqx.filter(model, eqx.is_array)  # the README pattern, applied to a Module
  grads = eqx.filter_jit(eqx.filter_grad(mse))(model)
  tx = optax.chain(optax_gsam.gsam(0.05, 0.3), optax.adam(1e-3))
  with pytest.raises(TypeError, match=r"Equinox MLP filtered.*eqx\.partition.*eqx\.combine"):
    jax.eval_shape(lambda: tx.update(grads, tx.init(params), params, loss_fn=mse))
  # The fix the message shows.
  params, static = eqx.partition(model, eqx.is_inexact_array)
  updates, _ = jax.eval_shape(
    lambda: tx.update(grads, tx.init(params), params, loss_fn=lambda p: mse(eqx.combine(p, static)))
  )
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_whole_model_as_params_gets_the_equinox_fix():
  model, mse = mlp_and_loss()
  grads = eqx.filter_grad(mse)(model)
  tx = optax.chain(optax_gsam.gsam(0.05, 0.3), optax.adam(1e-3))
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  with pytest.raises(ValueError, match=r"eqx\.partition\(model, eqx\.is_inexact_array\)"):
    tx.update(grads, opt_state, model, loss_fn=mse)
  assert user_functions.holds_equinox_module([{"a": model}])
  assert not user_functions.holds_equinox_module({"w": jnp.ones(2)})


def test_whole_model_to_accumulate_value_and_grad_gets_the_equinox_fix():
  """The whole model (BatchNorm's axis_name "batch" a str leaf) as params used to fail inside JAX
  with "Argument 'batch' of type <class 'str'>", which reads as if the batch were wrong."""
  model, state = eqx.nn.make_with_state(Net)(jax.random.key(1))
  x, y = data()
  key = jax.random.key(2)
  microbatch_loss = lambda model, state, microbatch, key: loss(model, state, *microbatch, key)
  inputs = dict(microbatches=2, model_state=state, key=key)
  with pytest.raises(
    ValueError,
    match=r"accumulate_value_and_grad differentiates every leaf of params.*"
    r"params\.norm\.axis_name: str.*eqx\.partition\(model, eqx\.is_inexact_array\)",
  ):
    optax_gsam.accumulate_value_and_grad(microbatch_loss, model, (x, y), **inputs)
  # The fix the message shows.
  params, static = eqx.partition(model, eqx.is_inexact_array)
  of_params = lambda p, *args: microbatch_loss(eqx.combine(p, static), *args)
  (_, new_state), grads = optax_gsam.accumulate_value_and_grad(of_params, params, (x, y), **inputs)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_import_optax_gsam_does_not_import_equinox_or_haiku():
  code = "import sys, optax_gsam; assert not {'equinox', 'haiku'} & set(sys.modules)"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- item 4: data parallel ------------------------------------------------------------------


def pmean_floats(tree, axis_name):
  floats = lambda s: jnp.issubdtype(s.dtype, jnp.inexact)
  return jax.tree.map(lambda s: jax.lax.pmean(s, axis_name) if floats(s) else s, tree)


def data_parallel_step(tx, static, average_grads):
  def per_device_step(params, state, opt_state, x, y, key):
    key = jax.random.fold_in(key, jax.lax.axis_index("data"))
    loss_of = lambda p, state: loss(eqx.combine(p, static), state, x, y, key)
    (loss_value, new_state), grads = jax.value_and_grad(loss_of, has_aux=True)(params, state)
    if average_grads:  # the plain data-parallel step
      grads = jax.lax.pmean(grads, "data")
    updates, opt_state = tx.update(
      grads, opt_state, params, loss_fn=lambda p: loss_of(p, state), value=loss_value
    )
    params = eqx.apply_updates(params, updates)
    return params, pmean_floats(new_state, "data"), opt_state

  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  return optax_gsam.data_parallel(per_device_step, mesh, axis_name="data", batch_argnums=(3, 4))


def test_data_parallel_step_at_tiny_rho_is_the_plain_data_parallel_step():
  model, state0 = eqx.nn.make_with_state(Net)(jax.random.key(3), mode="batch")
  params0, static = eqx.partition(model, eqx.is_inexact_array)
  x, y = data(n=32)
  results, first_states = {}, {}
  for name, tx, average in [
    ("plain", SGD, True),
    ("gsam", optax.chain(optax_gsam.gsam(RHO_TINY, 0.3, axis_name="data"), optax.sgd(LR)), False),
  ]:
    step = data_parallel_step(tx, static, average)
    params, state, opt_state = params0, state0, tx.init(params0)
    for i in range(2):
      params, state, opt_state = step(params, state, opt_state, x, y, jax.random.key(i))
      first_states.setdefault(name, state)
    results[name] = (params, state)
  assert max_diff(results["gsam"][0], results["plain"][0]) < 1e-5
  assert max_diff(state_arrays(results["gsam"][1]), state_arrays(results["plain"][1])) < 1e-6
  # The first step's state is the average of the two devices' clean-pass states, not device 0's.
  per_device = [
    eqx.filter_jit(loss)(
      model, state0, x[16 * d : 16 * (d + 1)], y[16 * d : 16 * (d + 1)],
      jax.random.fold_in(jax.random.key(0), d),
    )[1]
    for d in range(2)
  ]  # fmt: skip
  average = [(a + b) / 2 for a, b in zip(*map(state_arrays, per_device), strict=True)]
  assert max_diff(state_arrays(first_states["gsam"]), average) < 1e-6
  assert max_diff(state_arrays(per_device[0]), average) > 1e-4


# --- the gradient cache with two Equinox towers ----------------------------------------------


def test_two_tower_gradient_cache_step_equals_gsam_with_the_full_batch_loss():
  k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
  towers = {
    "image": eqx.nn.MLP(6, 4, width_size=8, depth=1, key=k1),
    "text": eqx.nn.MLP(5, 4, width_size=8, depth=1, key=k2),
    "t": jnp.float32(2.0),
  }
  params, static = eqx.partition(towers, eqx.is_inexact_array)
  batch = {"image": jax.random.normal(k3, (10, 6)), "text": jax.random.normal(k4, (10, 5))}

  def embed_fn(params, chunk):
    model = eqx.combine(params, static)
    return {name: jax.vmap(model[name])(chunk[name]) for name in ("image", "text")}

  def clip_of(params, reps):
    return optax_gsam.clip_loss(reps["image"], reps["text"], params["t"])

  cached = optax_gsam.cached_value_and_grad(embed_fn, clip_of, chunk_size=5)
  full_loss = lambda p: clip_of(p, embed_fn(p, batch))
  tx = optax_gsam.gsam(0.1, 0.3)

  @jax.jit
  def both(params):
    grads = jax.grad(full_loss)(params)
    cached_out, _ = tx.update(
      grads, tx.init(params), params, value_and_grad_fn=lambda p: cached(p, batch)
    )
    full_out, _ = tx.update(grads, tx.init(params), params, loss_fn=full_loss)
    return cached_out, full_out

  cached_out, full_out = both(params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), cached_out, full_out
  )
