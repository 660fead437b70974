"""Stage 1 of a gsam/sam update: the hyperparameters at the step."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.core.validation import finite_non_negative
from optax_gsam._src.core.validation import is_real_number
from optax_gsam._src.policies.policies import SharpnessPolicy
from optax_gsam._src.policies.schedules import value_at


class Hyperparams(NamedTuple):
  """Stage 1: the hyperparameters at this step.

  Python bools where rho is a static number, so that nothing is traced for them.
  """

  rho: jax.Array  # rho_t as given, for the state
  safe_rho: jax.Array  # rho_t where it is a finite number >= 0, else 0
  rho_ok: bool | jax.Array  # rho_t (and an injected alpha) are finite numbers >= 0
  rho_positive: bool | jax.Array
  reuse_weight: jax.Array | None  # only for policies that store a direction


def hyperparams_at(
  rho: optax.ScalarOrSchedule,
  policy: SharpnessPolicy,
  count: jax.Array,
  alpha: float | jax.Array = 0.0,
) -> Hyperparams:
  """Stage 1: rho_t, whether it is usable, and the reuse weight (0 where no full step would run).

  A traced ``alpha`` (injected) is checked here like rho_t: where it is not a
  finite number >= 0, rho_ok is False and the step outputs the clean gradient.
  """
  rho_t = value_at(rho, count)
  rho_ok: bool | jax.Array
  rho_positive: bool | jax.Array
  if is_real_number(rho) and is_real_number(alpha):  # Validated at construction.
    rho_ok, rho_positive, safe_rho = True, bool(rho > 0), rho_t
  else:  # A schedule (or an injected array) can give anything; see fall_back_to_clean.
    rho_ok = finite_non_negative(rho_t) & finite_non_negative(alpha)
    rho_positive = rho_ok & (rho_t > 0)
    safe_rho = jnp.where(rho_ok, rho_t, jnp.zeros_like(rho_t))
  weight = None
  if policy.stores_direction:
    weight = value_at(policy.reuse_weight, count)
    usable = rho_positive if policy.skip_zero_rho else rho_ok  # At radius 0, g = g_c.
    if usable is not True:
      weight = jnp.where(usable, weight, jnp.zeros_like(weight))
  return Hyperparams(rho_t, safe_rho, rho_ok, rho_positive, weight)
