"""Where the transform sits: first in its chain, never inside optax.MultiSteps or optax.masked.

A stage placed before gsam/sam used to be silently lost (the transform takes
the gradient again at the perturbed weights); these placements are refused,
and the documented one (clipping and weight decay after the transform) applies
to the emitted gradient. What loses nothing is accepted and gives the plain
chain's answer: ``optax.identity()`` or a ``passthrough`` stage before the
transform, ``optax.MultiSteps`` with ``every_k_schedule=1``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gsam

W = jnp.array([0.5, -1.0, 2.0, 0.3])
LOSS = lambda w: jnp.sum(jnp.cos(3.0 * w) + w**4)


@pytest.mark.parametrize(
  "before",
  [
    optax.clip_by_global_norm(1e-3),
    optax.add_decayed_weights(0.5),
    optax.chain(optax.identity(), optax.scale(0.5)),
  ],
  ids=["clip", "decay", "identity-then-scale"],
)
@pytest.mark.parametrize(
  "make", [lambda: optax_gsam.sam(0.05), lambda: optax_gsam.momentum_sam(0.05)]
)
def test_a_stage_before_the_transform_is_refused(before, make):
  tx = optax.chain(before, make(), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"first transformation of its optax.chain.*after"):
    tx.update(jax.grad(LOSS)(W), tx.init(W), W, loss_fn=LOSS)


def test_a_chain_nested_after_a_stage_is_refused_too():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match="first transformation"):
    tx.update(jax.grad(LOSS)(W), tx.init(W), W, loss_fn=LOSS)


def test_clip_and_decay_after_the_transform_apply_to_the_emitted_gradient():
  sam = optax_gsam.sam(0.05)
  tx = optax.chain(sam, optax.clip_by_global_norm(1e-3), optax.add_decayed_weights(0.5))
  updates, _ = tx.update(jax.grad(LOSS)(W), tx.init(W), W, loss_fn=LOSS)
  emitted, _ = sam.update(jax.grad(LOSS)(W), sam.init(W), W, loss_fn=LOSS)
  emitted = np.asarray(emitted, np.float64)
  expected = emitted * min(1.0, 1e-3 / np.linalg.norm(emitted)) + 0.5 * np.asarray(W)
  np.testing.assert_allclose(updates, expected, rtol=1e-5)


def test_inside_inject_hyperparams_and_apply_if_finite_is_still_first():
  tx = optax.chain(
    optax.inject_hyperparams(optax_gsam.gsam)(rho=0.05, alpha=0.2),
    optax.sgd(0.1),
  )
  guarded = optax.apply_if_finite(tx, max_consecutive_errors=3)
  guarded.update(jax.grad(LOSS)(W), guarded.init(W), W, loss_fn=LOSS)


def test_rho_under_inject_hyperparams_is_the_value_used_at_the_last_step():
  """Before GSAMState.rho became last_rho, two leaves were named rho and optax.tree.get raised."""
  injected = optax.inject_hyperparams(optax_gsam.gsam)
  every_2 = optax_gsam.every_k_policy(2)
  tx = optax.chain(injected(rho=0.1, alpha=0.3, policy=every_2), optax.sgd(0.1))
  state = tx.init(W)
  _, state = tx.update(jax.grad(LOSS)(W), state, W, loss_fn=LOSS)
  assert float(optax.tree.get(state, "rho")) == pytest.approx(0.1)
  # A scheduled rho: optax keeps the schedule's own state under "rho" too; keep the array.
  schedule = optax.linear_schedule(0.2, 0.0, 10)
  tx = optax.chain(injected(rho=schedule, alpha=0.3, policy=every_2), optax.sgd(0.1))
  state = tx.init(W)
  step = jax.jit(lambda w, s: tx.update(jax.grad(LOSS)(w), s, w, loss_fn=LOSS))
  is_array = lambda path, value: isinstance(value, jax.Array)
  for i in range(3):
    _, state = step(W, state)
    rho = optax.tree.get(state, "rho", filtering=is_array)
    assert float(rho) == pytest.approx(float(schedule(i)))
    assert float(optax.tree.get(state, "last_rho")) == pytest.approx(float(schedule(i)))


MAKERS = [lambda: optax_gsam.sam(0.05), lambda: optax_gsam.momentum_sam(0.05)]


def _first_update(tx):
  return tx.update(jax.grad(LOSS)(W), tx.init(W), W, loss_fn=LOSS)


@pytest.mark.parametrize("make", MAKERS, ids=["sam", "momentum_sam"])
def test_a_stage_before_the_transform_in_a_named_chain_is_refused(make):
  """named_chain used to drop the clip silently (|u| = 0.10 instead of 1e-4)."""
  tx = optax.named_chain(
    ("clip", optax.clip_by_global_norm(1e-3)), ("sharp", make()), ("sgd", optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match=r"first transformation.*after"):
    _first_update(tx)
  first = optax.named_chain(("sharp", make()), ("clip", optax.clip_by_global_norm(1e-3)))
  updates, _ = _first_update(first)
  assert float(jnp.linalg.norm(updates)) == pytest.approx(1e-3, rel=1e-5)


def _plain_and(before):
  """The updates of chain(transform, sgd) and of ``before`` wrapped around the same transform."""
  plain = optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1))
  return _first_update(plain)[0], _first_update(before(plain))[0]


@pytest.mark.parametrize(
  "wrap, bitwise",
  [
    (lambda plain: optax.chain(optax.identity(), optax_gsam.sam(0.05), optax.sgd(0.1)), True),
    (
      lambda plain: optax.named_chain(
        ("noop", optax.identity()), ("sam", optax_gsam.sam(0.05)), ("sgd", optax.sgd(0.1))
      ),
      True,
    ),
    (lambda plain: optax.chain(optax.identity(), plain), True),
    # MultiSteps runs the chain inside a lax.cond, which compiles it as one program even eagerly.
    (lambda plain: optax.MultiSteps(plain, every_k_schedule=1), False),
  ],
  ids=["identity", "named-identity", "identity-nested", "multisteps-1"],
)
def test_what_loses_nothing_is_accepted_and_gives_the_plain_chains_answer(wrap, bitwise):
  expected, got = _plain_and(wrap)
  if bitwise:  # the identity passes the gradient on: the same operations, eagerly
    np.testing.assert_array_equal(got, expected)
  else:  # two programs (compiled vs eager): equal up to float32 rounding, which depends on the CPU
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_multisteps_with_one_step_under_jit_over_several_steps():
  plain = optax.chain(optax_gsam.gsam(0.05, 0.3), optax.sgd(0.1))
  multi = optax.MultiSteps(optax.chain(optax_gsam.gsam(0.05, 0.3), optax.sgd(0.1)), 1)
  results = []
  for tx in (plain, multi):
    step = jax.jit(lambda w, s, tx=tx: tx.update(jax.grad(LOSS)(w), s, w, loss_fn=LOSS))
    w, state = W, tx.init(W)
    for _ in range(3):
      updates, state = step(w, state)
      w = optax.apply_updates(w, updates)
    results.append(w)
  np.testing.assert_allclose(results[1], results[0], rtol=1e-6)


def test_multisteps_with_a_schedule_that_may_accumulate_is_still_refused():
  """A schedule giving an array may exceed 1 at a later step; only a Python int 1 is safe."""
  schedule = lambda step: jnp.where(step < 10, 1, 2)
  tx = optax.MultiSteps(optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1)), schedule)
  with pytest.raises(ValueError, match=r"MultiSteps.*microbatches=k"):
    _first_update(tx)


def _norm_logger():
  """A stage that only reads the gradient: its state is the norm of the last one."""

  def update_fn(updates, state, params=None):
    del state, params
    return updates, optax.tree.norm(updates)

  return optax.GradientTransformation(lambda params: jnp.zeros([]), update_fn)


def test_a_logging_stage_before_the_transform_is_refused_unless_marked_passthrough():
  with pytest.raises(ValueError, match=r"passthrough"):
    _first_update(optax.chain(_norm_logger(), optax_gsam.sam(0.05), optax.sgd(0.1)))
  tx = optax.chain(optax_gsam.passthrough(_norm_logger()), optax_gsam.sam(0.05), optax.sgd(0.1))
  expected, _ = _first_update(optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1)))
  updates, state = _first_update(tx)
  np.testing.assert_array_equal(updates, expected)
  assert float(state[0]) == pytest.approx(float(jnp.linalg.norm(jax.grad(LOSS)(W))), rel=1e-6)
  named = optax.named_chain(
    ("log", optax_gsam.passthrough(_norm_logger())), ("sam", optax_gsam.sam(0.05))
  )
  np.testing.assert_array_equal(_first_update(named)[0], _first_update(optax_gsam.sam(0.05))[0])


def test_passthrough_discards_what_its_stage_outputs():
  """A clip wrapped in passthrough clips nothing: the wrapper cannot lose a change silently."""
  tx = optax_gsam.passthrough(optax.clip_by_global_norm(1e-3))
  grads = jax.grad(LOSS)(W)
  updates, _ = tx.update(grads, tx.init(W), W, loss_fn=LOSS)  # extra args are dropped for it
  np.testing.assert_array_equal(updates, grads)


def test_optax_masked_around_momentum_sam_names_the_mask_argument():
  """It used to raise a TypeError about MaskedNode from inside the user's loss."""
  params = {"w": W, "b": jnp.array([0.3])}
  loss_fn = lambda p: LOSS(p["w"]) + jnp.sum(p["b"] ** 2)
  tx = optax.chain(
    optax.masked(optax_gsam.momentum_sam(0.05), {"w": True, "b": False}), optax.sgd(0.1)
  )
  grads = jax.grad(loss_fn)(params)
  with pytest.raises(ValueError, match=r"momentum_sam got params with optax.MaskedNode.*mask="):
    tx.update(grads, tx.init(params), params, loss_fn=loss_fn)


