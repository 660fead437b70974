"""Inputs that adversarial probes found to give silently wrong answers, each now right or refused.

Every reference here is written from the formulas in numpy (complex128 / float64).
"""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gsam

RHO, ALPHA, LR = 0.05, 0.4, 0.1


# --- complex parameters: |x|^2 and Re<a, b>, never x^2 ---------------------------------------


def _real_dot(a, b):
  return float(np.real(np.vdot(a, b)))  # vdot conjugates its first argument


def test_complex_norms_and_stats_match_numpy():
  rng = np.random.default_rng(0)
  a = rng.normal(size=5) + 1j * rng.normal(size=5)
  b = rng.normal(size=5) + 1j * rng.normal(size=5)
  x = jnp.asarray(a, jnp.complex64)
  assert float(optax_gsam.stable_global_norm(jnp.array([1 + 1j, 2 + 0j]))) == pytest.approx(
    np.sqrt(6.0), rel=1e-6
  )
  stats = optax_gsam.gradient_stats(x, jnp.asarray(b, jnp.complex64))
  assert float(stats.clean_norm) == pytest.approx(np.linalg.norm(a), rel=1e-6)
  assert float(stats.perturbed_norm) == pytest.approx(np.linalg.norm(b), rel=1e-6)
  cosine = _real_dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)
  assert float(stats.cosine) == pytest.approx(cosine, rel=1e-5)
  e = optax_gsam.perturbation(x, jnp.zeros(5, jnp.complex64), RHO)
  assert e.dtype == jnp.complex64
  np.testing.assert_allclose(e, RHO * a / np.linalg.norm(a), rtol=1e-5)


@pytest.mark.parametrize("minimize_fp", [True, False])
def test_gsam_with_complex_params_matches_the_real_formulas(minimize_fp):
  rng = np.random.default_rng(1)
  n = 4
  hessian = rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))
  shift = rng.normal(size=n) + 1j * rng.normal(size=n)
  w = rng.normal(size=n) + 1j * rng.normal(size=n)
  grad = lambda z: hessian @ z + shift  # any smooth complex gradient field will do

  def value_and_grad_fn(p):
    return jnp.float32(0.0), jnp.asarray(hessian, jnp.complex64) @ p + jnp.asarray(
      shift, jnp.complex64
    )

  tx = optax_gsam.gsam(RHO, ALPHA, minimize_fp=minimize_fp)
  params = jnp.asarray(w, jnp.complex64)
  g_c = jnp.asarray(grad(w), jnp.complex64)
  out, state = tx.update(g_c, tx.init(params), params, value_and_grad_fn=value_and_grad_fn)

  c = grad(w)
  p = grad(w + RHO * c / np.linalg.norm(c))
  if minimize_fp:
    expected = p - ALPHA * (c - _real_dot(c, p) / np.vdot(p, p).real * p)
  else:
    expected = c + ALPHA * (p - _real_dot(p, c) / np.vdot(c, c).real * c)
  np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-5)
  assert float(state.cosine) == pytest.approx(
    _real_dot(c, p) / np.linalg.norm(c) / np.linalg.norm(p), rel=1e-5
  )


def _complex_problem():
  """f(z) = |A z - b|^2 + 0.1 sum |z|^4 on C^2, and its steepest-ascent direction, by hand.

  Over the pairs (x, y) of z = x + iy, f rises fastest along
  df/dx + i df/dy = 2 A^H (A z - b) + 0.4 |z|^2 z.
  """
  a = np.array([[1.0, 0.3 - 0.5j], [0.2j, 2.0]])
  b = np.array([1 + 2j, -1.0])
  loss = lambda z: jnp.sum(jnp.abs(a @ z - b) ** 2) + 0.1 * jnp.sum(jnp.abs(z) ** 4)
  ascent = lambda z: 2 * a.conj().T @ (a @ z - b) + 0.4 * np.abs(z) ** 2 * z
  return loss, ascent


