"""Cheap-step policies against references written from their formulas (numpy, float64)."""

import functools
import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import SCALES
from _problems import all_finite
from _problems import flatten
from _problems import float32_problem
from _problems import make_problem
from _problems import runtime_conditionals
from _problems import unflatten
from jax.sharding import PartitionSpec as P

import optax_gsam

EPS = 1e-12
LR = 0.05


def gsam_direction(w, g_c, grad_np, like, rho, alpha):
  """GSAM's output (minimize_fp) from the paper's formulas."""
  e = rho * g_c / np.linalg.norm(g_c)
  g_p = flatten(grad_np(unflatten(w + e, like)))
  return g_p - alpha * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)


def reference_run(params, grad_np, *, rho_at, alpha, due_at, cheap, weight, steps):
  """Plain SGD on the policy's output; ``due_at(t, g_c)`` is the policy's decision."""
  w, v, full = flatten(params), np.zeros(flatten(params).shape), 0
  for t in range(steps):
    g_c = flatten(grad_np(unflatten(w, params)))
    rho = rho_at(t)
    if due_at(t, g_c) and rho > 0:
      g = gsam_direction(w, g_c, grad_np, params, rho, alpha)
      # The stored direction: the orthogonal part relative to the clean norm (reuse_scale="relative").
      v = (g - g @ g_c / (g_c @ g_c) * g_c) / np.linalg.norm(g_c)
      full += 1
    elif cheap == "reuse" and rho > 0:
      g = g_c + weight * np.linalg.norm(g_c) * v
    else:
      g = g_c
    w = w - LR * g
  return w, full


def run(tx, params, loss_jax, steps, perturb_fn=None):
  """``steps`` jitted steps; ``perturb_fn(state, grads)`` picks the static branch if given."""

  def step(p, state, perturb=None):
    grads = jax.grad(loss_jax)(p)
    updates, state = tx.update(grads, state, p, loss_fn=loss_jax, perturb=perturb)
    return optax.apply_updates(p, updates), state

  p = jax.tree.map(jnp.asarray, params)
  state = tx.init(p)
  jitted = {b: jax.jit(functools.partial(step, perturb=b)) for b in (None, True, False)}
  for _ in range(steps):
    branch = None if perturb_fn is None else bool(perturb_fn(state, jax.grad(loss_jax)(p)))
    p, state = jitted[branch](p, state)
  return p, state


def ae_sam_decisions(threshold_at, decay, cap=10.0):
  """AE-SAM's rule: update the running mean and variance of ||g||^2, then compare.

  With ``cap``, the value entering the statistics is at most ``cap`` times their mean
  divided by 1 - decay^t (the weight of the t values so far), where that mean is > 0.
  """
  stats = {"mean": 0.0, "var": 0.0}

  def due_at(t, g_c):
    s = float(g_c @ g_c)
    entered = s
    if cap is not None and t > 0 and stats["mean"] > 0:
      entered = min(s, cap * stats["mean"] / (1 - decay**t))
    stats["mean"] = decay * stats["mean"] + (1 - decay) * entered
    stats["var"] = decay * stats["var"] + (1 - decay) * (entered - stats["mean"]) ** 2
    return s >= stats["mean"] + threshold_at(t) * np.sqrt(stats["var"])

  return due_at


def random_decisions(key, probability_at):
  """A uniform draw per step from a key split once per step."""
  state = {"key": key}

  def due_at(t, g_c):
    state["key"], draw = jax.random.split(state["key"])
    return float(jax.random.uniform(draw)) < probability_at(t)

  return due_at


STEPS = 12
THRESHOLD = optax.linear_schedule(-1.0, 0.0, STEPS)


