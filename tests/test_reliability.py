"""Reliability guarantees (docs/guarantees.md): bad inputs, non-finite values, checkpoints,
determinism and dtypes.

References are written here from the formulas (numpy float64); nothing in them calls the
package's own helpers.
"""

import functools
import pathlib
import re

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _problems import make_problem
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam
from optax_gsam import big_vision
from optax_gsam.flax import TrainState

EPS = 1e-12
LR = optax.cosine_decay_schedule(0.05, 20, alpha=0.1)
RHO = optax_gsam.rho_from_lr(LR, rho_max=0.2, rho_min=0.05, num_steps=20)


def float32_problem(seed=0):
  params, loss_fn, _, _ = make_problem(seed=seed)
  return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params), loss_fn


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def all_finite(tree):
  return all(bool(np.all(np.isfinite(np.asarray(x, np.float32)))) for x in jax.tree.leaves(tree))


def make_step(tx, loss_fn):
  """A jitted train step with the clean gradient, the loss and the clean loss value."""

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state

  return step


# --- 1. Bad configuration fails at construction, naming the argument and the allowed values ---

mlp = lambda p, x: x @ p["w"]
sum_loss = lambda p, r: jnp.sum(r)

BAD_CONSTRUCTION = {
  "gsam_rho_string": (
    lambda: optax_gsam.gsam("0.1"),
    r"rho must be a finite number >= 0.*schedule",
  ),
  "gsam_rho_none": (lambda: optax_gsam.gsam(None), r"rho must be .*schedule, got None"),
  "gsam_rho_vector": (lambda: optax_gsam.gsam(jnp.ones(3)), r"rho must be .*scalar array"),
  "gsam_alpha_none": (lambda: optax_gsam.gsam(0.1, None), r"alpha must be a finite number >= 0"),
  "gsam_alpha_list": (lambda: optax_gsam.gsam(0.1, [0.5]), r"alpha must be .*scalar array"),
  "gsam_eps_none": (lambda: optax_gsam.gsam(0.1, eps=None), r"eps must be a finite number > 0"),
  "gsam_eps_bool": (lambda: optax_gsam.gsam(0.1, eps=True), r"eps must be a finite number > 0"),
  "gsam_eps_inf": (lambda: optax_gsam.gsam(0.1, eps=float("inf")), r"eps must be a finite"),
  "gsam_reuse_weight_string": (  # None is the "not given" default since 0.2
    lambda: optax_gsam.gsam(0.1, perturb_every=2, reuse_weight="0.7"),
    r"reuse_weight must be .*schedule",
  ),
  "gsam_rho_concrete_nan_array": (
    lambda: optax_gsam.gsam(jnp.asarray(jnp.nan)),
    r"rho must be a finite number >= 0, got Array\(nan",
  ),
  "gsam_alpha_concrete_negative_array": (
    lambda: optax_gsam.gsam(jnp.asarray(0.1), alpha=jnp.asarray(-0.5)),
    r"alpha must be a finite number >= 0, got Array\(-0.5",
  ),
  "gsam_eps_concrete_zero_array": (
    lambda: optax_gsam.gsam(0.1, eps=jnp.asarray(0.0)),
    r"eps must be a finite number > 0",
  ),
  "momentum_sam_momentum_concrete_array": (
    lambda: optax_gsam.momentum_sam(0.1, momentum=jnp.asarray(1.0)),
    r"momentum must be a float in \[0, 1\)",
  ),
  "gsam_perturb_every_float": (
    lambda: optax_gsam.gsam(0.1, perturb_every=2.0),
    r"perturb_every must be None or an int >= 1",
  ),
  "gsam_num_groups_zero": (
    lambda: optax_gsam.gsam(0.1, num_groups=0),
    r"num_groups must be None or an int >= 1",
  ),
  "gsam_num_groups_with_axis": (
    lambda: optax_gsam.gsam(0.1, num_groups=2, axis_name="data"),
    r"num_groups .*axis_name",
  ),
  "gsam_adaptive_choices": (
    lambda: optax_gsam.gsam(0.1, adaptive="ASAM"),
    r"adaptive must be one of \(None, 'gsam', 'asam'\)",
  ),
  "sam_eps_string": (lambda: optax_gsam.sam(0.1, eps="1e-12"), r"eps must be a finite number"),
  "rho_from_lr_lr_string": (
    lambda: optax_gsam.rho_from_lr("3e-3", 0.6, 0.1, num_steps=10),
    r"lr_schedule must be a finite number >= 0.*schedule",
  ),
  "rho_from_lr_rho_max_none": (
    lambda: optax_gsam.rho_from_lr(3e-3, None, 0.1),
    r"rho_max must be a finite number >= 0",
  ),
  "rho_from_lr_lr_min_string": (
    lambda: optax_gsam.rho_from_lr(3e-3, 0.6, 0.1, lr_max=1.0, lr_min="0"),
    r"lr_min must be a finite number >= 0",
  ),
  "cached_embed_none": (
    lambda: optax_gsam.cached_value_and_grad(None, sum_loss, chunk_size=2),
    r"embed_fn must be callable",
  ),
  "cached_axis_list": (
    lambda: optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=2, axis_name=["d"]),
    r"axis_name must be None, a hashable axis name or a tuple",
  ),
  "cached_chunk_none": (
    lambda: optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=None),
    r"chunk_size must be a positive int",
  ),
  "big_vision_gradient_alpha": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, -0.5, 1e-3, 3e-3, 3e-5
    ),
    r"alpha must be a finite number >= 0",
  ),
  "big_vision_gradient_rho_max": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, float("nan"), 0.1, 0.5, 1e-3, 3e-3, 0.0
    ),
    r"rho_max must be a finite number >= 0",
  ),
  "big_vision_gradient_rho_order": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.1, 0.6, 0.5, 1e-3, 3e-3, 3e-5
    ),
    r"rho_min \(0.6\) must be <= rho_max \(0.1\)",
  ),
  "big_vision_gradient_lr_order": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, 0.5, 1e-3, 3e-5, 3e-3
    ),
    r"lr_min .* must be <= lr_max",
  ),
  "big_vision_gradient_lr_max_string": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, 0.5, 1e-3, "3e-3", 3e-5
    ),
    r"lr_max must be a finite number >= 0",
  ),
  "big_vision_steps_batch_size": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, batch_size=0), 100),
    r"config.batch_size must be a positive int",
  ),
  "big_vision_steps_num_examples": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, batch_size=8), -1),
    r"num_examples must be a positive int",
  ),
  "big_vision_steps_both": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, total_steps=10, batch_size=8), 100),
    r"either config.num_epochs or config.total_steps",
  ),
  "big_vision_config_alpha": (
    lambda: big_vision.gsam_from_config(
      dict(lr=0.1, gsam=dict(rho_max=0.1, rho_min=0.0, alpha="0.5")), 10
    ),
    r"alpha must be a finite number >= 0",
  ),
  "big_vision_config_sync_without_axis": (
    lambda: big_vision.gsam_from_config(
      dict(lr=0.1, gsam=dict(rho_max=0.1, rho_min=0.0, alpha=0.5)), 10, sync_perturbation=True
    ),
    r"sync_perturbation=True needs axis_name",
  ),
  "flax_train_state_tx_factory": (
    lambda: TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd),
    r"tx must be an optax.GradientTransformation.*call it",
  ),
  "flax_train_state_tx_none": (
    lambda: TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=None),
    r"tx must be an optax.GradientTransformation",
  ),
}


