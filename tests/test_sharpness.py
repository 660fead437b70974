"""gsam/sam against an independent float64 reference, optax.contrib.sam and optax."""

import itertools

import chex
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
from _problems import unflatten

import optax_gsam

EPS = 1e-12


def ascent_of(adaptive):
  """The direction of the reference's ``adaptive``: None (SAM's), "gsam" or "asam"."""
  return None if adaptive is None else optax_gsam.adaptive_ascent(adaptive)


def reference_gsam_direction(w, g_c, grad_np, rho, alpha, adaptive, minimize_fp, like):
  """The GSAM update direction, written from the paper's formulas (numpy, float64)."""
  if adaptive is None:
    e = rho * g_c / (np.linalg.norm(g_c) + EPS)
  elif adaptive == "gsam":
    e = rho * np.abs(w) * g_c / (np.linalg.norm(g_c) + EPS)
  else:  # asam
    e = rho * w**2 * g_c / (np.linalg.norm(np.abs(w) * g_c) + EPS)
  g_p = flatten(grad_np(unflatten(w + e, like)))
  if minimize_fp:
    return g_p - alpha * (g_c - g_c @ g_p / (g_p @ g_p) * g_p)
  return g_c + alpha * (g_p - g_p @ g_c / (g_c @ g_c) * g_c)


CASES = [
  dict(adaptive=a, minimize_fp=m, alpha=al, scheduled=s)
  for a, m, al, s in itertools.product(
    [None, "gsam", "asam"], [True, False], [0.0, 0.4], [False, True]
  )
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gsam_matches_float64_reference_over_steps(case):
  lr, num_steps = 0.05, 5
  rho_fn = optax.linear_schedule(0.3, 0.05, num_steps) if case["scheduled"] else None
  with jax.enable_x64(True):
    params, loss_jax, _, grad_np = make_problem(seed=1)
    rho = rho_fn if case["scheduled"] else 0.2
    tx = optax.chain(
      optax_gsam.gsam(
        rho, case["alpha"], ascent=ascent_of(case["adaptive"]), minimize_fp=case["minimize_fp"]
      ),
      optax.sgd(lr),
    )
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    w_ref = flatten(params)
    for t in range(num_steps):
      grads = jax.grad(loss_jax)(p)
      updates, state = tx.update(grads, state, p, loss_fn=loss_jax)
      p = optax.apply_updates(p, updates)

      # Step counts are int32, as in optax; the schedule's value at such a count.
      rho_t = float(rho_fn(jnp.int32(t))) if case["scheduled"] else 0.2
      g_c = flatten(grad_np(unflatten(w_ref, params)))
      direction = reference_gsam_direction(
        w_ref, g_c, grad_np, rho_t, case["alpha"], case["adaptive"], case["minimize_fp"], params
      )
      w_ref = w_ref - lr * direction
      np.testing.assert_allclose(flatten(p), w_ref, rtol=1e-10, atol=1e-12)
      assert float(optax.tree.get(state, "last_rho")) == pytest.approx(rho_t, rel=1e-6)
    assert int(optax.tree.get(state, "count")) == num_steps


def test_diagnostics_match_reference():
  with jax.enable_x64(True):
    params, loss_jax, loss_np, grad_np = make_problem(seed=2)
    rho = 0.25
    tx = optax_gsam.gsam(rho, 0.3)
    p = jax.tree.map(jnp.asarray, params)
    loss, grads = jax.value_and_grad(loss_jax)(p)
    _, state = tx.update(grads, tx.init(p), p, loss_fn=loss_jax, value=loss)

    g_c = flatten(grad_np(params))
    w_p = flatten(params) + rho * g_c / np.linalg.norm(g_c)
    f_p = loss_np(unflatten(w_p, params))
    g_p = flatten(grad_np(unflatten(w_p, params)))
    expected = dict(
      perturbed_loss=f_p,
      surrogate_gap=f_p - loss_np(params),
      cosine=g_c @ g_p / np.linalg.norm(g_c) / np.linalg.norm(g_p),
      clean_grad_norm=np.linalg.norm(g_c),
      perturbed_grad_norm=np.linalg.norm(g_p),
      last_rho=rho,
    )
  # Diagnostics are stored in float32.
  for name, value in expected.items():
    assert float(getattr(state, name)) == pytest.approx(value, rel=2e-6), name
  assert state.surrogate_gap > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sam_equals_optax_contrib_sam(optimizer):
  rho, lr = 0.1, 0.03
  make_opt = {"sgd": lambda: optax.sgd(lr, momentum=0.9), "adam": lambda: optax.adam(lr)}[optimizer]
  with jax.enable_x64(True):
    params, loss_jax, _, _ = make_problem(seed=3)
    p_ours = p_theirs = jax.tree.map(jnp.asarray, params)
    ours = optax.chain(optax_gsam.sam(rho), make_opt())
    theirs = optax.contrib.sam(
      make_opt(),
      optax.chain(optax.contrib.normalize(), optax.sgd(rho)),
      opaque_mode=True,
    )
    s_ours, s_theirs = ours.init(p_ours), theirs.init(p_theirs)
    grad_fn = jax.grad(loss_jax)
    for _ in range(6):
      u, s_ours = ours.update(grad_fn(p_ours), s_ours, p_ours, loss_fn=loss_jax)
      p_ours = optax.apply_updates(p_ours, u)
      u, s_theirs = theirs.update(
        grad_fn(p_theirs), s_theirs, p_theirs, grad_fn=lambda q, _: grad_fn(q)
      )
      p_theirs = optax.apply_updates(p_theirs, u)
    chex.assert_trees_all_close(p_ours, p_theirs, rtol=1e-9, atol=1e-12)
    # The problem is non-degenerate: SAM moved away from plain gradient descent.
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), p_ours, params)
    assert min(jax.tree.leaves(moved)) > 1e-3