def policy_cases():
  key = jax.random.key(3)
  probability = optax.linear_schedule(0.8, 0.2, STEPS)
  return {
    "every_3_reuse": (
      optax_gsam.every_k_policy(3, reuse_weight=0.6),
      lambda: lambda t, g: t % 3 == 0,
      "reuse",
    ),
    "every_2_clean": (
      optax_gsam.every_k_policy(2, cheap="clean"),
      lambda: lambda t, g: t % 2 == 0,
      "clean",
    ),
    "ae_sam": (
      optax_gsam.gradient_norm_policy(THRESHOLD, decay=0.8),
      lambda: ae_sam_decisions(lambda t: float(THRESHOLD(t)), 0.8),
      "clean",
    ),
    "ae_looksam": (
      optax_gsam.gradient_norm_policy(-0.6, decay=0.5, cheap="reuse", reuse_weight=0.6),
      lambda: ae_sam_decisions(lambda t: -0.6, 0.5),
      "reuse",
    ),
    "random": (
      optax_gsam.random_policy(probability, key=key),
      lambda: random_decisions(key, lambda t: float(probability(t))),
      "clean",
    ),
  }


RHO_CASES = {
  "constant": lambda t: 0.2,
  "late_phase": lambda t: 0.0 if t < 5 else 0.2,
}


@pytest.mark.parametrize("rho_case", list(RHO_CASES))
@pytest.mark.parametrize("name", list(policy_cases()))
def test_policy_matches_float64_reference(name, rho_case):
  policy, due_factory, cheap = policy_cases()[name]
  rho_at = RHO_CASES[rho_case]
  rho = 0.2 if rho_case == "constant" else (lambda count: jnp.where(count < 5, 0.0, 0.2))
  with jax.enable_x64(True):
    params, loss_jax, _, grad_np = make_problem(seed=21)
    tx = optax.chain(optax_gsam.gsam(rho, 0.3, policy=policy), optax.sgd(LR))
    p, state = run(tx, params, loss_jax, STEPS)
    expected, full = reference_run(
      params,
      grad_np,
      rho_at=rho_at,
      alpha=0.3,
      due_at=due_factory(),
      cheap=cheap,
      weight=0.6,
      steps=STEPS,
    )
    np.testing.assert_allclose(flatten(p), expected, rtol=1e-10, atol=1e-12)
    assert int(optax.tree.get(state, "full_steps")) == full
    assert 0 < full < STEPS  # both branches ran, so the comparison sees the policy


@pytest.mark.parametrize("name", list(policy_cases()))
def test_static_branches_driven_by_full_step_due_equal_the_cond(name):
  policy, _, _ = policy_cases()[name]
  rho = lambda count: jnp.where(count < 3, 0.0, 0.2)
  params, loss_jax = float32_problem(seed=22)
  tx = optax.chain(optax_gsam.gsam(rho, 0.3, policy=policy), optax.sgd(LR))
  due = jax.jit(functools.partial(optax_gsam.full_step_due, policy=policy, rho=rho))
  a, state_a = run(tx, params, loss_jax, 8)
  b, state_b = run(tx, params, loss_jax, 8, perturb_fn=due)
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
    without_keys((a, state_a)),
    without_keys((b, state_b)),
  )


def without_keys(tree):
  """PRNG keys as their raw data, which numpy can compare."""
  is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def test_perturb_every_is_the_every_k_policy():
  params, loss_jax, _, _ = make_problem(seed=23)
  with pytest.warns(DeprecationWarning, match="perturb_every="):  # the alias, on purpose
    legacy = optax_gsam.gsam(0.1, 0.2, perturb_every=3, reuse_weight=0.5)
  policy = optax_gsam.gsam(0.1, 0.2, policy=optax_gsam.every_k_policy(3, reuse_weight=0.5))
  a, state_a = run(optax.chain(legacy, optax.sgd(LR)), params, loss_jax, 7)
  b, state_b = run(optax.chain(policy, optax.sgd(LR)), params, loss_jax, 7)
  jax.tree.map(
    np.testing.assert_array_equal, without_keys((a, state_a)), without_keys((b, state_b))
  )


def count_conds(tx, params, loss_jax, **kwargs):
  def step(p, state):
    return tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax, **kwargs)

  return runtime_conditionals(step, params, tx.init(params))


def count_loss_traces(tx, params, loss_jax, **kwargs):
  """How many times tracing one update calls the loss (the clean pass included)."""
  calls = []

  def counted(p):
    calls.append(1)
    return loss_jax(p)

  def step(p, state):
    return tx.update(jax.grad(counted)(p), state, p, loss_fn=counted, **kwargs)

  jax.make_jaxpr(step)(params, tx.init(params))
  return len(calls)


