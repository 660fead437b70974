"""Sharded parameters under ``jax.jit``: FSDP, tensor parallelism and both, in Auto and Explicit axes.

Each case trains a two-layer MLP for three steps with its parameters sharded
over a mesh of the 8 simulated CPU devices, in float64, and compares the
parameters and the optimizer state with the same transform run unsharded on
one device. The transforms' maths is tested against references written from
the formulas elsewhere; what these cases check is that sharding changes
nothing: every option runs in both axis modes, the numbers agree to rounding,
and no parameter-sized buffer of the state or the updates is replicated.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam

BATCH, D_IN, HIDDEN, D_OUT = 32, 16, 32, 8
STEPS = 3

# name -> (mesh shape, axis names, params' specs, the specs the model computes with, batch spec).
# FSDP gathers each weight before use; tensor parallelism keeps the hidden axis sharded.
LAYOUTS = {
  "fsdp": (
    (8,),
    ("data",),
    {"w1": P("data", None), "b1": P("data"), "w2": P("data", None), "b2": P("data")},
    {"w1": P(None, None), "b1": P(None), "w2": P(None, None), "b2": P(None)},
    P("data", None),
  ),
  "tensor": (
    (8,),
    ("model",),
    {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(None)},
    {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(None)},
    P(None, None),
  ),
  "fsdp+tensor": (
    (2, 4),
    ("data", "model"),
    {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P(None)},
    {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(None)},
    P("data", None),
  ),
}


def make_data():
  rng = np.random.default_rng(0)
  params = {
    "w1": rng.normal(size=(D_IN, HIDDEN)) * 0.4,
    "b1": rng.normal(size=(HIDDEN,)) * 0.1,
    "w2": rng.normal(size=(HIDDEN, D_OUT)) * 0.4,
    "b2": rng.normal(size=(D_OUT,)) * 0.1,
  }
  batch = (rng.normal(size=(BATCH, D_IN)), rng.normal(size=(BATCH, D_OUT)))
  return params, batch


def mlp_loss(params, batch, layout):
  """A smooth loss; ``layout`` places the weights and activations (or leaves them be)."""
  p = {name: layout.place(value, name) for name, value in params.items()}
  x, target = batch
  hidden = layout.place(jnp.tanh(x @ p["w1"] + p["b1"]), "hidden")
  out = layout.matmul(hidden, p["w2"], "out") + p["b2"]
  return jnp.mean(jnp.logaddexp(0.0, out) * target) + 0.01 * jnp.sum(p["w1"] ** 4)


class Unsharded:
  place = staticmethod(lambda x, name: x)
  matmul = staticmethod(lambda a, b, name: a @ b)


class Layout:
  """A model's layout as the users of each axis mode write it: explicit axes reshard where the
  layout changes and name the output of a contraction over a sharded axis; Auto axes constrain."""

  def __init__(self, layout, mode):
    _, _, _, compute, batch_spec = LAYOUTS[layout]
    hidden = P(batch_spec[0], compute["w1"][1])
    self.specs = {**compute, "hidden": hidden, "out": P(batch_spec[0], None)}
    self.explicit = mode == AxisType.Explicit

  def place(self, x, name):
    if self.explicit:
      return jax.sharding.reshard(x, self.specs[name])
    return jax.lax.with_sharding_constraint(x, self.specs[name])

  def matmul(self, a, b, name):
    if self.explicit:
      return jnp.matmul(a, b, out_sharding=self.specs[name])
    return self.place(a @ b, name)


# name -> (transform factory, whether update takes batch= (micro-batches) instead of a gradient).
CASES = {
  "gsam": (lambda: optax_gsam.gsam(0.1, 0.3), False),
  "sam": (lambda: optax_gsam.sam(0.1), False),
  "gsam minimize_fp=False": (lambda: optax_gsam.gsam(0.1, 0.3, minimize_fp=False), False),
  "every_k": (lambda: optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(2)), False),
  "gradient_norm_policy": (
    lambda: optax_gsam.sam(0.1, policy=optax_gsam.gradient_norm_policy(decay=0.5)),
    False,
  ),
  "random_policy": (
    lambda: optax_gsam.sam(0.1, policy=optax_gsam.random_policy(0.5, key=jax.random.key(3))),
    False,
  ),
  "adaptive gsam": (
    lambda: optax_gsam.gsam(0.1, 0.3, ascent=optax_gsam.adaptive_ascent("gsam")),
    False,
  ),
  "asam": (lambda: optax_gsam.sam(0.1, ascent=optax_gsam.adaptive_ascent("asam")), False),
  "friendly": (lambda: optax_gsam.sam(0.1, ascent=optax_gsam.friendly_ascent(1.0, 0.9)), False),
  "vasso": (lambda: optax_gsam.gsam(0.1, 0.3, ascent=optax_gsam.vasso_ascent(0.4)), False),
  "ascent_steps=2": (lambda: optax_gsam.gsam(0.1, 0.3, ascent_steps=2), False),
  "mask": (
    lambda: optax_gsam.sam(0.1, mask={"w1": True, "b1": False, "w2": True, "b2": False}),
    False,
  ),
  "on_nonfinite=clean": (lambda: optax_gsam.gsam(0.1, 0.3, on_nonfinite="clean"), False),
  "microbatches": (lambda: optax_gsam.gsam(0.1, 0.3, microbatches=4), True),
  "perturb_each_microbatch": (
    lambda: optax_gsam.gsam(0.1, 0.3, microbatches=4, perturb_each_microbatch=True),
    True,
  ),
  "sam microbatches diagnostics=False": (
    lambda: optax_gsam.sam(0.1, microbatches=4, diagnostics=False),
    True,
  ),
  "momentum_sam": (lambda: optax_gsam.momentum_sam(0.1, 0.9), False),
  "momentum_sam microbatches": (lambda: optax_gsam.momentum_sam(0.1, 0.9, microbatches=4), True),
}


def train(make_tx, takes_batch, params, batch, layout):
  """Three jitted steps; returns the final params, the optimizer state and the last updates."""
  tx = optax.chain(make_tx(), optax.sgd(0.05))
  loss_fn = functools.partial(mlp_loss, layout=layout)

  @jax.jit
  def step(params, opt_state, batch):
    if takes_batch:
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss_fn, batch=batch)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      closed = lambda p: loss_fn(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=closed, value=loss)
    return optax.apply_updates(params, updates), opt_state, updates

  opt_state = tx.init(params)
  for _ in range(STEPS):
    params, opt_state, updates = step(params, opt_state, batch)
  return params, opt_state, updates


@functools.cache
def unsharded_run(case):
  """The case on one device, in float64 (computed once for every layout and mode)."""
  make_tx, takes_batch = CASES[case]
  with jax.enable_x64(True):
    params, batch = make_data()
    return jax.device_get(train(make_tx, takes_batch, params, batch, Unsharded))


def sharded_run(make_tx, takes_batch, layout, mode):
  shape, names, param_specs, _, batch_spec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(mode,) * len(names))
  params, batch = make_data()
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(v, NamedSharding(mesh, param_specs[k])) for k, v in params.items()}
    batch = (
      jax.device_put(batch[0], NamedSharding(mesh, batch_spec)),
      jax.device_put(batch[1], NamedSharding(mesh, batch_spec)),
    )
    return train(make_tx, takes_batch, params, batch, Layout(layout, mode)), params


def assert_no_replicated_params_buffer(tree, params):
  """Every leaf of ``tree`` as large as a sharded parameter is sharded too."""
  leaves = jax.tree.leaves(params)
  replicated = {int(np.size(p)) for p in leaves if p.sharding.is_fully_replicated}
  sizes = {int(np.size(p)) for p in leaves} - replicated
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if np.size(leaf) in sizes and np.size(leaf) > 1:
      assert not leaf.sharding.is_fully_replicated, (
        f"{jax.tree_util.keystr(path)} of shape {leaf.shape} is replicated: {leaf.sharding}"
      )


def assert_close(actual, expected, what):
  for path, a, e in zip(
    [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]],
    jax.tree.leaves(actual),
    jax.tree.leaves(expected),
    strict=True,
  ):
    a, e = np.asarray(a), np.asarray(e)
    if np.issubdtype(e.dtype, np.inexact):
      np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12, err_msg=f"{what}{path}")
    elif not jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      np.testing.assert_array_equal(a, e, err_msg=f"{what}{path}")


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_option_on_a_fsdp_and_tensor_parallel_mesh(case, mode):
  make_tx, takes_batch = CASES[case]
  expected = unsharded_run(case)
  with jax.enable_x64(True):
    actual, sharded_params = sharded_run(make_tx, takes_batch, "fsdp+tensor", mode)
  for name, a, e in zip(("params", "opt_state", "updates"), actual, expected, strict=True):
    assert_close(a, e, name)
  final_params, opt_state, updates = actual
  for name, spec_of in (("params", final_params), ("updates", updates)):
    for key, leaf in spec_of.items():
      expected_sharding = sharded_params[key].sharding
      assert leaf.sharding.is_equivalent_to(expected_sharding, leaf.ndim), (name, key)
  assert_no_replicated_params_buffer((opt_state, updates), sharded_params)


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("layout", ["fsdp", "tensor"])
@pytest.mark.parametrize("case", ["every_k", "microbatches"])
def test_fsdp_alone_and_tensor_parallelism_alone(case, layout, mode):
  make_tx, takes_batch = CASES[case]
  expected = unsharded_run(case)
  with jax.enable_x64(True):
    actual, sharded_params = sharded_run(make_tx, takes_batch, layout, mode)
  for name, a, e in zip(("params", "opt_state", "updates"), actual, expected, strict=True):
    assert_close(a, e, name)
  assert_no_replicated_params_buffer(actual[1:], sharded_params)


# Perturbation groups on a replica x fsdp mesh (HSDP): a linear model whose weights are sharded
# over "fsdp", perturbed separately per replica group and synchronized within each group.
GROUP_RHO, GROUP_ALPHA, GROUP_LR, GROUP_STEPS = 0.1, 0.3, 0.1, 2


def group_reference(w, b, x, t, num_groups, sync):
  """GSAM per group from the formulas (numpy float64): the mean of the groups' gradients."""

  def grad(vec, xs, ts):
    z = xs @ vec[: w.size].reshape(w.shape) + vec[w.size :]
    s = ts / (1.0 + np.exp(-z)) / z.size
    return np.concatenate([(xs.T @ s).ravel(), s.sum(axis=0)])

  def gsam(g_c, g_p):
    return g_p - GROUP_ALPHA * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)

  vec = np.concatenate([w.ravel(), b])
  groups = list(zip(np.split(x, num_groups), np.split(t, num_groups), strict=True))
  for _ in range(GROUP_STEPS):
    clean = [grad(vec, xs, ts) for xs, ts in groups]
    if sync:
      g_c = np.mean(clean, axis=0)
      g_p = np.mean([grad(vec + GROUP_RHO * g_c / np.linalg.norm(g_c), *g) for g in groups], 0)
      direction = gsam(g_c, g_p)
    else:
      perturbed = [
        grad(vec + GROUP_RHO * g_c / np.linalg.norm(g_c), *g)
        for g_c, g in zip(clean, groups, strict=True)
      ]
      direction = np.mean([gsam(c, p) for c, p in zip(clean, perturbed, strict=True)], axis=0)
    vec = vec - GROUP_LR * direction
  return vec[: w.size].reshape(w.shape), vec[w.size :]


