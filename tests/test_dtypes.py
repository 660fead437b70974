"""dtypes: float32, bfloat16 and mixed trees keep their dtypes; norms accumulate in float32;
x64 does not promote float32 state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import RHO
from _problems import float32_problem
from _problems import in_float32
from _problems import mixed_params

import optax_gsam
from optax_gsam import big_vision

EPS = 1e-12


def scaled_by_group(loss_fn, params, group):
  return loss_fn(params) * (1.0 + group.astype(jnp.float32))


def test_bfloat16_and_mixed_trees_keep_dtypes_on_cheap_and_grouped_steps():
  params, loss_fn = float32_problem(seed=10)
  tx = optax_gsam.gsam(RHO, 0.3, policy=optax_gsam.every_k_policy(2))
  for p in (jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), mixed_params(params)):
    f32_loss = functools.partial(in_float32, loss_fn)
    dtypes = jax.tree.map(lambda x: x.dtype, p)
    update = jax.jit(lambda s, p=p, f=f32_loss: tx.update(jax.grad(f)(p), s, p, loss_fn=f))
    state = tx.init(p)
    for _ in range(2):  # a full step, then a cheap one
      updates, state = update(state)
      assert jax.tree.map(lambda x: x.dtype, updates) == dtypes
      assert jax.tree.map(lambda x: x.dtype, state.stored_direction) == dtypes
      for name in (
        "last_rho",
        "perturbed_loss",
        "cosine",
        "clean_grad_norm",
        "perturbed_grad_norm",
      ):
        assert getattr(state, name).dtype == jnp.float32, name
    grouped = optax_gsam.gsam(0.1, 0.3, microbatches=2, perturb_each_microbatch=True)
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
    tx = optax.chain(optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(2)), optax.sgd(0.1))
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


def _tanh_regression(x, y, w, b):
  """The loss mean((tanh(x w + b) - y)^2) and its gradient, by hand in float64."""
  t = np.tanh(x @ w + b)
  r = 2.0 * (t - y) * (1.0 - t**2) / len(y)
  return np.mean((t - y) ** 2), {"b": np.sum(r), "w": x.T @ r}


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "model_state"])
def test_accumulate_value_and_grad_keeps_the_dtypes_of_jax_value_and_grad(stateful):
  """Under x64, float64 params gave a float32 loss (1.9e-8 off the float64 value); now the loss
  keeps the loss function's dtype and the gradients the params', as jax.value_and_grad's."""
  rng = np.random.default_rng(12)
  x, y, w, b = rng.normal(size=(16, 3)), rng.normal(size=16), rng.normal(size=3), 0.3
  value, grads = _tanh_regression(x, y, w, b)
  cases = [  # params dtype, the loss's dtype, tolerance against the float64 reference
    (jnp.float64, jnp.float64, 1e-12),
    (jnp.float32, jnp.float32, 1e-5),
    (jnp.float32, jnp.bfloat16, 1e-2),
  ]
  with jax.enable_x64(True):
    for param_dtype, loss_dtype, tol in cases:
      params = {"b": jnp.asarray(b, param_dtype), "w": jnp.asarray(w, param_dtype)}
      batch = (jnp.asarray(x, param_dtype), jnp.asarray(y, param_dtype))

      def loss(p, microbatch, loss_dtype=loss_dtype):
        mean = jnp.mean((jnp.tanh(microbatch[0] @ p["w"] + p["b"]) - microbatch[1]) ** 2)
        return mean.astype(loss_dtype)

      state = {"count": jnp.zeros([], jnp.int32)} if stateful else None
      f = (lambda p, s, m, loss=loss: (loss(p, m), {"count": s["count"] + 1})) if stateful else loss
      (got, new_state), got_grads = optax_gsam.accumulate_value_and_grad(
        f, params, batch, microbatches=4, model_state=state
      )
      whole = jax.value_and_grad(loss)(params, batch)
      assert jax.tree.map(jnp.result_type, (got, got_grads)) == jax.tree.map(jnp.result_type, whole)
      assert got.dtype == loss_dtype and got_grads["w"].dtype == param_dtype
      assert float(got) == pytest.approx(value, rel=tol)
      for name in grads:
        np.testing.assert_allclose(np.asarray(got_grads[name], np.float64), grads[name], rtol=tol)
      assert new_state == (None if not stateful else {"count": 4})
