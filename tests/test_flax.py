"""optax_gsam.flax.TrainState, optax_gsam.flax.nnx_loss_fn and the steps of docs/flax.md.

Consistency of the two passes is tested at a tiny rho (at rho = 0 the transform
outputs the clean gradient without using the perturbed pass): the perturbed
weights are then within 1e-5 of the clean ones, so the GSAM update is the base
optimizer's update on the clean gradient, to O(rho), exactly when the perturbed
pass sees the same dropout mask and the same inputs. A negative control with a
fresh key shows the test can fail.
"""

import functools
from typing import Any

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_common import LR
from _flax_common import TX_GSAM
from _flax_common import TX_PLAIN
from _flax_common import TX_TINY
from _flax_common import data
from _flax_common import max_tree_diff
from flax import nnx
from flax.linen import fp8_ops
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state as flax_train_state

import optax_gsam
from optax_gsam.flax import TrainState


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


class BatchNormState(TrainState):
  batch_stats: Any


def make_state(tx, cls=None):
  x, _ = data()
  variables = LinenNet().init(jax.random.key(0), x, train=False)
  return (cls or BatchNormState).create(
    apply_fn=LinenNet().apply,
    params=variables["params"],
    tx=tx,
    batch_stats=variables["batch_stats"],
  )


def mixup(key, x, y):
  lam = jax.random.uniform(key, minval=0.3, maxval=0.7)
  perm = jax.random.permutation(key, x.shape[0])
  return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


def forward_fn(state, x, y, dropout_key):
  def forward(params):
    logits, updates = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats},
      x,
      train=True,
      mutable=["batch_stats"],
      rngs={"dropout": dropout_key},
    )
    return optax.softmax_cross_entropy(logits, y).mean(), updates["batch_stats"]

  return forward


@jax.jit
def gsam_step(state, x, y, key):
  """The docs' Linen step: mix once, one dropout key, the clean pass's batch stats."""
  mix_key, dropout_key = jax.random.split(key)
  x, y = mixup(mix_key, x, y)
  forward = forward_fn(state, x, y, dropout_key)
  (loss, batch_stats), grads = jax.value_and_grad(forward, has_aux=True)(state.params)
  return state.apply_gradients(
    grads=grads, batch_stats=batch_stats, loss_fn=lambda p: forward(p)[0], value=loss
  )


@jax.jit
def gsam_step_fresh_randomness(state, x, y, key):
  """A wrong step: the perturbed pass re-mixes and draws a new dropout mask."""
  mix_key, dropout_key = jax.random.split(key)
  xm, ym = mixup(mix_key, x, y)
  forward = forward_fn(state, xm, ym, dropout_key)
  (loss, batch_stats), grads = jax.value_and_grad(forward, has_aux=True)(state.params)
  other_mix, other_dropout = jax.random.split(jax.random.fold_in(key, 1))
  xo, yo = mixup(other_mix, x, y)
  return state.apply_gradients(
    grads=grads,
    batch_stats=batch_stats,
    loss_fn=lambda p: forward_fn(state, xo, yo, other_dropout)(p)[0],
    value=loss,
  )


@jax.jit
def plain_step(state, x, y, key):
  """The base step: clean gradient, clean batch stats, no GSAM."""
  mix_key, dropout_key = jax.random.split(key)
  x, y = mixup(mix_key, x, y)
  forward = forward_fn(state, x, y, dropout_key)
  (_, batch_stats), grads = jax.value_and_grad(forward, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=batch_stats)


def test_linen_perturbed_pass_sees_clean_rng_and_inputs():
  x, y = data()
  key = jax.random.key(3)
  gsam, plain = make_state(TX_TINY), make_state(TX_PLAIN)
  for step in range(2):
    k = jax.random.fold_in(key, step)
    gsam, plain = gsam_step(gsam, x, y, k), plain_step(plain, x, y, k)
    chex.assert_trees_all_close(gsam.params, plain.params, rtol=1e-5, atol=1e-5)  # O(rho)
    chex.assert_trees_all_close(gsam.batch_stats, plain.batch_stats, rtol=1e-6, atol=1e-7)
  # Negative control: fresh randomness in the perturbed pass changes the update.
  wrong = gsam_step_fresh_randomness(make_state(TX_TINY), x, y, key)
  right = gsam_step(make_state(TX_TINY), x, y, key)
  assert max_tree_diff(wrong.params, right.params) > 1e-3


