"""Checkpoints: every transform's state round-trips through orbax and flax.serialization,
and training resumed from one continues bitwise."""

import functools

import flax.serialization
import jax
import optax
import orbax.checkpoint as ocp
import pytest
from _problems import LR
from _problems import RHO
from _problems import assert_trees_equal
from _problems import float32_problem
from _problems import in_float32
from _problems import make_step
from _problems import mixed_params

import optax_gsam

EPS = 1e-12


def gsam_states(tree):
  return [
    x
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax_gsam.GSAMState))
    if isinstance(x, optax_gsam.GSAMState)
  ]


CHECKPOINTED = {
  "perturb_every": lambda: optax.chain(
    optax_gsam.gsam(
      RHO, 0.3, policy=optax_gsam.every_k_policy(3, reuse_weight=optax.linear_schedule(0.9, 0.3, 8))
    ),
    optax.sgd(LR),
  ),
  "inject_hyperparams": lambda: optax.chain(
    optax.inject_hyperparams(optax_gsam.gsam)(
      rho=RHO, alpha=0.3, policy=optax_gsam.every_k_policy(2)
    ),
    optax.sgd(LR),
  ),
  "adamw_chain": lambda: optax.chain(
    optax_gsam.gsam(RHO, 0.3),
    optax.clip_by_global_norm(1.0),
    optax.adamw(LR, weight_decay=0.1),
  ),
  "apply_if_finite": lambda: optax.apply_if_finite(
    optax.chain(optax_gsam.gsam(RHO, 0.3, policy=optax_gsam.every_k_policy(2)), optax.adamw(LR)), 3
  ),
  "bfloat16_mixed": lambda: optax.chain(
    optax_gsam.gsam(RHO, 0.3, policy=optax_gsam.every_k_policy(2)), optax.sgd(LR, momentum=0.9)
  ),
}


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_checkpoint_round_trip_and_bitwise_resume(name, tmp_path):
  params, loss_fn = float32_problem(seed=7)
  if name == "bfloat16_mixed":
    params = mixed_params(params)
    loss_fn = functools.partial(in_float32, loss_fn)
  tx = CHECKPOINTED[name]()
  step = make_step(tx, loss_fn)
  params_t, state_t = params, tx.init(params)
  for _ in range(4):
    params_t, state_t = step(params_t, state_t)

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", {"params": params_t, "opt_state": state_t})
  checkpointer.wait_until_finished()
  fresh = {"params": params, "opt_state": tx.init(params)}  # the structure a new job builds
  restored_orbax = checkpointer.restore(tmp_path / "ckpt", fresh)
  restored_flax = flax.serialization.from_bytes(
    fresh, flax.serialization.to_bytes({"params": params_t, "opt_state": state_t})
  )
  for restored in (restored_orbax, restored_flax):
    assert_trees_equal(restored, {"params": params_t, "opt_state": state_t})
    assert jax.tree.map(lambda x: x.dtype, restored) == jax.tree.map(
      lambda x: x.dtype, {"params": params_t, "opt_state": state_t}
    )
  (gsam_state,) = gsam_states(restored_orbax["opt_state"])
  assert int(gsam_state.count) == 4
  if gsam_state.stored_direction is not None:  # the cheap-mode stored direction came back
    assert float(optax_gsam.stable_global_norm(gsam_state.stored_direction)) > 0

  uninterrupted = (params_t, state_t)
  for _ in range(4):
    uninterrupted = step(*uninterrupted)
  for restored in (restored_orbax, restored_flax):
    resumed = (restored["params"], restored["opt_state"])
    for _ in range(4):
      resumed = step(*resumed)
    assert_trees_equal(resumed, uninterrupted)
