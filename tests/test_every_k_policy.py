"""perturb_every (LookSAM-style cheap steps) against an independent reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import flatten
from _problems import float32_problem
from _problems import make_problem
from _problems import unflatten

import optax_gsam

EPS = 1e-12


def reference_run(params, grad_np, *, rho, alpha, k, weights, lr, steps, minimize_fp=True):
  """LookSAM/GSAM reuse from the formulas, numpy float64."""
  w = flatten(params)
  v = None
  for t in range(steps):
    g_c = flatten(grad_np(unflatten(w, params)))
    if t % k == 0:
      e = rho * g_c / np.linalg.norm(g_c)
      g_p = flatten(grad_np(unflatten(w + e, params)))
      if minimize_fp:
        g = g_p - alpha * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)
      else:
        g = g_c + alpha * (g_p - g_p @ g_c / (g_c @ g_c) * g_c)
      v = g - g @ g_c / (g_c @ g_c) * g_c
    else:
      g = g_c + weights[t] * np.linalg.norm(g_c) / np.linalg.norm(v) * v
    w = w - lr * g
  return w


CASES = [
  dict(alpha=0.0, k=3, scheduled=False, minimize_fp=True),
  dict(alpha=0.5, k=2, scheduled=False, minimize_fp=True),
  dict(alpha=0.5, k=4, scheduled=True, minimize_fp=True),
  dict(alpha=0.3, k=3, scheduled=True, minimize_fp=False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reuse_matches_float64_reference(case):
  steps, lr, rho = 9, 0.05, 0.2
  weight_fn = optax.linear_schedule(0.9, 0.3, steps)
  with jax.enable_x64(True):
    params, loss_jax, _, grad_np = make_problem(seed=11)
    weight = weight_fn if case["scheduled"] else 0.7
    weights = [float(weight_fn(jnp.int32(t))) if case["scheduled"] else 0.7 for t in range(steps)]
    tx = optax.chain(
      optax_gsam.gsam(
        rho,
        case["alpha"],
        minimize_fp=case["minimize_fp"],
        perturb_every=case["k"],
        reuse_weight=weight,
      ),
      optax.sgd(lr),
    )
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    step = jax.jit(
      lambda p, s: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
        tx.update(jax.grad(loss_jax)(p), s, p, loss_fn=loss_jax)
      )
    )
    for _ in range(steps):
      p, state = step(p, state)
    expected = reference_run(
      params,
      grad_np,
      rho=rho,
      alpha=case["alpha"],
      k=case["k"],
      weights=weights,
      lr=lr,
      steps=steps,
      minimize_fp=case["minimize_fp"],
    )
    np.testing.assert_allclose(flatten(p), expected, rtol=1e-9, atol=1e-12)


def test_perturbed_gradient_runs_only_on_every_kth_step():
  p, loss_jax = float32_problem(seed=12)
  calls = []

  def counted_loss(q):
    jax.debug.callback(lambda: calls.append(1))
    return loss_jax(q)

  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, perturb_every=4), optax.sgd(0.1))

  @jax.jit
  def step(p, state):
    updates, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=counted_loss)
    return optax.apply_updates(p, updates), state

  state = tx.init(p)
  per_step = []
  for _ in range(9):
    before = len(calls)
    p, state = step(p, state)
    jax.effects_barrier()
    per_step.append(len(calls) - before)
  assert per_step == [1, 0, 0, 0, 1, 0, 0, 0, 1]
  # The perturbed pass sits inside a cond branch in the compiled program.
  assert "cond[" in str(jax.make_jaxpr(step)(p, state))


def test_perturb_every_one_is_bitwise_the_plain_transform():
  params, loss_jax, _, _ = make_problem(seed=13)
  results = []
  for kwargs in ({}, {"perturb_every": 1}):
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    tx = optax.chain(optax_gsam.gsam(0.1, 0.4, **kwargs), optax.adam(1e-2))
    state = tx.init(p)
    for _ in range(4):
      updates, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax)
      p = optax.apply_updates(p, updates)
    results.append((p, state))
  jax.tree.map(np.testing.assert_array_equal, results[0], results[1])


def test_sync_mode_on_a_mesh_equals_single_device_cheap_gsam(data_mesh):
  mesh = data_mesh
  params, _, _, _ = make_problem(seed=14)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, 5)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
  loss = lambda q, xs, ys: jnp.mean((jnp.tanh(xs @ q["w"] + q["b"]) - ys) ** 2)
  sharded_tx = optax.chain(
    optax_gsam.gsam(0.2, 0.3, axis_name="data", sync_perturbation=True, perturb_every=2),
    optax.sgd(0.2),
  )
  single_tx = optax.chain(optax_gsam.gsam(0.2, 0.3, perturb_every=2), optax.sgd(0.2))

  def device_step(p, s, batch):
    loss_fn = functools.partial(loss, xs=batch[0], ys=batch[1])
    updates, s = sharded_tx.update(jax.grad(loss_fn)(p), s, p, loss_fn=loss_fn)
    return optax.apply_updates(p, updates), s

  sharded = optax_gsam.data_parallel(device_step, mesh)
  a = b = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  sa, sb = sharded_tx.init(a), single_tx.init(b)
  full_loss = functools.partial(loss, xs=x, ys=y)
  for _ in range(5):
    a, sa = sharded(a, sa, (x, y))
    updates, sb = single_tx.update(jax.grad(full_loss)(b), sb, b, loss_fn=full_loss)
    b = optax.apply_updates(b, updates)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


def test_non_finite_step_keeps_the_stored_direction():
  p, loss_jax = float32_problem(seed=15)
  tx = optax_gsam.gsam(0.1, 0.3, perturb_every=2)
  state = tx.init(p)
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax)
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax)
  stored = state.stored_direction
  assert optax_gsam.stable_global_norm(stored) > 0
  nan_loss = lambda q: loss_jax(q) * jnp.nan
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=nan_loss)  # full step, NaN
  jax.tree.map(np.testing.assert_array_equal, state.stored_direction, stored)
  assert int(state.count) == 2  # a non-finite output does not count


def test_perturb_every_under_inject_hyperparams_as_a_static_arg():
  tx = optax.inject_hyperparams(optax_gsam.gsam, static_args=("perturb_every",))(
    rho=0.1, alpha=0.2, perturb_every=2
  )
  w = jnp.ones(3)
  loss_fn = lambda q: jnp.sum(jnp.sin(q))
  state = tx.init(w)
  for _ in range(3):
    _, state = tx.update(jax.grad(loss_fn)(w), state, w, loss_fn=loss_fn)
  assert int(state.inner_state.count) == 3


def test_static_perturb_override_equals_the_cond_schedule():
  p0, loss_jax = float32_problem(seed=16)
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, perturb_every=3), optax.sgd(0.1))

  def step(p, state, perturb=None):
    updates, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax, perturb=perturb)
    return optax.apply_updates(p, updates), state

  scheduled = jax.jit(step)
  full, cheap = (
    jax.jit(functools.partial(step, perturb=True)),
    jax.jit(functools.partial(step, perturb=False)),
  )
  conds = lambda f: str(jax.make_jaxpr(f)(p0, tx.init(p0))).count("cond[")
  assert conds(full) == 0 < conds(scheduled)  # the static branch traces no conditional
  a, sa = p0, tx.init(p0)
  b, sb = p0, tx.init(p0)
  for t in range(7):
    a, sa = scheduled(a, sa)
    b, sb = (full if t % 3 == 0 else cheap)(b, sb)
  jax.tree.map(
    lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7), (a, sa), (b, sb)
  )
  with pytest.raises(ValueError, match="perturb"):
    tx.update(jax.grad(loss_jax)(p0), tx.init(p0), p0, loss_fn=loss_jax, perturb=jnp.bool_(True))
  plain = optax_gsam.gsam(0.1)
  with pytest.raises(ValueError, match="perturb_every"):
    plain.update(jax.grad(loss_jax)(p0), plain.init(p0), p0, loss_fn=loss_jax, perturb=False)


def test_sam_takes_the_cheap_step_options_too():
  p, loss_jax = float32_problem(seed=17)
  looksam = optax_gsam.sam(0.1, perturb_every=2, reuse_weight=0.5)
  same = optax_gsam.gsam(0.1, 0.0, perturb_every=2, reuse_weight=0.5)
  sa, sb = looksam.init(p), same.init(p)
  for _ in range(3):
    ua, sa = looksam.update(jax.grad(loss_jax)(p), sa, p, loss_fn=loss_jax)
    ub, sb = same.update(jax.grad(loss_jax)(p), sb, p, loss_fn=loss_jax)
    jax.tree.map(np.testing.assert_array_equal, ua, ub)
  assert sa.stored_direction is not None
