"""The pure maths: perturbation forms, decomposition and overflow-safe reductions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_gsam


def _tree(rng, scale=1.0, dtype=np.float64):
  return {
    "a": (rng.normal(size=(4, 3)) * scale).astype(dtype),
    "b": (rng.normal(size=5) * scale).astype(dtype),
  }


def _flat(tree):
  return np.concatenate(
    [np.ravel(np.asarray(tree["a"], np.float64)), np.ravel(np.asarray(tree["b"], np.float64))]
  )


@pytest.mark.parametrize("adaptive", [None, "gsam", "asam"])
def test_perturbation_forms(adaptive):
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    g, w = _tree(rng), _tree(rng)
    e = optax_gsam.perturbation(g, w, 0.3, adaptive=adaptive, eps=1e-12)
    gf, wf = _flat(g), _flat(w)
    expected = {
      None: 0.3 * gf / np.linalg.norm(gf),
      "gsam": 0.3 * np.abs(wf) * gf / np.linalg.norm(gf),
      "asam": 0.3 * wf**2 * gf / np.linalg.norm(np.abs(wf) * gf),
    }[adaptive]
    np.testing.assert_allclose(_flat(e), expected, rtol=1e-12)


@pytest.mark.parametrize("minimize_fp", [True, False])
def test_decompose_orthogonality(minimize_fp):
  """minimize_fp=True keeps g_p's component along g_p; False keeps g_c's along g_c."""
  rng = np.random.default_rng(1)
  with jax.enable_x64(True):
    g_c, g_p = _tree(rng), _tree(rng)
    g = _flat(optax_gsam.decompose(g_c, g_p, 0.7, minimize_fp=minimize_fp))
    kept = _flat(g_p) if minimize_fp else _flat(g_c)
    assert g @ kept == pytest.approx(kept @ kept, rel=1e-10)


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_reductions_are_overflow_and_underflow_safe_in_float32(scale):
  rng = np.random.default_rng(2)
  a, b = _tree(rng, scale, np.float32), _tree(rng, scale, np.float32)
  stats = optax_gsam.gradient_stats(a, b)
  fa, fb = _flat(a), _flat(b)
  assert float(stats.clean_norm) == pytest.approx(np.linalg.norm(fa), rel=1e-5)
  assert float(stats.perturbed_norm) == pytest.approx(np.linalg.norm(fb), rel=1e-5)
  cosine = fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb)
  assert float(stats.cosine) == pytest.approx(cosine, rel=1e-4, abs=1e-6)
  assert float(optax_gsam.stable_global_norm(a)) == pytest.approx(np.linalg.norm(fa), rel=1e-5)
  g = optax_gsam.decompose(a, b, 0.5)
  params = _tree(rng, 1.0, np.float32)
  e = optax_gsam.perturbation(a, params, 0.1, adaptive="asam")
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((g, e)))


def test_zero_and_empty_trees():
  zeros = {"a": jnp.zeros(3), "b": jnp.zeros((0,))}
  assert float(optax_gsam.stable_global_norm(zeros)) == 0.0
  stats = optax_gsam.gradient_stats(zeros, zeros)
  assert float(stats.cosine) == 0.0
  e = optax_gsam.perturbation(zeros, zeros, 0.5)
  assert all(np.all(x == 0) for x in jax.tree.leaves(e))


def test_bfloat16_norm_accumulates_in_float32():
  x = jnp.full((4096,), 1.0 + 2.0**-7, jnp.bfloat16)
  assert optax_gsam.stable_global_norm(x).dtype == jnp.float32
  assert float(optax_gsam.stable_global_norm(x)) == pytest.approx(64.0 * (1.0 + 2.0**-7), rel=1e-6)
