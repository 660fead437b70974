"""What a micro-batched step carries: a PRNG key per micro-batch, and model state.

Each against a reference written here from the formulas: the k micro-batches
applied in sequence (the clean pass's state passing from one to the next, the
perturbed pass starting again from the step's input state), SAM's

  eps = rho g_c / ||g_c||,   w <- w - lr * mean_i grad f_i(w + eps),

and, for dropout, micro-batch i's key fold_in(key, i) in both passes. The
BatchNorm models of Flax Linen, Flax NNX, Haiku and Equinox are tiny.
"""

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_gsam
from optax_gsam.flax import nnx_microbatch_loss_fn

RHO, LR, K = 0.05, 0.1, 4


def split(batch, k=K):
  size = jax.tree.leaves(batch)[0].shape[0] // k
  return [jax.tree.map(lambda a, i=i: a[i * size : (i + 1) * size], batch) for i in range(k)]


def tree_norm(tree):
  return jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(tree)))


def reference_sam_step(loss, params, state, batch, keys=None):
  """SAM on the whole batch with ``loss(params, state, microbatch[, key]) -> (f_i, s_i)``
  applied to the micro-batches in sequence; returns the new params and the clean pass's s_k."""
  pieces = split(batch)
  args = [(b,) if keys is None else (b, keys[i]) for i, b in enumerate(pieces)]

  def pass_at(w, s):
    grads = []
    for a in args:
      g, s = jax.grad(loss, has_aux=True)(w, s, *a)
      grads.append(g)
    return jax.tree.map(lambda *g: sum(g) / len(g), *grads), s

  clean, new_state = pass_at(params, state)
  scale = RHO / tree_norm(clean)
  perturbed, _ = pass_at(jax.tree.map(lambda w, g: w + scale * g, params, clean), state)
  return jax.tree.map(lambda w, g: w - LR * g, params, perturbed), new_state


def package_step(loss, params, state, batch, key=None):
  tx = optax.chain(optax_gsam.sam(RHO, microbatches=K), optax.sgd(LR))
  extra = dict(model_state=state, key=key)
  (_, new_state), grads = optax_gsam.accumulate_value_and_grad(
    loss, params, batch, microbatches=K, **extra
  )
  updates, _ = tx.update(grads, tx.init(params), params, loss_fn=loss, batch=batch, **extra)
  return optax.apply_updates(params, updates), new_state


def as_numbers(x):
  return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def assert_trees_close(actual, expected, rtol):
  leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
  for a, e in ((as_numbers(a), as_numbers(e)) for a, e in leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=rtol * 1e-2)