@pytest.mark.parametrize("name", BAD_CONSTRUCTION)
def test_bad_construction_names_argument_and_allowed_values(name):
  build, match = BAD_CONSTRUCTION[name]
  with pytest.raises(ValueError, match=match):
    build()


def test_scalar_arrays_are_accepted_for_inject_hyperparams():
  # The validation must not reject what optax.inject_hyperparams passes: 0-d arrays.
  tx = optax_gsam.gsam(jnp.float32(0.1), jnp.asarray(0.3), eps=jnp.asarray(1e-12))
  p = jnp.ones(3)
  loss_fn = lambda w: jnp.sum(jnp.sin(w))
  updates, _ = tx.update(jax.grad(loss_fn)(p), tx.init(p), p, loss_fn=loss_fn)
  assert all_finite(updates)
  assert optax_gsam.gsam(np.float32(0.1), np.float64(0.2)) is not None


# --- 2. Bad call-time input gets a clear error ---------------------------------------------------


def test_gsam_update_rejects_leaf_shape_mismatch_naming_the_leaf():
  p = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
  tx = optax_gsam.gsam(0.1, 0.3)
  loss_fn = lambda q: jnp.sum(q["w"] ** 2)
  grads = {"w": jnp.ones((2, 3)), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"leaf shapes.*\['w'\]: \(2, 3\) vs \(3, 2\)"):
    tx.update(grads, tx.init(p), p, loss_fn=loss_fn)
  with pytest.raises(ValueError, match="leaf shapes"):
    jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=loss_fn))(grads)


