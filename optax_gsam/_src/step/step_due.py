"""The policy's answer ahead of ``update``, for the static protocol (``perturb=True|False``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.core.keywords import runtime_signature
from optax_gsam._src.fine_tuning.frozen import FrozenOrFn
from optax_gsam._src.fine_tuning.frozen import trained_part
from optax_gsam._src.policies.policies import SharpnessPolicy
from optax_gsam._src.policies.policies import policy_from_arguments
from optax_gsam._src.step import hyperparams
from optax_gsam._src.step import step
from optax_gsam._src.step.state import GSAMState
from optax_gsam.typing import AxisName


def _find_state(opt_state: Any) -> GSAMState:
  found = [
    leaf
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, GSAMState))
    if isinstance(leaf, GSAMState)
  ]
  if len(found) != 1:
    raise ValueError(
      f"opt_state must hold exactly one GSAMState (the state of gsam or sam), found {len(found)}."
    )
  return found[0]


@runtime_signature
def full_step_due(
  opt_state: Any,
  grads: optax.Updates,
  *,
  policy: SharpnessPolicy | None = None,
  rho: optax.ScalarOrSchedule,
  axis_name: AxisName = None,
  frozen: FrozenOrFn = None,
) -> jax.Array:
  r"""Whether the next ``update`` would take the full step: the policy's answer, ahead of it.

  For the static protocol: jit one step per branch (``update(...,
  perturb=True)`` and ``perturb=False``) and pick it in Python with this
  function, so no ``lax.cond`` is traced. It evaluates the policy's decision
  (and :math:`\rho_t > 0`) at the state's step without changing the state;
  the ``update`` that follows advances the policy's state as usual.

  Args:
    opt_state: the optimizer state holding one :class:`GSAMState`, e.g. a
      chain's (unreplicated: one device's copy under ``pmap``).
    grads: the clean gradient of this step, read by
      :func:`optax_gsam.gradient_norm_policy` only.
    policy: the ``policy`` given to :func:`optax_gsam.gsam` (``None``: the
      default).
    rho: the ``rho`` given to :func:`optax_gsam.gsam`.
    axis_name: for per-device perturbation, the transform's ``axis_name``:
      call this inside the mapped function with each device's own ``grads``,
      and it averages the squared gradient norms over the axis exactly as
      ``update`` does. With synchronized perturbation, or on one device, leave
      it ``None`` and pass the global gradient.
    frozen: the ``frozen`` given to :func:`optax_gsam.gsam`: the policy reads
      the gradient of the trained leaves only, as ``update`` does.

  Returns:
    A bool scalar array.

  Raises:
    ValueError: if ``policy`` is not the one the state was built with (its
      state or its stored direction does not match).

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> policy = optax_gsam.every_k_policy(3)
    >>> tx = optax.chain(optax_gsam.sam(0.05, policy=policy), optax.sgd(0.1))
    >>> state = tx.init(jnp.ones(2))
    >>> bool(optax_gsam.full_step_due(state, jnp.ones(2), policy=policy, rho=0.05))
    True
  """
  policy = policy_from_arguments(policy, None, None)
  state = _find_state(opt_state)
  same_state = jax.tree.structure(policy.init()) == jax.tree.structure(state.policy_state)
  if not same_state or policy.stores_direction != (state.stored_direction is not None):
    raise ValueError(
      f"policy ({policy.name!r}) is not the policy this optimizer state was built with: pass "
      "full_step_due the policy given to gsam/sam."
    )
  if frozen is not None:
    grads = trained_part(frozen, grads)
  hyper = hyperparams.hyperparams_at(rho, policy, state.count)
  due, _ = step.decide(policy, state.policy_state, state.count, hyper, grads, axis_name)
  return jnp.asarray(due)