def test_linen_batch_stats_come_from_the_clean_pass():
  x, y = data()
  key = jax.random.key(4)
  rho = 0.5  # TX_GSAM's
  state = make_state(TX_GSAM)
  new_state = gsam_step(state, x, y, key)

  @jax.jit
  def clean_and_perturbed_stats(state):
    mix_key, dropout_key = jax.random.split(key)
    xm, ym = mixup(mix_key, x, y)
    forward = forward_fn(state, xm, ym, dropout_key)
    (_, clean_stats), g = jax.value_and_grad(forward, has_aux=True)(state.params)
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    perturbed = jax.tree.map(lambda w, gi: w + rho * gi / norm, state.params, g)
    return clean_stats, forward(perturbed)[1]

  clean_stats, perturbed_stats = clean_and_perturbed_stats(state)

  chex.assert_trees_all_close(new_state.batch_stats, clean_stats, rtol=1e-6, atol=1e-7)
  assert max_tree_diff(clean_stats, perturbed_stats) > 1e-3  # the test can tell them apart
  assert int(new_state.step) == 1
  assert float(optax.tree.get(new_state.opt_state, "last_rho")) == pytest.approx(rho)


class CustomKeywordState(BatchNormState):
  """A state whose tx has a transform of the user's own that reads `custom=`."""

  forwarded_keywords = (*TrainState.forwarded_keywords, "custom")


def recording_state(cls=None):
  """A TrainState whose transform records the extra arguments it receives."""
  seen = {}

  def update_fn(updates, state, params=None, **extra_args):
    seen.update(extra_args)
    return updates, state

  recorder = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
  return make_state(optax.chain(recorder, optax.sgd(LR)), cls), seen


def test_train_state_forwards_non_field_kwargs_only():
  state, seen = recording_state(CustomKeywordState)
  grads = jax.tree.map(jnp.ones_like, state.params)
  new_stats = jax.tree.map(lambda s: s + 1.0, state.batch_stats)

  def loss_fn(p):
    return 0.0

  new_state = state.apply_gradients(
    grads=grads, batch_stats=new_stats, loss_fn=loss_fn, value=2.0, custom=3
  )
  assert seen == {"loss_fn": loss_fn, "value": 2.0, "custom": 3}
  chex.assert_trees_all_close(new_state.batch_stats, new_stats)
  assert new_state.tx is state.tx and int(new_state.step) == 1
  chex.assert_trees_all_close(
    new_state.params, jax.tree.map(lambda w: w - LR, state.params), rtol=1e-6
  )


def test_train_state_without_extra_args_is_flax():
  tx = optax.adam(1e-2)
  ours = make_state(tx)
  theirs = flax_train_state.TrainState.create(apply_fn=ours.apply_fn, params=ours.params, tx=tx)
  grads = jax.tree.map(lambda w: jnp.full_like(w, 0.3), ours.params)
  # A plain optimizer ignores the extra args, so the same step runs without GSAM.
  a = ours.apply_gradients(grads=grads, loss_fn=lambda p: 0.0, value=1.0)
  b = theirs.apply_gradients(grads=grads)
  c = ours.apply_gradients(grads=grads)
  jax.tree.map(np.testing.assert_array_equal, a.params, b.params)
  jax.tree.map(np.testing.assert_array_equal, c.params, b.params)
  assert isinstance(a, BatchNormState) and int(a.step) == 1


# --- NNX -----------------------------------------------------------------------------------


# --- A misspelled field --------------------------------------------------------------------


@pytest.mark.parametrize(
  "typo,field", [("batch_stat", "batch_stats"), ("param", "params"), ("opt_stat", "opt_state")]
)
def test_apply_gradients_rejects_a_misspelled_field(typo, field):
  state = make_state(TX_GSAM)
  grads = jax.tree.map(jnp.ones_like, state.params)
  with pytest.raises(TypeError, match=rf"{typo}=.*did you mean {field}="):
    state.apply_gradients(grads=grads, loss_fn=lambda p: 0.0, **{typo: state.batch_stats})


