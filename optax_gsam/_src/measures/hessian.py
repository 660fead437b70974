"""Curvature of a loss: Hessian-vector products, Lanczos, Hutchinson and spectral density.

Every measure here sees the Hessian only through Hessian-vector products
(forward-over-reverse: ``jax.jvp`` of ``jax.grad``), so it works on any params
pytree at the memory of about two gradients, plus the Lanczos basis
(``num_iterations`` vectors the size of the params).

The loss measured is the mean of ``loss_fn(params, batch)`` over the batches
given (one fixed batch, or ``num_batches`` equal-sized batches taken from an
iterator and stacked), and with ``axis_name`` also over the devices of that
axis: each Hessian-vector product is averaged with ``jax.lax.pmean``, so under
data parallelism the measure is the global batch's. The Hessian is the one over
the params' float leaves as real numbers (complex leaves as (real, imaginary)
pairs, other leaves held fixed: ``_src/measuring.py``). Vectors and sums are
kept in float32 at least (float64 stays float64), whatever the params' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from optax_gsam._src.core.arrays import compute_dtype
from optax_gsam._src.core.arrays import conform
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.measures.measuring import Batches
from optax_gsam._src.measures.measuring import LossFn
from optax_gsam._src.measures.measuring import MeasureOptions
from optax_gsam._src.measures.measuring import ParamView
from optax_gsam._src.measures.measuring import Progress
from optax_gsam._src.measures.measuring import batch_mean
from optax_gsam._src.measures.measuring import measure_keywords
from optax_gsam._src.measures.measuring import param_view
from optax_gsam._src.measures.measuring import report
from optax_gsam._src.measures.measuring import run_measure

_METHODS = ("lanczos", "power")

if TYPE_CHECKING:  # PEP 692's Unpack is typing's own from Python 3.12
  from typing_extensions import Unpack


# ----------------------------------------------------------------------------- Hessian-vector products


def flat_hvp(
  loss_fn: LossFn, params: Any, batches: Batches, axis_name: Hashable | None
) -> tuple[Callable[[jax.Array], jax.Array], int, np.dtype]:
  """``v -> H v`` on flat vectors, the dimension, and the vectors' dtype (float32 at least).

  ``params`` are real (a :class:`ParamView`'s leaves); ``loss_fn`` is a function of them.
  """
  flat, unravel = ravel_pytree(params)
  dtype = compute_dtype(flat.dtype)

  def one_batch(v: jax.Array, batch: Any) -> jax.Array:
    grad = lambda p: jax.grad(loss_fn)(p, batch)
    _, hv = jax.jvp(grad, (params,), (unravel(v.astype(flat.dtype)),))
    # H v in v's layout: with sharded params, the flattened product is laid out as the
    # leaves were, and Lanczos' selects need one layout for all its vectors.
    return conform(ravel_pytree(hv)[0].astype(dtype), v)

  def hvp(v: jax.Array) -> jax.Array:
    hv = batch_mean(lambda b: one_batch(v, b), batches)
    return hv if axis_name is None else jax.lax.pmean(hv, axis_name)

  return hvp, flat.size, dtype


def hessian_vector_product(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  vector: Any,
  *,
  axis_name: Hashable | None = None,
) -> Any:
  r"""The Hessian of the loss times a vector, :math:`H v`, without forming :math:`H`.

  Forward-over-reverse, ``jax.jvp(jax.grad(f), (w,), (v,))``: about the cost of two
  gradients. With ``axis_name`` (inside ``data_parallel`` or a ``shard_map`` with
  ``check_vma=False``) the product is averaged over the axis, so it is the
  global batch's.

  The Hessian is the one over the params' float leaves as real numbers: a complex
  leaf :math:`z = x + iy` counts as the pairs :math:`(x, y)`, its entry of
  :math:`v` as :math:`(\operatorname{Re} v, \operatorname{Im} v)`, and its entry
  of :math:`H v` is returned as the complex number of the product's pair. Int and
  bool leaves are held fixed: their entries of :math:`H v` are 0.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    params: the weights :math:`w`, any pytree of arrays.
    batch: the batch the loss is evaluated on.
    vector: :math:`v`, a pytree like ``params``.
    axis_name: the data axis to average over, or ``None``.

  Returns:
    :math:`H v`, a pytree like ``params`` (float32 at least).

  Example:
    >>> import jax.numpy as jnp, optax_gsam
    >>> loss_fn = lambda w, x: jnp.sum(x * w ** 2)  # H = diag(2 x)
    >>> optax_gsam.hessian_vector_product(loss_fn, jnp.ones(2), jnp.array([1.0, 3.0]), jnp.ones(2))
    Array([2., 6.], dtype=float32)
  """
  view = param_view(params)
  real_loss = lambda leaves, batch: loss_fn(view.tree(leaves), batch)
  hvp, _, _ = flat_hvp(real_loss, view.leaves, Batches(batch, False), axis_name)
  flat, unravel = ravel_pytree(view.of(vector))
  rest = [jnp.zeros_like(x) for x in view.treedef.flatten_up_to(vector)]
  return view.tree(unravel(hvp(flat).astype(flat.dtype)), rest)


# ----------------------------------------------------------------------------- Lanczos and power iteration


def _orthogonalize(w: jax.Array, basis: jax.Array) -> jax.Array:
  """``w`` minus its projection on the rows of ``basis``, twice ("twice is enough")."""
  for _ in range(2):
    w = w - basis.T @ (basis @ w)
  return w


def lanczos(
  hvp: Callable[[jax.Array], jax.Array],
  v0: jax.Array,
  num_iterations: int,
  key: jax.Array,
  on_step: Callable[[jax.Array], None] = lambda i: None,
) -> tuple[jax.Array, jax.Array]:
  """The Lanczos tridiagonal of ``hvp`` from ``v0``: its diagonal and off-diagonal.

  Fully reorthogonalized, so the Ritz values are as accurate as the arithmetic. If the
  Krylov space closes (a vanishing off-diagonal), the next vector is a random one
  orthogonal to the basis and the off-diagonal there is 0: the Ritz values stay
  eigenvalues and the new block gets no weight in the first components.
  """
  dim, dtype = v0.shape[0], v0.dtype
  tolerance = float(np.sqrt(np.finfo(dtype).eps))
  # Restart candidates are shifts of one random vector: no random draws inside the loop.
  noise = jax.random.normal(key, (dim,), dtype)

  def body(i, carry):
    basis, v, beta_prev, alphas, betas = carry
    basis = basis.at[i].set(v)
    w = hvp(v)
    alpha = jnp.vdot(v, w)
    w = _orthogonalize(w - alpha * v - beta_prev * basis[i - 1], basis)
    beta = jnp.linalg.norm(w)
    restart = _orthogonalize(jnp.roll(noise, i + 1), basis)
    closed = beta <= tolerance * (jnp.abs(alpha) + beta_prev)
    v = jnp.where(closed, restart / jnp.linalg.norm(restart), w / jnp.where(closed, 1.0, beta))
    beta = jnp.where(closed, 0.0, beta)
    on_step(i)
    return basis, v, beta, alphas.at[i].set(alpha), betas.at[i].set(beta)

  zeros = jnp.zeros(num_iterations, dtype)
  init = (jnp.zeros((num_iterations, dim), dtype), v0 / jnp.linalg.norm(v0), zeros[0], zeros, zeros)
  _, _, _, alphas, betas = jax.lax.fori_loop(0, num_iterations, body, init)
  return alphas, betas[:-1]


def ritz(alphas: jax.Array, betas: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Eigenvalues (ascending) of the tridiagonal, and the squared first components of its eigenvectors."""
  tridiagonal = jnp.diag(alphas) + jnp.diag(betas, 1) + jnp.diag(betas, -1)
  values, vectors = jnp.linalg.eigh(tridiagonal)
  return values, vectors[0] ** 2


def _power_iteration(
  hvp: Callable[[jax.Array], jax.Array],
  v0: jax.Array,
  num_iterations: int,
  on_step: Callable[[jax.Array], None],
) -> jax.Array:
  """The Rayleigh quotient of ``hvp`` at ``num_iterations`` power steps from ``v0``."""

  def body(i, v):
    w = hvp(v)
    on_step(i)
    return w / jnp.maximum(jnp.linalg.norm(w), jnp.finfo(w.dtype).tiny)

  v = jax.lax.fori_loop(0, num_iterations, body, v0 / jnp.linalg.norm(v0))
  return jnp.vdot(v, hvp(v))[None]


def _check_eigen_args(k: int, num_iterations: int, method: str) -> None:
  check_positive_int("k", k)
  check_positive_int("num_iterations", num_iterations)
  if method not in _METHODS:
    raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
  if method == "power" and k != 1:
    raise ValueError(f"method='power' finds one eigenvalue; got k={k}. Use method='lanczos'.")
  if k > num_iterations:
    raise ValueError(f"k={k} eigenvalues need num_iterations >= k, got {num_iterations}.")


class _EigenOptions(NamedTuple):
  """The static arguments of :func:`hessian_eigenvalues`: with ``loss_fn``, its cache key."""

  k: int
  num_iterations: int
  method: str
  progress: Progress | None


def _eigenvalues(
  loss: LossFn, view: ParamView, batches: Batches, key: jax.Array, axis_name, options: _EigenOptions
) -> jax.Array:
  """The measure of :func:`hessian_eigenvalues`, on the params' real view."""
  hvp, dim, dtype = flat_hvp(loss, view.leaves, batches, axis_name)
  if options.k > dim:
    raise ValueError(f"k={options.k} eigenvalues asked of a Hessian of dimension {dim}.")
  # Lanczos is exact after dim steps (the Krylov space is complete); power iteration is not.
  power = options.method == "power"
  steps = options.num_iterations if power else min(options.num_iterations, dim)
  on_step = lambda i: report(options.progress, i + 1, steps)
  v0 = jax.random.normal(key, (dim,), dtype)
  if power:
    return _power_iteration(hvp, v0, steps, on_step)
  values, _ = ritz(*lanczos(hvp, v0, steps, key, on_step))
  return values[::-1][: options.k]


@measure_keywords
def hessian_eigenvalues(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  key: jax.Array,
  *,
  k: int = 1,
  num_iterations: int = 20,
  method: str = "lanczos",
  **data: Unpack[MeasureOptions],
) -> jax.Array:
  r"""The ``k`` largest eigenvalues of the loss's Hessian, by Lanczos (or power iteration).

  Lanczos builds the tridiagonal :math:`T = V^\top H V` of the Krylov space
  :math:`\mathrm{span}\{v_0, H v_0, \dots, H^{m-1} v_0\}` (fully reorthogonalized) and
  returns its largest eigenvalues (Ritz values); the extreme ones converge first,
  typically to many digits within 20 products. ``method="power"`` iterates
  :math:`v \leftarrow H v / \|H v\|` and returns the Rayleigh quotient
  :math:`v^\top H v`: the eigenvalue of largest *magnitude*, slower to converge.

  :math:`\lambda_{\max}` is the sharpness of the loss's quadratic model; it depends on
  the parameters' scale (reparametrizing a ReLU network changes it, not the function).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, a mean over the batch's examples.
    params: the weights, any pytree of arrays (see :func:`hessian_vector_product`).
    batch: a fixed batch, or an iterator of equal-sized batches (with ``num_batches``).
    key: the PRNG key of the starting vector.
    k: how many eigenvalues, largest first.
    num_iterations: Hessian-vector products. Lanczos caps them at the number of
      parameters, where its Krylov space is the whole space and its Ritz values
      are exact; power iteration takes all of them.
    method: ``"lanczos"`` or ``"power"`` (``k=1`` only).
    num_batches: how many batches to take from an iterator ``batch``.
    axis_name: average the products over this data axis (inside a per-device step).
    mesh: run per device on this mesh, the batch split over ``axis_name``.
    progress: called as ``progress(done, total)`` after each product.

  Returns:
    An array of shape ``(k,)``, descending.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> loss_fn = lambda w, x: jnp.sum(x * w ** 2)  # H = diag(2 x)
    >>> x = jnp.array([1.0, 5.0, 2.0])
    >>> eigenvalues = optax_gsam.hessian_eigenvalues(loss_fn, jnp.ones(3), x, jax.random.key(0), k=2)
    >>> eigenvalues.round(4)  # Lanczos in float32: the last digits depend on the CPU's kernels
    Array([10.,  4.], dtype=float32)

  References:
    Ghorbani, Krishnan and Xiao, *An investigation into neural net optimization via
    Hessian eigenvalue density*, ICML 2019; Yao et al., *PyHessian*, 2020.
  """
  _check_eigen_args(k, num_iterations, method)
  options = _EigenOptions(k, num_iterations, method, data["progress"])
  return run_measure(_eigenvalues, loss_fn, options, params, batch, key, data)


# ----------------------------------------------------------------------------- trace and density


def _probe(key: jax.Array, dim: int, dtype: np.dtype) -> jax.Array:
  """A Rademacher vector: entries +-1, so :math:`E[z z^\\top] = I`."""
  return jax.random.rademacher(key, (dim,), dtype)


class TraceEstimate(NamedTuple):
  """Hutchinson's estimate of the Hessian trace.

  Attributes:
    trace: the mean of :math:`z^\\top H z` over the probes.
    std_error: its standard error, the probes' sample standard deviation over
      :math:`\\sqrt{n}`. With Rademacher probes the variance of one probe is
      :math:`2 (\\|H\\|_F^2 - \\sum_i H_{ii}^2)`.
  """

  trace: jax.Array
  std_error: jax.Array


def _map_probes(one: Callable[[jax.Array, jax.Array], Any], key: jax.Array, num_probes: int) -> Any:
  """``one(i, key_i)`` for each probe ``i`` and its own key, one probe live at a time."""
  keys = jax.random.split(key, num_probes)
  return jax.lax.map(lambda args: one(*args), (jnp.arange(num_probes), keys))


class _TraceOptions(NamedTuple):
  """The static arguments of :func:`hessian_trace`."""

  num_probes: int
  progress: Progress | None


def _trace(
  loss: LossFn, view: ParamView, batches: Batches, key: jax.Array, axis_name, options: _TraceOptions
) -> TraceEstimate:
  """The measure of :func:`hessian_trace`, on the params' real view."""
  hvp, dim, dtype = flat_hvp(loss, view.leaves, batches, axis_name)

  def one(i, probe_key):
    z = _probe(probe_key, dim, dtype)
    value = jnp.vdot(z, hvp(z))
    report(options.progress, i + 1, options.num_probes)
    return value

  samples = _map_probes(one, key, options.num_probes)
  error = jnp.std(samples, ddof=1) / np.sqrt(options.num_probes)
  return TraceEstimate(jnp.mean(samples), error)


@measure_keywords
def hessian_trace(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  key: jax.Array,
  *,
  num_probes: int = 32,
  **data: Unpack[MeasureOptions],
) -> TraceEstimate:
  r"""The Hessian trace by Hutchinson's estimator, with its standard error.

  .. math::

    \operatorname{tr} H \approx \frac{1}{n} \sum_{i=1}^{n} z_i^\top H z_i,
    \qquad z_i \in \{-1, +1\}^d \text{ uniform (Rademacher)}.

  The trace is the sum of all eigenvalues: the average curvature, where
  :math:`\lambda_{\max}` is the worst one. It depends on the parameters' scale.

  Args:
    loss_fn, params, batch: as :func:`hessian_eigenvalues` takes them.
    key: the PRNG key of the probes.
    num_probes: :math:`n` >= 2, one Hessian-vector product each.
    num_batches, axis_name, mesh, progress: as :func:`hessian_eigenvalues` takes
      them; ``progress(done, num_probes)`` is called after each probe.

  Returns:
    A :class:`TraceEstimate`.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> loss_fn = lambda w, x: jnp.sum(x * w ** 2)  # H = diag(2 x): z^T H z = tr H exactly
    >>> optax_gsam.hessian_trace(loss_fn, jnp.ones(3), jnp.array([1.0, 5.0, 2.0]), jax.random.key(0))
    TraceEstimate(trace=Array(16., dtype=float32), std_error=Array(0., dtype=float32))

  References:
    Hutchinson, *A stochastic estimator of the trace of the influence matrix for
    Laplacian smoothing splines*, 1990; Yao et al., *PyHessian*, 2020.
  """
  check_positive_int("num_probes", num_probes)
  if num_probes < 2:
    raise ValueError(f"num_probes must be >= 2 to state an error, got {num_probes}.")

  options = _TraceOptions(num_probes, data["progress"])
  return run_measure(_trace, loss_fn, options, params, batch, key, data)


class SpectralDensity(NamedTuple):
  r"""The Hessian's eigenvalue density by stochastic Lanczos quadrature.

  Per probe :math:`v` (unit norm), Lanczos gives nodes :math:`\theta_j` and weights
  :math:`\tau_j` (the squared first components of the tridiagonal's eigenvectors;
  they sum to 1) with :math:`\sum_j \tau_j \theta_j^k = v^\top H^k v` exactly for
  :math:`k < 2m`. Averaged over probes, the weights approximate the density
  :math:`\frac{1}{d} \sum_i \delta(\lambda - \lambda_i)`.

  Attributes:
    eigenvalues: the nodes :math:`\theta`, shape ``(num_probes, num_iterations)``.
    weights: the weights :math:`\tau`, the same shape.
  """

  eigenvalues: jax.Array
  weights: jax.Array

  def moment(self, order: int) -> jax.Array:
    r"""The estimate of :math:`\frac{1}{d} \operatorname{tr} H^{k}` for ``order`` :math:`k`."""
    return jnp.mean(jnp.sum(self.weights * self.eigenvalues**order, axis=-1))

  def smoothed(self, grid: jax.Array, sigma: float) -> jax.Array:
    """The density on ``grid``: each node a Gaussian of width ``sigma``, mean over probes."""
    grid = jnp.asarray(grid)[:, None, None]
    bumps = jnp.exp(-0.5 * ((grid - self.eigenvalues) / sigma) ** 2) / (sigma * np.sqrt(2 * np.pi))
    return jnp.mean(jnp.sum(self.weights * bumps, axis=-1), axis=-1)


class _DensityOptions(NamedTuple):
  """The static arguments of :func:`hessian_spectral_density`."""

  num_probes: int
  num_iterations: int
  progress: Progress | None


def _density(
  loss: LossFn,
  view: ParamView,
  batches: Batches,
  key: jax.Array,
  axis_name,
  options: _DensityOptions,
) -> SpectralDensity:
  """The measure of :func:`hessian_spectral_density`, on the params' real view."""
  hvp, dim, dtype = flat_hvp(loss, view.leaves, batches, axis_name)
  steps = min(options.num_iterations, dim)
  total = options.num_probes * steps

  def one(i, probe_key):
    on_step = lambda j: report(options.progress, i * steps + j + 1, total)
    probe = _probe(probe_key, dim, dtype)
    return ritz(*lanczos(hvp, probe, steps, jax.random.fold_in(probe_key, 1), on_step))

  return SpectralDensity(*_map_probes(one, key, options.num_probes))


@measure_keywords
def hessian_spectral_density(
  loss_fn: Callable[[Any, Any], jax.Array],
  params: Any,
  batch: Any,
  key: jax.Array,
  *,
  num_probes: int = 4,
  num_iterations: int = 30,
  **data: Unpack[MeasureOptions],
) -> SpectralDensity:
  r"""The Hessian's spectral density by stochastic Lanczos quadrature (SLQ).

  Each probe is a normalized Rademacher vector and runs ``num_iterations`` Lanczos
  steps; see :class:`SpectralDensity` for what the nodes and weights mean. The
  density shows the whole spectrum: the bulk near 0 and the few outliers that set
  :math:`\lambda_{\max}`, and negative eigenvalues (a saddle) if any.

  Args:
    loss_fn, params, batch: as :func:`hessian_eigenvalues` takes them.
    key: the PRNG key of the probes.
    num_probes: independent Lanczos runs averaged.
    num_iterations: Lanczos steps per probe (capped at the number of parameters).
    num_batches, axis_name, mesh, progress: as :func:`hessian_eigenvalues` takes
      them.

  Returns:
    A :class:`SpectralDensity`.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> loss_fn = lambda w, x: jnp.sum(x * w ** 2)  # eigenvalues 2, 4, 10
    >>> density = optax_gsam.hessian_spectral_density(
    ...     loss_fn, jnp.ones(3), jnp.array([1.0, 5.0, 2.0]), jax.random.key(0), num_probes=2)
    >>> density.eigenvalues.shape, round(float(density.moment(1)), 4)  # tr H / d = 16 / 3
    ((2, 3), 5.3333)

  References:
    Lin, Saad and Yang, *Approximating spectral densities of large matrices*, SIAM
    Review 2016; Ghorbani, Krishnan and Xiao, ICML 2019.
  """
  check_positive_int("num_probes", num_probes)
  check_positive_int("num_iterations", num_iterations)

  options = _DensityOptions(num_probes, num_iterations, data["progress"])
  return run_measure(_density, loss_fn, options, params, batch, key, data)