@pytest.mark.parametrize("route", ["loss_fn", "value_and_grad_fn"])
@pytest.mark.parametrize("minimize_fp", [True, False])
def test_complex_params_follow_optax_convention_along_both_routes(route, minimize_fp):
  # optax's convention: the optimizer gets conj(jax.grad), the steepest-ascent direction.
  loss, ascent = _complex_problem()
  w = np.array([0.5 - 0.2j, 0.1 + 0.3j])
  c = ascent(w)
  p = ascent(w + RHO * c / np.linalg.norm(c))
  if minimize_fp:
    expected = p - ALPHA * (c - _real_dot(c, p) / np.vdot(p, p).real * p)
  else:
    expected = c + ALPHA * (p - _real_dot(p, c) / np.vdot(c, c).real * c)
  with jax.enable_x64(True):
    z = jnp.asarray(w, jnp.complex128)
    clean = jnp.conj(jax.grad(loss)(z))
    np.testing.assert_allclose(clean, c, rtol=1e-12)  # JAX's grad is the conjugate of c
    if route == "loss_fn":
      functions = {"loss_fn": loss}
    else:
      functions = {"value_and_grad_fn": lambda q: (loss(q), jnp.conj(jax.grad(loss)(q)))}
    tx = optax_gsam.gsam(RHO, ALPHA, minimize_fp=minimize_fp)
    out, _ = tx.update(clean, tx.init(z), z, **functions)
  np.testing.assert_allclose(out, expected, rtol=1e-10)


# --- a rho schedule that returns NaN or a negative value never stalls training -----------------


def _scheduled(bad_value):
  return lambda count: jnp.where(count == 3, bad_value, RHO)


def _quadratic():
  target = jnp.array([1.0, -2.0, 0.5])
  return jnp.zeros(3), lambda w: jnp.sum((w - target) ** 2) + jnp.sum(jnp.sin(w))


@pytest.mark.parametrize("bad_value", [jnp.nan, jnp.inf, -0.1])
def test_an_unusable_rho_value_outputs_the_clean_gradient_and_training_goes_on(bad_value):
  w, loss_fn = _quadratic()
  tx = optax.apply_if_finite(
    optax.chain(optax_gsam.gsam(_scheduled(bad_value), ALPHA), optax.sgd(LR)),
    max_consecutive_errors=2,
  )
  state = tx.init(w)
  counts = []
  for t in range(8):
    grads = jax.grad(loss_fn)(w)
    updates, state = tx.update(grads, state, w, loss_fn=loss_fn)
    if t == 3:  # the schedule's bad value: a plain SGD step with the clean gradient
      np.testing.assert_array_equal(updates, -LR * grads)
    w = optax.apply_updates(w, updates)
    counts.append(int(optax.tree.get(state, "count")))
  assert counts == [1, 2, 3, 4, 5, 6, 7, 8]
  assert bool(jnp.all(jnp.isfinite(w)))
  assert int(optax.tree.get(state, "fallback_count")) == 1
  assert int(optax.tree.get(state, "full_steps")) == 7


def test_momentum_sam_with_an_unusable_rho_value_takes_the_clean_gradient():
  w, loss_fn = _quadratic()
  tx = optax.chain(optax_gsam.momentum_sam(_scheduled(jnp.nan)), optax.sgd(LR))
  state = tx.init(w)
  for t in range(6):
    updates, state = tx.update(optax.tree.zeros_like(w), state, w, loss_fn=loss_fn)
    if t == 3:
      np.testing.assert_allclose(updates, -LR * jax.grad(loss_fn)(w), rtol=1e-6)
    w = optax.apply_updates(w, updates)
  msam = state[0]
  assert int(msam.count) == 6 and int(msam.fallback_count) == 1
  assert bool(jnp.all(jnp.isfinite(w)))


def test_an_unusable_rho_under_a_cheap_policy_counts_as_a_fallback():
  w, loss_fn = _quadratic()
  tx = optax_gsam.gsam(_scheduled(jnp.nan), ALPHA, policy=optax_gsam.every_k_policy(2))
  state = tx.init(w)
  for t in range(5):
    grads = jax.grad(loss_fn)(w)
    out, state = tx.update(grads, state, w, loss_fn=loss_fn)
    if t == 3:
      np.testing.assert_array_equal(out, grads)
    w = w - LR * out
  assert int(state.count) == 5 and int(state.fallback_count) == 1