@pytest.mark.parametrize("sync", [False, True], ids=["per-group", "synchronized"])
@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_perturbation_groups_over_the_replica_axis_of_an_hsdp_mesh(mode, sync):
  rng = np.random.default_rng(1)
  w, b = rng.normal(size=(16, 8)) * 0.5, rng.normal(size=(8,)) * 0.1
  x, t = rng.normal(size=(32, 16)), rng.normal(size=(32, 8))
  mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(mode, mode))
  tx = optax.chain(
    optax_gsam.gsam(GROUP_RHO, GROUP_ALPHA, axis_name="replica", sync_perturbation=sync),
    optax.sgd(GROUP_LR),
  )
  gather = (lambda v: jax.sharding.reshard(v, P())) if mode == AxisType.Explicit else (lambda v: v)

  def loss_fn(params, x, t):  # one replica's batch; FSDP gathers the weights before use
    z = x @ gather(params["w"]) + gather(params["b"])
    return jnp.mean(jnp.logaddexp(0.0, z) * t)

  def step(params, opt_state, x, t):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, t)
    closed = lambda p: loss_fn(p, x, t)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=closed, value=loss)
    return optax.apply_updates(params, updates), opt_state

  train_step = optax_gsam.data_parallel(step, mesh, axis_name="replica", batch_argnums=(2, 3))
  with jax.enable_x64(True), jax.set_mesh(mesh):
    fsdp = {"w": P("fsdp", None), "b": P("fsdp")}
    params = {
      k: jax.device_put(v, NamedSharding(mesh, fsdp[k])) for k, v in {"w": w, "b": b}.items()
    }
    rows = NamedSharding(mesh, P(("replica", "fsdp"), None))
    x_sharded, t_sharded = jax.device_put(x, rows), jax.device_put(t, rows)
    opt_state = tx.init(params)
    for _ in range(GROUP_STEPS):
      params, opt_state = train_step(params, opt_state, x_sharded, t_sharded)
  expected_w, expected_b = group_reference(w, b, x, t, num_groups=2, sync=sync)
  np.testing.assert_allclose(params["w"], expected_w, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(params["b"], expected_b, rtol=1e-12, atol=1e-13)
  assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, fsdp["w"]), 2)
  if not sync:  # the groups' perturbations differ, so this is not the whole batch's GSAM
    whole_w, _ = group_reference(w, b, x, t, num_groups=1, sync=False)
    assert np.abs(np.asarray(params["w"]) - whole_w).max() > 1e-6