def test_apply_gradients_forwards_names_far_from_every_field():
  # loss_fn is close-ish to apply_fn (0.53) and must still reach tx.update.
  state, seen = recording_state()
  grads = jax.tree.map(jnp.ones_like, state.params)
  state.apply_gradients(grads=grads, loss_fn=None, value_and_grad_fn=None, value=1.0, perturb=True)
  assert set(seen) == {"loss_fn", "value_and_grad_fn", "value", "perturb"}


# --- Mixed precision: DynamicScale (the recipe of docs/flax.md) -----------------------------


class ScaledState(TrainState):
  dynamic_scale: dynamic_scale_lib.DynamicScale


def dynamic_scale_step(loss_of, *, scale_perturbed_pass=True):
  """The docs' DynamicScale step; the wrong variant leaves the perturbed pass unscaled."""

  @jax.jit
  def step(state):
    dynamic_scale, _, loss, grads = state.dynamic_scale.value_and_grad(loss_of)(state.params)

    def perturbed_value_and_grad(params):
      if not scale_perturbed_pass:
        return jax.value_and_grad(loss_of)(params)
      result = state.dynamic_scale.value_and_grad(loss_of)(params)
      return result.aux, result.grad

    return state.apply_gradients(
      grads=grads,
      dynamic_scale=dynamic_scale,
      value_and_grad_fn=perturbed_value_and_grad,
      value=loss,
    )

  return step


def scaled_state(params, tx, scale):
  return ScaledState.create(
    apply_fn=None,
    params=params,
    tx=tx,
    dynamic_scale=dynamic_scale_lib.DynamicScale(scale=scale),
  )


@pytest.mark.float16
def test_dynamic_scale_recipe_scales_the_perturbed_pass():
  """In float16 a gradient of ~1e-9 underflows unless the loss is scaled, in both passes."""
  x = jnp.linspace(0.5, 1.5, 4)

  def loss_of(params, dtype=jnp.float16):
    z = jnp.sum(params["w"].astype(dtype) ** 2 * x.astype(dtype))
    return 1e-9 * z.astype(jnp.float32)  # the cotangent 1e-9 is 0 in float16

  tx = optax.chain(optax_gsam.sam(rho=0.5), optax.sgd(1e8))
  params = {"w": jnp.array([1.0, -0.5, 0.25, 2.0])}
  # The float32 reference: SAM's gradient, 2e-9 x (w + eps).
  reference_loss = functools.partial(loss_of, dtype=jnp.float32)
  g = jax.grad(reference_loss)(params)
  expected, _ = tx.update(g, tx.init(params), params, loss_fn=reference_loss)

  right = dynamic_scale_step(loss_of)(scaled_state(params, tx, 2.0**16))
  wrong = dynamic_scale_step(loss_of, scale_perturbed_pass=False)(scaled_state(params, tx, 2.0**16))
  moved = jax.tree.map(lambda a, b: a - b, right.params, params)
  chex.assert_trees_all_close(moved, expected, rtol=5e-3)
  # The unscaled perturbed gradient underflowed to zero: SAM made no step at all.
  chex.assert_trees_all_close(wrong.params, params)


@pytest.mark.float16
def test_dynamic_scale_recipe_with_on_nonfinite_clean_and_apply_if_finite():
  tx = optax.chain(
    optax_gsam.gsam(rho=40.0, alpha=0.3, on_nonfinite="clean"),
    optax.apply_if_finite(optax.sgd(0.01), max_consecutive_errors=10),
  )

  def loss_of(params):  # float16: the loss overflows past 65504, its gradient 2000 w too
    return jnp.sum(params["w"].astype(jnp.float16) ** 2 * 1000.0).astype(jnp.float32)

  step = dynamic_scale_step(loss_of)
  # The clean pass is finite, the perturbed one (|w + eps| ~ 40) overflows: the clean gradient.
  params = {"w": jnp.array([1.0, 2.0])}
  state = step(scaled_state(params, tx, 1.0))
  clean_grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2 * 1000.0))(params)
  chex.assert_trees_all_close(state.params, {"w": params["w"] - 0.01 * clean_grads["w"]}, rtol=1e-3)
  assert int(optax.tree.get(state.opt_state, "fallback_count")) == 1
  assert float(state.dynamic_scale.scale) == 1.0
  # With "propagate", apply_if_finite drops that step, and the scale does not move either.
  propagate_tx = optax.chain(
    optax_gsam.gsam(rho=40.0, alpha=0.3),
    optax.apply_if_finite(optax.sgd(0.01), max_consecutive_errors=10),
  )
  dropped = step(scaled_state(params, propagate_tx, 1.0))
  chex.assert_trees_all_close(dropped.params, params)
  assert float(dropped.dynamic_scale.scale) == 1.0
  # The clean gradient overflows (2000 w > 65504): apply_if_finite skips the step, DynamicScale
  # backs off, and the transform does not count it.
  big = {"w": jnp.array([40.0, 5.0])}
  state = step(scaled_state(big, tx, 1.0))
  chex.assert_trees_all_close(state.params, big)
  assert float(state.dynamic_scale.scale) == 0.5
  assert int(optax.tree.get(state.opt_state, "count")) == 0