def test_sam_is_gsam_with_zero_alpha_and_both_branches():
  p, loss_jax = float32_problem(seed=4)
  grads = jax.grad(loss_jax)(p)
  out = {}
  for name, tx in {
    "sam": optax_gsam.sam(0.1),
    "gsam_fp": optax_gsam.gsam(0.1, 0.0, minimize_fp=True),
    "gsam_traced_alpha": optax.inject_hyperparams(optax_gsam.gsam)(rho=0.1, alpha=0.0),
  }.items():
    out[name], _ = tx.update(grads, tx.init(p), p, loss_fn=loss_jax)
  for name in ("gsam_fp", "gsam_traced_alpha"):
    chex.assert_trees_all_close(out["sam"], out[name], rtol=1e-6)
  # minimize_fp=False with alpha=0 is the clean gradient.
  tx = optax_gsam.gsam(0.1, 0.0, minimize_fp=False)
  clean, _ = tx.update(grads, tx.init(p), p, loss_fn=loss_jax)
  jax.tree.map(np.testing.assert_array_equal, clean, grads)


def test_value_and_grad_fn_with_aux_equals_loss_fn():
  p, loss_jax = float32_problem(seed=5)
  grads = jax.grad(loss_jax)(p)
  tx = optax_gsam.gsam(0.1, 0.5)
  a, sa = tx.update(grads, tx.init(p), p, loss_fn=loss_jax)
  vg = jax.value_and_grad(lambda q: (loss_jax(q), {"aux": 1.0}), has_aux=True)
  b, sb = tx.update(grads, tx.init(p), p, value_and_grad_fn=vg)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert sa.perturbed_loss == sb.perturbed_loss


def test_chain_passes_extra_args_and_ignores_unknown_ones():
  p, loss_jax = float32_problem(seed=6)
  tx = optax.chain(
    optax_gsam.gsam(0.1, 0.2),
    optax.clip_by_global_norm(1.0),
    optax.adamw(1e-3, weight_decay=0.1),
  )
  state = tx.init(p)
  loss, grads = jax.value_and_grad(loss_jax)(p)
  updates, state = tx.update(
    grads, state, p, loss_fn=loss_jax, value=loss, some_unknown_arg=jnp.ones(3)
  )
  assert jax.tree.structure(updates) == jax.tree.structure(p)
  assert float(optax.tree.get(state, "surrogate_gap")) != 0.0