def test_gsam_update_rejects_state_of_other_params():
  tx = optax_gsam.gsam(0.1, 0.3, perturb_every=2)
  stale = tx.init({"w": jnp.ones(3)})
  p = {"w": jnp.ones(4)}
  with pytest.raises(ValueError, match=r"initialised for other params.*tx.init\(params\)"):
    tx.update(p, stale, p, loss_fn=lambda q: jnp.sum(q["w"]))


def test_missing_loss_function_is_clear_through_wrappers_and_groups():
  p = {"w": jnp.ones(3)}
  state_error = r"Pass exactly one of loss_fn .* or value_and_grad_fn"
  wrapped = optax.apply_if_finite(optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.1)), 2)
  with pytest.raises(ValueError, match=state_error):
    wrapped.update(p, wrapped.init(p), p)
  grouped = optax_gsam.gsam(0.1, 0.3, num_groups=2, perturb_every=2)
  with pytest.raises(ValueError, match=state_error):
    grouped.update(p, grouped.init(p), p)
  state = TrainState.create(
    apply_fn=None, params=p, tx=optax.chain(optax_gsam.gsam(0.1), optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match=state_error):
    state.apply_gradients(grads=p, value=1.0)
  with pytest.raises(ValueError, match="loss_fn must be callable"):
    big_vision.gsam_gradient(None, p, None, None, 0.6, 0.1, 0.5, 1e-3, 3e-3, 3e-5)


def test_non_scalar_clean_loss_value_is_rejected():
  p = jnp.ones(3)
  tx = optax_gsam.gsam(0.1, 0.3)
  loss_fn = lambda w: jnp.sum(w**2)
  with pytest.raises(ValueError, match="The loss must be a scalar, got shape"):
    tx.update(p, tx.init(p), p, loss_fn=loss_fn, value=jnp.ones(3))


def test_chunk_size_larger_than_the_batch_is_an_error():
  p = {"w": jnp.ones((3, 2))}
  fn = optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=8)
  with pytest.raises(ValueError, match=r"chunk_size=8 is larger than the batch, which has 5"):
    fn(p, jnp.ones((5, 3)))
  value, _ = fn(p, jnp.ones((8, 3)))  # chunk_size equal to the batch: one chunk
  assert float(value) == 8 * 2 * 3
  towers = optax_gsam.cached_value_and_grad(
    {"query": mlp, "doc": mlp}, lambda p, r: jnp.sum(r["query"]) + jnp.sum(r["doc"]), chunk_size=4
  )
  with pytest.raises(
    ValueError, match=r"chunk_size=4 is larger than the batch of tower \['query'\]"
  ):
    towers(p, {"query": jnp.ones((3, 3)), "doc": jnp.ones((12, 3))})


def test_chunk_size_larger_than_the_local_shard_is_an_error():
  mesh = jax.make_mesh((8,), ("data",))
  fn = optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=4, axis_name="data")
  sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
  # 16 examples over 8 devices: 2 per shard, fewer than chunk_size.
  with pytest.raises(ValueError, match=r"chunk_size=4 .* has 2 examples \(the local shard"):
    sharded(
      jax.device_put({"w": jnp.ones((3, 2))}, NamedSharding(mesh, P())),
      jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P("data"))),
    )


def test_batch_whose_leaves_disagree_on_axis_0_is_an_error():
  p = {"w": jnp.ones((3, 2))}
  embed = lambda q, b: b["x"] @ q["w"] + b["y"]
  fn = optax_gsam.cached_value_and_grad(embed, sum_loss, chunk_size=2)
  with pytest.raises(ValueError, match=r"leading sizes \['4', '6'\]"):
    fn(p, {"x": jnp.ones((4, 3)), "y": jnp.ones((6, 1))})
  with pytest.raises(ValueError, match=r"examples on axis 0.*None"):
    fn(p, {"x": jnp.ones((4, 3)), "y": jnp.float32(1.0)})
  towers = optax_gsam.cached_value_and_grad(
    {"a": embed}, lambda q, r: jnp.sum(r["a"]), chunk_size=2
  )
  with pytest.raises(ValueError, match=r"batch of tower \['a'\].*leading sizes"):
    towers(p, {"a": {"x": jnp.ones((4, 3)), "y": jnp.ones((3, 1))}})


