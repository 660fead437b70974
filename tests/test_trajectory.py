"""SAF and MESA (Du et al. 2022) against float64 references written here from the paper's formulas.

The references are numpy: the trajectory term KL(softmax(past / tau) || softmax(z / tau)), its
gradient (softmax(z / tau) - p) / tau per example, and a tiny linear softmax model trained with
SGD, whose outputs are recorded per (example, epoch) in a dict (SAF) or read at an EMA of the
weights (MESA). The package's helpers are used only on the side under test.
"""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam

N, D, C = 16, 4, 3  # examples, features, classes
TAU, LAM, LR = 2.0, 0.7, 0.5


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, D))
  y = rng.integers(0, C, size=N)
  w0 = rng.normal(size=(D, C)) * 0.5
  return x, y, w0


def _softmax(z):
  e = np.exp(z - z.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


def _kl_reference(z, t, tau, valid):
  """Mean over valid examples of sum_k p (log p - log q), p = softmax(t/tau), q = softmax(z/tau)."""
  p, q = _softmax(t / tau), _softmax(z / tau)
  kl = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
  return kl[valid].sum() / max(valid.sum(), 1), p, q


def _model(params, x):
  return x @ params["w"] + params["b"]


def _ce(logits, y):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _loss_fn(params, x, y, targets, valid):
  logits = _model(params, x)
  term = optax_gsam.trajectory_loss(logits, targets, temperature=TAU, weight=LAM, where=valid)
  return _ce(logits, y) + term, logits


def _reference_grad(x, y, z, targets, valid):
  """d(CE + lambda tau^2 KL-mean)/dz, numpy float64."""
  dz = _softmax(z)
  dz[np.arange(len(y)), y] -= 1
  dz /= len(y)
  kl, p, q = _kl_reference(z, targets, TAU, valid)
  dz += LAM * TAU**2 * valid[:, None] * (q - p) / TAU / max(valid.sum(), 1)
  ce = -np.mean(np.log(_softmax(z))[np.arange(len(y)), y])
  return dz, ce + LAM * TAU**2 * kl


def _schedule(epochs, per_epoch, batch, seed=1):
  """(epoch, ids) per step: each epoch a random subset of per_epoch examples, shuffled."""
  rng = np.random.default_rng(seed)
  steps = []
  for epoch in range(epochs):
    order = rng.permutation(N)[:per_epoch]
    steps += [(epoch, order[i : i + batch]) for i in range(0, per_epoch, batch)]
  return steps


# ---------------------------------------------------------------------------------------------
# The KL term


@pytest.mark.parametrize(
  "tau, weight, squared, where",
  [
    (1.0, 1.0, True, None),
    (5.0, 0.3, True, [True, False, True, True, False]),
    (2.0, 0.8, False, [False, True, True, True, True]),
    (0.5, 2.0, True, [False] * 5),
  ],
)
def test_trajectory_loss_matches_float64_reference(tau, weight, squared, where):
  rng = np.random.default_rng(3)
  z, t = rng.normal(size=(5, 7)) * 3, rng.normal(size=(5, 7)) * 3
  valid = np.ones(5, bool) if where is None else np.array(where)
  kl, _, _ = _kl_reference(z, t, tau, valid)
  expected = weight * (tau**2 if squared else 1) * kl
  with jax.enable_x64(True):
    got = optax_gsam.trajectory_loss(
      jnp.asarray(z),
      jnp.asarray(t),
      temperature=tau,
      weight=weight,
      temperature_squared=squared,
      where=None if where is None else jnp.asarray(valid),
    )
    target_grad = jax.grad(
      lambda t: optax_gsam.trajectory_loss(jnp.asarray(z), t, temperature=tau)
    )(jnp.asarray(t))
  assert got.dtype == jnp.float64
  np.testing.assert_allclose(float(got), expected, rtol=1e-12, atol=1e-15)
  assert not np.any(np.asarray(target_grad)), "the target must be a constant"


# ---------------------------------------------------------------------------------------------
# SAF over a training trajectory


def _saf_reference(steps, lag, start_epoch):
  x, y, w0 = _data()
  w, b = w0.copy(), np.zeros(C)
  recorded, losses = {}, []
  for epoch, ids in steps:
    z = x[ids] @ w + b
    past = [recorded.get((i, epoch - lag)) for i in ids]
    valid = np.array([t is not None and epoch >= start_epoch for t in past])
    targets = np.stack([np.zeros(C) if t is None else t for t in past])
    dz, loss = _reference_grad(x[ids], y[ids], z, targets, valid)
    losses.append(loss)
    w, b = w - LR * x[ids].T @ dz, b - LR * dz.sum(axis=0)
    recorded.update({(i, epoch): z[k] for k, i in enumerate(ids)})
  return {"w": w, "b": b}, np.array(losses)


def _saf_step(start_epoch):
  def step(params, store, x, y, ids, epoch):
    targets, valid = optax_gsam.saf_targets(store, ids, epoch, start_epoch=start_epoch)
    (loss, logits), grads = jax.value_and_grad(_loss_fn, has_aux=True)(params, x, y, targets, valid)
    params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params, optax_gsam.saf_record(store, ids, logits, epoch), loss

  return jax.jit(step, donate_argnums=(1,))


def _run_saf(step, steps, params, store, dtype=jnp.float64):
  x, y, _ = _data()
  losses = []
  for epoch, ids in steps:
    params, store, loss = step(
      params, store, jnp.asarray(x[ids], dtype), jnp.asarray(y[ids]), jnp.asarray(ids), epoch
    )
    losses.append(float(loss))
  return params, store, np.array(losses)


def test_saf_training_trajectory_matches_float64_reference():
  """5 epochs of 12 of the 16 examples (some unseen in the lagged epoch), lag 2, term from 3."""
  steps = _schedule(epochs=5, per_epoch=12, batch=4)
  expected_params, expected_losses = _saf_reference(steps, lag=2, start_epoch=3)
  with jax.enable_x64(True):
    params = {"w": jnp.asarray(_data()[2]), "b": jnp.zeros(C, jnp.float64)}
    store = optax_gsam.saf_store(N, C, lag_epochs=2, dtype=jnp.float64)
    params, store, losses = _run_saf(_saf_step(3), steps, params, store)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)
  for name in ("w", "b"):
    np.testing.assert_allclose(np.asarray(params[name]), expected_params[name], rtol=1e-12)
  # The term was on at epochs 3 and 4 and the examples seen at 1 and 2 had targets.
  assert not np.allclose(losses, _saf_reference(steps, lag=2, start_epoch=99)[1])