def fsdp_linear_problem(mode):
  """A linear model with FSDP weights on an 8-device "data" mesh, its batch, and its loss."""
  rng = np.random.default_rng(2)
  params = {"w": rng.normal(size=(16, 8)) * 0.5, "b": rng.normal(size=(8,)) * 0.1}
  batch = (rng.normal(size=(32, 16)), rng.normal(size=(32, 8)))
  mesh = jax.make_mesh((8,), ("data",), axis_types=(mode,))
  explicit = mode == AxisType.Explicit

  def loss_fn(p, batch, gather=explicit):
    w, b = (jax.sharding.reshard(p[k], P()) for k in "wb") if gather else (p["w"], p["b"])
    return jnp.mean(jnp.logaddexp(0.0, batch[0] @ w + b) * batch[1]) + 0.1 * jnp.sum(w**4)

  return mesh, params, batch, loss_fn


MEASURES = {
  "hessian_eigenvalues": lambda f, p, b: optax_gsam.hessian_eigenvalues(
    f, p, b, jax.random.key(0), k=2
  ),
  "hessian_trace": lambda f, p, b: optax_gsam.hessian_trace(
    f, p, b, jax.random.key(0), num_probes=4
  ),
  "hessian_spectral_density": lambda f, p, b: optax_gsam.hessian_spectral_density(
    f, p, b, jax.random.key(0), num_probes=2, num_iterations=8
  ),
  "m_sharpness": lambda f, p, b: optax_gsam.m_sharpness(f, p, b, rho=0.05),
}


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("measure", list(MEASURES))
def test_sharpness_measures_of_a_sharded_model(measure, mode):
  with jax.enable_x64(True):
    mesh, params, batch, loss_fn = fsdp_linear_problem(mode)
    expected = MEASURES[measure](functools.partial(loss_fn, gather=False), params, batch)
    with jax.set_mesh(mesh):
      fsdp = {"w": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P("data"))}
      rows = NamedSharding(mesh, P("data", None))
      params, batch = jax.device_put(params, fsdp), jax.device_put(batch, rows)
      actual = jax.jit(functools.partial(MEASURES[measure], loss_fn))(params, batch)
  assert_close(actual, expected, measure)


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_gsam_with_the_gradient_cache_on_sharded_params(mode):
  """The cached gradient of a contrastive loss drives GSAM's two passes, params sharded."""
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.05))

  def run(params, x, gather):
    place = (lambda v: jax.sharding.reshard(v, P())) if gather else (lambda v: v)
    embed = lambda p, chunk: jnp.tanh(chunk @ place(p["w"]))
    contrastive = lambda p, r: jnp.mean(jax.nn.logsumexp(p["s"] * place(r) @ place(r).T, axis=1))
    value_and_grad = optax_gsam.cached_value_and_grad(embed, contrastive, chunk_size=8)

    @jax.jit
    def step(params, opt_state):
      loss, grads = value_and_grad(params, x)
      fn = lambda p: value_and_grad(p, x)
      updates, opt_state = tx.update(grads, opt_state, params, value_and_grad_fn=fn, value=loss)
      return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(2):
      params, opt_state = step(params, opt_state)
    return params, opt_state

  rng = np.random.default_rng(3)
  params = {"w": rng.normal(size=(16, 8)) * 0.3, "s": np.float64(2.0)}
  x = rng.normal(size=(32, 16))
  with jax.enable_x64(True):
    expected = run(params, x, gather=False)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(mode,))
    with jax.set_mesh(mesh):
      sharded = {"w": NamedSharding(mesh, P("data", None)), "s": NamedSharding(mesh, P())}
      params = jax.device_put(params, sharded)
      x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
      actual = run(params, x, gather=mode == AxisType.Explicit)
  assert_close(actual, expected, "gradient cache")
  assert actual[0]["w"].sharding.is_equivalent_to(sharded["w"], 2)
  assert_no_replicated_params_buffer(actual[1], params)


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_microbatches_with_model_state_and_keys_on_sharded_params(mode):
  """A running mean of the hidden units (as BatchNorm keeps) and a dropout key per micro-batch,
  through 4 micro-batches of a sharded step: the same params, state and updates as unsharded."""
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, microbatches=4), optax.sgd(0.05))

  def run(params, batch, layout):
    def loss_fn(p, stats, microbatch, key):
      p = {name: layout.place(value, name) for name, value in p.items()}
      x, target = microbatch
      hidden = layout.place(jnp.tanh(x @ p["w1"] + p["b1"]), "hidden")
      keep = jax.random.bernoulli(key, 0.8, hidden.shape)
      centred = jnp.where(keep, hidden - stats, 0.0) / 0.8
      out = layout.matmul(centred, p["w2"], "out") + p["b2"]
      new_stats = 0.9 * stats + 0.1 * jnp.mean(jax.lax.stop_gradient(hidden), axis=0)
      return jnp.mean(jnp.logaddexp(0.0, out) * target), new_stats

    @jax.jit
    def step(params, opt_state, stats, key):
      args = dict(microbatches=4, model_state=stats, key=key)
      (loss, new_stats), grads = optax_gsam.accumulate_value_and_grad(
        loss_fn, params, batch, **args
      )
      updates, opt_state = tx.update(
        grads, opt_state, params, loss_fn=loss_fn, batch=batch, model_state=stats, key=key,
        value=loss,
      )  # fmt: skip
      return optax.apply_updates(params, updates), opt_state, new_stats

    opt_state, stats = tx.init(params), jnp.zeros(HIDDEN)
    for i in range(2):
      params, opt_state, stats = step(params, opt_state, stats, jax.random.key(i))
    return params, opt_state, stats

  with jax.enable_x64(True):
    params, batch = make_data()
    expected = jax.device_get(run(params, batch, Unsharded))
    shape, names, param_specs, _, batch_spec = LAYOUTS["fsdp+tensor"]
    mesh = jax.make_mesh(shape, names, axis_types=(mode,) * len(names))
    with jax.set_mesh(mesh):
      params = {
        k: jax.device_put(v, NamedSharding(mesh, param_specs[k])) for k, v in params.items()
      }
      batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))
      actual = run(params, batch, Layout("fsdp+tensor", mode))
  assert_close(actual, expected, "stateful micro-batches")
  assert_no_replicated_params_buffer(actual[1], params)