# --- 3. Zero, tiny and huge gradients give finite, correct outputs -------------------------------


def reference_gsam(w, c, d, scale, rho, alpha, adaptive, minimize_fp):
  """GSAM of f(w) = scale * (<c, w> + <d, w^2> / 2), numpy float64, with eps as documented."""

  def grad(v):
    return scale * (c + d * v)

  def projection(dot, norm):
    return dot / (norm * (norm + EPS)) if norm > 0 else 0.0

  g_c = grad(w)
  if adaptive is None:
    e = rho * g_c / (np.linalg.norm(g_c) + EPS)
  else:  # asam
    e = rho * w**2 * g_c / (np.linalg.norm(np.abs(w) * g_c) + EPS)
  g_p = grad((w + e).astype(np.float32).astype(np.float64))
  if minimize_fp:
    return g_p - alpha * (g_c - projection(g_c @ g_p, np.linalg.norm(g_p)) * g_p), g_c
  return g_c + alpha * (g_p - projection(g_p @ g_c, np.linalg.norm(g_c)) * g_c), g_c


SCALES = [0.0, 1e-30, 1e-20, 1.0, 1e20, 1e30]


@pytest.mark.parametrize("adaptive", [None, "asam"])
@pytest.mark.parametrize("minimize_fp", [True, False])
def test_zero_tiny_and_huge_gradients_give_finite_correct_outputs(adaptive, minimize_fp):
  rng = np.random.default_rng(0)
  shapes = {"a": (3, 2), "b": (4,)}
  w64 = {k: rng.normal(size=s) for k, s in shapes.items()}
  c64 = {k: rng.normal(size=s) for k, s in shapes.items()}
  d64 = {k: rng.uniform(0.5, 1.5, size=s) for k, s in shapes.items()}
  w, c, d = (jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t) for t in (w64, c64, d64))
  tx = optax_gsam.gsam(0.1, 0.4, adaptive=adaptive, minimize_fp=minimize_fp)

  @jax.jit
  def update(scale):
    def loss_fn(q):
      terms = jax.tree.map(lambda qi, ci, di: jnp.sum(ci * qi + 0.5 * di * qi**2), q, c, d)
      return scale * sum(jax.tree.leaves(terms))

    loss, grads = jax.value_and_grad(loss_fn)(w)
    return tx.update(grads, tx.init(w), w, loss_fn=loss_fn, value=loss)

  flat = lambda t: np.concatenate([np.ravel(np.asarray(t[k], np.float64)) for k in shapes])
  w_f, c_f, d_f = flat(w), flat(c), flat(d)
  for scale in SCALES:
    updates, state = update(jnp.float32(scale))
    assert all_finite((updates, state)), scale
    expected, g_c = reference_gsam(w_f, c_f, d_f, scale, 0.1, 0.4, adaptive, minimize_fp)
    np.testing.assert_allclose(
      flat(updates), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max(), err_msg=str(scale)
    )
    assert float(state.clean_grad_norm) == pytest.approx(np.linalg.norm(g_c), rel=1e-5)


def test_cheap_steps_with_extreme_gradients_stay_finite():
  p, loss_fn = float32_problem(seed=3)
  tx = optax_gsam.gsam(0.1, 0.4, perturb_every=2)

  @jax.jit
  def update(state, scale):
    scaled = lambda q: scale * loss_fn(q)
    return tx.update(jax.grad(scaled)(p), state, p, loss_fn=scaled)

  for scale in SCALES:
    state = tx.init(p)
    for _ in range(3):  # full, cheap, full
      updates, state = update(state, jnp.float32(scale))
      assert all_finite((updates, state)), scale


# --- 4. Non-finite values never corrupt the transform's state ------------------------------------

BAD_STEPS = ["nan_clean_grad", "inf_clean_grad", "nan_perturbed_loss", "inf_perturbed_loss"]


