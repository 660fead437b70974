r"""Checks of the ascent stage's arguments: at construction, and on a probe at ``init``.

A direction maps a gradient to an *ascent* direction of radius 1, which the
transform scales by :math:`\rho_t`. Two compositions give something else
without any error in the arrays, so :func:`check_direction` runs a direction
given as ``ascent=`` once, at ``init``, on a probe gradient :math:`g` (positive
values between 2 and 4, params-shaped, with params of ones) and refuses:

* a descent direction, :math:`\langle a(g), g\rangle < 0` and
  :math:`\langle a(-g), -g\rangle < 0`: an optax optimizer's output
  (``optax.sgd``, the adversarial optimizer of ``optax.contrib.sam``), which is
  the negated direction. A direction that does not depend on the gradient (a
  random perturbation) cannot be below 0 on both, so it passes;
* a leaf passed through unchanged, :math:`a(g)_\ell = g_\ell`: what
  ``optax.masked`` does outside its mask, which would perturb that leaf by
  :math:`\rho_t` times its raw gradient.

The probe runs eagerly (``jax.ensure_compile_time_eval``, so also where
``init`` is traced) on the host's CPU where there is one, and only for a
direction given as ``ascent=``; the package's own directions skip it. It fails
open: a direction that cannot run on the probe (one that needs a bound axis
name, say) is not checked, and raises its own error at the first update.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.directions.ascent import KNOWN_DIRECTIONS
from optax_gsam._src.directions.ascent import check_mask
from optax_gsam._src.directions.ascent import resolve_mask
from optax_gsam._src.directions.ascent import select_leaves

DESCENT_FIX = (
  "ascent= must map a gradient to an ascent direction of radius 1 (the weights move by rho "
  "times it, uphill), but on a probe gradient g its output a has <a, g> < 0: it is a descent "
  "direction, as an optax optimizer's update is (the adversarial optimizer of "
  "optax.contrib.sam, which negates it back; gsam/sam do not). Negate it, e.g. "
  "ascent=optax.chain(optax.contrib.normalize(), optax.sgd(1.0), optax.scale(-1.0)), or use "
  "optax_gsam.normalized_ascent()."
)


def check_ascent(settings: Any) -> None:
  """The static arguments of the ascent stage: ``ascent``, ``adaptive``, ``ascent_steps``, ``mask``."""
  if settings.ascent is not None:
    if settings.adaptive is not None:
      raise ValueError(
        "adaptive and ascent both choose the ascent direction: pass ascent="
        f"optax_gsam.adaptive_ascent({settings.adaptive!r}) alone."
      )
    if not isinstance(settings.ascent, optax.GradientTransformation):
      raise ValueError(
        "ascent must be an optax.GradientTransformation mapping a gradient to a perturbation of "
        f"radius 1 (e.g. optax_gsam.normalized_ascent()), got {settings.ascent!r}."
      )
  check_positive_int("ascent_steps", settings.ascent_steps)
  check_mask(settings.mask)


def _probe_dtype(param: Any) -> Any:
  dtype = jnp.result_type(param)
  return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


def _probe_leaf(param: Any) -> jax.Array:
  """Positive values from 2 to 4 (exact in bfloat16): far from a unit norm, never all equal."""
  shape = jnp.shape(param)
  values = 2.0 + (np.arange(int(np.prod(shape))) % 5) * 0.5
  return jnp.asarray(values.reshape(shape), _probe_dtype(param))


def _on_host():
  """The CPU device as default where JAX has one: the probe must not take accelerator memory."""
  try:
    return jax.default_device(jax.local_devices(backend="cpu")[0])
  except RuntimeError:
    return contextlib.nullcontext()


def _as_numpy(tree: Any) -> list[np.ndarray]:
  """The leaves in float64 (complex128 for complex ones), on the host."""
  wide = lambda x: np.complex128 if np.iscomplexobj(x) else np.float64
  return [np.asarray(x).astype(wide(np.asarray(x))) for x in jax.tree.leaves(tree)]


def _probe(ascent: optax.GradientTransformation, mask: Any, params: optax.Params):
  """The direction's outputs on the probe g and on -g, the probe g (all masked, as float64
  leaves) and the mask's selection per leaf; None where the direction cannot run on the probe."""
  with _on_host(), jax.ensure_compile_time_eval():
    ones = jax.tree.map(lambda p: jnp.ones(jnp.shape(p), _probe_dtype(p)), params)
    mask_tree = resolve_mask(mask, ones)
    grads = select_leaves(mask_tree, jax.tree.map(_probe_leaf, params))
    try:
      units = [
        select_leaves(mask_tree, ascent.update(g, ascent.init(ones), ones)[0])
        for g in (grads, optax.tree.scale(-1.0, grads))
      ]
    except Exception:  # fail open: the first update raises the same error
      return None
    for unit in units:
      if jax.tree.structure(unit) != jax.tree.structure(grads) or any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(unit)
      ):
        return None
    selected = jax.tree.leaves(select_leaves(mask_tree, jax.tree.map(lambda _: True, params)))
    return _as_numpy(units[0]), _as_numpy(units[1]), _as_numpy(grads), selected


def _passed_through(unit: list, grads: list, selected: list, params: optax.Params) -> str | None:
  """The path of a perturbed leaf whose direction is the probe gradient itself, if any."""
  paths = [
    jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  for path, a, g, chosen in zip(paths, unit, grads, selected, strict=True):
    if chosen and g.size and np.array_equal(a, g):
      return path
  return None


def check_direction(
  ascent: optax.GradientTransformation | None, mask: Any, params: optax.Params
) -> None:
  """Raises a ValueError where ``ascent`` is a descent direction or passes a leaf through.

  See the module's docstring for the probe. ``None`` (the transform's own
  direction) and the package's directions are not probed.
  """
  if ascent is None or ascent.update in KNOWN_DIRECTIONS or not jax.tree.leaves(params):
    return
  probed = _probe(ascent, mask, params)
  if probed is None:
    return
  unit, unit_of_negated, grads, selected = probed
  leaf = _passed_through(unit, grads, selected, params)
  if leaf is not None:
    raise ValueError(
      f"ascent= passes the gradient of params{leaf} through unchanged, so that leaf would be "
      "perturbed by rho times its raw gradient instead of along a direction of radius 1. That "
      "is what optax.masked does outside its mask: to perturb some leaves only, pass the "
      "direction itself with the transform's mask=, e.g. optax_gsam.sam(0.05, "
      "ascent=direction, mask=mask) (docs/directions.md)."
    )
  negated = [-g for g in grads]
  if _inner(unit, grads) < 0 and _inner(unit_of_negated, negated) < 0:
    raise ValueError(DESCENT_FIX)


def _inner(a: list, b: list) -> float:
  r""":math:`\operatorname{Re} \sum \bar a b` over the leaves."""
  return sum(float(np.sum(np.real(np.conj(x) * y))) for x, y in zip(a, b, strict=True))
