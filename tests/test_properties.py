"""Property-based tests (hypothesis) of the invariants in docs/guarantees.md.

Random pytree structures (nested dicts, lists and tuples), leaf shapes, rho, alpha, batch and
chunk sizes; float64 references written here from the formulas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def gsam_output(problem, rho, alpha, **kwargs):
  tx = optax_gsam.gsam(rho, alpha, **kwargs)
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


def embed(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


def coupled_loss(params, reps):
  logits = params["t"] * reps @ reps.T
  return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
  data=st.data(),
  batch=st.integers(1, 12),
  features=st.integers(1, 4),
  hidden=st.integers(1, 5),
  seed=st.integers(0, 2**16),
)
def test_cached_gradient_equals_the_full_batch_gradient(data, batch, features, hidden, seed):
  chunk_size = data.draw(st.integers(1, batch), label="chunk_size")
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    params = {
      "w1": jnp.asarray(rng.normal(size=(features, hidden))),
      "w2": jnp.asarray(rng.normal(size=(hidden, 3))),
      "t": jnp.asarray(rng.uniform(0.5, 2.0)),
    }
    x = jnp.asarray(rng.normal(size=(batch, features)))
    value, grads = optax_gsam.cached_value_and_grad(embed, coupled_loss, chunk_size=chunk_size)(
      params, x
    )
    ref_value, ref_grads = jax.value_and_grad(lambda p: coupled_loss(p, embed(p, x)))(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    jax.tree.map(
      lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12), grads, ref_grads
    )
    assert optax.tree.allclose(grads, ref_grads, rtol=1e-10, atol=1e-12)