@pytest.mark.parametrize("perturb_every", [None, 2])
def test_non_finite_step_does_not_corrupt_the_state(perturb_every):
  """After a bad step, the next output is that of a state which skipped it.

  A non-finite output does not advance the count; a finite one (an Inf perturbed loss with
  finite gradients) does, as the optimizer after the transform applies it."""
  p, loss_fn = float32_problem(seed=4)
  tx = optax_gsam.gsam(RHO, 0.3, perturb_every=perturb_every)

  @jax.jit
  def update(state, clean_scale, loss_scale, loss_shift):
    bad_loss = lambda q: loss_fn(q) * loss_scale + loss_shift  # what the perturbed pass sees
    grads = jax.tree.map(lambda g: g * clean_scale, jax.grad(loss_fn)(p))
    return tx.update(grads, state, p, loss_fn=bad_loss, value=loss_fn(p))

  good = (1.0, 1.0, 0.0)
  bad = {
    "nan_clean_grad": (jnp.nan, 1.0, 0.0),
    "inf_clean_grad": (jnp.inf, 1.0, 0.0),
    "nan_perturbed_loss": (1.0, jnp.nan, 0.0),
    "inf_perturbed_loss": (1.0, 1.0, jnp.inf),
  }
  state = tx.init(p)
  for _ in range(2):
    _, state = update(state, *good)
  for kind in BAD_STEPS:
    out, after_bad = update(state, *bad[kind])  # a full step (count 2)
    assert int(after_bad.count) == (3 if all_finite(out) else 2), kind
    assert kind == "inf_perturbed_loss" or not all_finite(out)
    skipped = state._replace(count=after_bad.count)
    assert all_finite((after_bad.count, after_bad.rho, after_bad.stored_direction)), kind
    if perturb_every:
      assert_trees_equal(after_bad.stored_direction, state.stored_direction)
    out_bad, next_bad = update(after_bad, *good)
    out_skip, next_skip = update(skipped, *good)
    assert all_finite(out_bad), kind
    assert_trees_equal(out_bad, out_skip)
    if perturb_every:  # a cheap step keeps the last full step's diagnostics: compare the rest
      next_bad = next_bad._replace(perturbed_loss=0, surrogate_gap=0, cosine=0)
      next_skip = next_skip._replace(perturbed_loss=0, surrogate_gap=0, cosine=0)
      next_bad = next_bad._replace(clean_grad_norm=0, perturbed_grad_norm=0)
      next_skip = next_skip._replace(clean_grad_norm=0, perturbed_grad_norm=0)
    assert_trees_equal(next_bad, next_skip)


def guarded_step(tx, loss_fn, perturbed_only=False):
  """A jitted step taking ``bad``: then the clean gradient (or, with ``perturbed_only``, only
  the loss the transform evaluates at the perturbed weights) is NaN."""

  @jax.jit
  def step(params, state, bad):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    nan_or_one = jnp.where(bad, jnp.nan, 1.0)
    if perturbed_only:
      perturbed = lambda q: loss_fn(q) * nan_or_one
    else:
      perturbed = loss_fn
      grads = jax.tree.map(lambda g: g * nan_or_one, grads)
    updates, state = tx.update(grads, state, params, loss_fn=perturbed, value=loss)
    return optax.apply_updates(params, updates), state

  return step


def run(step, start, steps, bad_step=-1):
  """Every (params, state) pair of ``steps`` steps from ``start``; step ``bad_step`` is bad."""
  history = [start]
  for t in range(steps):
    history.append(step(*history[-1], jnp.asarray(t == bad_step)))
  return history


def test_apply_if_finite_skips_a_non_finite_clean_gradient():
  p, loss_fn = float32_problem(seed=5)
  inner = optax.chain(
    optax_gsam.gsam(RHO, 0.3, perturb_every=2),
    optax.clip_by_global_norm(1.0),
    optax.adamw(LR, weight_decay=1e-2),
  )
  tx = optax.apply_if_finite(inner, max_consecutive_errors=3)
  step = guarded_step(tx, loss_fn)
  with_bad = run(step, (p, tx.init(p)), steps=6, bad_step=2)
  without = run(step, (p, tx.init(p)), steps=5)
  (params_before, state_before), (params_after, state_after) = with_bad[2], with_bad[3]
  assert_trees_equal(params_after, params_before)  # the bad step changed nothing
  assert_trees_equal(state_after.inner_state, state_before.inner_state)
  assert int(state_after.notfinite_count) == 1 and not bool(state_after.last_finite)
  # Training continues as if the bad batch had never been drawn, bit for bit: the rho
  # schedule's count and the stored cheap-step direction included.
  final_params, final_state = with_bad[-1]
  assert_trees_equal(final_params, without[-1][0])
  assert_trees_equal(final_state.inner_state, without[-1][1].inner_state)
  assert int(final_state.total_notfinite) == 1 and int(final_state.notfinite_count) == 0


