"""Argument checks shared by the factories: each raises a ValueError naming the argument."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable

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
