"""The pure maths: perturbation forms, decomposition and overflow-safe reductions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_gsam
from optax_gsam._src.directions import perturbation as perturbation_src

from benchmarks.costs import compile_time  # the one HLO instruction count


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


# Both forms of the norms, each checked on CPU: the public functions lower the first for CPU and
# the second for TPU and GPU (jax.lax.platform_dependent).
FORMS = {
  "two_pass (cpu)": (perturbation_src._two_pass_norm, perturbation_src._two_pass_pair_stats),
  "one_pass (tpu, gpu)": (perturbation_src._one_pass_norm, perturbation_src._one_pass_pair_stats),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30])
def test_each_backends_norms_are_exact_across_float32s_range(form, scale):
  """Against float64 numpy: no overflow or underflow in either form, jitted or not."""
  norm, pair_stats = FORMS[form]
  rng = np.random.default_rng(3)
  a, b = _tree(rng, scale, np.float32), _tree(rng, scale, np.float32)
  fa, fb = _flat(a), _flat(b)
  cosine = fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb)
  for run in (lambda f, *x: f(*x), lambda f, *x: jax.jit(f)(*x)):
    assert float(run(norm, a)) == pytest.approx(np.linalg.norm(fa), rel=1e-6)
    norm_a, norm_b, cos = run(pair_stats, a, b)
    assert float(norm_a) == pytest.approx(np.linalg.norm(fa), rel=1e-6)
    assert float(norm_b) == pytest.approx(np.linalg.norm(fb), rel=1e-6)
    assert float(cos) == pytest.approx(cosine, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("scale", [0.0, 1e-25, 1e-20, 1.0, 1e19, 1.8e19])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["scalar", "size 1"])
def test_each_backends_norms_of_trees_with_a_one_entry_leaf_compiled(form, scale, shape):
  """Compiled, a one-entry leaf's scaled products are scalars to XLA's simplifier, which folded
  their two factors of 2^72 into 2^144 (inf in float32; 2^-144 is 0): a zero or tiny gradient's
  norm was NaN, a huge one's cosine 3.6e16. Against float64 numpy."""
  norm, pair_stats = FORMS[form]
  a = {f"s{i}": jnp.full(shape, scale * (i + 1), jnp.float32) for i in range(4)}
  b = {f"s{i}": jnp.full(shape, scale / (i + 1), jnp.float32) for i in range(4)}
  a["w"], b["w"] = jnp.array([scale, 0.0]), jnp.array([scale / 2, 0.0])
  fa, fb = (np.concatenate([np.ravel(np.float64(x)) for x in jax.tree.leaves(t)]) for t in (a, b))
  expected = (
    np.linalg.norm(fa),
    np.linalg.norm(fb),
    (fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb) if scale else 0.0),
  )
  norm_a, norm_b, cos = jax.jit(pair_stats)(a, b)
  np.testing.assert_allclose(
    [float(jax.jit(norm)(a)), float(norm_a), float(norm_b), float(cos)],
    [expected[0], *expected],
    rtol=1e-5,
  )


@pytest.mark.parametrize("form", FORMS)
def test_each_backends_norms_of_zero_bfloat16_complex_and_float64_trees(form):
  norm, pair_stats = FORMS[form]
  zeros = {"a": jnp.zeros(3), "b": jnp.zeros((0,))}
  assert [float(v) for v in (norm(zeros), *pair_stats(zeros, zeros))] == [0.0] * 4
  x = jnp.full((4096,), 1.0 + 2.0**-7, jnp.bfloat16)
  assert norm(x).dtype == jnp.float32
  assert float(norm(x)) == pytest.approx(64.0 * (1.0 + 2.0**-7), rel=1e-6)
  z = jnp.array([3.0 + 4.0j, 1e20j], jnp.complex64)  # |z|^2 summed over real and imaginary parts
  assert float(norm(z)) == pytest.approx(np.hypot(5.0, 1e20), rel=1e-6)
  with jax.enable_x64(True):
    rng = np.random.default_rng(4)
    a, b = _tree(rng), _tree(rng)
    fa, fb = _flat(a), _flat(b)
    assert norm(a).dtype == jnp.float64
    np.testing.assert_allclose(
      [float(v) for v in pair_stats(a, b)],
      [np.linalg.norm(fa), np.linalg.norm(fb), fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb)],
      rtol=1e-13,
    )


def test_the_norms_lower_in_two_passes_for_cpu_and_in_one_for_tpu():
  """CPU's form reduces each leaf by its largest entry first; TPU's forms its sums in one pass."""
  tree = {"x": jnp.ones(3), "y": jnp.ones((2, 2))}
  for fn, args in (
    (optax_gsam.stable_global_norm, (tree,)),
    (optax_gsam.gradient_stats, (tree, tree)),
  ):
    traced = jax.jit(fn).trace(*args)
    text = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "tpu")}
    assert text["cpu"].count("stablehlo.maximum") > 0, fn
    assert text["tpu"].count("stablehlo.maximum") == 0, fn
    assert "conditional" not in jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("form", FORMS)
