"""The stages of one update (optax_gsam._src.step.step), each tested alone."""

import jax
import jax.numpy as jnp
import numpy as np
from _problems import optimization_barriers

import optax_gsam
from optax_gsam._src.microbatches import microbatch
from optax_gsam._src.step import hyperparams
from optax_gsam._src.step import step


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
  static = hyperparams.hyperparams_at(0.0, reuse, jnp.int32(3))
  assert static.rho_positive is False
  assert float(static.reuse_weight) == 0.0
  scheduled = hyperparams.hyperparams_at(lambda c: 0.1 * c, reuse, jnp.int32(3))
  assert isinstance(scheduled.rho_positive, jax.Array) and bool(scheduled.rho_positive)
  assert float(scheduled.reuse_weight) == 0.5
  assert (
    hyperparams.hyperparams_at(0.1, optax_gsam.every_step_policy(), jnp.int32(0)).reuse_weight
    is None
  )


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


def test_cond_puts_the_full_step_first_behind_an_optimization_barrier():
  # The layout that keeps the every-k program's peak at the full step's on the
  # TPU compiler (benchmarks/README.md): the full step is branch 0, and the
  # outputs go through a barrier before anything reads them.
  full = lambda: jnp.sin(jnp.ones(3))
  cheap = lambda: jnp.zeros(3)
  jaxpr = jax.make_jaxpr(lambda d: 2.0 * step.choose(d, full, cheap, perturb=None))(True).jaxpr
  names = [eqn.primitive.name for eqn in jaxpr.eqns]
  cond = jaxpr.eqns[names.index("cond")]
  first, second = (str(branch) for branch in cond.params["branches"])
  assert "sin" in first and "sin" not in second
  barrier = jaxpr.eqns[names.index("optimization_barrier")]
  assert barrier.invars == cond.outvars
  assert names.index("cond") < names.index("optimization_barrier") < names.index("mul")
  assert np.allclose(jax.jit(lambda d: step.choose(d, full, cheap, None))(True), np.sin(1.0))
  assert np.allclose(jax.jit(lambda d: step.choose(d, full, cheap, None))(False), 0.0)


def test_decide_folds_zero_rho_into_every_policy_but_the_default():
  grads = {"w": jnp.ones(3)}
  zero = hyperparams.hyperparams_at(lambda c: 0.0 * c, optax_gsam.every_k_policy(1), jnp.int32(0))
  for policy in (
    optax_gsam.every_k_policy(1),
    optax_gsam.random_policy(1.0, key=jax.random.key(0)),
  ):
    due, _ = step.decide(policy, policy.init(), jnp.int32(0), zero, grads)
    assert not bool(due), policy.name
  default = optax_gsam.every_step_policy()
  due, _ = step.decide(default, default.init(), jnp.int32(0), zero, grads)
  assert due is True  # static: no conditional is traced for plain GSAM


def test_unusable_schedule_values_zero_the_radius_and_the_reuse_weight():
  reuse = optax_gsam.every_k_policy(2, reuse_weight=0.5)
  for value in (jnp.nan, jnp.inf, -0.1):
    hyper = hyperparams.hyperparams_at(lambda c, v=value: v + 0.0 * c, reuse, jnp.int32(1))
    assert not bool(hyper.rho_ok) and not bool(hyper.rho_positive), value
    assert float(hyper.safe_rho) == 0.0 and float(hyper.reuse_weight) == 0.0
    assert bool(step.rho_unusable(hyper))
  assert step.rho_unusable(hyperparams.hyperparams_at(0.0, reuse, jnp.int32(0))) is False


def test_reduce_over_axis_averages_what_differs_per_device():
  diagnostics = step.Diagnostics(*(jnp.arange(4.0) * k for k in range(1, 6)))
  result = step.BranchResult(gradient={"w": jnp.arange(4.0)}, diagnostics=diagnostics)
  per_device = settings(axis_name="i")
  synchronized = settings(axis_name="i", sync_perturbation=True)
  out = jax.vmap(lambda r: step.reduce_over_axis(per_device, r), axis_name="i")(result)
  np.testing.assert_allclose(out.gradient["w"], np.full(4, 1.5))
  np.testing.assert_allclose(out.diagnostics.perturbed_loss, np.full(4, 1.5))
  np.testing.assert_allclose(out.diagnostics.perturbed_grad_norm, np.full(4, 7.5))
  out = jax.vmap(lambda r: step.reduce_over_axis(synchronized, r), axis_name="i")(result)
  np.testing.assert_allclose(out.gradient["w"], np.arange(4.0))  # global already
  np.testing.assert_allclose(out.diagnostics.cosine, np.full(4, 4.5))