def test_non_finite_perturbed_pass_needs_the_rest_of_the_chain_guarded_too():
  """apply_if_finite checks the gradient it receives, the clean one; a NaN that appears only at
  the perturbed weights passes it. gsam then outputs the NaN (it never hides one), and an inner
  apply_if_finite around the rest of the chain skips the step."""
  p, loss_fn = float32_problem(seed=6)
  outer_only = optax.apply_if_finite(
    optax.chain(optax_gsam.gsam(0.1, 0.3), optax.adamw(1e-2, weight_decay=1e-2)), 3
  )
  params, _ = guarded_step(outer_only, loss_fn, perturbed_only=True)(
    p, outer_only.init(p), jnp.asarray(True)
  )
  assert not all_finite(params)  # the documented limitation: the outer guard cannot see it

  nested = optax.apply_if_finite(
    optax.chain(
      optax_gsam.gsam(0.1, 0.3), optax.apply_if_finite(optax.adamw(1e-2, weight_decay=1e-2), 3)
    ),
    3,
  )
  step = guarded_step(nested, loss_fn, perturbed_only=True)
  with_bad = run(step, (p, nested.init(p)), steps=4, bad_step=1)
  without = run(step, (p, nested.init(p)), steps=3)
  (params_before, state_before), (params_after, state_after) = with_bad[1], with_bad[2]
  assert_trees_equal(params_after, params_before)
  gsam_before, adam_before = state_before.inner_state
  gsam_after, adam_after = state_after.inner_state
  assert_trees_equal(adam_after.inner_state, adam_before.inner_state)
  assert int(adam_after.total_notfinite) == 1
  assert int(gsam_after.count) == int(gsam_before.count)  # the skipped step does not count
  # With a constant rho the skipped step leaves no trace on the trajectory.
  assert_trees_equal(with_bad[-1][0], without[-1][0])


# --- 5. Checkpoints: orbax-checkpoint and flax.serialization round trips, bitwise resume ---------


def mixed_params(params):
  return {"w": params["w"].astype(jnp.bfloat16), "b": params["b"]}


def in_float32(loss_fn, params):
  return loss_fn(jax.tree.map(lambda x: x.astype(jnp.float32), params))


def gsam_states(tree):
  return [
    x
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax_gsam.GSAMState))
    if isinstance(x, optax_gsam.GSAMState)
  ]


CHECKPOINTED = {
  "perturb_every": lambda: optax.chain(
    optax_gsam.gsam(RHO, 0.3, perturb_every=3, reuse_weight=optax.linear_schedule(0.9, 0.3, 8)),
    optax.sgd(LR),
  ),
  "inject_hyperparams": lambda: optax.chain(
    optax.inject_hyperparams(optax_gsam.gsam, static_args=("perturb_every",))(
      rho=RHO, alpha=0.3, perturb_every=2
    ),
    optax.sgd(LR),
  ),
  "adamw_chain": lambda: optax.chain(
    optax_gsam.gsam(RHO, 0.3),
    optax.clip_by_global_norm(1.0),
    optax.adamw(LR, weight_decay=0.1),
  ),
  "apply_if_finite": lambda: optax.apply_if_finite(
    optax.chain(optax_gsam.gsam(RHO, 0.3, perturb_every=2), optax.adamw(LR)), 3
  ),
  "bfloat16_mixed": lambda: optax.chain(
    optax_gsam.gsam(RHO, 0.3, perturb_every=2), optax.sgd(LR, momentum=0.9)
  ),
}


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_checkpoint_round_trip_and_bitwise_resume(name, tmp_path):
  params, loss_fn = float32_problem(seed=7)
  if name == "bfloat16_mixed":
    params = mixed_params(params)
    loss_fn = functools.partial(in_float32, loss_fn)
  tx = CHECKPOINTED[name]()
  step = make_step(tx, loss_fn)
  params_t, state_t = params, tx.init(params)
  for _ in range(4):
    params_t, state_t = step(params_t, state_t)

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params_t, "opt_state": state_t})
  checkpointer.wait_until_finished()
  fresh = {"params": params, "opt_state": tx.init(params)}  # the structure a new job builds
  restored_orbax = checkpointer.restore(tmp_path / "ckpt", fresh)
  restored_flax = flax.serialization.from_bytes(
    fresh, flax.serialization.to_bytes({"params": params_t, "opt_state": state_t})
  )
  for restored in (restored_orbax, restored_flax):
    assert_trees_equal(restored, {"params": params_t, "opt_state": state_t})
    assert jax.tree.map(lambda x: x.dtype, restored) == jax.tree.map(
      lambda x: x.dtype, {"params": params_t, "opt_state": state_t}
    )
  (gsam_state,) = gsam_states(restored_orbax["opt_state"])
  assert int(gsam_state.count) == 4
  if gsam_state.stored_direction is not None:  # the cheap-mode stored direction came back
    assert float(optax_gsam.stable_global_norm(gsam_state.stored_direction)) > 0

  uninterrupted = (params_t, state_t)
  for _ in range(4):
    uninterrupted = step(*uninterrupted)
  for restored in (restored_orbax, restored_flax):
    resumed = (restored["params"], restored["opt_state"])
    for _ in range(4):
      resumed = step(*resumed)
    assert_trees_equal(resumed, uninterrupted)


