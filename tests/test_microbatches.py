"""Micro-batches: whole-batch (exact accumulation) and per-micro-batch (m-sharpness) semantics.

Both against float64 references from the formulas (tests/_ascent_reference.py),
on one device and per device under data_parallel; memory from the compiled
program; and optax.MultiSteps, which cannot be right, refused.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ascent_reference import ALPHA
from _ascent_reference import DIRECTIONS
from _ascent_reference import LR
from _ascent_reference import NUM_DEVICES
from _ascent_reference import RHO
from _ascent_reference import flat
from _ascent_reference import loss_jax
from _ascent_reference import make_data
from _ascent_reference import reference_run
from _problems import optimization_barriers

import optax_gsam

K = 4  # micro-batches


def batch_loss(p, batch):
  return loss_jax(p, *batch)


def run(params, x, t, tx, num_steps=3, pass_clean=False, sharded_on=None):
  """``num_steps`` steps of ``update(None or g_c, ..., loss_fn(p, microbatch), batch=...)``."""

  def step(p, opt_state, batch):
    clean = jax.grad(batch_loss)(p, batch) if pass_clean else None
    updates, opt_state = tx.update(clean, opt_state, p, loss_fn=batch_loss, batch=batch)
    return optax.apply_updates(p, updates), opt_state

  step = jax.jit(step) if sharded_on is None else optax_gsam.data_parallel(step, sharded_on)
  p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
  for _ in range(num_steps):
    p, state = step(p, state, (jnp.asarray(x), jnp.asarray(t)))
  return p, state


def gsam_chain(**kwargs):
  return optax.chain(optax_gsam.gsam(RHO, ALPHA, **kwargs), optax.sgd(LR))


@pytest.mark.parametrize("pass_clean", [False, True])
@pytest.mark.parametrize("name", ["sam", "friendly"])
def test_whole_batch_semantics_is_gsam_on_the_whole_batch(pass_clean, name):
  direction, kwargs = DIRECTIONS[name]
  with jax.enable_x64(True):
    params, x, t = make_data(11)
    p, state = run(params, x, t, gsam_chain(microbatches=K, **kwargs), pass_clean=pass_clean)
    expected = reference_run(params, x, t, direction, shards=1)
    np.testing.assert_allclose(flat(p), expected, rtol=1e-12, atol=1e-13)
    assert int(state[0].gradient_evaluations) == 3 * (1 if pass_clean else 2)


# Per-micro-batch semantics, for every direction with gsam and sam, masks and n ascent steps:
# tests/test_ascent.py's table (the "8-devices-per-microbatch" layout).


@pytest.mark.parametrize(
  "kwargs, shards",
  [
    (dict(), NUM_DEVICES),  # per device, each device's micro-batches accumulated
    (dict(sync_perturbation=True), 1),  # synchronized: the global batch
    (dict(perturb_each_microbatch=True), NUM_DEVICES * 2),  # every micro-batch of every device
  ],
  ids=["per-device", "sync", "per-microbatch"],
)
def test_microbatches_under_data_parallel_match_the_reference(kwargs, shards):
  direction, _ = DIRECTIONS["sam"]
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  with jax.enable_x64(True):
    params, x, t = make_data(13)
    tx = gsam_chain(microbatches=2, axis_name="data", **kwargs)
    p, _ = run(params, x, t, tx, sharded_on=mesh)
    expected = reference_run(params, x, t, direction, shards=shards)
    np.testing.assert_allclose(flat(p), expected, rtol=1e-10)


def test_every_k_and_on_nonfinite_with_microbatches_equal_the_whole_batch_step():
  with jax.enable_x64(True):
    params, x, t = make_data(14)
    options = dict(policy=optax_gsam.every_k_policy(2), on_nonfinite="clean")
    p_micro, s_micro = run(params, x, t, gsam_chain(microbatches=K, **options), num_steps=4)
    whole = gsam_chain(**options)

    @jax.jit
    def whole_step(p, s):
      loss_fn = lambda q: loss_jax(q, jnp.asarray(x), jnp.asarray(t))
      updates, s = whole.update(jax.grad(loss_fn)(p), s, p, loss_fn=loss_fn)
      return optax.apply_updates(p, updates), s

    p, s = jax.tree.map(jnp.asarray, params), whole.init(params)
    for _ in range(4):
      p, s = whole_step(p, s)
    np.testing.assert_allclose(flat(p_micro), flat(p), rtol=1e-12)
    assert int(s_micro[0].full_steps) == int(s[0].full_steps) == 2


def test_momentum_sam_with_microbatches_is_momentum_sam_on_the_whole_batch():
  with jax.enable_x64(True):
    params, x, t = make_data(15)
    micro = optax.chain(optax_gsam.momentum_sam(RHO, microbatches=K), optax.sgd(LR))
    p_micro, _ = run(params, x, t, micro)
    whole = optax.chain(optax_gsam.momentum_sam(RHO), optax.sgd(LR))

    @jax.jit
    def whole_step(p, s):
      loss_fn = lambda q: loss_jax(q, jnp.asarray(x), jnp.asarray(t))
      updates, s = whole.update(optax.tree.zeros_like(p), s, p, loss_fn=loss_fn)
      return optax.apply_updates(p, updates), s

    p, s = jax.tree.map(jnp.asarray, params), whole.init(params)
    for _ in range(3):
      p, s = whole_step(p, s)
    np.testing.assert_allclose(flat(p_micro), flat(p), rtol=1e-12)


def _temp_bytes(num_microbatches, microbatch_size=64, width=256, transform=None, base=optax.sgd):
  """Compiled temporary bytes of one micro-batched step of a tanh MLP, and the params' bytes.

  ``transform(k)`` is the sharpness-aware stage before SGD (GSAM by default); ``"scan"`` is
  SGD with its gradient accumulated in a ``lax.scan`` written here, the baseline.
  """
  rng = np.random.default_rng(0)
  params = {
    "w1": jnp.asarray(rng.normal(size=(32, width)), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(width, 10)), jnp.float32),
  }
  k, n = num_microbatches, num_microbatches * microbatch_size
  batch = (jnp.ones((n, 32)), jnp.ones((n, 10)))
  loss = lambda p, b: jnp.mean((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2)
  if transform == "scan":
    tx = base(0.1)

    def step(p, s, b):
      add = lambda total, piece: (jax.tree.map(jnp.add, total, jax.grad(loss)(p, piece)), None)
      pieces = jax.tree.map(lambda a: a.reshape(k, -1, *a.shape[1:]), b)
      total, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, p), pieces)
      updates, s = tx.update(jax.tree.map(lambda g: g / k, total), s, p)
      return optax.apply_updates(p, updates), s

  else:
    transform = transform or (lambda k: optax_gsam.gsam(0.05, 0.3, microbatches=k))
    tx = optax.chain(transform(k), base(0.1))

    def step(p, s, b):
      updates, s = tx.update(None, s, p, loss_fn=loss, batch=b)
      return optax.apply_updates(p, updates), s

  compiled = jax.jit(step).lower(params, tx.init(params), batch).compile()
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  return compiled.memory_analysis().temp_size_in_bytes, param_bytes


def test_temporary_memory_is_flat_in_the_number_of_microbatches():
  (two, _), (sixteen, _) = _temp_bytes(2), _temp_bytes(16)
  activations = 16 * 64 * 256 * 4  # what one more copy of 14 micro-batches' hidden layer costs
  assert sixteen <= 1.05 * two, (two, sixteen)
  assert sixteen - two < activations / 10


# The parameter-sized buffers each may hold beyond the scanned baseline's: GSAM the perturbed
# weights and the perturbed gradient's sum beside the clean one; SAM the same (its diagnostics
# read the clean gradient after the perturbed pass); SAM without them only the perturbed weights.
MEMORY_ALLOWANCE = {
  "gsam": (lambda k: optax_gsam.gsam(0.05, 0.3, microbatches=k), 2),
  "sam": (lambda k: optax_gsam.sam(0.05, microbatches=k), 2),
  "sam diagnostics=False": (lambda k: optax_gsam.sam(0.05, microbatches=k, diagnostics=False), 1),
}


@pytest.mark.parametrize(
  ("microbatch_size", "optimizer"),
  [(16, optax.sgd), (64, optax.sgd), (256, optax.sgd), (16, optax.adamw)],
  ids=["16-sgd", "64-sgd", "256-sgd", "16-adamw"],
)
@pytest.mark.parametrize("name", list(MEMORY_ALLOWANCE))
def test_memory_beyond_an_accumulating_scan_is_the_buffers_the_method_needs(
  name, microbatch_size, optimizer
):
  """Counted to 1% of a buffer (scalars), at every micro-batch size: a scan sum shared between
  passes, a scaled copy shared by two reductions or a late finiteness check would add one."""
  transform, allowed = MEMORY_ALLOWANCE[name]
  (base, param_bytes), (found, _) = (
    _temp_bytes(4, microbatch_size, 512, "scan", optimizer),
    _temp_bytes(4, microbatch_size, 512, transform, optimizer),
  )
  assert (found - base) / param_bytes <= allowed + 0.01, (found, base, param_bytes)


def test_diagnostics_false_gives_the_same_step_and_leaves_the_statistics_at_zero():
  params, x, t = make_data(16)
  batch = (jnp.asarray(x), jnp.asarray(t))
  outs = []
  for diagnostics in (True, False):
    tx = optax.chain(optax_gsam.sam(0.05, microbatches=K, diagnostics=diagnostics), optax.sgd(0.1))
    updates, state = tx.update(None, tx.init(params), params, loss_fn=batch_loss, batch=batch)
    outs.append((updates, state[0]))
  (updates, full), (lean_updates, lean) = outs
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), updates, lean_updates)
  assert float(full.cosine) > 0 and float(full.clean_grad_norm) > 0
  assert float(lean.cosine) == float(lean.clean_grad_norm) == float(lean.perturbed_grad_norm) == 0
  assert float(lean.perturbed_loss) == float(full.perturbed_loss)
  assert float(lean.surrogate_gap) == float(full.surrogate_gap)


def test_multisteps_around_sam_is_refused_with_the_microbatch_api():
  """optax.MultiSteps would perturb with the accumulated gradient and evaluate the last loss_fn."""
  params, x, t = jax.tree.map(lambda a: np.asarray(a, np.float32), make_data(16))
  tx = optax.MultiSteps(optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1)), every_k_schedule=4)
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x[:8]), jnp.asarray(t[:8]))
  with pytest.raises(ValueError, match=r"optax.MultiSteps.*microbatches=k"):
    tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
  momentum = optax.MultiSteps(optax_gsam.momentum_sam(0.05), every_k_schedule=2)
  with pytest.raises(ValueError, match=r"optax\.MultiSteps"):
    momentum.update(params, momentum.init(params), params, loss_fn=loss_fn)


def test_multisteps_called_as_the_microbatch_docs_call_it_names_microbatches():
  """update(None, ...) used to fail inside MultiSteps with optax's pytree-structure error."""
  params, x, t = make_data(16)
  batch = (jnp.asarray(x), jnp.asarray(t))
  inner = optax.chain(optax_gsam.sam(0.05, microbatches=K), optax.sgd(0.1))
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  with pytest.raises(ValueError, match=r"optax.MultiSteps.*microbatches=k"):
    tx.update(None, tx.init(params), params, loss_fn=batch_loss, batch=batch)