def test_saf_before_the_lag_and_unseen_examples_have_no_target():
  store = optax_gsam.saf_store(N, C, lag_epochs=2)
  ids = jnp.array([0, 1, 2])
  logits = jnp.arange(9.0).reshape(3, 3)
  for epoch in (0, 1):
    targets, valid = optax_gsam.saf_targets(store, ids, epoch)
    assert not valid.any() and not targets.any()
    store = optax_gsam.saf_record(store, ids[:2], logits[:2] + epoch, epoch)
  targets, valid = optax_gsam.saf_targets(store, ids, 2)  # epoch 0's outputs; 2 never seen
  assert valid.tolist() == [True, True, False]
  np.testing.assert_array_equal(targets, jnp.concatenate([logits[:2], jnp.zeros((1, 3))]))
  term = lambda z: optax_gsam.trajectory_loss(z, targets, where=jnp.zeros(3, bool))
  assert float(term(logits)) == 0.0 and not jax.grad(term)(logits).any()
  _, valid = optax_gsam.saf_targets(store, ids, 2, start_epoch=3)  # E_start not reached
  assert not valid.any()


def test_saf_store_is_donated_under_jit():
  step = _saf_step(0)
  x, y, w0 = _data()
  params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.zeros(C)}
  store = optax_gsam.saf_store(N, C, lag_epochs=1)
  ids = jnp.arange(4)
  _, new_store, _ = step(params, store, jnp.asarray(x[:4], jnp.float32), jnp.asarray(y[:4]), ids, 0)
  assert store.outputs.is_deleted() and store.recorded_epoch.is_deleted()
  assert new_store.recorded_epoch[:4, 0].tolist() == [0] * 4