# --- params leaves that cannot be perturbed -------------------------------------------------


@pytest.mark.parametrize(
  "make_tx", [lambda: optax_gsam.gsam(RHO, ALPHA), lambda: optax_gsam.momentum_sam(RHO)]
)
def test_an_integer_params_leaf_is_named_with_the_fix(make_tx):
  params = {"w": jnp.ones(3), "step": jnp.int32(0)}
  grads = {"w": jnp.ones(3), "step": jnp.int32(0)}
  tx = make_tx()
  with pytest.raises(ValueError, match=r"params\['step'\]: dtype int32.*eqx.partition"):
    tx.update(grads, tx.init(params), params, loss_fn=lambda p: jnp.sum(p["w"] ** 2))


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda: optax_gsam.gsam(RHO, ALPHA),
    lambda: optax_gsam.sam(RHO, policy=optax_gsam.every_k_policy(2)),
    lambda: optax_gsam.momentum_sam(RHO),
  ],
  ids=["gsam", "sam_every_2", "momentum_sam"],
)
def test_python_float_params_leaves_work_like_0d_arrays(make_tx):
  loss_fn = lambda p: p["scale"] * jnp.sum(jnp.sin(p["w"]) ** 2) + p["scale"] ** 2
  numbers = {"scale": 0.3, "w": jnp.array([0.5, -1.0])}
  arrays = {"scale": jnp.asarray(0.3), "w": numbers["w"]}
  tx = optax.chain(make_tx(), optax.sgd(LR))
  runs = []
  for params in (numbers, arrays):
    state = tx.init(params)
    for _ in range(2):
      updates, state = tx.update(jax.grad(loss_fn)(params), state, params, loss_fn=loss_fn)
      params = optax.apply_updates(params, updates)
    runs.append(params)
  jax.tree.map(np.testing.assert_array_equal, runs[0], runs[1])


def test_a_python_int_params_leaf_is_named_at_init_and_update():
  params = {"w": jnp.ones(3), "n": 3}
  tx = optax_gsam.momentum_sam(RHO, 0.9)
  with pytest.raises(ValueError, match=r"params\['n'\].*eqx.partition"):
    tx.init(params)
  tx = optax_gsam.gsam(RHO)
  with pytest.raises(ValueError, match=r"params\['n'\].*eqx.partition"):
    tx.update(params, tx.init(params), params, loss_fn=lambda p: jnp.sum(p["w"]))


def test_a_structure_mismatch_names_the_leaves():
  params = {"w": jnp.ones(3), "b": jnp.ones(())}
  tx = optax_gsam.gsam(RHO)
  with pytest.raises(ValueError, match=r"only in params: \['b'\].*eqx.partition"):
    tx.update({"w": jnp.ones(3)}, tx.init(params), params, loss_fn=lambda p: jnp.sum(p["w"]))


# --- a misspelt update keyword -----------------------------------------------------------------


def test_a_misspelt_update_keyword_is_refused():
  w, loss_fn = _quadratic()
  tx = optax.chain(optax_gsam.gsam(RHO, ALPHA), optax.sgd(LR))
  loss, grads = jax.value_and_grad(loss_fn)(w)
  with pytest.raises(TypeError, match=r"valu=, .*did you mean value="):
    tx.update(grads, tx.init(w), w, loss_fn=loss_fn, valu=loss)
  with pytest.raises(TypeError, match=r"loss_func=, .*did you mean loss_fn="):
    tx.update(grads, tx.init(w), w, loss_func=loss_fn)


# --- a typed PRNG key in the state serializes ----------------------------------------------


def test_random_policy_state_with_a_typed_key_round_trips_through_flax_serialization():
  w, loss_fn = _quadratic()
  policy = optax_gsam.random_policy(0.5, key=jax.random.key(3))
  tx = optax.chain(optax_gsam.sam(RHO, policy=policy), optax.sgd(LR))

  @jax.jit
  def step(w, state):
    updates, state = tx.update(jax.grad(loss_fn)(w), state, w, loss_fn=loss_fn)
    return optax.apply_updates(w, updates), state

  state = tx.init(w)
  for _ in range(3):
    w, state = step(w, state)
  restored = flax.serialization.from_bytes(tx.init(w), flax.serialization.to_bytes(state))
  a, b = (w, state), (w, restored)
  for _ in range(6):
    a, b = step(*a), step(*b)
  np.testing.assert_array_equal(a[0], b[0])
  full_steps = int(optax.tree.get(a[1], "full_steps"))
  assert 0 < full_steps < 9  # the draws really vary


