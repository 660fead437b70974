"""Non-finite values: a NaN or Inf in the clean or perturbed pass never corrupts the state.

`on_nonfinite="propagate"` (the default) lets `optax.apply_if_finite` see the bad step;
`on_nonfinite="clean"` outputs the clean gradient and counts the fallback.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import LR
from _problems import RHO
from _problems import all_finite
from _problems import assert_trees_equal
from _problems import float32_problem
from jax.sharding import PartitionSpec as P

import optax_gsam

EPS = 1e-12


BAD_STEPS = ["nan_clean_grad", "inf_clean_grad", "nan_perturbed_loss", "inf_perturbed_loss"]


@pytest.mark.parametrize("k", [None, 2])
def test_non_finite_step_does_not_corrupt_the_state(k):
  """After a bad step, the next output is that of a state which skipped it.

  A non-finite output does not advance the count; a finite one (an Inf perturbed loss with
  finite gradients) does, as the optimizer after the transform applies it."""
  p, loss_fn = float32_problem(seed=4)
  tx = optax_gsam.gsam(RHO, 0.3, policy=k and optax_gsam.every_k_policy(k))

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
    # the bad step did evaluate its gradients: only gradient_evaluations records it
    skipped = state._replace(
      count=after_bad.count, gradient_evaluations=after_bad.gradient_evaluations
    )
    assert all_finite((after_bad.count, after_bad.last_rho, after_bad.stored_direction)), kind
    if k:
      assert_trees_equal(after_bad.stored_direction, state.stored_direction)
    out_bad, next_bad = update(after_bad, *good)
    out_skip, next_skip = update(skipped, *good)
    assert all_finite(out_bad), kind
    assert_trees_equal(out_bad, out_skip)
    if k:  # a cheap step keeps the last full step's diagnostics: compare the rest
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
    optax_gsam.gsam(RHO, 0.3, policy=optax_gsam.every_k_policy(2)),
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


def nan_at_perturbed(loss_jax, params):
  """A loss that is finite at ``params`` and NaN anywhere else (every perturbed point)."""
  anchor = jax.tree.map(jnp.copy, params)

  def loss(q):
    moved = sum(
      jnp.sum((a - b) ** 2)
      for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(anchor), strict=True)
    )
    return loss_jax(q) * jnp.where(moved > 0, jnp.nan, 1.0)  # NaN loss and gradient

  return loss


@pytest.mark.parametrize("transform", ["gsam", "sam"])
def test_on_nonfinite_clean_outputs_the_clean_gradient_and_counts(transform):
  p, loss_jax = float32_problem(seed=33)
  bad = nan_at_perturbed(loss_jax, p)
  make = optax_gsam.sam if transform == "sam" else lambda rho, **kw: optax_gsam.gsam(rho, 0.3, **kw)
  grads = jax.grad(loss_jax)(p)
  propagate = make(0.1)
  out, _ = propagate.update(grads, propagate.init(p), p, loss_fn=bad)
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  clean = make(0.1, on_nonfinite="clean")
  state = clean.init(p)
  out, state = jax.jit(lambda s: clean.update(grads, s, p, loss_fn=bad))(state)
  jax.tree.map(np.testing.assert_array_equal, out, grads)
  assert int(state.fallback_count) == 1 and int(state.count) == 1
  assert state.fallback_count.dtype == jnp.int32
  # A finite perturbed pass is no fallback.
  _, state = clean.update(grads, state, p, loss_fn=loss_jax)
  assert int(state.fallback_count) == 1 and int(state.count) == 2
  # A non-finite clean gradient is not rescued: it propagates, uncounted.
  nan_grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  out, state = clean.update(nan_grads, state, p, loss_fn=bad)
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  assert int(state.fallback_count) == 1 and int(state.count) == 2


def test_on_nonfinite_clean_keeps_training_behind_apply_if_finite():
  """A loss that is NaN at every perturbed point stalls a propagating chain forever.

  ``optax.apply_if_finite`` checks the updates it receives, so it goes after the transform.
  """
  p, loss_jax = float32_problem(seed=34)

  def train(on_nonfinite):
    tx = optax.chain(
      optax_gsam.gsam(0.1, 0.3, on_nonfinite=on_nonfinite),
      optax.apply_if_finite(optax.sgd(0.05), max_consecutive_errors=100),
    )

    @jax.jit
    def step(params, state):
      bad = nan_at_perturbed(loss_jax, params)
      loss, grads = jax.value_and_grad(loss_jax)(params)
      updates, state = tx.update(grads, state, params, loss_fn=bad, value=loss)
      return optax.apply_updates(params, updates), state

    params, state = p, tx.init(p)
    for _ in range(5):
      params, state = step(params, state)
    return params, state

  stalled, _ = train("propagate")
  jax.tree.map(np.testing.assert_array_equal, stalled, p)
  trained, state = train("clean")
  plain = p
  for _ in range(5):
    plain = jax.tree.map(lambda w, g: w - 0.05 * g, plain, jax.grad(loss_jax)(plain))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), trained, plain)
  assert int(optax.tree.get(state, "fallback_count")) == 5


NONFINITE_ON_ONE_DEVICE = {
  # A NaN loss whose gradient is finite (zero) there.
  "nan_loss": lambda local, q, bad: jnp.where(bad, jnp.nan, local(q)),
  # A finite loss whose gradient is NaN: d sqrt(u) at u = 0 is inf, times 0.
  "nan_gradient": lambda local, q, bad: (
    local(q) + jnp.where(bad, jnp.sqrt(0.0 * jnp.sum(q["w"] ** 2)), 0.0)
  ),
}


@pytest.mark.parametrize("kind", list(NONFINITE_ON_ONE_DEVICE))
def test_on_nonfinite_clean_under_per_device_perturbation(kind, data_mesh):
  """One device's non-finite perturbed pass makes every device output the averaged clean gradient."""
  p, loss_jax = float32_problem(seed=35)
  mesh = data_mesh
  tx = optax_gsam.gsam(0.1, 0.3, axis_name="data", on_nonfinite="clean")
  x = jnp.arange(8.0)

  def step(params, state, xb):
    local = lambda q: loss_jax(q) * (1.0 + xb[0])
    bad = lambda q: NONFINITE_ON_ONE_DEVICE[kind](local, q, xb[0] == 3.0)
    updates, state = tx.update(jax.grad(local)(params), state, params, loss_fn=bad)
    return updates, state

  updates, state = optax_gsam.data_parallel(
    step, mesh, axis_name="data", batch_argnums=(2,), out_specs=(P(), P())
  )(p, tx.init(p), x)
  expected = jax.tree.map(lambda g: g * jnp.mean(1.0 + x), jax.grad(loss_jax)(p))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected)
  assert int(state.fallback_count) == 1 and int(state.full_steps) == 0


