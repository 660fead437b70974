"""Curvature measures against the dense Hessian (``jax.hessian``, float64) and their formulas.

The references are written here from the definitions: the dense Hessian's eigenvalues,
trace and moments, Hutchinson's variance for Rademacher probes, SAM's and ASAM's
one-step perturbations, and the trust-region maximum of a quadratic on a ball.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import optax_gsam


@pytest.fixture(autouse=True)
def float64():
  with jax.enable_x64(True):
    yield


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def mlp_loss(params, batch, activation=jnp.tanh):
  hidden = activation(batch["x"] @ params["w1"] + params["b1"])
  return cross_entropy(hidden @ params["w2"] + params["b2"], batch["y"])


def cnn_loss(params, batch):
  z = jax.lax.conv_general_dilated(
    batch["x"], params["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  z = jnp.tanh(z + params["bias"]).reshape(z.shape[0], -1)
  return cross_entropy(z @ params["w"] + params["b"], batch["y"])


def make_model(kind, n=16, seed=0):
  """A tiny MLP (45 params) or CNN (77 params) in float64, and a batch of n examples."""
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    shapes = {"w1": (3, 6), "b1": (6,), "w2": (6, 3), "b2": (3,)}
    x, loss = rng.normal(size=(n, 3)), mlp_loss
  else:
    shapes = {"kernel": (3, 3, 1, 2), "bias": (2,), "w": (18, 3), "b": (3,)}
    x, loss = rng.normal(size=(n, 5, 5, 1)), cnn_loss
  params = {k: jnp.asarray(rng.normal(size=s) * 0.8) for k, s in shapes.items()}
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(rng.integers(0, 3, size=n))}
  return loss, params, batch


def dense_hessian(loss, params, batch):
  flat, unravel = ravel_pytree(params)
  return np.asarray(jax.jit(jax.hessian(lambda f, b: loss(unravel(f), b)))(flat, batch))


def rademacher_std(a):
  """The standard deviation of z^T A z for one Rademacher probe z."""
  return np.sqrt(2.0 * (np.sum(a**2) - np.sum(np.diag(a) ** 2)))


MODELS = ("mlp", "cnn")
KEY = jax.random.key(0)


@pytest.mark.parametrize("kind", MODELS)
def test_hvp_and_top_eigenvalues_match_dense_hessian(kind):
  loss, params, batch = make_model(kind)
  hessian = dense_hessian(loss, params, batch)
  exact = np.linalg.eigvalsh(hessian)[::-1]
  v = jax.tree.map(lambda w: jnp.cos(jnp.arange(w.size).reshape(w.shape) * 1.0), params)
  hv = jax.jit(lambda p, b, v: optax_gsam.hessian_vector_product(loss, p, b, v))(params, batch, v)
  np.testing.assert_allclose(ravel_pytree(hv)[0], hessian @ ravel_pytree(v)[0], rtol=1e-10)
  top = jax.jit(
    lambda p, b: optax_gsam.hessian_eigenvalues(loss, p, b, KEY, k=3, num_iterations=40)
  )(params, batch)
  np.testing.assert_allclose(top, exact[:3], rtol=1e-6)


def test_power_iteration_finds_the_largest_magnitude_eigenvalue():
  loss, params, batch = make_model("mlp")
  exact = np.linalg.eigvalsh(dense_hessian(loss, params, batch))
  largest = exact[np.argmax(np.abs(exact))]
  power = optax_gsam.hessian_eigenvalues(
    loss, params, batch, KEY, method="power", num_iterations=300
  )
  np.testing.assert_allclose(power, [largest], rtol=1e-6)


@pytest.mark.parametrize("kind", MODELS)
def test_trace_within_its_stated_error(kind):
  loss, params, batch = make_model(kind)
  hessian = dense_hessian(loss, params, batch)
  probes = 64
  sigma = rademacher_std(hessian) / np.sqrt(probes)  # the estimator's standard error
  estimate = optax_gsam.hessian_trace(loss, params, batch, KEY, num_probes=probes)
  assert abs(float(estimate.trace) - np.trace(hessian)) <= 4 * sigma
  assert 0.6 * sigma <= float(estimate.std_error) <= 1.4 * sigma


@pytest.mark.parametrize("kind", MODELS)
def test_spectral_density_moments_match(kind):
  loss, params, batch = make_model(kind)
  hessian = dense_hessian(loss, params, batch)
  dim, probes = hessian.shape[0], 16
  density = optax_gsam.hessian_spectral_density(
    loss, params, batch, KEY, num_probes=probes, num_iterations=10
  )
  np.testing.assert_allclose(density.moment(0), 1.0, rtol=1e-12)
  for order in (1, 2, 3):
    power = np.linalg.matrix_power(hessian, order)
    sigma = rademacher_std(power) / dim / np.sqrt(probes)
    assert abs(float(density.moment(order)) - np.trace(power) / dim) <= 4 * sigma, order


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_ascent_step_is_the_sam_surrogate(adaptive):
  loss, params, batch = make_model("mlp")
  rho, m = 0.3, 4

  @jax.jit
  def surrogate(group):
    g = jax.grad(loss)(params, group)
    if adaptive:  # ASAM: eps = rho w^2 g / || |w| g ||
      norm = jnp.sqrt(sum(jnp.sum((params[k] * g[k]) ** 2) for k in g))
      eps = {k: rho * params[k] ** 2 * g[k] / norm for k in g}
    else:  # SAM: eps = rho g / ||g||
      norm = jnp.sqrt(sum(jnp.sum(g[k] ** 2) for k in g))
      eps = {k: rho * g[k] / norm for k in g}
    perturbed = {k: params[k] + eps[k] for k in g}
    return loss(perturbed, group) - loss(params, group)

  expected = [surrogate(jax.tree.map(lambda x, i=i: x[i : i + m], batch)) for i in range(0, 16, m)]
  measured = optax_gsam.m_sharpness(
    loss, params, batch, rho=rho, m=m, ascent_steps=1, adaptive=adaptive
  )
  np.testing.assert_allclose(measured, np.mean(expected), rtol=1e-10)


def trust_region_maximum(a, g, rho):
  """max over ||e|| <= rho of g.e + e.A.e / 2: e = (mu I - A)^-1 g on the sphere, mu > lambda_max."""
  values, vectors = np.linalg.eigh(a)
  coef = vectors.T @ g
  norm = lambda mu: np.linalg.norm(coef / (mu - values))
  low, high = values[-1] + 1e-12, values[-1] + np.linalg.norm(g) / rho + 1.0
  for _ in range(200):
    mid = (low + high) / 2
    low, high = (mid, high) if norm(mid) > rho else (low, mid)
  e = vectors @ (coef / (high - values))
  return g @ e + e @ a @ e / 2


def test_ascent_approaches_the_worst_case_on_a_quadratic():
  rng = np.random.default_rng(1)
  root = rng.normal(size=(6, 6))
  a, b, w = root @ root.T / 6, rng.normal(size=6), rng.normal(size=6)
  loss = lambda w, _: 0.5 * w @ jnp.asarray(a) @ w + jnp.asarray(b) @ w
  rho = 1.0
  exact = trust_region_maximum(a, a @ w + b, rho)
  measure = lambda steps: float(
    optax_gsam.m_sharpness(loss, jnp.asarray(w), jnp.zeros(1), rho=rho, ascent_steps=steps)
  )
  one, many = measure(1), measure(20)
  assert one < many <= exact + 1e-10
  assert many >= 0.999 * exact


def test_only_adaptive_sharpness_is_invariant_to_rescaling_relu_units():
  _, params, batch = make_model("mlp")
  relu_loss = lambda p, b: mlp_loss(p, b, jax.nn.relu)
  c = jnp.asarray([0.2, 5.0, 0.5, 3.0, 0.3, 2.0])  # unit j: c_j x its inputs, 1 / c_j x its output
  scaled = {
    **params,
    "w1": params["w1"] * c,
    "b1": params["b1"] * c,
    "w2": params["w2"] / c[:, None],
  }
  np.testing.assert_allclose(relu_loss(scaled, batch), relu_loss(params, batch), rtol=1e-12)
  for adaptive in (True, False):
    measure = jax.jit(
      lambda p, adaptive=adaptive: optax_gsam.m_sharpness(
        relu_loss, p, batch, rho=0.2, ascent_steps=3, adaptive=adaptive
      )
    )
    ratio = float(measure(scaled) / measure(params))
    if adaptive:
      np.testing.assert_allclose(ratio, 1.0, rtol=1e-9)
    else:
      assert abs(ratio - 1) > 0.1, ratio


MEASURES = {
  "eigenvalues": lambda loss, p, b, **kw: optax_gsam.hessian_eigenvalues(
    loss, p, b, KEY, k=2, **kw
  ),
  "trace": lambda loss, p, b, **kw: optax_gsam.hessian_trace(loss, p, b, KEY, num_probes=4, **kw),
  "density": lambda loss, p, b, **kw: optax_gsam.hessian_spectral_density(
    loss, p, b, KEY, num_probes=2, num_iterations=6, **kw
  ),
  "m_sharpness": lambda loss, p, b, **kw: optax_gsam.m_sharpness(
    loss, p, b, rho=0.2, m=2, ascent_steps=2, **kw
  ),
}


def all_measures(loss, params, batch, **kwargs):
  return {name: measure(loss, params, batch, **kwargs) for name, measure in MEASURES.items()}


@pytest.fixture(scope="module")
def single_device():
  """Every measure on one device, the whole batch of 16: what the variants must reproduce."""
  with jax.enable_x64(True):
    loss, params, batch = make_model("mlp", n=16)
    return jax.jit(lambda p, b: all_measures(loss, p, b))(params, batch)


def assert_close_trees(actual, expected):
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13), actual, expected
  )


def test_eight_devices_give_the_global_batch_numbers(data_mesh, single_device):
  loss, params, batch = make_model("mlp", n=16)
  on_mesh = jax.jit(lambda p, b: all_measures(loss, p, b, mesh=data_mesh, axis_name="data"))
  assert_close_trees(on_mesh(params, batch), single_device)


def test_batch_iterator_is_the_mean_over_its_batches(single_device):
  loss, params, batch = make_model("mlp", n=16)
  halves = [jax.tree.map(lambda x, i=i: x[8 * i : 8 * i + 8], batch) for i in range(2)]
  streamed = {
    name: MEASURES[name](loss, params, iter(halves), num_batches=2)
    for name in ("eigenvalues", "m_sharpness")
  }
  assert_close_trees(streamed, {name: single_device[name] for name in streamed})


def test_jit_float32_and_progress():
  loss, params, batch = make_model("mlp")
  calls = []
  top64 = np.linalg.eigvalsh(dense_hessian(loss, params, batch))[-1:]
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  batch32 = {**batch, "x": batch["x"].astype(jnp.float32)}
  measure = jax.jit(
    lambda p, b, k: optax_gsam.hessian_eigenvalues(
      loss, p, b, k, num_iterations=8, progress=lambda done, total: calls.append((done, total))
    )
  )
  top32 = measure(params32, batch32, KEY)
  assert top32.dtype == jnp.float32
  np.testing.assert_allclose(top32, top64, rtol=1e-4)
  jax.effects_barrier()
  assert sorted(calls) == [(i, 8) for i in range(1, 9)]
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  trace = optax_gsam.hessian_trace(loss, params16, batch32, KEY, num_probes=2)
  assert trace.trace.dtype == jnp.float32 and np.isfinite(trace.trace)


BAD_ARGUMENTS = [
  (lambda f, p, b: optax_gsam.hessian_eigenvalues(f, p, b, KEY, k=5, num_iterations=3), "k=5"),
  (lambda f, p, b: optax_gsam.hessian_eigenvalues(f, p, b, KEY, method="arnoldi"), "method"),
  (lambda f, p, b: optax_gsam.hessian_eigenvalues(f, p, b, KEY, k=46, num_iterations=50), "k=46"),
  (lambda f, p, b: optax_gsam.hessian_eigenvalues(f, p, b, KEY, k=2, method="power"), "power"),
  (lambda f, p, b: optax_gsam.hessian_trace(f, p, b, KEY, num_probes=1), "num_probes"),
  (lambda f, p, b: optax_gsam.m_sharpness(f, p, b, rho=0.1, m=5), "m=5 must divide"),
  (lambda f, p, b: optax_gsam.m_sharpness(f, p, b, rho=-1.0), "rho"),
  (lambda f, p, b: optax_gsam.hessian_trace(f, p, iter([b]), KEY), "num_batches"),
  (lambda f, p, b: optax_gsam.hessian_trace(f, p, b, KEY, num_batches=2), "iterator"),
  (lambda f, p, b: optax_gsam.hessian_trace(f, p, iter([b]), KEY, num_batches=2), "ran out"),
  (
    lambda f, p, b: optax_gsam.m_sharpness(
      f, p, iter([b, jax.tree.map(lambda x: x[:8], b)]), rho=0.1, num_batches=2
    ),
    "batch: the iterator's batches must have equal shapes",
  ),
  (
    lambda f, p, b: optax_gsam.hessian_trace(f, {"n": jnp.array(3)}, b, KEY),
    "params has no float leaves",
  ),
  (
    lambda f, p, b: optax_gsam.hessian_trace(f, {**p, "act": jnp.tanh}, b, KEY),
    r"params leaves must be arrays; these are not: \['act'\]",
  ),
  (
    lambda f, p, b: optax_gsam.hessian_trace(f, p, b, KEY, mesh=jax.make_mesh((8,), ("data",))),
    "axis_name",
  ),
]


@pytest.mark.parametrize("call, message", BAD_ARGUMENTS)
def test_bad_arguments_raise_early(call, message):
  loss, params, batch = make_model("mlp")
  with pytest.raises(ValueError, match=message):
    call(loss, params, batch)


def test_power_iteration_runs_all_its_iterations_beyond_the_dimension():
  # H = diag(2, 1.9, 0.2): the error shrinks by (1.9 / 2)^2 a step, so 3 steps are far from 2.
  loss = lambda w, _: 0.5 * jnp.sum(jnp.array([2.0, 1.9, 0.2]) * w**2)
  power = lambda n: optax_gsam.hessian_eigenvalues(
    loss, jnp.ones(3), jnp.zeros(1), KEY, method="power", num_iterations=n
  )
  np.testing.assert_allclose(power(400), [2.0], rtol=1e-12)
  assert abs(float(power(3)[0]) - 2.0) > 1e-3


# ----------------------------------------------------------------------------- complex and int params


def complex_problem():
  """f = sum x |w|^2 over (Re w, Im w): H = diag(2 x, 2 x), eigenvalues 10, 10, 4, 4, 2, 2."""
  loss = lambda w, x: jnp.sum(x * jnp.abs(w) ** 2)
  w = jnp.array([1 + 1j, 1 - 1j, 0.5j], jnp.complex128)
  return loss, w, jnp.array([1.0, 5.0, 2.0])


def test_complex_params_are_measured_as_real_pairs():
  loss, w, x = complex_problem()
  d = np.concatenate([x, x])  # the Hessian's diagonal over (Re w, Im w), halved
  u = np.concatenate([np.real(w), np.imag(w)])
  top = optax_gsam.hessian_eigenvalues(loss, w, x, KEY, k=6)
  np.testing.assert_allclose(top, [10, 10, 4, 4, 2, 2], rtol=1e-10)
  trace = optax_gsam.hessian_trace(loss, w, x, KEY, num_probes=4)  # z^T H z = tr H: diagonal H
  np.testing.assert_allclose(trace.trace, 32.0, rtol=1e-12)
  assert trace.trace.dtype == jnp.float64
  density = optax_gsam.hessian_spectral_density(loss, w, x, KEY, num_probes=2)
  np.testing.assert_allclose(density.moment(1), 32.0 / 6, rtol=1e-10)
  v = jnp.array([1 + 2j, -1j, 3.0])
  hv = optax_gsam.hessian_vector_product(loss, w, x, v)
  np.testing.assert_allclose(hv, 2 * x * np.real(v) + 2j * x * np.imag(v), rtol=1e-12)
  # The rise in the ball over R^6: f(w + e) - f(w) = g.e + e.H.e / 2 exactly, g = 2 d u.
  exact = trust_region_maximum(np.diag(2 * d), 2 * d * u, 0.05)
  rise = float(optax_gsam.m_sharpness(loss, w, x, rho=0.05, ascent_steps=20))
  assert 0.9999 * exact <= rise <= exact + 1e-12, (rise, exact)
  # ASAM's s = |w| (the modulus for both parts): e = rho s^2 g / ||s g||, one step.
  s = np.concatenate([np.abs(w), np.abs(w)])
  e = 0.05 * s**2 * (2 * d * u) / np.linalg.norm(s * 2 * d * u)
  adaptive = optax_gsam.m_sharpness(loss, w, x, rho=0.05, ascent_steps=1, adaptive=True)
  np.testing.assert_allclose(adaptive, 2 * d * u @ e + e @ (d * e), rtol=1e-12)


def test_complex_hessian_is_the_dense_one_over_real_pairs():
  rng = np.random.default_rng(2)
  c = jnp.asarray(rng.normal(size=(5, 4)) + 1j * rng.normal(size=(5, 4)))
  loss = lambda w, c: jnp.sum(jnp.abs(c @ w) ** 2) + jnp.sum(jnp.real(w) ** 3 * jnp.imag(w))
  w = jnp.asarray(rng.normal(size=4) + 1j * rng.normal(size=4))
  real_loss = lambda u: loss(u[:4] + 1j * u[4:], c)  # the same loss on R^8
  dense = np.asarray(jax.hessian(real_loss)(jnp.concatenate([jnp.real(w), jnp.imag(w)])))
  top = optax_gsam.hessian_eigenvalues(loss, w, c, KEY, k=3, num_iterations=8)
  np.testing.assert_allclose(top, np.linalg.eigvalsh(dense)[::-1][:3], rtol=1e-9)


def test_int_and_bool_leaves_are_held_fixed():
  loss, params, batch = make_model("mlp")
  shift = jnp.array(2)
  with_ints = {**params, "shift": shift, "mask": jnp.array([True, False])}
  int_loss = lambda p, b: loss({k: p[k] for k in params}, b) * (1 + p["shift"]) + p["mask"][0]
  float_loss = lambda p, b: loss(p, b) * (1 + shift) + 1.0
  for name, measure in MEASURES.items():
    jax.tree.map(
      lambda a, b, name=name: np.testing.assert_allclose(a, b, rtol=1e-12, err_msg=name),
      measure(int_loss, with_ints, batch),
      measure(float_loss, params, batch),
    )
  hv = optax_gsam.hessian_vector_product(int_loss, with_ints, batch, with_ints)
  assert int(hv["shift"]) == 0 and not bool(hv["mask"].any())


# ----------------------------------------------------------------------------- iterators and caching


def test_batch_iterator_works_inside_jit(single_device):
  loss, params, batch = make_model("mlp", n=16)
  halves = [jax.tree.map(lambda x, i=i: x[8 * i : 8 * i + 8], batch) for i in range(2)]
  streamed = jax.jit(
    lambda a, b: {
      name: MEASURES[name](loss, params, iter([a, b]), num_batches=2)
      for name in ("trace", "m_sharpness")
    }
  )(*halves)
  assert_close_trees(streamed, {name: single_device[name] for name in streamed})


class CompileCounter:
  """Counts XLA compilations (jax.monitoring's backend compile events) while active."""

  def __init__(self):
    self.count = 0

  def __call__(self, event, duration, **kwargs):
    self.count += event == "/jax/core/compile/backend_compile_duration"

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self)


def test_measures_called_again_outside_jit_neither_retrace_nor_recompile():
  loss, params, batch = make_model("mlp")
  traces = []
  counted = lambda p, b: traces.append(1) or loss(p, b)
  other = jax.tree.map(lambda x: x * 0.5, params)
  for name, measure in MEASURES.items():
    measure(counted, params, batch)  # the first call compiles
    traced = len(traces)
    assert traced > 0
    with CompileCounter() as compiles:
      jax.block_until_ready(measure(counted, other, batch))
    assert (len(traces), compiles.count) == (traced, 0), name
