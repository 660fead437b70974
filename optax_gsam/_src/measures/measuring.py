"""What every sharpness measure shares: its batches, its view of the params, its compiled program.

**Batches.** A measure averages ``loss_fn`` over one fixed batch, or over
``num_batches`` batches of an iterator, stacked along axis 1 (axis 0 stays the
one a mesh splits) and scanned over, so one batch's activations are live.

**Params.** A measure differentiates with respect to the params' float leaves
as real numbers: a complex leaf :math:`z = x + iy` is viewed as the pairs
:math:`(x, y)` (a trailing axis of 2), so the Hessian is the one over
:math:`\\mathbb{R}^{2n}` and norms sum :math:`|z|^2`, as the training transforms
count complex leaves. Leaves that are not floats (int or bool: step counters,
masks, token ids) are held fixed, as a constant the loss reads.

**Compilation.** Each measure runs as one ``jax.jit`` program, cached on the
user's ``loss_fn`` and the static options, so a measure called again outside
``jax.jit`` with the same ``loss_fn`` and shapes neither retraces nor
recompiles. Inside the user's ``jax.jit`` the program is inlined.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from optax_gsam._src.core.keywords import takes_keywords
from optax_gsam._src.core.validation import check_axis_name
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.parallel.distributed import data_parallel

LossFn = Callable[[Any, Any], jax.Array]
Progress = Callable[[int, int], Any]


class MeasureOptions(TypedDict, total=False):
  """The keywords every measure takes, after its own (all default to ``None``).

  ``num_batches``: how many batches to take from an iterator ``batch``.
  ``axis_name``: average over this data axis (inside a per-device step).
  ``mesh``: run per device on this mesh, the batch split over ``axis_name``.
  ``progress``: called as ``progress(done, total)`` as the measure advances.
  """

  num_batches: int | None
  axis_name: Hashable | None
  mesh: jax.sharding.Mesh | None
  progress: Callable[[int, int], Any] | None


# The decorator of every measure: MeasureOptions in its signature, the defaults filled in.
measure_keywords = takes_keywords(MeasureOptions, dict.fromkeys(MeasureOptions.__annotations__))


# ----------------------------------------------------------------------------- batches


class Batches(NamedTuple):
  """The data a measure averages over.

  Attributes:
    data: one batch, or (``stacked``) batches stacked along axis 1, so that
      axis 0 stays the one a mesh splits.
    stacked: whether ``data`` holds several batches.
  """

  data: Any
  stacked: bool


def _shapes(batch: Any) -> list[tuple[int, ...]]:
  return [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]


def _check_equal_batches(taken: list) -> None:
  """Raises unless every batch has the first one's structure and shapes."""
  first, shapes = jax.tree.structure(taken[0]), _shapes(taken[0])
  for i, batch in enumerate(taken[1:], start=1):
    if jax.tree.structure(batch) != first or _shapes(batch) != shapes:
      raise ValueError(
        f"batch: the iterator's batches must have equal shapes; batch 0 has leaf shapes {shapes} "
        f"and batch {i} has {_shapes(batch)}. The measures weigh every batch alike, which is the "
        "mean loss only for batches of equal size: drop the smaller last batch "
        "(drop_remainder=True), or concatenate the batches and pass them as one fixed batch."
      )


def as_batches(batch: Any, num_batches: int | None) -> Batches:
  """A fixed batch as it is; ``num_batches`` batches of an iterator stacked along axis 1."""
  if not isinstance(batch, Iterator):
    if num_batches is not None:
      raise ValueError(
        "num_batches is for a batch iterator; a fixed batch (a pytree of arrays) is used whole."
      )
    return Batches(batch, False)
  check_positive_int("num_batches", num_batches)
  taken = list(itertools.islice(batch, num_batches))
  if len(taken) < num_batches:  # type: ignore[operator]
    raise ValueError(f"The batch iterator ran out after {len(taken)} of {num_batches} batches.")
  _check_equal_batches(taken)
  traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(taken))
  # Concrete batches are stacked on the host, so a mesh receives them unplaced; traced ones by jnp.
  stack = jnp.stack if traced else lambda xs, axis: np.stack([np.asarray(x) for x in xs], axis)
  return Batches(jax.tree.map(lambda *leaves: stack(leaves, axis=1), *taken), True)


def batch_mean(fn: Callable[[Any], Any], batches: Batches) -> Any:
  """The mean of ``fn(batch)`` over the batches, summed in a ``lax.scan`` (one batch live)."""
  if not batches.stacked:
    return fn(batches.data)
  leading = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), batches.data)
  num = jax.tree.leaves(leading)[0].shape[0]
  first = jax.tree.map(lambda x: x[0], leading)
  rest = jax.tree.map(lambda x: x[1:], leading)
  total, _ = jax.lax.scan(lambda acc, b: (jax.tree.map(jnp.add, acc, fn(b)), None), fn(first), rest)
  return jax.tree.map(lambda t: t / num, total)


def report(progress: Progress | None, done: Any, total: int) -> None:
  """Calls ``progress(done, total)`` from traced code (on every device under a mesh)."""
  if progress is not None:
    jax.debug.callback(lambda d: progress(int(d), total), done)


# ----------------------------------------------------------------------------- params as real leaves