def test_skipping_zero_rho_is_opt_in_for_the_default_policy():
  params, loss_jax = float32_problem(seed=24)
  late = lambda count: jnp.where(count < 2, 0.0, 0.1)
  default = count_conds(optax_gsam.sam(late), params, loss_jax)
  assert default == 0  # plain SAM traces no conditional, not even for its norms
  skipping = optax_gsam.sam(late, policy=optax_gsam.every_step_policy(skip_zero_rho=True))
  assert count_conds(skipping, params, loss_jax) == default + 1  # the full/clean choice
  # The static clean branch calls no loss function at all: no perturbed pass is traced.
  assert count_loss_traces(optax_gsam.sam(late), params, loss_jax) == 2
  assert count_loss_traces(skipping, params, loss_jax, perturb=False) == 1
  state = skipping.init(params)
  grads = jax.grad(loss_jax)(params)
  updates, state = skipping.update(grads, state, params, loss_fn=loss_jax)
  jax.tree.map(np.testing.assert_array_equal, updates, grads)  # rho_0 == 0: the clean gradient
  assert int(state.full_steps) == 0 and int(state.count) == 1
  # A static zero rho is decided in Python: no conditional and no perturbed pass at all.
  zero = optax_gsam.sam(0.0, policy=optax_gsam.every_step_policy(skip_zero_rho=True))
  assert count_conds(zero, params, loss_jax) == 0
  assert count_loss_traces(zero, params, loss_jax) == 1


def test_policies_agree_across_devices_and_count_the_same_steps(data_mesh):
  """Per-device perturbation under shard_map: one decision for all devices."""
  params, loss_jax = float32_problem(seed=25, n=16)
  x = jax.random.normal(jax.random.key(0), (16, 5))
  mesh = data_mesh
  for policy in (
    optax_gsam.gradient_norm_policy(0.0, decay=0.5),
    optax_gsam.random_policy(0.5, key=jax.random.key(1)),
  ):
    tx = optax.chain(optax_gsam.gsam(0.1, 0.3, axis_name="data", policy=policy), optax.sgd(LR))

    def step(p, state, xb, tx=tx):
      local = lambda q: loss_jax(q) + jnp.mean((xb @ q["w"]) ** 2)
      updates, state = tx.update(jax.grad(local)(p), state, p, loss_fn=local)
      full = optax.tree.get(state, "full_steps")
      return optax.apply_updates(p, updates), state, jax.lax.all_gather(full, "data")

    data_parallel = optax_gsam.data_parallel(
      step, mesh, axis_name="data", batch_argnums=(2,), out_specs=(P(), P(), P())
    )
    p, state = params, tx.init(params)
    for _ in range(6):
      p, state, full_per_device = data_parallel(p, state, x)
      assert len(set(np.asarray(full_per_device).tolist())) == 1, policy.name
    assert 0 < int(optax.tree.get(state, "full_steps")) <= 6


# --- Momentum-SAM ------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [None, {"b": False, "w": True}])
def test_momentum_sam_with_sgd_momentum_matches_the_papers_algorithm(mask):
  """SGD-MSAM (Becker et al., Algorithm 1) written from its formulas in float64.

  With a mask m, the perturbation is rho m*v / |m*v|; v keeps every leaf.
  """
  rho, mu, lr, steps = 0.3, 0.9, 0.05, 6
  with jax.enable_x64(True):
    params, loss_jax, _, grad_np = make_problem(seed=26)
    w, v = flatten(params), np.zeros(flatten(params).shape)
    selected = (
      np.ones_like(w) if mask is None else flatten({"b": 0 * params["b"], "w": 1 + 0 * params["w"]})
    )
    for _ in range(steps):
      direction = selected * v
      scale = rho / (np.linalg.norm(direction) + EPS)
      g = flatten(grad_np(unflatten(w - scale * direction, params)))
      v = mu * v + g
      w = w - lr * v
    tx = optax.chain(optax_gsam.momentum_sam(rho, mu, mask=mask), optax.sgd(lr, momentum=mu))
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    step = jax.jit(
      lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(optax.tree.zeros_like(p), s, p, loss_fn=loss_jax)
      )
    )
    for _ in range(steps):
      p, state = step(p, state)
    np.testing.assert_allclose(flatten(p), w, rtol=1e-10, atol=1e-12)
    # Not plain momentum SGD: the perturbation changed the trajectory.
    plain_w, plain_v = flatten(params), np.zeros(w.shape)
    for _ in range(steps):
      plain_v = mu * plain_v + flatten(grad_np(unflatten(plain_w, params)))
      plain_w = plain_w - lr * plain_v
    assert np.abs(plain_w - w).max() > 1e-4
    assert int(optax.tree.get(state, "count")) == steps


