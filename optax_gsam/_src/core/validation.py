"""Argument checks shared by the factories: each raises a ValueError naming the argument."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp


def is_real_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_scalar_array(value) -> bool:
  """A 0-d real numeric array (concrete or traced), as ``optax.inject_hyperparams`` passes.

  Complex arrays are not: a complex radius or weight has no meaning, and
  reading only its real part would hide the mistake.
  """
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None or tuple(shape) != ():
    return False
  return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))


def concrete_value(value) -> float | None:
  """The value of a number or a concrete scalar array; None for a tracer (checked where it is
  used)."""
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    return float(value)
  except jax.errors.ConcretizationTypeError:  # traced inside a cond (optax.apply_if_finite)
    return None


def check_non_negative(
  name: str, value, *, allow_schedule: bool = False, bound: str = ">= 0"
) -> None:
  """Raises a ValueError naming ``name`` unless ``value`` is a finite number >= 0.

  With ``allow_schedule``, any callable (an ``optax.Schedule``) is accepted
  too; its values are checked where they are used. 0-d numeric arrays (as
  ``optax.inject_hyperparams`` passes them) are checked like numbers when
  concrete, and accepted when traced.
  """
  if allow_schedule and callable(value):
    return
  allowed = f"a finite number {bound}" + (
    ", a scalar array or a schedule" if allow_schedule else " or a scalar array"
  )
  if isinstance(value, bool):
    raise ValueError(f"{name} must be {allowed}, got the bool {value!r}.")
  if is_scalar_array(value):
    number = concrete_value(value)
    if number is None:
      return
  elif is_real_number(value):
    number = float(value)
  else:
    raise ValueError(f"{name} must be {allowed}, got {value!r}.")
  if not (math.isfinite(number) and number >= 0) or (bound == "> 0" and number == 0):
    raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")


def finite_non_negative(value) -> jax.Array:
  """Whether a (possibly traced) hyperparameter is a finite number >= 0, as a bool array.

  What :func:`check_non_negative` checks at construction, for values only known
  inside the step (schedules, injected hyperparameters).
  """
  value = jnp.asarray(value)
  return jnp.isfinite(value) & (value >= 0)


def check_positive(name: str, value) -> None:
  """Raises a ValueError naming ``name`` unless ``value`` is a finite number > 0 (or a 0-d array)."""
  check_non_negative(name, value, bound="> 0")


def check_unit_interval(name: str, value, *, include_one: bool) -> None:
  """A float in [0, 1) or [0, 1], or a scalar array (checked when concrete)."""
  interval = "[0, 1]" if include_one else "[0, 1)"
  number = concrete_value(value) if is_scalar_array(value) else value
  if number is None:
    return
  if not is_real_number(number) or not (0 <= number <= 1) or (number == 1 and not include_one):
    raise ValueError(f"{name} must be a float in {interval}, got {value!r}.")


def with_fix(fix: str, check: Callable[..., None], *args: Any, **kwargs: Any) -> None:
  """``check(*args, **kwargs)``, its ValueError's message followed by ``fix``."""
  try:
    check(*args, **kwargs)
  except ValueError as error:
    raise ValueError(f"{error} {fix}") from None


def check_positive_int(name: str, value, *, allow_none: bool = False) -> None:
  """A static Python int >= 1 (or ``None`` where allowed); never an array or a bool."""
  if value is None and allow_none:
    return
  if isinstance(value, jax.Array):  # e.g. made an array by optax.inject_hyperparams.
    raise ValueError(
      f"{name} must be a static Python int; with optax.inject_hyperparams pass "
      f"static_args=({name!r},)."
    )
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    allowed = "None or an int >= 1" if allow_none else "a positive int"
    raise ValueError(f"{name} must be {allowed}, got {value!r}.")


def check_prng_key(name: str, key) -> None:
  """A single PRNG key: typed (``jax.random.key(seed)``) or a legacy raw uint32 key."""
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    if key.shape == ():
      return
    problem = f"an array of {key.shape} keys; pass one key"
  else:
    raw_shape = jax.random.key_data(jax.random.key(0)).shape  # the default implementation's
    if isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == raw_shape:
      return
    described = f"dtype {key.dtype}, shape {key.shape}" if hasattr(key, "dtype") else repr(key)
    problem = f"{described}, not a key ({raw_shape} uint32 raw key data or a typed key)"
  raise ValueError(f"{name} must be one PRNG key, jax.random.key(seed); got {problem}.")