# --- What loss_fn receives: fp8 overwrite-with-gradient collections --------------------------


class Fp8Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3, dot_general_cls=fp8_ops.Fp8DotGeneral)(x)


def test_fp8_loss_fn_receives_params_only_and_clean_fp8_statistics_are_stored():
  owg = fp8_ops.OVERWRITE_WITH_GRADIENT
  x, y = data()
  model = Fp8Net()
  state = TrainState.create(
    apply_fn=model.apply, params=model.init(jax.random.key(0), x), tx=TX_GSAM
  )

  def loss_of(variables):
    return optax.softmax_cross_entropy(state.apply_fn(variables, x), y).mean()

  grads = jax.grad(loss_of)(state.params)
  received = []

  def loss_fn(params):  # the docs' recipe: put back the fp8 collection from before the step
    received.append(jax.tree.structure(params))
    return loss_of({"params": params, owg: state.params[owg]})

  new_state = jax.jit(lambda s, g: s.apply_gradients(grads=g, loss_fn=loss_fn))(state, grads)
  assert received == [jax.tree.structure(state.params["params"])]
  # The clean pass's fp8 statistics are stored, and they differ from the initial ones.
  chex.assert_trees_all_close(new_state.params[owg], grads[owg])
  assert max_tree_diff(new_state.params[owg], state.params[owg]) > 0
  # The clean pass's function itself, given params["params"], finds no "params" collection.
  with pytest.raises(flax.errors.ScopeCollectionNotFound):
    jax.jit(lambda s, g: s.apply_gradients(grads=g, loss_fn=loss_of))(state, grads)


# --- Keywords nothing reads, and the two-function form of Flax's MNIST example ----------------


@pytest.mark.parametrize(
  "keyword,suggestion",
  [("stats", "batch_stats"), ("bn_stats", "batch_stats"), ("valu", "value"), ("custom", None)],
)
def test_apply_gradients_rejects_keywords_that_nothing_reads(keyword, suggestion):
  state, seen = recording_state()
  grads = jax.tree.map(jnp.ones_like, state.params)
  match = rf"got {keyword}=, which is neither a field.*" + (
    rf"did you mean {suggestion}=" if suggestion else r"forwarded_keywords = \(\*TrainState"
  )
  with pytest.raises(TypeError, match=match):
    state.apply_gradients(grads=grads, loss_fn=lambda p: 0.0, **{keyword: state.batch_stats})
  assert not seen  # nothing reached tx.update


def test_update_keyword_near_misses_are_caught_for_the_core_transforms():
  from optax_gsam._src.calls.user_functions import check_extra_args

  with pytest.raises(TypeError, match=r"valu=.*did you mean value="):
    check_extra_args(["valu"])
  with pytest.raises(TypeError, match=r"los_fn=.*did you mean loss_fn="):
    check_extra_args({"los_fn": None})
  check_extra_args(["value_fn", "grad", "batch_stats", "perturb", "value"])  # other transforms'
  # Through the transforms' update, as a chain forwards every keyword.
  w = jnp.ones(3)
  loss_fn = lambda v: jnp.sum(v**2)
  for tx in (optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.1)), optax_gsam.sam(0.1)):
    with pytest.raises(TypeError, match=r"valu=.*did you mean value="):
      tx.update(w, tx.init(w), w, loss_fn=loss_fn, valu=1.0)


