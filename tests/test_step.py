"""The stages of one update (optax_gsam._src.step), each tested alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam
from optax_gsam._src import step


def settings(**overrides):
  base = dict(
    alpha=0.3,
    eps=1e-12,
    adaptive=None,
    minimize_fp=True,
    sync_perturbation=False,
    axis_name=None,
    num_groups=None,
    policy=optax_gsam.every_step_policy(),
    on_nonfinite="propagate",
  )
  return step.Settings(**(base | overrides))


def test_hyperparams_static_rho_is_decided_in_python_and_zero_rho_zeroes_the_reuse_weight():
  reuse = optax_gsam.every_k_policy(2, reuse_weight=0.5)
  static = step.hyperparams_at(0.0, reuse, jnp.int32(3))
  assert static.rho_positive is False
  assert float(static.reuse_weight) == 0.0
  scheduled = step.hyperparams_at(lambda c: 0.1 * c, reuse, jnp.int32(3))
  assert isinstance(scheduled.rho_positive, jax.Array) and bool(scheduled.rho_positive)
  assert float(scheduled.reuse_weight) == 0.5
  assert step.hyperparams_at(0.1, optax_gsam.every_step_policy(), jnp.int32(0)).reuse_weight is None


def test_choose_runs_one_branch_statically_and_a_cond_otherwise():
  traced = []
  full = lambda: traced.append("full") or jnp.ones(())
  cheap = lambda: traced.append("cheap") or jnp.zeros(())
  assert float(step.choose(jnp.asarray(False), full, cheap, perturb=True)) == 1.0
  assert traced == ["full"]
  assert float(step.choose(True, full, cheap, perturb=None)) == 1.0
  assert float(step.choose(False, full, cheap, perturb=None)) == 0.0
  traced.clear()
  jaxpr = jax.make_jaxpr(lambda d: step.choose(d, full, cheap, perturb=None))(True)
  assert "cond[" in str(jaxpr) and sorted(traced) == ["cheap", "full"]


def test_decide_folds_zero_rho_into_every_policy_but_the_default():
  grads = {"w": jnp.ones(3)}
  zero = step.hyperparams_at(lambda c: 0.0 * c, optax_gsam.every_k_policy(1), jnp.int32(0))
  for policy in (
    optax_gsam.every_k_policy(1),
    optax_gsam.random_policy(1.0, key=jax.random.key(0)),
  ):
    due, _ = step.decide(policy, policy.init(), jnp.int32(0), zero, grads)
    assert not bool(due), policy.name
  default = optax_gsam.every_step_policy()
  due, _ = step.decide(default, default.init(), jnp.int32(0), zero, grads)
  assert due is True  # static: no conditional is traced for plain GSAM


def test_reduce_replica_averages_what_differs_per_device():
  result = step.ReplicaResult(
    direction={"w": jnp.arange(4.0)}, correction=None, diagnostics=jnp.arange(4.0) * 2
  )
  per_device = settings(axis_name="i")
  synchronized = settings(axis_name="i", sync_perturbation=True)
  out = jax.vmap(lambda r: step.reduce_replica(per_device, r), axis_name="i")(result)
  np.testing.assert_allclose(out.direction["w"], np.full(4, 1.5))
  np.testing.assert_allclose(out.diagnostics, np.full(4, 3.0))
  out = jax.vmap(lambda r: step.reduce_replica(synchronized, r), axis_name="i")(result)
  np.testing.assert_allclose(out.direction["w"], np.arange(4.0))  # global already
  np.testing.assert_allclose(out.diagnostics, np.full(4, 3.0))


def test_average_groups_accumulates_in_float32_and_divides():
  groups = lambda g: {"w": jnp.full((2,), g, jnp.bfloat16)}
  out = step.average_groups(4, groups)
  assert out["w"].dtype == jnp.float32
  np.testing.assert_allclose(out["w"], np.full(2, 1.5))


def test_guard_keeps_the_stored_direction_and_falls_back_to_the_clean_gradient():
  previous = {"w": jnp.ones(2)}
  bad = step.Outcome(
    direction={"w": jnp.array([jnp.nan, 1.0])},
    correction={"w": jnp.array([jnp.nan, 2.0])},
    diagnostics=jnp.array([jnp.nan, 0.0, 0.0, 0.0, 0.0]),
    full=jnp.asarray(True),
  )
  clean = {"w": jnp.array([0.5, -0.5])}
  out, fell_back = step.guard_nonfinite(settings(), bad, previous, lambda: clean)
  np.testing.assert_array_equal(out.correction["w"], previous["w"])
  assert not bool(fell_back) and bool(jnp.isnan(out.direction["w"][0]))
  out, fell_back = step.guard_nonfinite(
    settings(on_nonfinite="clean"), bad, previous, lambda: clean
  )
  np.testing.assert_array_equal(out.direction["w"], clean["w"])
  assert bool(fell_back)
  finite = bad._replace(direction=clean, correction=clean, diagnostics=jnp.zeros(5))
  out, fell_back = step.guard_nonfinite(
    settings(on_nonfinite="clean"), finite, previous, lambda: optax.tree.zeros_like(clean)
  )
  np.testing.assert_array_equal(out.direction["w"], clean["w"])
  assert not bool(fell_back)