def test_momentum_sam_evaluates_the_loss_once_and_keeps_state_finite():
  p, loss_jax = float32_problem(seed=27)
  calls = []

  def counting_loss(q):
    calls.append(1)
    return loss_jax(q)

  tx = optax_gsam.momentum_sam(0.1)
  state = tx.init(p)
  _, state = tx.update(optax.tree.zeros_like(p), state, p, loss_fn=counting_loss)
  assert len(calls) == 1  # traced once: one gradient evaluation a step
  good = state
  nan_loss = lambda q: loss_jax(q) * jnp.nan
  _, state = tx.update(optax.tree.zeros_like(p), state, p, loss_fn=nan_loss)
  jax.tree.map(np.testing.assert_array_equal, state.momentum, good.momentum)
  assert int(state.count) == 1
  for bad, match in (
    (lambda: optax_gsam.momentum_sam(0.1, momentum=1.0), "momentum"),
    (lambda: optax_gsam.momentum_sam(-0.1), "rho"),
    (lambda: optax_gsam.momentum_sam(0.1, eps=0.0), "eps"),
  ):
    with pytest.raises(ValueError, match=match):
      bad()


# --- Review findings: each fails without its fix -----------------------------------------------


def test_full_step_due_reads_the_same_signal_as_update_per_device():
  """Per-device perturbation: both average the devices' squared norms over the axis."""
  policy = optax_gsam.gradient_norm_policy(0.5, decay=0.0)
  tx = optax_gsam.gsam(0.1, 0.3, axis_name="d", policy=policy)
  p = {"w": jnp.zeros(2)}
  # Opposite gradients: the mean gradient is 0, each device's norm is not.
  grads = {"w": jnp.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])}
  loss_fn = lambda q: jnp.sum(q["w"])

  def per_device(g):
    state = tx.init(p)
    due = optax_gsam.full_step_due(state, g, policy=policy, rho=0.1, axis_name="d")
    _, state = tx.update(g, state, p, loss_fn=loss_fn)
    return due, state.full_steps

  due, full = jax.vmap(per_device, axis_name="d")(grads)
  np.testing.assert_array_equal(due, full.astype(bool))


def test_full_step_due_rejects_a_policy_the_state_was_not_built_with():
  tx = optax_gsam.sam(0.05, policy=optax_gsam.every_k_policy(5))
  state = tx.init(jnp.ones(2))
  with pytest.raises(ValueError, match="not the policy this optimizer state was built with"):
    optax_gsam.full_step_due(state, jnp.ones(2), rho=0.05)
  with pytest.raises(ValueError, match="not the policy"):
    optax_gsam.full_step_due(state, jnp.ones(2), policy=optax_gsam.gradient_norm_policy(), rho=0.05)
  assert bool(
    optax_gsam.full_step_due(state, jnp.ones(2), policy=optax_gsam.every_k_policy(5), rho=0.05)
  )


def test_policy_states_can_be_donated_and_reinitialised():
  key = jax.random.key(4)
  policy = optax_gsam.random_policy(0.5, key=key)
  tx = optax.chain(optax_gsam.sam(0.05, policy=policy), optax.sgd(0.1))
  p = jnp.ones(3)
  loss_fn = lambda w: jnp.sum(jnp.sin(w))

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(w, state):
    updates, state = tx.update(jax.grad(loss_fn)(w), state, w, loss_fn=loss_fn)
    return optax.apply_updates(w, updates), state

  leaves = jax.tree.leaves(tx.init(p))
  assert len({id(x) for x in leaves}) == len(leaves)
  step(p, tx.init(p))
  assert not key.is_deleted()
  tx.init(p)  # a restore target after a donated step