# --- The decomposition's verdict, read from its statistics -------------------------------------

BIG = 3.0e38  # near float32's largest finite value


def _decomposed_reference(clean, perturbed, alpha, minimize_fp):
  """GSAM's output from its formula in float64, then rounded to float32 entry by entry."""
  c, p = np.asarray(clean, np.float64), np.asarray(perturbed, np.float64)
  base, other = (p, c) if minimize_fp else (c, p)
  with np.errstate(all="ignore"):
    projected = other - (other @ base) / (base @ base) * base if base @ base else other
    sign = -1.0 if minimize_fp else 1.0
    return (base + sign * alpha * projected).astype(np.float32)


PAIRS = {
  "ordinary": ([0.5, -1.0, 2.0], [1.0, 0.25, -3.0]),
  "tiny": ([1e-30, -2e-31, 0.0], [3e-31, 1e-30, 1e-32]),
  "zero perturbed": ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]),
  "large and finite": ([1e30, -2e30, 0.0], [3e30, 1e29, -1e30]),
  "overflows": ([-BIG, BIG, 0.0], [BIG, BIG, 0.0]),  # g_p - g_c overflows in its first entry
  "inf clean": ([np.inf, 1.0, 0.0], [1.0, 2.0, 3.0]),
  "nan perturbed": ([1.0, 2.0, 3.0], [np.nan, 1.0, 0.0]),
}