# --- 6. Determinism ------------------------------------------------------------------------------


def test_same_inputs_give_bitwise_identical_outputs():
  params, loss_fn = float32_problem(seed=8)
  tx = optax.chain(
    optax_gsam.gsam(RHO, 0.3, adaptive="asam", perturb_every=2), optax.adamw(LR, weight_decay=0.1)
  )

  def step(p, s):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, s = tx.update(grads, s, p, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(p, updates), s

  def trajectory(step_fn, n=2):  # a full and a cheap step
    states = [(params, tx.init(params))]
    for _ in range(n):
      states.append(step_fn(*states[-1]))
    return states

  jitted = trajectory(jax.jit(step))
  assert_trees_equal(trajectory(jax.jit(step)), jitted)  # a second run
  assert_trees_equal(trajectory(jax.jit(lambda p, s: step(p, s))), jitted)  # a new compilation
  eager = trajectory(step, n=1)
  assert_trees_equal(trajectory(step, n=1), eager)
  # XLA may fuse and reorder float operations under jit, so jit and eager agree to rounding,
  # not bitwise (JAX does not promise more).
  jitted = jitted[:2]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), jitted, eager)


def test_data_parallel_and_gradient_cache_are_deterministic():
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.normal(size=(32, 5)), jnp.float32)
  params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)}
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, axis_name="data"), optax.sgd(0.1))

  def device_step(p, s, xs):
    loss_fn = lambda q: jnp.mean(jnp.tanh(xs @ q["w"]) ** 2)
    updates, s = tx.update(jax.grad(loss_fn)(p), s, p, loss_fn=loss_fn)
    return optax.apply_updates(p, updates), s

  step = optax_gsam.data_parallel(device_step, mesh)
  runs = []
  for _ in range(2):
    state = (params, tx.init(params))
    for _ in range(2):
      state = step(*state, x)
    runs.append(state)
  assert_trees_equal(runs[0], runs[1])

  cached = jax.jit(
    optax_gsam.cached_value_and_grad(
      lambda p, xs: jnp.tanh(xs @ p["w"]),
      lambda p, r: jnp.sum(jax.nn.logsumexp(r @ r.T, 1)),
      chunk_size=5,
    )
  )
  assert_trees_equal(cached(params, x), cached(params, x))


# --- 7. dtypes -----------------------------------------------------------------------------------


def scaled_by_group(loss_fn, params, group):
  return loss_fn(params) * (1.0 + group.astype(jnp.float32))