def test_inject_hyperparams_matches_plain_and_can_be_changed():
  p, loss_jax = float32_problem(seed=7)
  grads = jax.grad(loss_jax)(p)
  schedule = optax.linear_schedule(0.2, 0.02, 10)
  plain = optax_gsam.gsam(schedule, 0.3)
  injected = optax.inject_hyperparams(optax_gsam.gsam)(rho=schedule, alpha=0.3)
  s_plain, s_inj = plain.init(p), injected.init(p)
  for _ in range(3):
    u_plain, s_plain = plain.update(grads, s_plain, p, loss_fn=loss_jax)
    u_inj, s_inj = injected.update(grads, s_inj, p, loss_fn=loss_jax)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), u_plain, u_inj)
  # Changing alpha in the injected state changes the output.
  s_inj.hyperparams["alpha"] = jnp.asarray(0.9, jnp.float32)
  u_changed, _ = injected.update(grads, s_inj, p, loss_fn=loss_jax)
  u_same, _ = plain.update(grads, s_plain, p, loss_fn=loss_jax)
  assert not optax.tree.allclose(u_changed, u_same)


@pytest.mark.parametrize("scheduled", [False, True], ids=["float", "schedule"])
def test_the_documented_call_reads_the_injected_rho(scheduled):
  """GSAMState.last_rho's docstring: tree.get with an array filter, for a float and a schedule."""
  p, loss_jax = float32_problem(seed=7)
  grads = jax.grad(loss_jax)(p)
  schedule = optax.linear_schedule(0.2, 0.02, 10)
  injected = optax.inject_hyperparams(optax_gsam.gsam)(rho=schedule if scheduled else 0.1)
  tx = optax.chain(injected, optax.sgd(0.1))
  state = tx.init(p)
  is_array = lambda path, value: isinstance(value, jax.Array)
  for i in range(3):
    _, state = tx.update(grads, state, p, loss_fn=loss_jax)
    expected = float(schedule(i)) if scheduled else 0.1
    rho = optax.tree.get(state, "rho", filtering=is_array)
    assert float(rho) == pytest.approx(expected)
    assert float(state[0].hyperparams["rho"]) == pytest.approx(expected)
  if scheduled:  # the schedule's own state is a second "rho"
    with pytest.raises(KeyError, match="multiple values for 'rho'"):
      optax.tree.get(state, "rho")


def test_jit_does_not_recompile_on_second_call():
  p, loss_jax = float32_problem(seed=8)
  tx = optax.chain(
    optax_gsam.gsam(
      optax_gsam.rho_from_lr(optax.cosine_decay_schedule(0.1, 20), 0.2, 0.05, num_steps=20), 0.3
    ),
    optax.sgd(0.1),
  )
  traces = []

  @jax.jit
  def step(p, state):
    traces.append(1)
    loss, grads = jax.value_and_grad(loss_jax)(p)
    updates, state = tx.update(grads, state, p, loss_fn=loss_jax, value=loss)
    return optax.apply_updates(p, updates), state

  state = tx.init(p)
  for _ in range(4):
    p, state = step(p, state)
  assert len(traces) == 1


def test_bfloat16_params_keep_dtype_and_agree_with_float32():
  params, loss_jax, _, _ = make_problem(seed=9)
  out = {}
  for dtype in (jnp.float32, jnp.bfloat16):
    p = jax.tree.map(lambda x, dtype=dtype: jnp.asarray(x, dtype), params)
    grads = jax.grad(loss_jax)(p)
    tx = optax_gsam.gsam(0.1, 0.4, ascent=optax_gsam.adaptive_ascent("gsam"))
    out[dtype], state = tx.update(grads, tx.init(p), p, loss_fn=loss_jax)
    assert all(x.dtype == dtype for x in jax.tree.leaves(out[dtype]))
    assert state.cosine.dtype == jnp.float32
  for a, b in zip(
    jax.tree.leaves(out[jnp.float32]), jax.tree.leaves(out[jnp.bfloat16]), strict=False
  ):
    np.testing.assert_allclose(np.asarray(b, np.float32), a, rtol=0.05, atol=0.05 * np.abs(a).max())