def test_state_passes_through_the_microbatches_in_sequence():
  """A state that the loss reads and updates from the params: each clean micro-batch reads the
  state left by the previous one, the perturbed pass starts again from the input state."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=3)), "b": jnp.asarray(0.3)}
    batch = (jnp.asarray(rng.normal(size=(16, 3))), jnp.asarray(rng.normal(size=16)))

    def loss(p, s, microbatch):
      x, y = microbatch
      z = x @ p["w"] + p["b"]
      new = {"mean": 0.9 * s["mean"] + 0.1 * jnp.mean(z), "count": s["count"] + 1}
      return jnp.mean((z - y) ** 2) * (1.0 + s["mean"] ** 2), new

    state = {"mean": jnp.asarray(0.5), "count": jnp.asarray(0)}
    p, s = params, state
    expected_p, expected_s = params, state
    for _ in range(2):
      p, s = jax.jit(package_step, static_argnums=0)(loss, p, s, batch)
      expected_p, expected_s = reference_sam_step(loss, expected_p, expected_s, batch)
    assert_trees_close(p, expected_p, 1e-12)
    assert_trees_close(s, expected_s, 1e-12)
    assert int(s["count"]) == 2 * K


def dropout_loss(p, microbatch, key):
  x, y = microbatch
  mask = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.mean((jnp.where(mask, 2 * x, 0.0) @ p["w"] - y) ** 2)


@pytest.mark.parametrize("per_microbatch", [False, True], ids=["whole-batch", "per-microbatch"])
def test_each_microbatch_draws_its_own_key_in_both_passes(per_microbatch):
  with jax.enable_x64(True):
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=3))}
    batch = (jnp.asarray(rng.normal(size=(16, 3))), jnp.asarray(rng.normal(size=16)))
    key = jax.random.key(7)
    keys = [jax.random.fold_in(key, i) for i in range(K)]
    tx = optax.chain(
      optax_gsam.sam(RHO, microbatches=K, perturb_each_microbatch=per_microbatch), optax.sgd(LR)
    )
    kwargs = dict(loss_fn=dropout_loss, batch=batch, key=key)
    updates, _ = tx.update(None, tx.init(params), params, **kwargs)
    got = optax.apply_updates(params, updates)
    if per_microbatch:  # SAM on each micro-batch with its own key, averaged
      outputs = []
      for b, k in zip(split(batch), keys, strict=True):
        g = jax.grad(dropout_loss)(params, b, k)
        w = jax.tree.map(lambda w, g: w + RHO / tree_norm(g) * g, params, g)
        outputs.append(jax.grad(dropout_loss)(w, b, k))
      mean = jax.tree.map(lambda *g: sum(g) / K, *outputs)
      expected = jax.tree.map(lambda w, g: w - LR * g, params, mean)
    else:
      stateless = lambda p, s, b, k: (dropout_loss(p, b, k), s)
      expected, _ = reference_sam_step(stateless, params, {}, batch, keys)
    assert_trees_close(got, expected, 1e-12)


def test_dropout_masks_differ_across_microbatches_and_agree_between_passes():
  seen = []

  def loss(p, microbatch, key):
    mask = jax.random.bernoulli(key, 0.5, microbatch.shape)
    jax.debug.callback(lambda w, m: seen.append((float(w), np.asarray(m))), p[0], mask)
    return jnp.mean((jnp.where(mask, microbatch, 0.0) * p) ** 2)

  params, batch = jnp.ones(6), jnp.arange(48.0).reshape(8, 6) / 48
  tx = optax_gsam.sam(RHO, microbatches=K)
  jax.jit(
    lambda p: tx.update(None, tx.init(p), p, loss_fn=loss, batch=batch, key=jax.random.key(3))
  )(params)
  jax.effects_barrier()
  clean = [m for w, m in seen if w == 1.0]
  perturbed = [m for w, m in seen if w != 1.0]
  assert len(clean) == len(perturbed) == K
  distinct = {m.tobytes() for m in clean}
  assert len(distinct) == K  # every micro-batch its own mask
  assert distinct == {m.tobytes() for m in perturbed}  # the same masks in the perturbed pass


def regression_batch(seed, n=16, d=3):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  return jnp.asarray(x), jnp.asarray((x @ np.ones(d) > 0).astype(np.float32))


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    h = nn.BatchNorm(use_running_average=not train, momentum=0.8)(nn.Dense(4)(x))
    h = nn.Dropout(0.3, deterministic=not train)(nn.relu(h))
    return nn.Dense(1)(h)[:, 0]


def test_flax_linen_batch_norm_and_dropout_match_the_sequence_of_microbatches():
  batch = regression_batch(2)
  model = LinenNet()
  variables = model.init(jax.random.key(0), batch[0], train=False)

  def loss(params, batch_stats, microbatch, key):
    x, y = microbatch
    out, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      mutable=["batch_stats"],
      rngs={"dropout": key},
    )
    return jnp.mean((out - y) ** 2), updates["batch_stats"]

  key = jax.random.key(5)
  keys = [jax.random.fold_in(key, i) for i in range(K)]
  got = jax.jit(package_step, static_argnums=0)(
    loss, variables["params"], variables["batch_stats"], batch, key
  )
  expected = reference_sam_step(loss, variables["params"], variables["batch_stats"], batch, keys)
  assert_trees_close(got, expected, 1e-5)
  whole_batch_stats = model.apply(
    variables, batch[0], mutable=["batch_stats"], rngs={"dropout": key}
  )
  assert not np.allclose(  # ghost batch norm: not the whole batch's statistics
    jax.tree.leaves(got[1])[0], jax.tree.leaves(whole_batch_stats[1]["batch_stats"])[0]
  )


def test_haiku_batch_norm_matches_the_sequence_of_microbatches():
  def forward(x):
    h = hk.BatchNorm(True, True, 0.8)(hk.Linear(4)(x), is_training=True)
    return hk.Linear(1)(jax.nn.relu(h))[:, 0]

  net = hk.without_apply_rng(hk.transform_with_state(forward))
  batch = regression_batch(3)
  params, state = net.init(jax.random.key(0), batch[0])

  def loss(params, state, microbatch):
    out, state = net.apply(params, state, microbatch[0])
    return jnp.mean((out - microbatch[1]) ** 2), state

  got = jax.jit(package_step, static_argnums=0)(loss, params, state, batch)
  assert_trees_close(got, reference_sam_step(loss, params, state, batch), 1e-5)


class EqxNet(eqx.Module):
  first: eqx.nn.Linear
  norm: eqx.nn.BatchNorm
  last: eqx.nn.Linear

  def __init__(self, key):
    a, b = jax.random.split(key)
    self.first = eqx.nn.Linear(3, 4, key=a)
    self.norm = eqx.nn.BatchNorm(4, axis_name="batch", momentum=0.8, mode="ema")
    self.last = eqx.nn.Linear(4, 1, key=b)

  def __call__(self, x, state):
    h, state = self.norm(self.first(x), state)
    return self.last(jax.nn.relu(h))[0], state


def test_equinox_batch_norm_matches_the_sequence_of_microbatches():
  model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  batch = regression_batch(4)

  def loss(params, state, microbatch):
    net = eqx.combine(params, static)
    batched = jax.vmap(net, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    out, state = batched(microbatch[0], state)
    return jnp.mean((out - microbatch[1]) ** 2), state

  got = eqx.filter_jit(package_step)(loss, params, state, batch)
  assert_trees_close(got, reference_sam_step(loss, params, state, batch), 1e-5)


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.first = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)
    self.last = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    return self.last(self.drop(nnx.relu(self.norm(self.first(x)))))[:, 0]


def nnx_loss(model, microbatch):
  return jnp.mean((model(microbatch[0]) - microbatch[1]) ** 2)


def test_flax_nnx_optimizer_route_matches_the_sequence_of_microbatches():
  batch = regression_batch(5)
  model = NnxNet(nnx.Rngs(0, dropout=1))
  reference = nnx.clone(model)
  tx = optax.chain(optax_gsam.sam(RHO, microbatches=K), optax.sgd(LR))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    f, params, model_state = nnx_microbatch_loss_fn(nnx_loss, model)
    (loss, new_state), grads = optax_gsam.accumulate_value_and_grad(
      f, params, batch, microbatches=K, model_state=model_state
    )
    optimizer.update(model, grads, loss_fn=f, batch=batch, model_state=model_state, value=loss)
    nnx.update(model, new_state)

  train_step(model, optimizer, batch)

  # The reference: nnx.value_and_grad on each micro-batch in sequence (k small clean passes),
  # then the perturbed pass from a copy of the step's input model.
  start = nnx.clone(reference)
  clean = [nnx.as_pure(nnx.grad(nnx_loss)(reference, b)) for b in split(batch)]
  g_c = jax.tree.map(lambda *g: sum(g) / K, *clean)
  w = nnx.as_pure(nnx.state(start, nnx.Param))  # arrays: the update below leaves them
  scale = RHO / tree_norm(g_c)
  nnx.update(start, jax.tree.map(lambda w, g: w + scale * g, w, g_c))
  perturbed = [nnx.as_pure(nnx.grad(nnx_loss)(start, b)) for b in split(batch)]
  g_p = jax.tree.map(lambda *g: sum(g) / K, *perturbed)
  nnx.update(reference, jax.tree.map(lambda w, g: w - LR * g, w, g_p))
  assert_trees_close(nnx.state(model), nnx.state(reference), 1e-5)


def test_nnx_optimizer_update_with_none_names_the_route():
  model = NnxNet(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(
    model, optax.chain(optax_gsam.sam(RHO, microbatches=K), optax.sgd(LR)), wrt=nnx.Param
  )
  loss_fn = optax_gsam.flax.nnx_loss_fn(lambda m, b: nnx_loss(m, b), model)
  with pytest.raises(ValueError, match="nnx_microbatch_loss_fn"):
    optimizer.update(model, None, loss_fn=loss_fn, batch=regression_batch(6))


def test_model_state_errors_name_the_fix():
  params = {"w": jnp.ones(3)}
  batch = regression_batch(7)
  loss = lambda p, s, b: (jnp.mean((b[0] @ p["w"] - b[1]) ** 2), s)
  tx = optax_gsam.sam(RHO, microbatches=K)
  state = {"m": jnp.zeros(())}
  with pytest.raises(ValueError, match="accumulate_value_and_grad"):
    tx.update(None, tx.init(params), params, loss_fn=loss, batch=batch, model_state=state)
  per = optax_gsam.sam(RHO, microbatches=K, perturb_each_microbatch=True)
  with pytest.raises(ValueError, match="perturb_each_microbatch"):
    per.update(params, per.init(params), params, loss_fn=loss, batch=batch, model_state=state)
  plain = optax_gsam.sam(RHO)
  with pytest.raises(ValueError, match=r"key=.*microbatches=k"):
    plain.update(params, plain.init(params), params, loss_fn=loss, key=jax.random.key(0))
  wrong = lambda p, s, b: (jnp.mean((b[0] @ p["w"] - b[1]) ** 2), {"n": s["m"]})
  with pytest.raises(ValueError, match="new_model_state of model_state's"):
    optax_gsam.accumulate_value_and_grad(wrong, params, batch, microbatches=K, model_state=state)
  with pytest.raises(ValueError, match=r"loss_fn\(params, model_state, microbatch\)"):
    optax_gsam.accumulate_value_and_grad(
      lambda p, b: loss(p, None, b), params, batch, microbatches=K, model_state=state
    )


def test_momentum_sam_gives_each_microbatch_its_own_key():
  with jax.enable_x64(True):
    rng = np.random.default_rng(8)
    params = {"w": jnp.asarray(rng.normal(size=3))}
    batch = (jnp.asarray(rng.normal(size=(16, 3))), jnp.asarray(rng.normal(size=16)))
    key = jax.random.key(9)
    tx = optax_gsam.momentum_sam(RHO, microbatches=K)
    out, _ = tx.update(None, tx.init(params), params, loss_fn=dropout_loss, batch=batch, key=key)
    # The first step has no momentum: the gradient at w, micro-batch i with fold_in(key, i).
    grads = [
      jax.grad(dropout_loss)(params, b, jax.random.fold_in(key, i))
      for i, b in enumerate(split(batch))
    ]
    assert_trees_close(out, jax.tree.map(lambda *g: sum(g) / K, *grads), 1e-12)
    with pytest.raises(ValueError, match="momentum_sam does not read model_state"):
      tx.update(None, tx.init(params), params, loss_fn=dropout_loss, batch=batch, model_state={})