def test_inject_hyperparams_takes_a_policy_and_momentum_sam():
  p = jnp.ones(3)
  loss_fn = lambda w: jnp.sum(jnp.sin(w))
  tx = optax.inject_hyperparams(optax_gsam.gsam)(rho=0.05, policy=optax_gsam.every_k_policy(2))
  state = tx.init(p)
  for _ in range(3):
    _, state = tx.update(jax.grad(loss_fn)(p), state, p, loss_fn=loss_fn)
  assert int(state.inner_state.full_steps) == 2
  msam = optax.inject_hyperparams(optax_gsam.momentum_sam)(rho=0.05)
  _, state = msam.update(jnp.zeros(3), msam.init(p), p, loss_fn=loss_fn)
  assert int(state.inner_state.count) == 1


def test_a_static_zero_rho_traces_no_perturbed_pass_for_any_policy():
  params, loss_jax = float32_problem(seed=28)
  grads = jax.grad(loss_jax)(params)
  for policy, _, _ in policy_cases().values():
    traced = []
    counting = lambda p, traced=traced: traced.append(1) or loss_jax(p)
    tx = optax_gsam.sam(0.0, policy=policy)
    jax.make_jaxpr(lambda g, s, tx=tx, f=counting: tx.update(g, s, params, loss_fn=f))(
      grads, tx.init(params)
    )
    assert not traced, policy.name  # decided while tracing: no branch evaluates the loss


def test_cheap_steps_with_extreme_gradients_stay_finite():
  p, loss_fn = float32_problem(seed=3)
  tx = optax_gsam.gsam(0.1, 0.4, policy=optax_gsam.every_k_policy(2))

  @jax.jit
  def update(state, scale):
    scaled = lambda q: scale * loss_fn(q)
    return tx.update(jax.grad(scaled)(p), state, p, loss_fn=scaled)

  for scale in SCALES:
    state = tx.init(p)
    for _ in range(3):  # full, cheap, full
      updates, state = update(state, jnp.float32(scale))
      assert all_finite((updates, state)), scale


@pytest.mark.parametrize(
  "policy",
  [
    optax_gsam.random_policy(0.3, key=jax.random.key(0)),
    optax_gsam.gradient_norm_policy(-0.5),
    optax_gsam.every_k_policy(3),
  ],
  ids=lambda policy: policy.name,
)
def test_a_step_that_does_not_count_leaves_the_policy_state_as_it_was(policy):
  # A NaN clean gradient does not count; the run after it is the one that never saw it.
  w = jnp.array([1.0, -0.5])
  loss_fn = lambda q: jnp.sum(q**2) + jnp.sum(jnp.sin(3 * q))
  tx = optax_gsam.sam(0.05, policy=policy)
  update = jax.jit(lambda g, s: tx.update(g, s, w, loss_fn=loss_fn))

  def full_steps_after(state):
    counts = []
    for t in range(8):
      _, state = update(jax.grad(loss_fn)(w) * (1.0 + 0.5 * np.sin(t)), state)
      counts.append(int(state.full_steps))
    return counts

  state = tx.init(w)
  _, after_nan = update(jnp.array([jnp.nan, 1.0]), state)
  assert int(after_nan.count) == 0
  jax.tree.map(np.testing.assert_array_equal, after_nan.policy_state, state.policy_state)
  assert full_steps_after(after_nan) == full_steps_after(state)


def gradient_norm_decisions(policy, scales):
  """Whether each step of sam with ``policy`` was a full step, for gradients ``scale * base``."""
  tx = optax_gsam.sam(0.05, policy=policy)
  w = jnp.zeros(2)
  value_and_grad_fn = lambda q: (jnp.sum(q**2), 2 * q)
  update = jax.jit(lambda g, s: tx.update(g, s, w, value_and_grad_fn=value_and_grad_fn))
  state, decisions = tx.init(w), []
  for scale in scales:
    before = int(state.full_steps)
    _, state = update(jnp.asarray(scale * np.array([0.6, -0.8]), jnp.float32), state)
    decisions.append(int(state.full_steps) > before)
  assert all_finite(state.policy_state)
  return decisions