def test_two_function_form_without_loss_fn_points_to_apply_gradients():
  """Flax's MNIST example: apply_model computes the gradients, update_model(state, grads)."""
  state = make_state(TX_GSAM)

  def update_model(state, grads):
    return state.apply_gradients(grads=grads)

  grads = jax.tree.map(jnp.ones_like, state.params)
  with pytest.raises(ValueError, match=r"apply_gradients\(grads=grads, loss_fn=loss_fn") as error:
    update_model(state, grads)
  assert "update_model(state, grads)" in str(error.value)
  assert "inside apply_model" in str(error.value)
  assert "return loss_fn from" not in str(error.value)  # a jitted apply_model cannot
  assert "use optax_gsam.flax.TrainState instead" not in str(error.value)


def build_optimizer_tx(num_steps=20):
  lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, num_steps, end_value=1e-4)
  rho = optax_gsam.rho_from_lr(lr, 0.1, 0.02, num_steps=num_steps)
  return optax.chain(optax_gsam.gsam(rho, alpha=0.3), optax.adamw(lr))


def test_optimizer_with_rho_from_lr_built_inside_nnx_eval_shape():
  abstract = nnx.eval_shape(
    lambda: nnx.Optimizer(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), build_optimizer_tx(), wrt=nnx.Param)
  )
  leaves = jax.tree.leaves(nnx.state(abstract))
  assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  state = make_state(TX_PLAIN)
  shapes = jax.eval_shape(lambda: build_optimizer_tx().init(state.params))
  assert jax.tree.structure(shapes) == jax.tree.structure(build_optimizer_tx().init(state.params))


# --- docs/flax.md: what the old lax.pmean kept with axis_name set computes ---------------------


def test_kept_pmean_with_axis_name_computes_what_the_docs_say():
  """Every device perturbs with the average g, decomposes g against its own g_p, outputs averaged."""
  rho, alpha, n = 0.3, 0.4, 2
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  x = np.asarray(jax.random.normal(jax.random.key(0), (8, 3)), np.float64)
  y = np.sin(x.sum(axis=1))
  w = np.array([0.5, -0.2, 0.1])

  def local_loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

  def step(tx, keep_pmean):
    def per_device(w, x, y):
      grads = jax.grad(local_loss)(w, x, y)
      if keep_pmean:
        grads = jax.lax.pmean(grads, "data")
      return tx.update(grads, tx.init(w), w, loss_fn=lambda v: local_loss(v, x, y))[0]

    return optax_gsam.data_parallel(per_device, mesh, axis_name="data", batch_argnums=(1, 2))

  per_device_tx = optax_gsam.gsam(rho, alpha, axis_name="data")
  kept = step(per_device_tx, True)(jnp.float32(w), x, y)
  # The formulas in float64: shard k's gradient g_k, the average g, one perturbation from g.
  grad_of = lambda w, k: np.asarray(
    jax.grad(local_loss)(w, x[4 * k : 4 * k + 4], y[4 * k : 4 * k + 4]), np.float64
  )
  with jax.enable_x64(True):
    g = np.mean([grad_of(w, k) for k in range(n)], axis=0)
    eps = rho * g / np.linalg.norm(g)
    outputs = []
    for k in range(n):
      g_p = grad_of(w + eps, k)
      g_perp = g - (g @ g_p) / (g_p @ g_p) * g_p  # the average, against this device's g_p
      outputs.append(g_p - alpha * g_perp)
  np.testing.assert_allclose(kept, np.mean(outputs, axis=0), rtol=1e-5)
  # Neither documented mode: per-device perturbation without the pmean, or the synchronized one.
  own = step(per_device_tx, False)(jnp.float32(w), x, y)
  sync = step(optax_gsam.gsam(rho, alpha, axis_name="data", sync_perturbation=True), False)(
    jnp.float32(w), x, y
  )
  assert float(jnp.max(jnp.abs(kept - own))) > 1e-4
  assert float(jnp.max(jnp.abs(kept - sync))) > 1e-4
  # With alpha = 0 (SAM) it is the synchronized step: nothing is decomposed.
  sam_kept = step(optax_gsam.sam(rho, axis_name="data"), True)(jnp.float32(w), x, y)
  sam_sync = step(optax_gsam.sam(rho, axis_name="data", sync_perturbation=True), False)(
    jnp.float32(w), x, y
  )
  np.testing.assert_allclose(sam_kept, sam_sync, rtol=1e-6)