def test_bfloat16_and_mixed_trees_keep_dtypes_on_cheap_and_grouped_steps():
  params, loss_fn = float32_problem(seed=10)
  tx = optax_gsam.gsam(RHO, 0.3, perturb_every=2)
  for p in (jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), mixed_params(params)):
    f32_loss = functools.partial(in_float32, loss_fn)
    dtypes = jax.tree.map(lambda x: x.dtype, p)
    update = jax.jit(lambda s, p=p, f=f32_loss: tx.update(jax.grad(f)(p), s, p, loss_fn=f))
    state = tx.init(p)
    for _ in range(2):  # a full step, then a cheap one
      updates, state = update(state)
      assert jax.tree.map(lambda x: x.dtype, updates) == dtypes
      assert jax.tree.map(lambda x: x.dtype, state.stored_direction) == dtypes
      for name in ("rho", "perturbed_loss", "cosine", "clean_grad_norm", "perturbed_grad_norm"):
        assert getattr(state, name).dtype == jnp.float32, name
    grouped = optax_gsam.gsam(0.1, 0.3, num_groups=2)
    group_loss = functools.partial(scaled_by_group, f32_loss)
    zeros = optax.tree.zeros_like(p)
    updates, _ = jax.jit(functools.partial(grouped.update, loss_fn=group_loss))(
      zeros, grouped.init(p), p
    )
    assert jax.tree.map(lambda x: x.dtype, updates) == dtypes


def test_norms_of_bfloat16_gradients_are_accumulated_in_float32():
  # 4096 entries of 1 + 2^-7: their sum of squares is not representable in bfloat16
  # (which would round it to 4096 + 32 or worse); float32 holds it to 1e-7.
  n, value = 4096, 1.0 + 2.0**-7
  p = {"w": jnp.zeros(n, jnp.bfloat16)}
  coefficient = jnp.full(n, value, jnp.bfloat16)
  loss_fn = lambda q: jnp.sum((coefficient * q["w"]).astype(jnp.float32))
  tx = optax_gsam.gsam(0.1, 0.5)
  grads = jax.grad(loss_fn)(p)
  assert grads["w"].dtype == jnp.bfloat16
  updates, state = tx.update(grads, tx.init(p), p, loss_fn=loss_fn)
  expected = np.sqrt(n) * value
  assert float(state.clean_grad_norm) == pytest.approx(expected, rel=1e-6)
  assert float(state.cosine) == pytest.approx(1.0, rel=1e-6)
  assert updates["w"].dtype == jnp.bfloat16


def test_float32_params_stay_float32_with_x64_enabled():
  params, loss_fn = float32_problem(seed=11)
  with jax.enable_x64(True):
    tx = optax.chain(optax_gsam.gsam(0.1, 0.3, perturb_every=2), optax.sgd(0.1))
    update = jax.jit(lambda s: tx.update(jax.grad(loss_fn)(params), s, params, loss_fn=loss_fn))
    updates, state = update(tx.init(params))
    leaves = jax.tree.leaves((updates, state))
  assert {x.dtype for x in leaves} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}


def test_gradient_cache_and_big_vision_keep_mixed_dtypes():
  p = {"w": jnp.ones((3, 2), jnp.bfloat16), "s": jnp.float32(2.0)}
  embed = lambda q, x: (x @ q["w"].astype(jnp.float32)).astype(jnp.bfloat16)
  loss = lambda q, r: q["s"] * jnp.sum(r.astype(jnp.float32) ** 2)
  fn = optax_gsam.cached_value_and_grad(embed, loss, chunk_size=3)
  _, grads = jax.jit(fn)(p, jnp.ones((7, 3), jnp.float32))
  assert grads["w"].dtype == jnp.bfloat16 and grads["s"].dtype == jnp.float32

  bv_loss = lambda q, x, y: jnp.sum((x @ q["w"].astype(jnp.float32) * q["s"] - y) ** 2)
  gradient = functools.partial(big_vision.gsam_gradient, bv_loss)
  _, bv_grads = jax.jit(gradient)(
    p, jnp.ones((4, 3)), jnp.zeros((4, 2)), 0.6, 0.1, 0.5, 1e-3, 3e-3, 3e-5
  )
  assert bv_grads["w"].dtype == jnp.bfloat16 and bv_grads["s"].dtype == jnp.float32


# --- The Guarantees page names tests that exist ----------------------------------------------------


def test_every_test_named_in_the_guarantees_page_exists():
  root = pathlib.Path(__file__).resolve().parents[1]
  page = (root / "docs" / "guarantees.md").read_text()
  aliases = {"R": "test_reliability.py", "P": "test_properties.py"}
  named = re.findall(r"`(R|P|test_\w+\.py)::(test_\w+)`", page)
  assert len(named) > 20
  for module, test in named:
    source = (root / "tests" / aliases.get(module, module)).read_text()
    assert re.search(rf"^def {test}\(", source, re.M), f"{module}::{test}"