@pytest.mark.parametrize("form", ["this backend's", "one pass (GPU, TPU)"])
@pytest.mark.parametrize("minimize_fp", [True, False])
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_the_decompositions_verdict_is_its_outputs_finiteness(pair, minimize_fp, form):
  """Without a reduction of the output: True exactly where every entry of the output is finite,
  for both forms of the statistics (the CPU's two-pass and the accelerators' one-pass sums)."""
  from optax_gsam._src.directions import perturbation as pert
  from optax_gsam._src.directions.finite_output import decomposed_is_finite

  clean, perturbed = (jnp.asarray(x, jnp.float32) for x in PAIRS[pair])
  if form == "this backend's":
    stats = jax.jit(optax_gsam.gradient_stats)(clean, perturbed)
  else:  # compiled: XLA's simplifier then sees the scaled sums (a scalar leaf's among them)
    stats = pert.GradientStats(*jax.jit(pert._one_pass_pair_stats)(clean, perturbed))
  alpha = 1.0
  verdict = decomposed_is_finite(stats, alpha, minimize_fp=minimize_fp, eps=EPS, like=clean)
  reference = _decomposed_reference(PAIRS[pair][0], PAIRS[pair][1], alpha, minimize_fp)
  output = optax_gsam.decompose(clean, perturbed, alpha, minimize_fp=minimize_fp, stats=stats)
  assert bool(verdict) == bool(np.all(np.isfinite(reference))), (verdict, reference)
  assert bool(verdict) == bool(jnp.all(jnp.isfinite(output))), (verdict, output)


def test_a_float16_output_is_checked_itself():
  """float16 overflows far below the bound the verdict reads: its entries are checked instead."""
  from optax_gsam._src.directions.finite_output import decomposed_is_finite

  half = jnp.ones(3, jnp.float16)
  stats = optax_gsam.gradient_stats(half, half)
  assert decomposed_is_finite(stats, 0.5, minimize_fp=True, eps=EPS, like=half) is None
  mixed = {"a": jnp.ones(2, jnp.bfloat16), "b": half}
  assert decomposed_is_finite(stats, 0.5, minimize_fp=True, eps=EPS, like=mixed) is None
  assert decomposed_is_finite(stats, 0.5, minimize_fp=True, eps=EPS, like=half.astype(jnp.bfloat16))


def test_float64_outputs_are_checked_themselves():
  """float64 statistics overflow long before float64 does: its entries are checked instead."""
  from optax_gsam._src.directions.finite_output import decomposed_is_finite

  with jax.enable_x64(True):
    clean, perturbed = jnp.array([1.0, 2.0, 0.0]), jnp.array([1e200, -1e200, 0.0])
    stats = optax_gsam.gradient_stats(clean, perturbed)
    assert decomposed_is_finite(stats, 1.0, minimize_fp=True, eps=EPS, like=clean) is None
    tx = optax_gsam.gsam(RHO, 1.0)
    value_and_grad_fn = lambda params: (jnp.float64(1.0), perturbed)
    out, state = tx.update(clean, tx.init(clean), clean, value_and_grad_fn=value_and_grad_fn)
    assert bool(jnp.all(jnp.isfinite(out))) and int(state.count) == 1


@pytest.mark.parametrize("on_nonfinite", ["propagate", "clean"])
def test_a_decomposition_that_overflows_does_not_count(on_nonfinite):
  """Finite gradients whose decomposition overflows: the step does not count, as
  optax.apply_if_finite then skips it; with "clean" the output is the clean gradient, and counts."""
  clean, perturbed = (jnp.asarray(x, jnp.float32) for x in PAIRS["overflows"])
  w = jnp.zeros(3)
  tx = optax_gsam.gsam(RHO, 1.0, on_nonfinite=on_nonfinite)
  value_and_grad_fn = lambda params: (jnp.float32(1.0), perturbed)
  update = jax.jit(lambda s: tx.update(clean, s, w, value_and_grad_fn=value_and_grad_fn))
  out, state = update(tx.init(w))
  assert int(state.full_steps) == 0
  if on_nonfinite == "clean":  # the clean gradient is finite: that step counts
    np.testing.assert_array_equal(out, clean)
    assert int(state.fallback_count) == 1 and int(state.count) == 1
  else:
    assert not bool(jnp.all(jnp.isfinite(out)))
    assert int(state.count) == 0