class ParamView(NamedTuple):
  """The params' float leaves as real arrays, and how to put them back.

  Attributes:
    leaves: the float leaves in order, a complex one as its (real, imaginary)
      pairs along a new last axis.
    pairs: per entry of ``leaves``, whether it was complex.
    moving: the positions of those leaves among all the params' leaves.
    fixed: all the params' leaves (the non-float ones are held at these).
    treedef: the params' tree structure.
  """

  leaves: list
  pairs: tuple[bool, ...]
  moving: tuple[int, ...]
  fixed: list
  treedef: Any

  def of(self, tree: Any) -> list:
    """The view's leaves of ``tree``, a pytree like the params."""
    leaves = self.treedef.flatten_up_to(tree)
    return [
      _as_pairs(leaves[i]) if pair else leaves[i]
      for i, pair in zip(self.moving, self.pairs, strict=True)
    ]

  def tree(self, leaves: list, rest: list | None = None) -> Any:
    """The params' pytree from view ``leaves``, the other leaves from ``rest`` (default ``fixed``)."""
    out = list(self.fixed if rest is None else rest)
    for i, pair, leaf in zip(self.moving, self.pairs, leaves, strict=True):
      out[i] = jax.lax.complex(leaf[..., 0], leaf[..., 1]) if pair else leaf
    return self.treedef.unflatten(out)

  def modulus(self) -> list:
    """:math:`|w|` on the view: a complex entry's modulus for both of its parts."""
    return [_modulus(leaf, pair) for leaf, pair in zip(self.leaves, self.pairs, strict=True)]


def _as_pairs(x: Any) -> jax.Array:
  x = jnp.asarray(x)
  return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


def _modulus(leaf: jax.Array, pair: bool) -> jax.Array:
  if not pair:
    return jnp.abs(leaf)
  return jnp.broadcast_to(jnp.sqrt(jnp.sum(leaf**2, axis=-1, keepdims=True)), leaf.shape)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex))


def param_view(params: Any) -> ParamView:
  """The :class:`ParamView` of ``params``; a ValueError if a leaf is no array or none is a float."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  odd = [
    f"{jax.tree_util.keystr(path)} ({type(x).__name__})"
    for path, x in with_paths
    if not _is_array(x)
  ]
  if odd:
    raise ValueError(
      f"params leaves must be arrays; these are not: {', '.join(odd)}. Pass the arrays as "
      "params and close over the rest in loss_fn, e.g. with Equinox "
      "`params, static = eqx.partition(model, eqx.is_inexact_array)` and "
      "`loss_fn = lambda p, batch: loss(eqx.combine(p, static), batch)`."
    )
  fixed = [x for _, x in with_paths]
  moving = tuple(i for i, x in enumerate(fixed) if jnp.issubdtype(jnp.result_type(x), jnp.inexact))
  if not moving:
    raise ValueError(
      "params has no float leaves to measure the curvature in (int and bool leaves are held "
      "fixed): pass the float weights, e.g. eqx.partition(model, eqx.is_inexact_array)[0]."
    )
  pairs = tuple(bool(jnp.iscomplexobj(fixed[i])) for i in moving)
  view = ParamView([], pairs, moving, fixed, treedef)
  return view._replace(leaves=view.of(params))


# ----------------------------------------------------------------------------- one compiled program


Kernel = Callable[[LossFn, ParamView, Batches, Any, Hashable | None, Any], Any]


def _measure(
  kernel: Kernel,
  loss_fn: LossFn,
  options: Any,
  params: Any,
  batches: Batches,
  extra: Any,
  axis_name,
) -> Any:
  """``kernel`` on the params' real view, with the loss of those real leaves."""
  view = param_view(params)
  real_loss = lambda leaves, batch: loss_fn(view.tree(leaves), batch)
  return kernel(real_loss, view, batches, extra, axis_name, options)


def _run(params, data, extra, *, kernel, loss_fn, options, axis_name, mesh, stacked):
  """The measure here, or per device on ``mesh`` with the batch split over ``axis_name``."""
  if mesh is None:
    return _measure(kernel, loss_fn, options, params, Batches(data, stacked), extra, axis_name)
  per_device = lambda p, d, e: _measure(
    kernel, loss_fn, options, p, Batches(d, stacked), e, axis_name
  )
  return data_parallel(per_device, mesh, axis_name=axis_name, batch_argnums=(1,))(
    params, data, extra
  )


_STATIC = ("kernel", "loss_fn", "options", "axis_name", "mesh", "stacked")
# Module-level, so its cache outlives a call: keyed on the user's loss_fn object and the options.
_compiled = jax.jit(_run, static_argnames=_STATIC)


def _hashable(value: Any) -> bool:
  try:
    hash(value)
  except TypeError:
    return False
  return True


def run_measure(
  kernel: Kernel,
  loss_fn: LossFn,
  options: Any,
  params: Any,
  batch: Any,
  extra: Any,
  data: MeasureOptions,
) -> Any:
  """``kernel(real_loss, view, batches, extra, axis_name, options)``, compiled once per ``loss_fn``.

  ``options`` (hashable: the measure's static settings, ``progress`` included)
  and ``loss_fn`` key the compiled program; ``extra`` (a key, a radius) is an
  argument of it. A ``loss_fn`` that cannot be hashed is compiled afresh.
  ``data`` is the measure's :class:`MeasureOptions`.
  """
  num_batches, axis_name, mesh = data["num_batches"], data["axis_name"], data["mesh"]
  check_axis_name(axis_name)
  if mesh is not None and axis_name is None:
    raise ValueError("mesh needs axis_name: the mesh axis the batch is split over.")
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable as loss_fn(params, batch), got {loss_fn!r}.")
  param_view(params)  # the params' error, raised here rather than from inside the trace
  batches = as_batches(batch, num_batches)
  static = dict(
    kernel=kernel,
    loss_fn=loss_fn,
    options=options,
    axis_name=axis_name,
    mesh=mesh,
    stacked=batches.stacked,
  )
  if _hashable(loss_fn) and _hashable(options):
    return _compiled(params, batches.data, extra, **static)
  return jax.jit(lambda p, d, e: _run(p, d, e, **static))(params, batches.data, extra)
