"""m-sharpness under data parallelism, on 8 simulated CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import flatten
from _problems import float32_problem
from _problems import unflatten
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import optax_gsam

NUM_DEVICES = 8
PER_DEVICE = 4
RHO, ALPHA, LR = 0.15, 0.4, 0.1


def make_data(seed=0, d=5, k=3):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(NUM_DEVICES * PER_DEVICE, d))
  t = rng.normal(size=(NUM_DEVICES * PER_DEVICE, k))
  params = {"w": rng.normal(size=(d, k)) * 0.7, "b": rng.normal(size=(k,)) * 0.3}
  return params, x, t


def loss_jax(p, x, t):
  z = x @ p["w"] + p["b"]
  return jnp.mean(jnp.logaddexp(0.0, z) * t) + 0.25 * jnp.sum(p["w"] ** 4)


def grad_np(p, x, t):
  z = x @ p["w"] + p["b"]
  s = t / (1.0 + np.exp(-z)) / z.size
  return {"w": x.T @ s + p["w"] ** 3, "b": s.sum(axis=0)}


def reference_direction(w, x, t, like, sync):
  """(G)SAM per shard from the formulas (numpy float64), then the average."""

  def grad(vec, xs, ts):
    return flatten(grad_np(unflatten(vec, like), xs, ts))

  def gsam(g_c, g_p):
    return g_p - ALPHA * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)

  shards = [(x[i * PER_DEVICE : (i + 1) * PER_DEVICE], t[i * PER_DEVICE : (i + 1) * PER_DEVICE])
            for i in range(NUM_DEVICES)]  # fmt: skip
  clean = [grad(w, xs, ts) for xs, ts in shards]
  if sync:
    g_c = np.mean(clean, axis=0)
    e = RHO * g_c / np.linalg.norm(g_c)
    g_p = np.mean([grad(w + e, xs, ts) for xs, ts in shards], axis=0)
    return gsam(g_c, g_p)
  outs = []
  for g_c, (xs, ts) in zip(clean, shards, strict=True):
    e = RHO * g_c / np.linalg.norm(g_c)
    outs.append(gsam(g_c, grad(w + e, xs, ts)))
  return np.mean(outs, axis=0)


def make_tx(sync, **kwargs):
  return optax.chain(
    optax_gsam.gsam(RHO, ALPHA, axis_name="data", sync_perturbation=sync, **kwargs),
    optax.sgd(LR),
  )


def per_device_step(tx, params, opt_state, batch):
  x, t = batch
  loss_fn = lambda p: loss_jax(p, x, t)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
  return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")


def run_reference(params, x, t, sync, steps):
  w = flatten(params)
  for _ in range(steps):
    w = w - LR * reference_direction(w, x, t, params, sync)
  return w


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() >= NUM_DEVICES
  return jax.make_mesh((NUM_DEVICES,), ("data",))


def _three_steps_against_the_reference(mesh, sync):
  """Three data_parallel steps on ``mesh``, checked against the float64 reference; the params."""
  with jax.enable_x64(True):
    params, x, t = make_data(1)
    tx = make_tx(sync)
    step = optax_gsam.data_parallel(functools.partial(per_device_step, tx), mesh)
    p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
    for _ in range(3):
      p, state, _ = step(p, state, (jnp.asarray(x), jnp.asarray(t)))
    np.testing.assert_allclose(flatten(p), run_reference(params, x, t, sync, 3), rtol=1e-10)
  return p


@pytest.mark.parametrize("sync", [False, True])
def test_shard_map_matches_float64_reference(mesh, sync):
  _three_steps_against_the_reference(mesh, sync)


@pytest.mark.parametrize("sync", [False, True])
def test_classic_mesh_with_auto_axes_matches_float64_reference(sync):
  # Mesh(np.array(devices), names) has Auto axes, which jax.reshard refuses.
  classic = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("data",))
  assert classic.axis_types == (AxisType.Auto,)
  p = _three_steps_against_the_reference(classic, sync)
  assert p["w"].sharding.is_fully_replicated


def test_manual_mesh_axis_is_a_clear_error():
  manual = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("data",), axis_types=(AxisType.Manual,))
  with pytest.raises(ValueError, match="outside any shard_map"):
    optax_gsam.data_parallel(lambda *a: a, manual)


@pytest.mark.parametrize("sync", [False, True])
def test_pmap_matches_float64_reference_and_devices_agree(sync):
  with jax.enable_x64(True):
    params, x, t = make_data(2)
    tx = make_tx(sync)
    step = jax.pmap(functools.partial(per_device_step, tx), axis_name="data")
    replicate = lambda tree: jax.tree.map(lambda a: jnp.stack([jnp.asarray(a)] * NUM_DEVICES), tree)
    p, state = replicate(params), replicate(tx.init(params))
    batch = (x.reshape(NUM_DEVICES, PER_DEVICE, -1), t.reshape(NUM_DEVICES, PER_DEVICE, -1))
    for _ in range(3):
      p, state, _ = step(p, state, batch)
    for leaf in jax.tree.leaves((p, state)):  # Every device ends identical.
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    p0 = jax.tree.map(lambda a: a[0], p)
    np.testing.assert_allclose(flatten(p0), run_reference(params, x, t, sync, 3), rtol=1e-10)


def test_sync_equals_single_device_gsam_on_global_batch(mesh):
  with jax.enable_x64(True):
    params, x, t = make_data(3)
    tx = make_tx(True)
    step = optax_gsam.data_parallel(functools.partial(per_device_step, tx), mesh)
    p, state, _ = step(jax.tree.map(jnp.asarray, params), tx.init(params), (x, t))

    single = optax.chain(optax_gsam.gsam(RHO, ALPHA), optax.sgd(LR))
    loss_fn = lambda q: loss_jax(q, x, t)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, single_state = single.update(
      grads, single.init(params), params, loss_fn=loss_fn, value=loss
    )
    expected = optax.apply_updates(params, updates)
    np.testing.assert_allclose(flatten(p), flatten(expected), rtol=1e-12)
    # Diagnostics are averaged over the axis; in sync mode they are the global ones.
    for name in ("cosine", "clean_grad_norm", "perturbed_grad_norm", "perturbed_loss"):
      assert float(optax.tree.get(state, name)) == pytest.approx(
        float(optax.tree.get(single_state, name)), rel=1e-6
      )


@pytest.mark.parametrize("sync", [False, True])
def test_vmap_emulation_equals_shard_map(mesh, sync):
  params, x, t = make_data(4)
  tx = make_tx(sync)
  step_fn = functools.partial(per_device_step, tx)
  sharded = optax_gsam.data_parallel(step_fn, mesh)
  emulated = jax.jit(optax_gsam.emulate_devices(step_fn, NUM_DEVICES, axis_name="data"))
  a = b = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  sa, sb = tx.init(a), tx.init(b)
  batch = (jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
  for _ in range(3):
    a, sa, _ = sharded(a, sa, batch)
    b, sb, _ = emulated(b, sb, batch)
  jax.tree.map(
    lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-6), (a, sa), (b, sb)
  )


@pytest.mark.parametrize("k", [None, 3])
def test_sequential_groups_equal_per_device_shard_map(mesh, k):
  params, x, t = make_data(5)
  policy = None if k is None else optax_gsam.every_k_policy(k)
  sharded_tx = make_tx(False, policy=policy)
  sharded = optax_gsam.data_parallel(functools.partial(per_device_step, sharded_tx), mesh)
  grouped_tx = optax.chain(
    optax_gsam.gsam(
      RHO, ALPHA, microbatches=NUM_DEVICES, perturb_each_microbatch=True, policy=policy
    ),
    optax.sgd(LR),
  )
  x32, t32 = jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32)
  xg, tg = x32.reshape(NUM_DEVICES, PER_DEVICE, -1), t32.reshape(NUM_DEVICES, PER_DEVICE, -1)

  @jax.jit
  def grouped_step(p, state):
    group_loss = lambda q, g: loss_jax(q, xg[g], tg[g])
    updates, state = grouped_tx.update(optax.tree.zeros_like(p), state, p, loss_fn=group_loss)
    return optax.apply_updates(p, updates), state

  a = b = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  sa, sb = sharded_tx.init(a), grouped_tx.init(b)
  for _ in range(4):
    a, sa, _ = sharded(a, sa, (x32, t32))
    b, sb = grouped_step(b, sb)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-6), a, b)
  # Grouped diagnostics include the surrogate gap, from the per-group clean losses.
  assert float(optax.tree.get(sb, "surrogate_gap")) > 0


def test_per_device_perturbation_differs_from_synchronized(mesh):
  params, x, t = make_data(6)
  outs = []
  for sync in (False, True):
    tx = make_tx(sync)
    step = optax_gsam.data_parallel(functools.partial(per_device_step, tx), mesh)
    p, _, _ = step(jax.tree.map(jnp.asarray, params), tx.init(params), (x, t))
    outs.append(flatten(p))
  assert np.max(np.abs(outs[0] - outs[1])) > 1e-4


def test_unbound_or_wrong_axis_name_is_a_clear_error(mesh):
  params, x, t = make_data(7)
  p = jax.tree.map(jnp.asarray, params)
  loss_fn = lambda q: loss_jax(q, x, t)
  tx = optax_gsam.gsam(RHO, axis_name="data")
  with pytest.raises(ValueError, match="not bound"):
    tx.update(jax.grad(loss_fn)(p), tx.init(p), p, loss_fn=loss_fn)
  wrong = optax.chain(optax_gsam.gsam(RHO, axis_name="batch"), optax.sgd(LR))
  step = optax_gsam.data_parallel(functools.partial(per_device_step, wrong), mesh)
  with pytest.raises(ValueError, match="'batch' is not bound"):
    step(p, wrong.init(p), (x, t))
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    optax_gsam.data_parallel(lambda *a: a, mesh, axis_name="batch")


def test_helper_argument_errors():
  with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh.*got 'cpu'"):
    optax_gsam.data_parallel(lambda *a: a, "cpu", axis_name="data")
  with pytest.raises(ValueError, match="num_devices"):
    optax_gsam.emulate_devices(lambda *a: a, 0)
  with pytest.raises(ValueError, match="not divisible"):
    optax_gsam.emulate_devices(lambda p, s, b: (p, s), 3)(0.0, 0.0, jnp.ones((4, 2)))
  with pytest.raises(ValueError, match=r"perturb_each_microbatch=True.*sync_perturbation"):
    optax_gsam.gsam(
      0.1, microbatches=2, perturb_each_microbatch=True, axis_name="data", sync_perturbation=True
    )
  with pytest.raises(ValueError, match="microbatches"):
    optax_gsam.gsam(0.1, microbatches=0, perturb_each_microbatch=True)


def test_update_under_pmap_without_axis_name_raises_naming_the_axis():
  p, loss_jax = float32_problem(seed=32)
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.1))
  n = jax.local_device_count()

  def wrong_step(p, state):
    grads = jax.lax.pmean(jax.grad(loss_jax)(p), "batch")  # the user's own pmean, as before
    updates, state = tx.update(grads, state, p, loss_fn=loss_jax)
    return optax.apply_updates(p, updates), state

  replicate = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)
  with pytest.raises(ValueError, match=r"mapped axis 'batch'.*axis_name='batch'"):
    jax.pmap(wrong_step, axis_name="batch")(replicate(p), replicate(tx.init(p)))
  mesh = jax.make_mesh((n,), ("data",))
  sharded = jax.shard_map(
    lambda p, s: tx.update(p, s, p, loss_fn=loss_jax), mesh=mesh, in_specs=P(), out_specs=P()
  )
  with pytest.raises(ValueError, match=r"mapped axis 'data'.*check_axis=False"):
    jax.jit(sharded)(p, tx.init(p))
  # Gradients that are global already (a gradient cache with its own axis_name) opt out.
  trusted = optax_gsam.gsam(0.1, 0.3, check_axis=False)
  opted_out = jax.shard_map(
    lambda p, s: trusted.update(p, s, p, loss_fn=loss_jax), mesh=mesh, in_specs=P(), out_specs=P()
  )
  jax.jit(opted_out)(p, trusted.init(p))
  with pytest.raises(ValueError, match="check_axis must be a bool"):
    optax_gsam.sam(0.1, check_axis=None)
  # Plain vmap (no axis name), e.g. over seeds, is not a data axis.
  jax.vmap(lambda q: tx.update(q, tx.init(q), q, loss_fn=loss_jax))(replicate(p))