def test_multisteps_with_a_model_state_names_accumulate_value_and_grad():
  """The fix MultiSteps' error showed, update(None, ...), is itself refused with model_state=:
  the error names the route that keeps the new model state, and that route runs."""
  params, x, t = jax.tree.map(jnp.asarray, make_data(16))
  batch = (x, t)
  counted = lambda p, count, microbatch: (batch_loss(p, microbatch), count + 1)
  inner = optax.chain(optax_gsam.sam(0.05, microbatches=K), optax.sgd(0.1))
  with pytest.raises(
    ValueError,
    match=r"optax.MultiSteps.*With a model state.*loss_fn\(params, model_state, microbatch\).*"
    r"optax_gsam\.accumulate_value_and_grad\(loss_fn, params, batch, microbatches=k, "
    r"model_state=model_state\), then pass grads \(not None\) to update\(\)",
  ):
    optax.MultiSteps(inner, every_k_schedule=2).init(params)
  inputs = dict(batch=batch, model_state=jnp.zeros([], jnp.int32))
  (_, count), grads = optax_gsam.accumulate_value_and_grad(
    counted, params, microbatches=K, **inputs
  )
  inner.update(grads, inner.init(params), params, loss_fn=counted, **inputs)
  assert int(count) == K


def test_the_call_form_error_names_the_function_that_calls_loss_fn():
  """momentum_sam's and accumulate_value_and_grad's errors used to say 'gsam/sam call'."""
  params, x, t = jax.tree.map(jnp.asarray, make_data(17))
  batch = (x, t)
  whole = lambda p: batch_loss(p, batch)
  tx = optax_gsam.momentum_sam(RHO, microbatches=K)
  with pytest.raises(ValueError, match=r"momentum_sam calls loss_fn\(params, microbatch\)"):
    tx.update(None, tx.init(params), params, loss_fn=whole, batch=batch)
  with pytest.raises(
    ValueError, match=r"optax_gsam\.accumulate_value_and_grad calls loss_fn\(params, microbatch\)"
  ):
    optax_gsam.accumulate_value_and_grad(whole, params, batch, microbatches=K)
  gsam = optax_gsam.gsam(RHO, microbatches=K)
  with pytest.raises(ValueError, match=r"gsam/sam calls loss_fn\(params, microbatch\)"):
    gsam.update(None, gsam.init(params), params, loss_fn=whole, batch=batch)


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda tx, s, p, b: tx.update(None, s, p, loss_fn=batch_loss, batch=()), "batch has no"),
    (
      lambda tx, s, p, b: tx.update(None, s, p, loss_fn=batch_loss, batch=(b[0][:30], b[1][:30])),
      "divisible by 4",
    ),
    (
      lambda tx, s, p, b: tx.update(None, s, p, loss_fn=batch_loss, batch=(b[0][:0], b[1][:0])),
      "no examples",
    ),
  ],
)
def test_a_batch_the_microbatches_do_not_divide_is_named(call, match):
  params, x, t = make_data(17)
  tx = optax_gsam.gsam(RHO, microbatches=K)
  with pytest.raises(ValueError, match=match):
    call(tx, tx.init(params), params, (jnp.asarray(x), jnp.asarray(t)))