def test_each_backends_cosine_with_a_zero_tree_is_zero(form):
  """Entries over 2^56 would overflow the one-pass form's up-scaled sum: 0 * inf there."""
  _, pair_stats = FORMS[form]
  big, zeros = jnp.array([1e17, 1.0, -3e30]), jnp.zeros(3)
  for a, b in ((big, zeros), (zeros, big)):
    assert [float(v) for v in pair_stats(a, b)][2] == 0.0


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_each_backends_norms_differentiate_alike_and_finitely(scale):
  """jax.grad through either form is the analytic derivative (the one-pass form's unselected
  sums would otherwise give 0 * inf)."""
  x = jnp.array([3.0, 4.0, 0.0]) * scale
  y = jnp.array([1.0, -2.0, 2.0]) * scale
  expected_norm = np.array([0.6, 0.8, 0.0])
  u, v = np.array([3.0, 4.0, 0.0]), np.array([1.0, -2.0, 2.0])
  cosine_grad = (v / 3.0 - (u @ v) / 5.0 / 3.0 * u / 5.0) / 5.0 / scale  # d cos / d x
  for norm, pair_stats in FORMS.values():
    np.testing.assert_allclose(jax.grad(norm)(x), expected_norm, rtol=1e-6)
    np.testing.assert_allclose(
      jax.grad(lambda a, f=pair_stats: f(a, y)[2])(x), cosine_grad, rtol=1e-5
    )


EXPONENT_CASES = [0.0, 1.0, 0.75, 3.0, 1e-40, 1e-45, 1e38, 2.0**-126, 2.0**120, 2.0**121, 6e-5,
                  np.inf, np.nan]  # fmt: skip


def _frexp_exponent(tree):
  """The CPU norms' scaling exponent as jnp.frexp gives it: independent of the bit reading."""
  largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in tree.values()]))
  return jnp.clip(jnp.frexp(largest)[1], -120, 120)


@pytest.mark.parametrize(
  "dtype", [jnp.float32, jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.float16)]
)
def test_the_cpu_norms_exponent_is_frexps_eager_and_jitted(dtype):
  with np.errstate(all="ignore"):  # float16 overflows 1e38 to inf, a case of its own
    pairs = jnp.asarray(np.asarray([[value, -value / 2] for value in EXPONENT_CASES]), dtype)
  # Each case against a zero leaf, and against every other case in the second leaf (a
  # non-finite or zero leaf among finite ones, on either side).
  n = len(EXPONENT_CASES)
  others = jnp.concatenate([jnp.zeros_like(pairs)] + [jnp.roll(pairs, k, 0) for k in range(1, n)])
  trees = {"a": jnp.tile(pairs, (n, 1)), "b": others}
  jitted = jax.jit(jax.vmap(perturbation_src._scale))(trees)  # one compile for every case
  references = jax.vmap(_frexp_exponent)(trees)
  for i in range(len(others)):
    tree = jax.tree.map(lambda x, i=i: x[i], trees)
    expected = int(references[i])
    if i < n:  # eagerly, each case beside a zero leaf
      scale = perturbation_src._scale(tree)
      assert int(scale.exponent) == expected, (dtype, tree)
      assert float(scale.full) == 2.0**-expected, (dtype, tree)
      assert float(scale.half) == 2.0 ** (-expected - 1), (dtype, tree)
    assert int(jitted.exponent[i]) == expected, (dtype, tree)
    assert float(jitted.full[i]) == 2.0**-expected, (dtype, tree)
    assert float(jitted.half[i]) == 2.0 ** (-expected - 1), (dtype, tree)


def test_the_cpu_norms_exponent_of_a_subnormal_leaf_is_the_lowest_clipped():
  """A lone subnormal entry (a reduction over several flushes it to zero on CPU) is read from its
  bits: the lowest normal exponent, clipped to -120, whatever leaf it sits beside."""
  tiny = jnp.asarray([1e-40], jnp.float32)
  for tree in ({"a": tiny}, {"a": jnp.zeros(3), "b": tiny}, {"a": tiny, "b": jnp.zeros(2)}):
    assert int(perturbation_src._scale(tree).exponent) == -120, tree
    assert int(jax.jit(perturbation_src._scale)(tree).exponent) == -120, tree


def test_the_cpu_norms_exponent_of_float64_is_frexps():
  with jax.enable_x64(True):
    for value in [1e-300, 1e300, 5e-324, 0.3, 2.0**-1022]:
      for other in (jnp.zeros(2, jnp.float64), jnp.asarray([0.5, 1.0], jnp.float32)):
        tree = {"a": jnp.asarray([value, -value / 2], jnp.float64), "b": other}
        assert int(perturbation_src._scale(tree).exponent) == int(_frexp_exponent(tree)), tree


def test_the_cpu_norms_compile_linearly_in_the_number_of_leaves():
  """Each leaf adds the same few instructions to the compiled CPU program, however many leaves
  there are. A max over the leaves' stacked maxima compiles to a chain that XLA copies into every
  leaf's fusion: each leaf added from 16 to 64 cost 738 instructions, from 4 to 16 only 238."""
  cpu = jax.devices("cpu")[0]

  def instructions(leaves: int) -> int:
    tree = jax.device_put({f"w{i}": jnp.full((4, 4), 1.0 + i) for i in range(leaves)}, cpu)
    text = jax.jit(optax_gsam.gradient_stats).lower(tree, tree).compile().as_text()
    return sum(compile_time.opcode_counts(text).values())

  few, some, many = instructions(4), instructions(16), instructions(64)
  assert (many - some) / 48 <= 1.25 * (some - few) / 12, (few, some, many)