@pytest.mark.parametrize("mode", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("case", ["every_k", "friendly", "momentum_sam"])
def test_a_state_kept_replicated_beside_sharded_params_keeps_its_layout(case, mode):
  """The optimizer state built from unsharded params (replicated), the params sharded: the same
  numbers as unsharded, and the state's params-sized buffers stay replicated."""
  make_tx, _ = CASES[case]
  expected = unsharded_run(case)
  shape, names, param_specs, _, batch_spec = LAYOUTS["fsdp+tensor"]
  mesh = jax.make_mesh(shape, names, axis_types=(mode,) * len(names))
  with jax.enable_x64(True), jax.set_mesh(mesh):
    params, batch = make_data()
    replicated = NamedSharding(mesh, P())
    tx = optax.chain(make_tx(), optax.sgd(0.05))
    opt_state = jax.device_put(tx.init(params), replicated)
    params = {k: jax.device_put(v, NamedSharding(mesh, param_specs[k])) for k, v in params.items()}
    batch = jax.device_put(batch, NamedSharding(mesh, batch_spec))
    loss_fn = functools.partial(mlp_loss, layout=Layout("fsdp+tensor", mode))

    @jax.jit
    def step(params, opt_state):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      closed = lambda p: loss_fn(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=closed, value=loss)
      return optax.apply_updates(params, updates), opt_state, updates

    for _ in range(STEPS):
      params, opt_state, updates = step(params, opt_state)
  assert_close((params, opt_state, updates), expected, case)
  if mode == AxisType.Explicit:  # Auto axes leave the state's layout to the compiler
    for leaf in jax.tree.leaves(opt_state):
      assert leaf.sharding.is_fully_replicated, leaf.sharding