@pytest.mark.parametrize("extra", [(4,), (1, 3)], ids=["constant-of-length-k", "other-size"])
def test_a_batch_leaf_with_another_leading_size_is_refused(extra):
  """A per-batch constant (class weights) in batch used to be cut into k pieces silently."""
  params, x, t = make_data(17)
  batch = {"x": jnp.asarray(x), "t": jnp.asarray(t), "class_weights": jnp.ones(extra)}
  tx = optax_gsam.gsam(RHO, microbatches=K)
  with pytest.raises(ValueError, match=r"batch\['class_weights'\].*leading size.*Close over"):
    tx.update(
      None,
      tx.init(params),
      params,
      loss_fn=lambda p, b: batch_loss(p, (b["x"], b["t"])),
      batch=batch,
    )


def test_an_index_form_loss_of_one_argument_names_the_index():
  """microbatches=k without batch= calls loss_fn(params, index); a one-argument loss used to
  give Python's 'takes 1 positional argument' TypeError."""
  params, x, t = make_data(17)
  tx = optax_gsam.gsam(RHO, microbatches=K)
  loss_fn = lambda p: batch_loss(p, (jnp.asarray(x), jnp.asarray(t)))
  with pytest.raises(ValueError, match=r"loss_fn\(params, index\).*micro-batch index.*batch="):
    tx.update(None, tx.init(params), params, loss_fn=loss_fn)