def test_average_over_microbatches_accumulates_in_float32_and_divides():
  groups = lambda g: {"w": jnp.full((2,), g, jnp.bfloat16)}
  out = microbatch.average_over(4, groups)
  assert out["w"].dtype == jnp.float32
  np.testing.assert_allclose(out["w"], np.full(2, 1.5))


def _bad_full_result():
  nan_loss = step.Diagnostics(jnp.float32(jnp.nan), *(jnp.float32(0.0),) * 4)
  return step.BranchResult(
    gradient={"w": jnp.array([jnp.nan, 1.0])},
    stored_direction={"w": jnp.array([jnp.nan, 2.0])},
    diagnostics=nan_loss,
  )


def test_fallback_is_decided_on_scalars_and_selects_the_clean_gradient():
  clean = {"w": jnp.array([0.5, -0.5])}
  good_rho = hyperparams.hyperparams_at(0.1, optax_gsam.every_step_policy(), jnp.int32(0))
  bad = _bad_full_result()
  assert step.needs_fallback(settings(), good_rho, bad) is False  # "propagate" never falls back
  flag = step.needs_fallback(settings(on_nonfinite="clean"), good_rho, bad)
  out = step.fall_back_to_clean(flag, clean, bad)
  np.testing.assert_array_equal(out.gradient["w"], clean["w"])
  finite = bad._replace(gradient=clean, diagnostics=bad.diagnostics._replace(perturbed_loss=1.0))
  assert not bool(step.needs_fallback(settings(on_nonfinite="clean"), good_rho, finite))
  nan_rho = hyperparams.hyperparams_at(lambda c: jnp.nan * c, optax_gsam.every_step_policy(), 0)
  assert bool(step.needs_fallback(settings(), nan_rho, finite))  # a NaN rho always falls back


def test_what_a_full_step_learns_is_kept_only_from_a_finite_step_that_did_not_fall_back():
  previous = {"w": jnp.ones(2)}
  bad = _bad_full_result()
  outcome = step.Outcome(
    bad.gradient,
    bad.stored_direction,
    bad.diagnostics,
    full=jnp.asarray(True),
    fell_back=jnp.asarray(False),
    finite=jnp.asarray(False),
  )
  keep = lambda outcome: step.keep_learned(outcome, outcome.stored_direction, previous)["w"]
  np.testing.assert_array_equal(keep(outcome), previous["w"])
  good = {"w": jnp.array([3.0, 4.0])}
  diagnostics = bad.diagnostics._replace(perturbed_loss=jnp.float32(1.0))
  outcome = outcome._replace(stored_direction=good, diagnostics=diagnostics)
  np.testing.assert_array_equal(keep(outcome), previous["w"])  # the output is still NaN
  outcome = outcome._replace(gradient=good, finite=jnp.asarray(True))
  np.testing.assert_array_equal(keep(outcome), good["w"])
  np.testing.assert_array_equal(keep(outcome._replace(fell_back=jnp.asarray(True))), previous["w"])
  np.testing.assert_array_equal(keep(outcome._replace(full=jnp.asarray(False))), previous["w"])


def test_the_clean_pass_ends_behind_a_tpu_barrier_except_per_device_whole_batch():
  """The barrier is measured on the TPU compiler (benchmarks/compiled/sharded.py, tpu_compile.py):
  it cuts GSAM's FSDP peak by 9 parameter shards, but costs the per-device ViT 0.19 GiB in bf16;
  with micro-batches it helps per device too. The CPU's one barrier is another: the output's
  finiteness check (tests/test_microbatches.py)."""
  params = {"w": jnp.ones((4, 3))}
  loss = lambda p, x: jnp.sum((x @ p["w"]) ** 2)
  x = jnp.ones((2, 8, 4))

  def per_device(**kwargs):
    tx = optax_gsam.gsam(0.05, 0.3, axis_name="data", **kwargs)

    def update(p, xs):
      def one(batch):
        closed = lambda q: loss(q, batch)
        if "microbatches" in kwargs:
          return tx.update(None, tx.init(p), p, loss_fn=loss, batch=batch)[0]
        return tx.update(jax.grad(closed)(p), tx.init(p), p, loss_fn=closed)[0]

      return jax.vmap(one, axis_name="data")(xs)

    return optimization_barriers(update, params, x)

  tx = optax_gsam.gsam(0.05, 0.3)
  closed = lambda q: loss(q, x[0])
  whole = lambda p: tx.update(jax.grad(closed)(p), tx.init(p), p, loss_fn=closed)[0]
  assert optimization_barriers(whole, params) == {"tpu": 1, "cpu": 1}
  assert per_device() == {"tpu": 0, "cpu": 1}
  assert per_device(microbatches=2) == {"tpu": 1, "cpu": 1}
