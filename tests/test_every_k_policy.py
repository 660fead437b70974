"""every_k_policy (LookSAM-style cheap steps) against an independent reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import flatten
from _problems import float32_problem
from _problems import make_problem
from _problems import runtime_conditionals
from _problems import unflatten

import optax_gsam

EPS = 1e-12


def reused(g_c, u, weight, scale, max_amp, nb):
  """LookSAM's cheap step from its formulas; ``u`` is the stored v / ||g_c|| (b then w, ``nb`` b's)."""
  norm_u = np.linalg.norm(u)
  if scale == "relative":
    amplification = weight / max(norm_u, 1.0)
    added = weight * np.linalg.norm(g_c) * u / max(norm_u, 1.0)
  else:
    amplification = weight / norm_u if norm_u > 0 else 0.0
    if scale == "global":
      added = weight * np.linalg.norm(g_c) * u / (norm_u + EPS)
    else:  # per leaf: each leaf's own clean-gradient norm over its stored direction's norm
      added = np.concatenate(
        [
          weight * np.linalg.norm(g_c[part]) * u[part] / (np.linalg.norm(u[part]) + EPS)
          for part in (slice(0, nb), slice(nb, None))
        ]
      )
  if max_amp is not None and amplification > max_amp:
    return g_c, True
  return g_c + added, False


def reference_run(params, grad_np, *, rho, weights, lr, steps, **case):
  """LookSAM/GSAM reuse from the formulas, numpy float64; also how many cheap steps fell back."""
  w, u, fell_back, nb = flatten(params), None, 0, np.size(params["b"])
  for t in range(steps):
    g_c = flatten(grad_np(unflatten(w, params)))
    if t % case["k"] == 0:
      e = rho * g_c / np.linalg.norm(g_c)
      g_p = flatten(grad_np(unflatten(w + e, params)))
      if case["minimize_fp"]:
        g = g_p - case["alpha"] * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)
      else:
        g = g_c + case["alpha"] * (g_p - g_p @ g_c / (g_c @ g_c) * g_c)
      u = (g - g @ g_c / (g_c @ g_c) * g_c) / np.linalg.norm(g_c)
    else:
      fresh = case["reuse_steps"] is None or t % case["k"] <= case["reuse_steps"]
      g, fell = reused(g_c, u, weights[t] if fresh else 0.0, case["scale"], case["max_amp"], nb)
      fell_back += fell
    w = w - lr * g
  return w, fell_back


DEFAULT_AMP = 1.0
DEFAULT_STEPS = 2
GUARD = 2.1
CASES = [
  dict(alpha=0.0, k=3, scheduled=False, minimize_fp=True, scale="relative", max_amp=DEFAULT_AMP),
  dict(alpha=0.5, k=2, scheduled=False, minimize_fp=True, scale="global", max_amp=None),
  dict(alpha=0.5, k=4, scheduled=True, minimize_fp=True, scale="per_leaf", max_amp=None),
  dict(alpha=0.3, k=3, scheduled=True, minimize_fp=False, scale="relative", max_amp=DEFAULT_AMP),
  # The guard: |u| grows from 0.10 to 0.18 here, so LookSAM's forms enlarge v by 0.3 / |u|,
  # 3.0 to 1.7 times: the first cheap steps fall back, the later ones reuse.
  dict(alpha=0.3, k=3, scheduled=False, minimize_fp=True, scale="global", max_amp=GUARD),
  dict(alpha=0.0, k=2, scheduled=False, minimize_fp=True, scale="per_leaf", max_amp=GUARD),
]
# reuse_steps: the default 2 (the shorthand), except where a case says otherwise.
CASES = [dict(case, reuse_steps=DEFAULT_STEPS) for case in CASES]
CASES[2]["reuse_steps"] = None  # LookSAM as published: every cheap step of the 4 reuses
CASES.append(dict(CASES[3], k=4, reuse_steps=1))  # lags 2 and 3 are clean steps
CASES.append(dict(CASES[0], k=5))  # the default: lags 3 and 4 are clean steps


def _every_k_tx(case, rho, weight, lr):
  policy = optax_gsam.every_k_policy(
    case["k"],
    reuse_weight=weight,
    reuse_scale=case["scale"],
    max_amplification=case["max_amp"],
    reuse_steps=case["reuse_steps"],
  )
  gsam = optax_gsam.gsam(rho, case["alpha"], minimize_fp=case["minimize_fp"], policy=policy)
  return optax.chain(gsam, optax.sgd(lr))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reuse_matches_float64_reference(case):
  steps, lr, rho = 9, 0.05, 0.2
  weight_fn = optax.linear_schedule(0.9, 0.3, steps)
  constant = 0.3 if case["max_amp"] == GUARD else 0.7
  with jax.enable_x64(True):
    params, loss_jax, _, grad_np = make_problem(seed=11)
    weight = weight_fn if case["scheduled"] else constant
    weights = [
      float(weight_fn(jnp.int32(t))) if case["scheduled"] else constant for t in range(steps)
    ]
    tx = _every_k_tx(case, rho, weight, lr)
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    step = jax.jit(
      lambda p, s: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
        tx.update(jax.grad(loss_jax)(p), s, p, loss_fn=loss_jax)
      )
    )
    for _ in range(steps):
      p, state = step(p, state)
    expected, fell_back = reference_run(
      params,
      grad_np,
      rho=rho,
      weights=weights,
      lr=lr,
      steps=steps,
      **case,
    )
    np.testing.assert_allclose(flatten(p), expected, rtol=1e-9, atol=1e-12)
    cheap_steps = steps - len(range(0, steps, case["k"]))
    if case["max_amp"] == GUARD:  # the guard ran on some cheap steps and reused on others
      assert 0 < fell_back < cheap_steps, fell_back
    else:
      assert fell_back == 0


def test_perturbed_gradient_runs_only_on_every_kth_step():
  p, loss_jax = float32_problem(seed=12)
  calls = []

  def counted_loss(q):
    jax.debug.callback(lambda: calls.append(1))
    return loss_jax(q)

  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(4)), optax.sgd(0.1))

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


@pytest.mark.filterwarnings(
  "ignore:optax_gsam.*deprecated keyword:DeprecationWarning"
)  # the alias, on purpose
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
    optax_gsam.gsam(
      0.2, 0.3, axis_name="data", sync_perturbation=True, policy=optax_gsam.every_k_policy(2)
    ),
    optax.sgd(0.2),
  )
  single_tx = optax.chain(
    optax_gsam.gsam(0.2, 0.3, policy=optax_gsam.every_k_policy(2)), optax.sgd(0.2)
  )

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
  tx = optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(2))
  state = tx.init(p)
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax)
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax)
  stored = state.stored_direction
  assert optax_gsam.stable_global_norm(stored) > 0
  nan_loss = lambda q: loss_jax(q) * jnp.nan
  _, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=nan_loss)  # full step, NaN
  jax.tree.map(np.testing.assert_array_equal, state.stored_direction, stored)
  assert int(state.count) == 2  # a non-finite output does not count


@pytest.mark.filterwarnings(
  "ignore:optax_gsam.*deprecated keyword:DeprecationWarning"
)  # the alias, on purpose
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
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(3)), optax.sgd(0.1))

  def step(p, state, perturb=None):
    updates, state = tx.update(jax.grad(loss_jax)(p), state, p, loss_fn=loss_jax, perturb=perturb)
    return optax.apply_updates(p, updates), state

  scheduled = jax.jit(step)
  full, cheap = (
    jax.jit(functools.partial(step, perturb=True)),
    jax.jit(functools.partial(step, perturb=False)),
  )
  conds = lambda f: runtime_conditionals(f, p0, tx.init(p0))
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
  with pytest.raises(ValueError, match="every_k_policy"):
    plain.update(jax.grad(loss_jax)(p0), plain.init(p0), p0, loss_fn=loss_jax, perturb=False)


def test_sam_takes_the_cheap_step_options_too():
  p, loss_jax = float32_problem(seed=17)
  looksam = optax_gsam.sam(0.1, policy=optax_gsam.every_k_policy(2, reuse_weight=0.5))
  same = optax_gsam.gsam(0.1, 0.0, policy=optax_gsam.every_k_policy(2, reuse_weight=0.5))
  sa, sb = looksam.init(p), same.init(p)
  for _ in range(3):
    ua, sa = looksam.update(jax.grad(loss_jax)(p), sa, p, loss_fn=loss_jax)
    ub, sb = same.update(jax.grad(loss_jax)(p), sb, p, loss_fn=loss_jax)
    jax.tree.map(np.testing.assert_array_equal, ua, ub)
  assert sa.stored_direction is not None


def _blobs(noise: float, n: int = 512, seed: int = 0):
  """Four Gaussian classes in 16 dimensions; a ``noise`` share of the labels redrawn."""
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(4, 16))
  y = rng.integers(0, 4, n)
  x = centers[y] + rng.normal(size=(n, 16))
  y_noisy = np.where(rng.random(n) < noise, rng.integers(0, 4, n), y)
  return jnp.asarray(x, jnp.float32), jnp.asarray(y_noisy), jnp.asarray(y)


def _relu_net(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def _train_accuracy(policy, seeds, *, lr=0.1, rho=0.05, steps=300, batch=32):
  """Clean-label accuracy of a narrow ReLU net after SAM (every-5 with ``policy``) and Adam."""
  x, y, y_clean = _blobs(0.2)
  tx = optax.chain(optax_gsam.sam(rho, policy=policy), optax.adam(lr))
  sizes = (16, 8, 8, 8, 4)

  def one(seed):
    keys = jax.random.split(jax.random.key(seed), len(sizes))
    params = [
      {"w": jax.random.normal(key, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
      for key, a, b in zip(keys[:-1], sizes[:-1], sizes[1:], strict=True)
    ]

    def step(carry, idx):
      params, state = carry
      loss_fn = lambda p: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(_relu_net(p, x[idx]), y[idx])
      )
      updates, state = tx.update(jax.grad(loss_fn)(params), state, params, loss_fn=loss_fn)
      return (optax.apply_updates(params, updates), state), None

    batches = jax.random.randint(keys[-1], (steps, batch), 0, len(x))
    (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), batches)
    return jnp.mean(jnp.argmax(_relu_net(params, x), -1) == y_clean)

  return np.asarray(jax.jit(jax.vmap(one))(jnp.arange(seeds)))


def test_reuse_no_longer_collapses_adam_at_a_large_learning_rate():
  """The old default (LookSAM's global rescale on every cheap step, no guard) against the new one.

  The global form pushes the stored direction, a stale and mostly-noise one, at 70% of the
  gradient on every cheap step. With Adam at a large learning rate, a narrow ReLU net then
  ends at 50% clean accuracy over 3 seeds (SAM itself: 74%); the default reuse stays above 75%.
  """
  old = optax_gsam.every_k_policy(5, reuse_scale="global", max_amplification=None, reuse_steps=None)
  assert _train_accuracy(old, 3).mean() < 0.6
  assert _train_accuracy(optax_gsam.every_k_policy(5), 3).mean() > 0.75


def test_reuse_options_are_checked_at_construction():
  with pytest.raises(ValueError, match="reuse_scale"):
    optax_gsam.every_k_policy(5, reuse_scale="layer")
  with pytest.raises(ValueError, match="max_amplification"):
    optax_gsam.every_k_policy(5, max_amplification=0.0)
  with pytest.raises(ValueError, match="scale"):
    optax_gsam.reuse_direction(jnp.ones(2), jnp.ones(2), 0.5, scale="layer")


@pytest.mark.parametrize("scale", ["relative", "global", "per_leaf"])
def test_reuse_direction_matches_its_formula_in_float64(scale):
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    g_c = {"b": rng.normal(size=3), "w": rng.normal(size=(3, 2))}
    nb = 3
    for u_size in (0.8, 3.0, 0.05):  # relative: below and above the cap; 0.05: guarded
      u = {"b": rng.normal(size=3), "w": rng.normal(size=(3, 2))}
      factor = u_size / np.linalg.norm(flatten(u))
      u = {name: factor * value for name, value in u.items()}
      got = optax_gsam.reuse_direction(
        jax.tree.map(jnp.asarray, g_c), jax.tree.map(jnp.asarray, u), 0.7, scale=scale
      )
      expected, _ = reused(flatten(g_c), flatten(u), 0.7, scale, DEFAULT_AMP, nb)
      np.testing.assert_allclose(flatten(got), expected, rtol=1e-12)
      guarded = np.array_equal(expected, flatten(g_c))
      assert guarded == (scale != "relative" and u_size == 0.05)
