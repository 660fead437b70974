"""Where the transform sits: first in its chain, never inside optax.MultiSteps or optax.masked.

A stage placed before gsam/sam used to be silently lost (the transform takes
the gradient again at the perturbed weights); these placements are refused,
and the documented one (clipping and weight decay after the transform) applies
to the emitted gradient.
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
  [optax.clip_by_global_norm(1e-3), optax.add_decayed_weights(0.5), optax.identity()],
  ids=["clip", "decay", "identity"],
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
  injected = optax.inject_hyperparams(optax_gsam.gsam, static_args=("perturb_every",))
  tx = optax.chain(injected(rho=0.1, alpha=0.3, perturb_every=2), optax.sgd(0.1))
  state = tx.init(W)
  _, state = tx.update(jax.grad(LOSS)(W), state, W, loss_fn=LOSS)
  assert float(optax.tree.get(state, "rho")) == pytest.approx(0.1)
  # A scheduled rho: optax keeps the schedule's own state under "rho" too; keep the array.
  schedule = optax.linear_schedule(0.2, 0.0, 10)
  tx = optax.chain(injected(rho=schedule, alpha=0.3, perturb_every=2), optax.sgd(0.1))
  state = tx.init(W)
  step = jax.jit(lambda w, s: tx.update(jax.grad(LOSS)(w), s, w, loss_fn=LOSS))
  is_array = lambda path, value: isinstance(value, jax.Array)
  for i in range(3):
    _, state = step(W, state)
    rho = optax.tree.get(state, "rho", filtering=is_array)
    assert float(rho) == pytest.approx(float(schedule(i)))
    assert float(optax.tree.get(state, "last_rho")) == pytest.approx(float(schedule(i)))
