"""The user's loss function (optax_gsam._src.calls.user_functions): accepted forms, and a clear
error, with the fix, for each way to get it wrong."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import float32_problem

import optax_gsam
from optax_gsam import big_vision
from optax_gsam.flax import TrainState

EPS = 1e-12


def test_missing_loss_function_is_clear_through_wrappers_and_groups():
  p = {"w": jnp.ones(3)}
  state_error = r"Pass exactly one of loss_fn .* or value_and_grad_fn"
  wrapped = optax.apply_if_finite(optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.1)), 2)
  with pytest.raises(ValueError, match=state_error):
    wrapped.update(p, wrapped.init(p), p)
  grouped = optax_gsam.gsam(
    0.1, 0.3, microbatches=2, perturb_each_microbatch=True, policy=optax_gsam.every_k_policy(2)
  )
  with pytest.raises(ValueError, match=state_error):
    grouped.update(p, grouped.init(p), p)
  state = TrainState.create(
    apply_fn=None, params=p, tx=optax.chain(optax_gsam.gsam(0.1), optax.sgd(0.1))
  )
  with pytest.raises(ValueError, match=state_error):
    state.apply_gradients(grads=p, value=1.0)
  with pytest.raises(ValueError, match="loss_fn must be callable"):
    big_vision.gsam_gradient(None, p, None, None, 0.6, 0.1, 0.5, 1e-3, 3e-3, 3e-5)


def test_non_scalar_clean_loss_value_is_rejected():
  p = jnp.ones(3)
  tx = optax_gsam.gsam(0.1, 0.3)
  loss_fn = lambda w: jnp.sum(w**2)
  with pytest.raises(ValueError, match="The loss must be a scalar, got shape"):
    tx.update(p, tx.init(p), p, loss_fn=loss_fn, value=jnp.ones(3))


@pytest.mark.parametrize("container", [tuple, list])
@pytest.mark.parametrize("num_groups", [None, 2])
def test_loss_fn_returning_loss_and_aux_equals_the_scalar_loss(container, num_groups):
  p, loss_jax = float32_problem(seed=31)
  if num_groups:
    scalar = lambda q, group: loss_jax(q) * (1.0 + group)
  else:
    scalar = loss_jax
  with_aux = lambda *args: container([scalar(*args), {"logits": jnp.ones(3), "n": 7}])
  tx = optax_gsam.gsam(
    0.1, 0.3, microbatches=num_groups, perturb_each_microbatch=num_groups is not None
  )
  grads = jax.grad(loss_jax)(p)
  expected, expected_state = jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=scalar))(grads)
  got, state = jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=with_aux))(grads)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  jax.tree.map(np.testing.assert_array_equal, state, expected_state)


def test_missing_loss_fn_names_the_likely_cause_and_the_fix():
  p = {"w": jnp.ones(3)}
  tx = optax_gsam.gsam(0.1)
  with pytest.raises(ValueError, match=r"optax_gsam\.flax\.TrainState.*nnx\.Optimizer\.update"):
    tx.update(p, tx.init(p), p)


def test_nnx_loss_fn_of_the_model_gets_a_clear_error():
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
      return self.linear(x)

  model = Model(nnx.Rngs(0))
  x = jnp.ones((4, 3))
  loss_of_model = lambda m: jnp.mean(m(x) ** 2)
  params = nnx.state(model, nnx.Param)
  grads = nnx.grad(loss_of_model)(model)
  tx = optax_gsam.sam(0.05)
  with pytest.raises(
    TypeError, match=r"loss_fn\(params\).*not the model.*optax_gsam\.flax\.nnx_loss_fn"
  ):
    tx.update(nnx.state(grads, nnx.Param), tx.init(params), params, loss_fn=loss_of_model)


def test_unrelated_type_errors_in_the_loss_are_not_rewritten():
  p = {"w": jnp.ones(3)}
  tx = optax_gsam.sam(0.05)

  def broken(q):
    raise TypeError("'int' object is not callable")

  with pytest.raises(TypeError, match=r"^'int' object is not callable"):
    tx.update(p, tx.init(p), p, loss_fn=broken)


def ignoring_transforms():
  return {
    "gsam": optax_gsam.gsam(0.1, 0.3),
    "sam": optax_gsam.sam(0.1),
    "momentum_sam": optax_gsam.momentum_sam(0.1),
    "num_groups": optax_gsam.gsam(0.1, 0.3, microbatches=2, perturb_each_microbatch=True),
  }


@pytest.mark.parametrize("name", ["gsam", "sam", "momentum_sam", "num_groups"])
def test_loss_fn_that_closes_over_the_step_params_is_rejected_with_the_fix(name):
  tx = ignoring_transforms()[name]
  p, loss_jax = float32_problem(seed=33)
  grads = jax.grad(loss_jax)(p)
  ignoring = lambda q, *group: loss_jax(p)  # the step's own params, not its argument
  with pytest.raises(
    ValueError, match=r"does not depend on its argument.*lambda p: loss\(p, batch\)"
  ):
    jax.jit(lambda g, params: tx.update(g, tx.init(params), params, loss_fn=ignoring))(grads, p)
  with pytest.raises(ValueError, match="does not depend on its argument"):
    tx.update(grads, tx.init(p), p, loss_fn=ignoring)  # eagerly too


def test_valid_loss_functions_are_not_rejected():
  float_p = {"used": jnp.array([1.0, -2.0]), "unused": jnp.ones(3)}
  float_g = {"used": jnp.array([2.0, -4.0]), "unused": jnp.zeros(3)}
  partial = lambda q: jnp.sum(q["used"] ** 2)  # depends on some params only
  tx = optax_gsam.gsam(0.1, 0.3)
  updates, state = tx.update(float_g, tx.init(float_p), float_p, loss_fn=partial)
  assert float(state.perturbed_grad_norm) > 0
  np.testing.assert_array_equal(updates["unused"], 0.0)
  # with (loss, aux), per group, and through jit
  grouped = optax_gsam.gsam(0.1, 0.3, microbatches=2, perturb_each_microbatch=True)
  with_group = lambda q, group: (partial(q) * (1.0 + group), {"group": group})
  jax.jit(lambda g: grouped.update(g, grouped.init(float_p), float_p, loss_fn=with_group))(float_g)
  # value_and_grad_fn computes its own gradient and is not inspected (a constant value is fine).
  fixed = lambda q: (jnp.float32(1.0), float_g)
  updates, _ = tx.update(float_g, tx.init(float_p), float_p, value_and_grad_fn=fixed)
  # g_c = g_p: the decomposition returns g up to the rounding of cos(g, g) = 1 +- 1e-7, which
  # depends on the CPU's kernels (assert_allclose's default rtol, 1e-7, is under one float32 ulp).
  jax.tree.map(lambda u, g: np.testing.assert_allclose(u, g, rtol=1e-6), updates, float_g)


def test_zero_gradient_of_a_loss_that_uses_its_argument_is_accepted():
  w = jnp.zeros(3)
  tx = optax_gsam.gsam(0.1, 0.3)
  updates, _ = tx.update(w, tx.init(w), w, loss_fn=lambda v: jnp.sum(v**2))  # zero at w = 0
  np.testing.assert_array_equal(updates, 0.0)
  # stop_gradient on the whole argument is a loss without a gradient path: rejected.
  with pytest.raises(ValueError, match="does not depend on its argument"):
    tx.update(w, tx.init(w), w, loss_fn=lambda v: jnp.sum(jax.lax.stop_gradient(v) ** 2))


@pytest.mark.parametrize(
  "loss_fn,match",
  [
    (jnp.cos, r"scalar loss .*got shape \(3,\)"),
    (lambda w: (jnp.cos(w), 0.0), r"scalar loss .*got shape \(3,\)"),
    (lambda w: jnp.sum(w).astype(jnp.int32), "real floating-point loss, got dtype int32"),
    (lambda w: {"loss": jnp.sum(w)}, "scalar loss or a \\(loss, aux\\) pair, got dict"),
  ],
)
@pytest.mark.parametrize("transform", ["gsam", "momentum_sam"])
def test_loss_fn_that_is_not_a_real_scalar_raises_value_error(loss_fn, match, transform):
  w = jnp.ones(3)
  tx = ignoring_transforms()[transform]
  with pytest.raises(ValueError, match=match):
    tx.update(w, tx.init(w), w, loss_fn=loss_fn)


def test_update_reads_its_keywords_from_what_the_chain_forwards():
  """gsam, sam and momentum_sam read the keywords of UpdateArguments from ``**extra_args``.

  Another transform's keywords pass through; a near miss of a keyword the method reads is a
  TypeError naming the method; momentum_sam refuses ``perturb=False`` (a step it never takes).
  """
  from optax_gsam._src.calls.user_functions import UPDATE_KEYWORDS

  w = jnp.array([1.0, -2.0, 0.5])
  loss_fn = lambda v: jnp.sum(v**2) + jnp.sum(v**3)
  grads = jax.grad(loss_fn)(w)
  others = {"grad": grads, "value_fn": loss_fn, "batch_stats": None}  # other transforms'
  assert UPDATE_KEYWORDS == (
    "loss_fn",
    "value_and_grad_fn",
    "value",
    "perturb",
    "batch",
    "key",
    "model_state",
  )
  for tx in (optax_gsam.gsam(0.1, 0.3), optax_gsam.sam(0.1), optax_gsam.momentum_sam(0.1)):
    state = tx.init(w)
    plain, _ = tx.update(grads, state, w, loss_fn=loss_fn)
    forwarded, _ = tx.update(grads, state, w, loss_fn=loss_fn, **others)
    np.testing.assert_array_equal(forwarded, plain)
  momentum = optax_gsam.momentum_sam(0.1)
  with pytest.raises(
    TypeError, match=r"los_fn=, which no argument of momentum_sam reads.*loss_fn="
  ):
    momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn, los_fn=loss_fn)
  for refused in (False, np.False_, jnp.array(False)):
    with pytest.raises(ValueError, match=r"perturb=.*which momentum_sam does not take"):
      momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn, perturb=refused)
  with pytest.raises(TypeError, match=r"pertub=, which no argument of momentum_sam.*perturb="):
    momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn, pertub=False)
  always, _ = momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn, perturb=True)
  np.testing.assert_array_equal(
    always, momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn)[0]
  )
  # value= is optax's name for the clean loss: momentum_sam has no clean pass and ignores it.
  ignored, _ = momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn, value=loss_fn(w))
  np.testing.assert_array_equal(
    ignored, momentum.update(grads, momentum.init(w), w, loss_fn=loss_fn)[0]
  )