# --- rho = 0 is exactly the base step ----------------------------------------------------------


@pytest.mark.parametrize("rho", [0.0, lambda count: 0.0 * count], ids=["static", "schedule"])
@pytest.mark.parametrize("minimize_fp", [True, False])
def test_gsam_at_rho_zero_outputs_the_clean_gradient_bitwise(rho, minimize_fp):
  w, loss_fn = _quadratic()
  alone = optax_gsam.gsam(rho, ALPHA, minimize_fp=minimize_fp)
  grads = jax.grad(loss_fn)(w)
  out, _ = jax.jit(lambda g: alone.update(g, alone.init(w), w, loss_fn=loss_fn))(grads)
  np.testing.assert_array_equal(out, grads)  # under jit too: the input itself, selected
  # Fed the same clean gradients, the chain takes the base optimizer's steps bitwise.
  gsam = optax.chain(optax_gsam.gsam(rho, ALPHA, minimize_fp=minimize_fp), optax.adam(LR))
  plain = optax.adam(LR)
  a, b = w, w
  sa, sb = gsam.init(w), plain.init(w)
  for _ in range(4):
    updates, sa = gsam.update(jax.grad(loss_fn)(a), sa, a, loss_fn=loss_fn)
    a = optax.apply_updates(a, updates)
    updates, sb = plain.update(jax.grad(loss_fn)(b), sb, b)
    b = optax.apply_updates(b, updates)
  np.testing.assert_array_equal(a, b)
  assert int(optax.tree.get(sa, "fallback_count")) == 0


def test_per_device_gsam_at_rho_zero_is_the_averaged_clean_gradient(data_mesh):
  from jax.sharding import PartitionSpec as P

  x = jax.random.normal(jax.random.key(0), (16, 3))
  w0 = jnp.array([0.3, -0.2, 0.1])
  tx = optax_gsam.gsam(lambda c: 0.0 * c, ALPHA, axis_name="data")

  def step(w, state, xb):
    local = lambda q: jnp.mean(jnp.sin(xb @ q) ** 2)
    return tx.update(jax.grad(local)(w), state, w, loss_fn=local)

  def step_and_mean(w, state, xb):
    local = lambda q: jnp.mean(jnp.sin(xb @ q) ** 2)
    out, _ = step(w, state, xb)
    return out, jax.lax.pmean(jax.grad(local)(w), "data")

  run = optax_gsam.data_parallel(step_and_mean, data_mesh, batch_argnums=(2,), out_specs=(P(), P()))
  out, mean = run(w0, tx.init(w0), x)
  np.testing.assert_array_equal(out, mean)  # bitwise the pmean of the clean gradients
  shards = x.reshape(8, 2, 3)
  local_grads = [jax.grad(lambda q, s=s: jnp.mean(jnp.sin(s @ q) ** 2))(w0) for s in shards]
  np.testing.assert_allclose(out, np.mean(local_grads, axis=0), rtol=1e-6)  # and the maths


# --- a traced alpha is checked where it is used, like a traced rho -----------------------------


@pytest.mark.parametrize("bad_alpha", [-0.3, jnp.nan])
def test_a_traced_unusable_alpha_outputs_the_clean_gradient(bad_alpha):
  w, loss_fn = _quadratic()
  tx = optax.inject_hyperparams(optax_gsam.gsam)(rho=RHO, alpha=ALPHA)
  state = tx.init(w)
  state.hyperparams["alpha"] = jnp.asarray(bad_alpha)  # under jit: traced, unchecked at build
  grads = jax.grad(loss_fn)(w)
  out, state = jax.jit(lambda g, s: tx.update(g, s, w, loss_fn=loss_fn))(grads, state)
  np.testing.assert_array_equal(out, grads)
  assert int(state.inner_state.fallback_count) == 1 and int(state.inner_state.count) == 1