def test_checkpoint_round_trip_resumes_bitwise():
  """SAF's store and MESA's optimizer state through flax.serialization, mid-run."""
  steps = _schedule(epochs=4, per_epoch=12, batch=4, seed=5)
  step = _saf_step(1)
  fresh = lambda: (
    {"w": jnp.asarray(_data()[2], jnp.float32), "b": jnp.zeros(C)},
    optax_gsam.saf_store(N, C, lag_epochs=1),
  )
  whole = _run_saf(step, steps, *fresh(), dtype=jnp.float32)
  half = len(steps) // 2
  params, store, _ = _run_saf(step, steps[:half], *fresh(), dtype=jnp.float32)
  blob = flax.serialization.to_bytes((params, store))
  params, store = flax.serialization.from_bytes(fresh(), blob)
  resumed = _run_saf(step, steps[half:], params, store, dtype=jnp.float32)
  for a, b in zip(jax.tree.leaves(whole[:2]), jax.tree.leaves(resumed[:2]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  tx = optax.chain(optax.sgd(0.1), optax_gsam.mesa_ema(0.9))
  w = jnp.ones(3)
  state = tx.init(w)
  restored = flax.serialization.from_bytes(
    tx.init(jnp.zeros(3)), flax.serialization.to_bytes(state)
  )
  assert isinstance(restored[1], optax_gsam.MESAState)
  np.testing.assert_array_equal(restored[1].ema_params, state[1].ema_params)


def _store_step(store, logits, ids, epoch):
  targets, valid = optax_gsam.saf_targets(store, ids, epoch)
  term = optax_gsam.trajectory_loss(logits, targets, temperature=TAU, where=valid)
  return optax_gsam.saf_record(store, ids, logits, epoch), term


_store_step_jit = jax.jit(_store_step, donate_argnums=(0,))


@pytest.mark.parametrize("store_spec", [P(), P("data")], ids=["replicated", "sharded"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_saf_under_data_parallelism_equals_one_device(store_spec, axis_type):
  """Ids, inputs and logits split over 8 devices; the store replicated or split by example.

  Under Auto axes, the whole SGD step; under Explicit axes (jax.make_mesh's default) the
  store's read, term and write (a model there needs its own out_sharding for the backward
  pass's contraction over the batch).
  """
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
  x, y, w0 = _data()
  steps = [(0, np.arange(8)), (0, np.arange(8, 16)), (1, np.arange(8)[::-1])]
  train = _saf_step(0)

  def run(put):
    params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.zeros(C)}
    store = jax.device_put(optax_gsam.saf_store(N, C, lag_epochs=1), put(store_spec))
    results = []
    for epoch, ids in steps:
      x_b, y_b, ids_b = jax.device_put(
        [jnp.asarray(x[ids], jnp.float32), jnp.asarray(y[ids]), jnp.asarray(ids)], put(P("data"))
      )
      if axis_type == "Auto":
        params, store, loss = train(params, store, x_b, y_b, ids_b, epoch)
      else:
        store, loss = _store_step_jit(store, x_b @ jnp.asarray(w0, jnp.float32), ids_b, epoch)
      results.append(loss)
    return params, store, results

  one = run(lambda spec: jax.devices()[0])
  many = run(lambda spec: NamedSharding(mesh, spec))
  assert many[1].outputs.sharding.is_equivalent_to(NamedSharding(mesh, store_spec), 3)
  assert float(many[2][-1]) > 0 or axis_type == "Explicit"
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_saf_over_microbatches_equals_the_whole_batch():
  """The store passes through micro-batches as model state: read, then record, per micro-batch."""
  x, y, w0 = _data()
  params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.zeros(C)}
  store = optax_gsam.saf_store(N, C, lag_epochs=1)
  store = optax_gsam.saf_record(store, jnp.arange(N), jnp.asarray(x @ w0 * 0.5, jnp.float32), 0)
  batch = {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y), "id": jnp.arange(N)[::-1]}

  def loss_fn(params, store, mb):
    targets, valid = optax_gsam.saf_targets(store, mb["id"], 1)
    loss, logits = _loss_fn(params, mb["x"], mb["y"], targets, valid)
    return loss, optax_gsam.saf_record(store, mb["id"], logits, 1)

  (loss, new_store), grads = optax_gsam.accumulate_value_and_grad(
    loss_fn, params, batch, microbatches=4, model_state=store
  )
  (whole_loss, whole_store), whole_grads = jax.value_and_grad(loss_fn, has_aux=True)(
    params, store, batch
  )
  np.testing.assert_allclose(loss, whole_loss, rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves((grads, new_store)), jax.tree.leaves((whole_grads, whole_store)), strict=True
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# MESA over a training trajectory


def test_mesa_training_trajectory_matches_float64_reference():
  beta, start = 0.8, 1
  steps = _schedule(epochs=3, per_epoch=16, batch=8, seed=2)
  x, y, w0 = _data()
  w, b = w0.copy(), np.zeros(C)
  vw, vb = w.copy(), b.copy()
  expected = []
  for epoch, ids in steps:
    z = x[ids] @ w + b
    valid = np.full(len(ids), epoch >= start)
    dz, loss = _reference_grad(x[ids], y[ids], z, x[ids] @ vw + vb, valid)
    expected.append(loss)
    w, b = w - LR * x[ids].T @ dz, b - LR * dz.sum(axis=0)
    vw, vb = beta * vw + (1 - beta) * w, beta * vb + (1 - beta) * b

  with jax.enable_x64(True):
    tx = optax.chain(optax.sgd(LR), optax_gsam.mesa_ema(beta))

    @jax.jit
    def step(params, opt_state, x, y, epoch):
      targets = optax_gsam.mesa_targets(_model, optax.tree.get(opt_state, "ema_params"), x)
      valid = jnp.full(len(y), epoch >= start)
      (loss, _), grads = jax.value_and_grad(_loss_fn, has_aux=True)(params, x, y, targets, valid)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    params = {"w": jnp.asarray(w0), "b": jnp.zeros(C, jnp.float64)}
    opt_state = tx.init(params)
    losses = []
    for epoch, ids in steps:
      params, opt_state, loss = step(
        params, opt_state, jnp.asarray(x[ids]), jnp.asarray(y[ids]), epoch
      )
      losses.append(float(loss))
  np.testing.assert_allclose(losses, expected, rtol=1e-12)
  np.testing.assert_allclose(np.asarray(params["w"]), w, rtol=1e-12)
  np.testing.assert_allclose(np.asarray(opt_state[1].ema_params["w"]), vw, rtol=1e-12)
  assert int(opt_state[1].count) == len(steps)


# ---------------------------------------------------------------------------------------------
# Composition with the sharpness-aware transforms


def _composed_problem():
  x, y, w0 = _data()
  params = {"w": jnp.asarray(w0, jnp.float32), "b": jnp.zeros(C)}
  targets = jnp.asarray(x @ w0 * 0.3, jnp.float32)
  valid = jnp.arange(N) % 3 != 0
  loss_fn = lambda p: _loss_fn(p, jnp.asarray(x, jnp.float32), jnp.asarray(y), targets, valid)[0]
  return params, loss_fn


def test_sam_and_gsam_with_the_trajectory_term_in_loss_fn():
  """sam's output is grad L(w + rho g / |g|) with L = CE + the term; gsam(alpha=0) is sam."""
  params, loss_fn = _composed_problem()
  rho = 0.1
  loss, g = jax.value_and_grad(loss_fn)(params)
  norm = optax.tree.norm(g)
  expected = jax.grad(loss_fn)(jax.tree.map(lambda w, gi: w + rho * gi / norm, params, g))
  outputs = []
  for tx in (optax_gsam.sam(rho), optax_gsam.gsam(rho, alpha=0.0)):
    out, _ = tx.update(g, tx.init(params), params, loss_fn=loss_fn, value=loss)
    outputs.append(out)
  for out in outputs:
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_momentum_sam_with_the_trajectory_term_in_loss_fn():
  """Two steps: g_t = grad L(w_t - rho v_t / |v_t|), v_{t+1} = mu v_t + g_t (v_0 = 0)."""
  params, loss_fn = _composed_problem()
  rho, mu, lr = 0.1, 0.9, 0.2
  tx = optax.chain(optax_gsam.momentum_sam(rho, mu), optax.sgd(lr))
  state = tx.init(params)
  w, v = params, jax.tree.map(jnp.zeros_like, params)
  for t in range(2):
    scale = 0.0 if t == 0 else -rho / optax.tree.norm(v)
    g = jax.grad(loss_fn)(jax.tree.map(lambda wi, vi, s=scale: wi + s * vi, w, v))
    v = jax.tree.map(lambda vi, gi: mu * vi + gi, v, g)
    updates, state = tx.update(optax.tree.zeros_like(params), state, params, loss_fn=loss_fn)
    params = optax.apply_updates(params, updates)
    w = jax.tree.map(lambda wi, gi: wi - lr * gi, w, g)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(w), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad inputs: each names the argument


def _bad_calls():
  store = optax_gsam.saf_store(4, 3)
  logits = jnp.zeros((2, 3))
  return {
    "ids out of range": (lambda: optax_gsam.saf_targets(store, jnp.array([0, 4]), 0), "ids"),
    "negative ids": (lambda: optax_gsam.saf_record(store, jnp.array([-1, 0]), logits, 0), "ids"),
    "float ids": (lambda: optax_gsam.saf_record(store, jnp.array([0.0, 1.0]), logits, 0), "ids"),
    "ids of another length": (
      lambda: optax_gsam.saf_record(store, jnp.array([0, 1, 2]), logits, 0),
      "ids",
    ),
    "store of other classes": (
      lambda: optax_gsam.saf_record(store, jnp.array([0, 1]), jnp.zeros((2, 5)), 0),
      "num_classes",
    ),
    "temperature 0": (
      lambda: optax_gsam.trajectory_loss(logits, logits, temperature=0.0),
      "temperature",
    ),
    "temperature < 0": (
      lambda: optax_gsam.trajectory_loss(logits, logits, temperature=-1.0),
      "temperature",
    ),
    "weight < 0": (lambda: optax_gsam.trajectory_loss(logits, logits, weight=-0.1), "weight"),
    "where of another shape": (
      lambda: optax_gsam.trajectory_loss(logits, logits, where=jnp.ones(3, bool)),
      "where",
    ),
    "targets of another shape": (
      lambda: optax_gsam.trajectory_loss(logits, jnp.zeros((2, 4))),
      "target_logits",
    ),
    "lag 0": (lambda: optax_gsam.saf_store(4, 3, lag_epochs=0), "lag_epochs"),
    "negative epoch": (lambda: optax_gsam.saf_targets(store, jnp.array([0]), -1), "epoch"),
    "decay 1": (lambda: optax_gsam.mesa_ema(1.0), "decay"),
    "decay < 0": (lambda: optax_gsam.mesa_ema(-0.1), "decay"),
  }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_naming_the_argument(case):
  call, name = _bad_calls()[case]
  with pytest.raises(ValueError, match=name):
    call()


def test_out_of_range_ids_under_jit_are_masked_and_dropped():
  store = optax_gsam.saf_store(4, 2, lag_epochs=1)
  ids = jnp.array([1, 7, -1])
  store = jax.jit(optax_gsam.saf_record)(store, ids, jnp.ones((3, 2)), 0)
  never = int(np.iinfo(np.int32).min)
  assert store.recorded_epoch[:, 0].tolist() == [never, 0, never, never]
  _, valid = jax.jit(optax_gsam.saf_targets)(store, ids, 1)
  assert valid.tolist() == [True, False, False]


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.chain(optax_gsam.mesa_ema(0.9), optax.sgd(0.1)),
    lambda: optax.chain(optax.chain(optax.sgd(0.1), optax_gsam.mesa_ema(0.9)), optax.scale(0.5)),
    lambda: optax.named_chain(("ema", optax_gsam.mesa_ema(0.9)), ("sgd", optax.sgd(0.1))),
  ],
  ids=["before-the-optimizer", "last-of-an-inner-chain", "named-chain"],
)
def test_mesa_ema_before_a_stage_that_changes_the_updates_is_refused(make):
  tx, w = make(), jnp.ones(2)
  with pytest.raises(
    ValueError, match=r"mesa_ema is not the last transformation.*after the optimizer"
  ):
    tx.update(jnp.ones(2), tx.init(w), w)