@pytest.mark.parametrize("spike_cap", [10.0, None])
@pytest.mark.parametrize("threshold", [0.0, -0.5])
def test_gradient_norm_statistics_survive_a_spike_and_full_steps_resume(threshold, spike_cap):
  # ||g|| = 1e11 once: s_t = 1e22, whose square (the variance's scale) overflows float32.
  decay, steps, spike = 0.5, 100, 4
  scales = [(1e11 if t == spike else 1.0) * (1.0 + 0.3 * np.sin(t)) for t in range(steps)]
  due_at = ae_sam_decisions(lambda t: threshold, decay, spike_cap)  # float64 reference
  base = np.array([0.6, -0.8])
  expected = [due_at(t, scale * base) for t, scale in enumerate(scales)]
  assert expected[-20:].count(True) > 0  # the reference resumes full steps
  policy = optax_gsam.gradient_norm_policy(threshold, decay=decay, spike_cap=spike_cap)
  assert gradient_norm_decisions(policy, scales) == expected


@pytest.mark.parametrize("spike", [1e5, 1e10])
@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_one_gradient_spike_stops_full_steps_for_a_few_times_one_over_one_minus_decay(
  spike, threshold
):
  # Uncapped, mu_t stays above the usual s_t for log(spike^2) / log(1 / decay) steps: 203 and 423
  # at threshold 0. The cap bounds it by the spike-free recovery of the statistics instead.
  decay, at = 0.9, 30
  scales = [(spike if t == at else 1.0) * (1.0 + 0.3 * np.sin(t)) for t in range(at + 80)]
  decisions = gradient_norm_decisions(
    optax_gsam.gradient_norm_policy(threshold, decay=decay), scales
  )
  assert decisions[at]  # the spike itself is a large gradient: a full step
  resumed = decisions[at + 1 :].index(True) + 1
  assert resumed <= 5 / (1 - decay), resumed
  due_at = ae_sam_decisions(lambda t: threshold, decay)  # float64 reference, capped
  assert decisions == [due_at(t, scale * np.array([0.6, -0.8])) for t, scale in enumerate(scales)]


# reuse_weight, deprecated, is the alias on purpose: it is annotated as a schedule until it goes.
@pytest.mark.filterwarnings("ignore:optax_gsam.gsam. deprecated keyword:DeprecationWarning")
def test_arguments_annotated_as_schedules_take_schedules():
  # optax's common tests pass a schedule to an argument annotated optax.ScalarOrSchedule.
  for factory in (optax_gsam.gsam, optax_gsam.sam):
    hints = typing.get_type_hints(factory)
    names = [n for n in inspect.signature(factory).parameters if hints[n] == optax.ScalarOrSchedule]
    assert names == ["rho", "reuse_weight"], factory.__name__
  factory = optax_gsam.gsam  # sam is gsam with alpha=0
  p, loss_fn = float32_problem(seed=5)
  values = {"rho": 0.05, "reuse_weight": 0.4}

  def run(**arguments):
    tx = optax.chain(factory(**arguments, perturb_every=2), optax.sgd(LR))
    step = jax.jit(lambda q, s: tx.update(jax.grad(loss_fn)(q), s, q, loss_fn=loss_fn))
    q, state = p, tx.init(p)
    for _ in range(4):
      updates, state = step(q, state)
      q = optax.apply_updates(q, updates)
    return q

  with_floats = run(**values)
  # Two programs (a float is a compile-time constant, a schedule is evaluated in the program, and
  # a scheduled rho adds the checks of its value): equal up to float32 rounding, which depends on
  # the CPU's kernels.
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  for name in names:
    scheduled = dict(values, **{name: optax.constant_schedule(values[name])})
    jax.tree.map(close, run(**scheduled), with_floats)