def test_microbatches_larger_than_a_device_shard_say_it_is_per_device():
  params, x, t = make_data(17)  # 32 rows: 4 per device, which 8 micro-batches do not divide
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",))
  tx = gsam_chain(microbatches=8, axis_name="data")
  with pytest.raises(ValueError, match=r"one device's shard.*multiple of 8 times the number"):
    run(params, x, t, tx, num_steps=1, sharded_on=mesh)


def test_updates_none_or_batch_without_microbatches_is_refused():
  params, x, t = make_data(18)
  tx = optax_gsam.gsam(RHO)
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x), jnp.asarray(t))
  with pytest.raises(ValueError, match="updates is None"):
    tx.update(None, tx.init(params), params, loss_fn=loss_fn)
  with pytest.raises(ValueError, match=r"batch=.*microbatches=k"):
    tx.update(params, tx.init(params), params, loss_fn=loss_fn, batch=(x, t))
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="num_groups=G is"):
    optax_gsam.gsam(RHO, microbatches=2, num_groups=2)
  with pytest.raises(ValueError, match="perturb_each_microbatch=True needs microbatches"):
    optax_gsam.gsam(RHO, perturb_each_microbatch=True)


def test_a_gradient_cache_per_microbatch_is_the_dense_micro_batched_step():
  """value_and_grad_fn(params, microbatch) from cached_value_and_grad: each micro-batch's
  contrastive loss, exact, in chunks of 2."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(19)
    params = {"a": rng.normal(size=(5, 3)), "b": rng.normal(size=(4, 3))}
    batch = (rng.normal(size=(16, 5)), rng.normal(size=(16, 4)))
    unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    embed = lambda p, pair: (unit(jnp.tanh(pair[0] @ p["a"])), unit(jnp.tanh(pair[1] @ p["b"])))
    loss = lambda p, reps: optax_gsam.clip_loss(*reps, 1.0)
    cached = optax_gsam.cached_value_and_grad(embed, loss, chunk_size=2)
    dense = lambda p, microbatch: loss(p, embed(p, microbatch))
    outputs = []
    for fn in (dict(value_and_grad_fn=cached), dict(loss_fn=dense)):
      tx = optax_gsam.gsam(RHO, ALPHA, microbatches=2)
      out, _ = tx.update(None, tx.init(params), params, batch=batch, **fn)
      outputs.append(np.concatenate([np.ravel(out["a"]), np.ravel(out["b"])]))
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-10)


def test_the_clean_passs_mean_is_behind_a_barrier_when_lowered_for_tpu_only():
  """TPU's compiler otherwise folds the mean into late readers (benchmarks/compiled/tpu_compile.py);
  the CPU's one barrier orders the output's finiteness check (the next test). The TPU's barrier
  is the one every full step passes (tests/test_tpu_sharded.py measures it)."""
  params, x, t = make_data(16)
  batch = (jnp.asarray(x), jnp.asarray(t))
  tx = optax.chain(optax_gsam.gsam(0.05, 0.3, microbatches=K), optax.sgd(0.1))
  step = lambda p, s: tx.update(None, s, p, loss_fn=batch_loss, batch=batch)[0]
  assert optimization_barriers(step, params, tx.init(params)) == {"cpu": 1, "tpu": 1}


def test_the_outputs_finiteness_check_is_behind_a_barrier_when_lowered_for_cpu():
  """XLA's CPU compiler otherwise reads the output after SGD's update and keeps it: SAM held 3
  parameter buffers over the scan, not 2 (test_memory_beyond_an_accumulating_scan...)."""
  params, x, t = make_data(16)
  tx = optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1))
  loss_fn = lambda p: batch_loss(p, (jnp.asarray(x), jnp.asarray(t)))
  step = lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p, loss_fn=loss_fn)[0]
  assert (
    optimization_barriers(step, params, tx.init(params))["cpu"] == 1
  )  # TPU's: tests/test_step.py


@pytest.mark.parametrize("k", [4, NUM_DEVICES])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("stateful", [False, True], ids=["loss_fn", "model_state"])
def test_a_sharded_batch_reaches_its_microbatches_without_a_gather(explicit, stateful, k):
  """Micro-batch i is rows [i n, (i + 1) n) of the global batch, which the mesh splits. Sliced
  at a traced offset along the rows, XLA gathered the whole batch onto every device first, under
  any axes (on the GPU compiler, a ViT-L/16's 1024 images, 588 MiB a GPU); cut into blocks once,
  only each device's share moves (an all-to-all). Under Auto axes XLA learns the micro-batch's
  layout from the loss's own constraint, as a data-parallel model states it."""
  axis_types = (jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto,)
  mesh = jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=axis_types)
  rows, width = 32 * NUM_DEVICES, 48
  params = {"w": jnp.zeros((width, 3)), "b": jnp.zeros(3)}
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  batch = (
    jax.device_put(jnp.ones((rows, width)), batch_sharding),
    jax.device_put(jnp.zeros(rows, jnp.int32), batch_sharding),
  )

  def loss(p, b):
    if not explicit:  # a data-parallel model's constraint on its inputs
      b = jax.lax.with_sharding_constraint(b, jax.sharding.PartitionSpec("data"))
    logits = b[0] @ p["w"] + p["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=1))

  if stateful:
    step = lambda p, b: optax_gsam.accumulate_value_and_grad(
      lambda p, s, b: (loss(p, b), s + 1.0), p, b, microbatches=k, model_state=jnp.zeros([])
    )[1]
  else:
    tx = optax_gsam.gsam(RHO, ALPHA, microbatches=k)
    step = lambda p, b: tx.update(None, tx.init(p), p, loss_fn=loss, batch=b)[0]
  with jax.set_mesh(mesh):
    text = jax.jit(step).lower(params, batch).compile().as_text()
  gathers = [line for line in text.splitlines() if " all-gather(" in line]
  if explicit:  # the layout is in the types: each device's share moves, nothing is gathered
    assert not gathers, gathers[:2]
  whole = {"f32": rows * width, "s32": rows}  # each leaf's elements in the global batch
  for line in gathers:  # XLA may gather a group's blocks (Auto axes, a few), never the batch
    dtype, shape = re.search(r"= (\w+)\[([\d,]*)\]", line).groups()
    assert math.prod(int(d) for d in shape.split(",")) < whole[dtype], line.strip()[:120]