def test_mesa_ema_before_identity_or_a_passthrough_is_accepted():
  tx = optax.chain(
    optax.sgd(0.5),
    optax_gsam.mesa_ema(0.5),
    optax.identity(),
    optax_gsam.passthrough(optax.identity()),
  )
  w = jnp.array([1.0])
  updates, state = tx.update(jnp.array([2.0]), tx.init(w), w)
  assert float(updates[0]) == -1.0  # 0.5 * 1 + 0.5 * (1 - 0.5 * 2)
  assert float(optax.tree.get(state, "ema_params")[0]) == 0.5


def test_integer_logits_and_duplicate_ids_are_refused_naming_the_argument():
  with pytest.raises(ValueError, match="logits must be floating-point"):
    optax_gsam.trajectory_loss(jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3)), temperature=2.5)
  store = optax_gsam.saf_store(4, 3)
  with pytest.raises(ValueError, match="ids must be unique within a batch"):
    optax_gsam.saf_record(store, jnp.array([1, 1]), jnp.ones((2, 3)), 0)


@pytest.mark.parametrize(
  "wrap",
  [
    lambda tx: optax.MultiSteps(tx, every_k_schedule=1),
    lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
    lambda tx: optax.named_chain(("sgd", optax.sgd(0.5)), ("ema", optax_gsam.mesa_ema(0.5))),
  ],
  ids=["MultiSteps", "apply_if_finite", "named_chain"],
)
def test_mesa_ema_last_is_accepted_inside_optax_wrappers(wrap):
  tx = wrap(optax.chain(optax.sgd(0.5), optax_gsam.mesa_ema(0.5)))
  w = jnp.array([1.0])
  _, state = tx.update(jnp.array([2.0]), tx.init(w), w)
  assert float(optax.tree.get(state, "ema_params")[0]) == 0.5  # 0.5 * 1 + 0.5 * (1 - 0.5 * 2)


def test_mesa_decay_as_a_python_float_is_exact_to_float32():
  tx = optax_gsam.mesa_ema(0.9998)
  w = jnp.zeros(1)
  _, state = tx.update(jnp.ones(1), tx.init(w), w)
  assert float(state.ema_params[0]) == np.float32(1.0 - 0.9998)