def check_axis_name(axis_name) -> None:
  """None, a hashable axis name, or a non-empty tuple of them."""
  if axis_name is None:
    return
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, Hashable) and n is not None for n in names):
    raise ValueError(
      f"axis_name must be None, a hashable axis name or a tuple of them, got {axis_name!r}."
    )


PARAMS_FIX = (
  "Pass only the trainable float arrays as params and close over the rest in loss_fn: with "
  "Equinox, `params, static = eqx.partition(model, eqx.is_inexact_array)` and "
  "`loss_fn = lambda p: loss(eqx.combine(p, static), batch)`, initialising the optimizer with "
  "the same `params`; with Flax Linen, variables['params']; with Haiku, the params of "
  "transform/transform_with_state."
)


def _paths_and_leaves(tree) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _is_trainable_leaf(x) -> bool:
  if isinstance(x, (float, complex)):  # a plain number: made an array by numbers_as_arrays
    return True
  dtype = getattr(x, "dtype", None)
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def check_params_leaves(
  params, reader: str = "gsam/sam/momentum_sam perturb and differentiate"
) -> None:
  """Every params leaf is a float or complex array: the transforms perturb and differentiate each.

  ``reader`` says who reads every leaf, for the message: the transforms, or
  ``optax_gsam.accumulate_value_and_grad``, which differentiates each.
  """
  bad = [(path, x) for path, x in _paths_and_leaves(params) if not _is_trainable_leaf(x)]
  if not bad:
    return
  described = [
    f"params{path}: " + (f"dtype {x.dtype}" if hasattr(x, "dtype") else type(x).__name__)
    for path, x in bad[:5]
  ]
  raise ValueError(
    f"{reader} every leaf of params, and these leaves are not float arrays: "
    f"{'; '.join(described)}. " + PARAMS_FIX
  )


def _shape_mismatches(a, b) -> list[str]:
  """'path: shape vs shape' for every leaf pair of two same-structure pytrees whose shapes differ."""
  return [
    f"{path}: {jnp.shape(x)} vs {jnp.shape(y)}"
    for (path, x), y in zip(_paths_and_leaves(a), jax.tree.leaves(b), strict=True)
    if jnp.shape(x) != jnp.shape(y)
  ]


def _structure_mismatch(updates, params) -> str:
  """The leaf paths that one tree has and the other lacks, for the error message."""
  update_paths = {path for path, _ in _paths_and_leaves(updates)}
  param_paths = {path for path, _ in _paths_and_leaves(params)}
  only = lambda a, b: ", ".join(sorted(a - b)[:5]) or "none"
  return (
    f"leaves only in the gradient: {only(update_paths, param_paths)}; only in params: "
    f"{only(param_paths, update_paths)}"
  )


def check_update_inputs(updates, params, stored_direction=None) -> None:
  """The params are float arrays, and agree with the gradient and the state in structure and shapes."""
  if params is None:
    raise ValueError("gsam/sam need params: call tx.update(grads, opt_state, params, loss_fn=...).")
  check_params_leaves(params)
  if jax.tree.structure(updates) != jax.tree.structure(params):
    raise ValueError(
      "The gradient and params pytrees differ in structure ("
      + _structure_mismatch(updates, params)
      + "). The gradient must be taken with respect to exactly the params given to update and "
      "init. " + PARAMS_FIX
    )
  mismatches = _shape_mismatches(updates, params)
  if mismatches:
    raise ValueError(
      "The gradient and params pytrees differ in leaf shapes (gradient vs params): "
      + "; ".join(mismatches[:5])
      + "."
    )
  if stored_direction is None:
    return
  same_structure = jax.tree.structure(stored_direction) == jax.tree.structure(params)
  if not same_structure or _shape_mismatches(stored_direction, params):
    raise ValueError(
      "The optimizer state was initialised for other params: its params-shaped part "
      "(GSAMState.stored_direction, MomentumSAMState.momentum) does not match the structure "
      "and shapes of params. Call tx.init(params) with these params, or restore the "
      "checkpoint into tx.init(params)."
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
