"""GSAM's invariants from docs/guarantees.md, tested with hypothesis.

Random pytree structures (nested dicts, lists and tuples), leaf shapes, rho and alpha; float64
references written here from the formulas. The gradient cache's property test is in
test_gradient_cache.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import optax_gsam

EPS = 1e-12
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
structures = st.recursive(
  shapes,
  lambda children: st.one_of(
    st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3),
    st.lists(children, min_size=1, max_size=3),
    st.lists(children, min_size=1, max_size=2).map(tuple),
  ),
  max_leaves=5,
)


def is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def random_tree(structure, rng, low=-1.0, high=1.0):
  return jax.tree.map(
    lambda s: jnp.asarray(rng.uniform(low, high, size=s), jnp.float64), structure, is_leaf=is_shape
  )


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


class Problem:
  """f(w) = sum(c w + d w^2 / 2 + e w^4 / 4) over a random pytree, with its gradient."""

  def __init__(self, structure, seed):
    rng = np.random.default_rng(seed)
    self.params = random_tree(structure, rng)
    self.c, self.d, self.e = (random_tree(structure, rng, lo, hi) for lo, hi in ((-1, 1),) * 3)
    self.c_f, self.d_f, self.e_f = flat(self.c), flat(self.d), flat(self.e)

  def loss(self, params):
    terms = jax.tree.map(
      lambda w, c, d, e: jnp.sum(c * w + 0.5 * d * w**2 + 0.25 * e * w**4),
      params,
      self.c,
      self.d,
      self.e,
    )
    return sum(jax.tree.leaves(terms))

  def grad(self, w):  # numpy, flattened, float64
    return self.c_f + self.d_f * w + self.e_f * w**3

  def perturbed_grad(self, w, rho, adaptive):
    g = self.grad(w)
    if adaptive is None:
      e = rho * g / (np.linalg.norm(g) + EPS)
    elif adaptive == "gsam":
      e = rho * np.abs(w) * g / (np.linalg.norm(g) + EPS)
    else:
      e = rho * w**2 * g / (np.linalg.norm(np.abs(w) * g) + EPS)
    return self.grad(w + e)


def gsam_output(problem, rho, alpha, adaptive=None, **kwargs):
  ascent = None if adaptive is None else optax_gsam.adaptive_ascent(adaptive)
  tx = optax_gsam.gsam(rho, alpha, ascent=ascent, **kwargs)
  p = problem.params
  updates, _ = tx.update(jax.grad(problem.loss)(p), tx.init(p), p, loss_fn=problem.loss)
  assert jax.tree.structure(updates) == jax.tree.structure(p)
  return flat(updates)


rhos = st.floats(0.0, 0.5)
alphas = st.floats(0.0, 1.0)
adaptives = st.sampled_from([None, "gsam", "asam"])


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16), rho=rhos, adaptive=adaptives)
def test_alpha_zero_is_sam(structure, seed, rho, adaptive):
  with jax.enable_x64(True):
    problem = Problem(structure, seed)
    # alpha as an array runs the decomposition (a static 0 skips it).
    out = gsam_output(problem, rho, jnp.asarray(0.0), adaptive=adaptive)
    expected = problem.perturbed_grad(flat(problem.params), rho, adaptive)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-12)


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16), alpha=alphas, minimize_fp=st.booleans())
def test_rho_zero_is_the_clean_gradient(structure, seed, alpha, minimize_fp):
  with jax.enable_x64(True):
    problem = Problem(structure, seed)
    out = gsam_output(problem, 0.0, alpha, minimize_fp=minimize_fp)
    clean = problem.grad(flat(problem.params))
    # eps makes the projection coefficient |g| / (|g| + eps), not exactly 1.
    np.testing.assert_allclose(out, clean, rtol=1e-9, atol=1e-9 * np.linalg.norm(clean))


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16), rho=rhos, alpha=alphas, adaptive=adaptives)
def test_component_along_the_perturbed_gradient_is_kept(structure, seed, rho, alpha, adaptive):
  with jax.enable_x64(True):
    problem = Problem(structure, seed)
    out = gsam_output(problem, rho, alpha, adaptive=adaptive, minimize_fp=True)
    w = flat(problem.params)
    g_p, g_c = problem.perturbed_grad(w, rho, adaptive), problem.grad(w)
    scale = np.linalg.norm(g_p) * (np.linalg.norm(g_p) + alpha * np.linalg.norm(g_c))
    assert abs(out @ g_p - g_p @ g_p) <= 1e-9 * scale + 1e-12