def test_lookahead_with_the_loss_bound_into_its_fast_optimizer_is_lookahead_over_sam():
  """The documented form (docs/getting_started.md) against Lookahead over SAM, from the formulas.

  Without the binding, the missing loss function's error names the form.
  """
  rho, lr, period, slow_step = 0.05, 0.1, 3, 0.5
  with jax.enable_x64(True):
    w0 = W.astype(jnp.float64)

    def lookahead(loss_fn):
      tx = optax.chain(optax_gsam.sam(rho), optax.sgd(lr))
      fast = optax.GradientTransformation(
        tx.init, lambda u, s, p: tx.update(u, s, p, loss_fn=loss_fn)
      )
      return optax.lookahead(fast, sync_period=period, slow_step_size=slow_step)

    params = optax.LookaheadParams.init_synced(w0)
    state = lookahead(None).init(params)
    fast = slow = w0
    for step in range(2 * period + 1):
      updates, state = lookahead(LOSS).update(jax.grad(LOSS)(params.fast), state, params)
      params = optax.apply_updates(params, updates)
      g = jax.grad(LOSS)(fast)
      fast = fast - lr * jax.grad(LOSS)(fast + rho * g / jnp.linalg.norm(g))
      if (step + 1) % period == 0:
        slow = fast = slow + slow_step * (fast - slow)
      np.testing.assert_allclose(params.fast, fast, rtol=1e-12)
      np.testing.assert_allclose(params.slow, slow, rtol=1e-12)

  unbound = optax.lookahead(optax.chain(optax_gsam.sam(rho), optax.sgd(lr)), period, slow_step)
  params = optax.LookaheadParams.init_synced(W)
  with pytest.raises(ValueError, match=r"optax.lookahead calls its fast optimizer.*partial"):
    unbound.update(jax.grad(LOSS)(W), unbound.init(params), params)