def test_mixed_dtype_tree():
  params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
  loss_fn = lambda p: jnp.sum(p["a"].astype(jnp.float32) ** 3) + jnp.sum(jnp.sin(p["b"]))
  tx = optax_gsam.gsam(0.1, 0.5)
  updates, _ = tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
  assert updates["a"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32


@pytest.mark.parametrize("adaptive", [None, "gsam", "asam"])
@pytest.mark.parametrize("minimize_fp", [True, False])
def test_zero_gradient_gives_finite_zero_update(adaptive, minimize_fp):
  p = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  loss_fn = lambda q: 0.0 * jnp.sum(q["w"]) + 3.0
  tx = optax_gsam.gsam(0.1, 0.5, ascent=ascent_of(adaptive), minimize_fp=minimize_fp)
  updates, state = tx.update(jax.grad(loss_fn)(p), tx.init(p), p, loss_fn=loss_fn, value=3.0)
  for leaf in jax.tree.leaves(updates):
    np.testing.assert_array_equal(leaf, 0.0)
  for leaf in jax.tree.leaves(state):
    assert np.all(np.isfinite(leaf))


def test_update_requires_exactly_one_loss_function_and_params():
  p = jnp.ones(3)
  tx = optax_gsam.gsam(0.1)
  state = tx.init(p)
  loss_fn = lambda w: jnp.sum(w**2)
  with pytest.raises(ValueError, match=r"loss_fn.*value_and_grad_fn"):
    tx.update(p, state, p)
  with pytest.raises(ValueError, match=r"loss_fn.*value_and_grad_fn"):
    tx.update(p, state, p, loss_fn=loss_fn, value_and_grad_fn=jax.value_and_grad(loss_fn))
  with pytest.raises(ValueError, match="params"):
    tx.update(p, state, None, loss_fn=loss_fn)
  with pytest.raises(ValueError, match="structure"):
    tx.update({"a": p}, state, p, loss_fn=loss_fn)
  with pytest.raises(ValueError, match="callable"):
    tx.update(p, state, p, loss_fn=3.0)
  with pytest.raises((TypeError, ValueError), match="scalar"):
    tx.update(p, state, p, loss_fn=lambda w: w)
  with pytest.raises(ValueError, match="scalar"):
    tx.update(p, state, p, value_and_grad_fn=lambda w: (w, w))


class UpdateVariantsTest(chex.TestCase):
  """The update gives the same output and state with and without jit, as optax's tests check."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_update_is_the_same_with_and_without_jit(self):
    p, loss_jax = float32_problem(seed=9)
    tx = optax_gsam.gsam(
      optax.linear_schedule(0.0, 0.2, 4), 0.3, policy=optax_gsam.every_k_policy(2)
    )
    update = self.variant(lambda g, s, q: tx.update(g, s, q, loss_fn=loss_jax))
    state, reference_state = tx.init(p), tx.init(p)
    for _ in range(3):
      grads = jax.grad(loss_jax)(p)
      out, state = update(grads, state, p)
      expected, reference_state = tx.update(grads, reference_state, p, loss_fn=loss_jax)
      chex.assert_trees_all_close(out, expected, rtol=1e-6)
      chex.assert_trees_all_close(state, reference_state, rtol=1e-6)
      p = jax.tree.map(lambda a, b: a - 0.1 * b, p, out)


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


@pytest.mark.parametrize("adaptive", [None, "asam"])
@pytest.mark.parametrize("minimize_fp", [True, False])
def test_zero_tiny_and_huge_gradients_give_finite_correct_outputs(adaptive, minimize_fp):
  rng = np.random.default_rng(0)
  shapes = {"a": (3, 2), "b": (4,)}
  w64 = {k: rng.normal(size=s) for k, s in shapes.items()}
  c64 = {k: rng.normal(size=s) for k, s in shapes.items()}
  d64 = {k: rng.uniform(0.5, 1.5, size=s) for k, s in shapes.items()}
  w, c, d = (jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), t) for t in (w64, c64, d64))
  tx = optax_gsam.gsam(0.1, 0.4, ascent=ascent_of(adaptive), minimize_fp=minimize_fp)

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
