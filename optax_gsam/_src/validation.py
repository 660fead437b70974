"""Argument checks shared by the factories: each raises a ValueError naming the argument."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable

import jax
import jax.numpy as jnp


def is_real_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_scalar_array(value) -> bool:
  """A 0-d numeric array (concrete or traced), as ``optax.inject_hyperparams`` passes."""
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None or tuple(shape) != ():
    return False
  return bool(jnp.issubdtype(dtype, jnp.number)) and not jnp.issubdtype(dtype, jnp.bool_)


def check_non_negative(name: str, value, *, schedule: bool = False, bound: str = ">= 0") -> None:
  """Raises a ValueError naming ``name`` unless ``value`` is a finite number >= 0.

  0-d numeric arrays (as passed by ``optax.inject_hyperparams``, possibly
  traced) are accepted without a value check: they need not have a concrete
  value at construction. ``schedule=True`` only adds "or a schedule" to the
  message: callers accept schedules before calling this.
  """
  allowed = f"a finite number {bound}" + (
    ", a scalar array or a schedule" if schedule else " or a scalar array"
  )
  if isinstance(value, bool):
    raise ValueError(f"{name} must be {allowed}, got the bool {value!r}.")
  if is_real_number(value):
    if not (math.isfinite(value) and value >= 0):
      raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return
  if not is_scalar_array(value):
    raise ValueError(f"{name} must be {allowed}, got {value!r}.")


def check_positive(name: str, value) -> None:
  """Raises a ValueError naming ``name`` unless ``value`` is a finite number > 0 (or a 0-d array)."""
  check_non_negative(name, value, bound="> 0")
  if is_real_number(value) and not value > 0:
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")


def check_axis_name(axis_name) -> None:
  """None, a hashable axis name, or a non-empty tuple of them."""
  if axis_name is None:
    return
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, Hashable) and n is not None for n in names):
    raise ValueError(
      f"axis_name must be None, a hashable axis name or a tuple of them, got {axis_name!r}."
    )


def check_static_count(name: str, value, minimum: int) -> None:
  """None or a static Python int >= ``minimum`` (never an array)."""
  if value is None:
    return
  if isinstance(value, jax.Array):  # e.g. made an array by optax.inject_hyperparams.
    raise ValueError(
      f"{name} must be a static Python int; with optax.inject_hyperparams pass "
      f"static_args=({name!r},)."
    )
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}.")


def _shape_mismatches(a, b) -> list[str]:
  """'path: shape vs shape' for every leaf pair of two same-structure pytrees whose shapes differ."""
  paths_a = jax.tree_util.tree_flatten_with_path(a)[0]
  return [
    f"{jax.tree_util.keystr(path)}: {jnp.shape(x)} vs {jnp.shape(y)}"
    for (path, x), y in zip(paths_a, jax.tree.leaves(b), strict=True)
    if jnp.shape(x) != jnp.shape(y)
  ]


def check_update_inputs(updates, params, correction=None) -> None:
  """The gradient, the params and the stored direction of the state agree in structure and shapes."""
  if params is None:
    raise ValueError("gsam/sam need params: call tx.update(grads, opt_state, params, loss_fn=...).")
  updates_structure, params_structure = jax.tree.structure(updates), jax.tree.structure(params)
  if updates_structure != params_structure:
    raise ValueError(
      "The gradient and params pytrees differ in structure: "
      f"{updates_structure} vs {params_structure}."
    )
  mismatches = _shape_mismatches(updates, params)
  if mismatches:
    raise ValueError(
      "The gradient and params pytrees differ in leaf shapes (gradient vs params): "
      + "; ".join(mismatches[:5])
      + "."
    )
  if correction is None:
    return
  if jax.tree.structure(correction) != params_structure or _shape_mismatches(correction, params):
    raise ValueError(
      "The optimizer state was initialised for other params: its stored direction "
      "(GSAMState.correction) does not match the structure and shapes of params. Call "
      "tx.init(params) with these params, or restore the checkpoint into tx.init(params)."
    )


def _bound_axis_names() -> tuple:
  """The named axes bound where this is traced (pmap, shard_map, named vmap); () if unknown."""
  try:
    from jax._src import core  # No public API lists them; fail open if it moves.

    return tuple(core.unsafe_get_axis_names())
  except Exception:
    return ()


def check_data_axis_is_set(axis_name) -> None:
  """A transform with ``axis_name=None`` must not run per replica under a mapped axis.

  There, each replica would perturb and decompose its own gradient and nothing
  would average the outputs (a pmean of the clean gradient before ``update``
  does not help: the perturbed gradients still differ), so replicas drift
  apart silently.
  """
  if axis_name is not None:
    return
  names = _bound_axis_names()
  if names:
    raise ValueError(
      f"gsam/sam run under the mapped axis {names[0]!r} (jax.pmap, jax.shard_map or a named "
      "jax.vmap) with axis_name=None, so each replica would perturb and decompose its own "
      "gradient and nothing would average the results: the replicas drift apart. Pass "
      f"axis_name={names[0]!r} to gsam/sam and remove your own lax.pmean of the gradients "
      "(the transform's output is averaged already). See docs/distributed.md. If this axis "
      "is not a data axis (a named vmap over seeds, say), or the gradients are already "
      "global here (cached_value_and_grad with its own axis_name), pass check_axis=False."
    )
