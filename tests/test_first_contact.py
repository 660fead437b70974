"""The transform's side of the first-contact traps: each test fails without its fix."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import float32_problem
from jax.sharding import PartitionSpec as P

import optax_gsam

# --- (loss, aux) loss functions ---------------------------------------------------------------


@pytest.mark.parametrize("container", [tuple, list])
@pytest.mark.parametrize("num_groups", [None, 2])
def test_loss_fn_returning_loss_and_aux_equals_the_scalar_loss(container, num_groups):
  p, loss_jax = float32_problem(seed=31)
  if num_groups:
    scalar = lambda q, group: loss_jax(q) * (1.0 + group)
  else:
    scalar = loss_jax
  with_aux = lambda *args: container([scalar(*args), {"logits": jnp.ones(3), "n": 7}])
  tx = optax_gsam.gsam(0.1, 0.3, num_groups=num_groups)
  grads = jax.grad(loss_jax)(p)
  expected, expected_state = jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=scalar))(grads)
  got, state = jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=with_aux))(grads)
  jax.tree.map(np.testing.assert_array_equal, got, expected)
  jax.tree.map(np.testing.assert_array_equal, state, expected_state)


# --- Misleading errors ------------------------------------------------------------------------


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


# --- a loss_fn that ignores its argument, and one that is not a scalar -------------------------


def ignoring_transforms():
  return {
    "gsam": optax_gsam.gsam(0.1, 0.3),
    "sam": optax_gsam.sam(0.1),
    "momentum_sam": optax_gsam.momentum_sam(0.1),
    "num_groups": optax_gsam.gsam(0.1, 0.3, num_groups=2),
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
  grouped = optax_gsam.gsam(0.1, 0.3, num_groups=2)
  with_group = lambda q, group: (partial(q) * (1.0 + group), {"group": group})
  jax.jit(lambda g: grouped.update(g, grouped.init(float_p), float_p, loss_fn=with_group))(float_g)
  # value_and_grad_fn computes its own gradient and is not inspected (a constant value is fine).
  fixed = lambda q: (jnp.float32(1.0), float_g)
  updates, _ = tx.update(float_g, tx.init(float_p), float_p, value_and_grad_fn=fixed)
  jax.tree.map(np.testing.assert_allclose, updates, float_g)


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


# --- pmap with axis_name unset ----------------------------------------------------------------


def test_update_under_pmap_without_axis_name_raises_naming_the_axis():
  p, loss_jax = float32_problem(seed=32)
  tx = optax.chain(optax_gsam.gsam(0.1, 0.3), optax.sgd(0.1))
  n = jax.local_device_count()

  def wrong_step(p, state):
    grads = jax.lax.pmean(jax.grad(loss_jax)(p), "batch")  # the user's own pmean, as before
    updates, state = tx.update(grads, state, p, loss_fn=loss_jax)
    return optax.apply_updates(p, updates), state

  replicate = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)
  with pytest.raises(ValueError, match=r"mapped axis 'batch'.*axis_name='batch'"):
    jax.pmap(wrong_step, axis_name="batch")(replicate(p), replicate(tx.init(p)))
  mesh = jax.make_mesh((n,), ("data",))
  sharded = jax.shard_map(
    lambda p, s: tx.update(p, s, p, loss_fn=loss_jax), mesh=mesh, in_specs=P(), out_specs=P()
  )
  with pytest.raises(ValueError, match=r"mapped axis 'data'.*check_axis=False"):
    jax.jit(sharded)(p, tx.init(p))
  # Gradients that are global already (a gradient cache with its own axis_name) opt out.
  trusted = optax_gsam.gsam(0.1, 0.3, check_axis=False)
  opted_out = jax.shard_map(
    lambda p, s: trusted.update(p, s, p, loss_fn=loss_jax), mesh=mesh, in_specs=P(), out_specs=P()
  )
  jax.jit(opted_out)(p, trusted.init(p))
  with pytest.raises(ValueError, match="check_axis must be a bool"):
    optax_gsam.sam(0.1, check_axis=None)
  # Plain vmap (no axis name), e.g. over seeds, is not a data axis.
  jax.vmap(lambda q: tx.update(q, tx.init(q), q, loss_fn=loss_jax))(replicate(p))


# --- on_nonfinite -----------------------------------------------------------------------------


def nan_at_perturbed(loss_jax, params):
  """A loss that is finite at ``params`` and NaN anywhere else (every perturbed point)."""
  anchor = jax.tree.map(jnp.copy, params)

  def loss(q):
    moved = sum(
      jnp.sum((a - b) ** 2)
      for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(anchor), strict=True)
    )
    return loss_jax(q) * jnp.where(moved > 0, jnp.nan, 1.0)  # NaN loss and gradient

  return loss


@pytest.mark.parametrize("transform", ["gsam", "sam"])
def test_on_nonfinite_clean_outputs_the_clean_gradient_and_counts(transform):
  p, loss_jax = float32_problem(seed=33)
  bad = nan_at_perturbed(loss_jax, p)
  make = optax_gsam.sam if transform == "sam" else lambda rho, **kw: optax_gsam.gsam(rho, 0.3, **kw)
  grads = jax.grad(loss_jax)(p)
  propagate = make(0.1)
  out, _ = propagate.update(grads, propagate.init(p), p, loss_fn=bad)
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  clean = make(0.1, on_nonfinite="clean")
  state = clean.init(p)
  out, state = jax.jit(lambda s: clean.update(grads, s, p, loss_fn=bad))(state)
  jax.tree.map(np.testing.assert_array_equal, out, grads)
  assert int(state.fallback_count) == 1 and int(state.count) == 1
  assert state.fallback_count.dtype == jnp.int32
  # A finite perturbed pass is no fallback.
  _, state = clean.update(grads, state, p, loss_fn=loss_jax)
  assert int(state.fallback_count) == 1 and int(state.count) == 2
  # A non-finite clean gradient is not rescued: it propagates, uncounted.
  nan_grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  out, state = clean.update(nan_grads, state, p, loss_fn=bad)
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
  assert int(state.fallback_count) == 1 and int(state.count) == 2


def test_on_nonfinite_clean_keeps_training_behind_apply_if_finite():
  """A loss that is NaN at every perturbed point stalls a propagating chain forever.

  ``optax.apply_if_finite`` checks the updates it receives, so it goes after the transform.
  """
  p, loss_jax = float32_problem(seed=34)

  def train(on_nonfinite):
    tx = optax.chain(
      optax_gsam.gsam(0.1, 0.3, on_nonfinite=on_nonfinite),
      optax.apply_if_finite(optax.sgd(0.05), max_consecutive_errors=100),
    )

    @jax.jit
    def step(params, state):
      bad = nan_at_perturbed(loss_jax, params)
      loss, grads = jax.value_and_grad(loss_jax)(params)
      updates, state = tx.update(grads, state, params, loss_fn=bad, value=loss)
      return optax.apply_updates(params, updates), state

    params, state = p, tx.init(p)
    for _ in range(5):
      params, state = step(params, state)
    return params, state

  stalled, _ = train("propagate")
  jax.tree.map(np.testing.assert_array_equal, stalled, p)
  trained, state = train("clean")
  plain = p
  for _ in range(5):
    plain = jax.tree.map(lambda w, g: w - 0.05 * g, plain, jax.grad(loss_jax)(plain))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), trained, plain)
  assert int(optax.tree.get(state, "fallback_count")) == 5


NONFINITE_ON_ONE_DEVICE = {
  # A NaN loss whose gradient is finite (zero) there.
  "nan_loss": lambda local, q, bad: jnp.where(bad, jnp.nan, local(q)),
  # A finite loss whose gradient is NaN: d sqrt(u) at u = 0 is inf, times 0.
  "nan_gradient": lambda local, q, bad: (
    local(q) + jnp.where(bad, jnp.sqrt(0.0 * jnp.sum(q["w"] ** 2)), 0.0)
  ),
}


@pytest.mark.parametrize("kind", list(NONFINITE_ON_ONE_DEVICE))
def test_on_nonfinite_clean_under_per_device_perturbation(kind, data_mesh):
  """One device's non-finite perturbed pass makes every device output the averaged clean gradient."""
  p, loss_jax = float32_problem(seed=35)
  mesh = data_mesh
  tx = optax_gsam.gsam(0.1, 0.3, axis_name="data", on_nonfinite="clean")
  x = jnp.arange(8.0)

  def step(params, state, xb):
    local = lambda q: loss_jax(q) * (1.0 + xb[0])
    bad = lambda q: NONFINITE_ON_ONE_DEVICE[kind](local, q, xb[0] == 3.0)
    updates, state = tx.update(jax.grad(local)(params), state, params, loss_fn=bad)
    return updates, state

  updates, state = optax_gsam.data_parallel(
    step, mesh, axis_name="data", batch_argnums=(2,), out_specs=(P(), P())
  )(p, tx.init(p), x)
  expected = jax.tree.map(lambda g: g * jnp.mean(1.0 + x), jax.grad(loss_jax)(p))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), updates, expected)
  assert int(state.fallback_count) == 1 and int(state.full_steps) == 0


# --- A readable core --------------------------------------------------------------------------


def code_lines(function: ast.AST, source_lines: list[str]) -> int:
  """Non-blank, non-comment lines of a function, its docstring excluded (nested ones count)."""
  body = function.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    docstring = range(body[0].lineno, body[0].end_lineno + 1)
  else:
    docstring = range(0)
  lines = range(function.lineno, function.end_lineno + 1)
  return sum(
    1
    for n in lines
    if n not in docstring
    and source_lines[n - 1].strip()
    and not source_lines[n - 1].strip().startswith("#")
  )


def test_no_function_in_the_package_exceeds_60_lines_of_code():
  package = pathlib.Path(optax_gsam.__file__).parent
  too_long = []
  for path in sorted(package.rglob("*.py")):
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = code_lines(node, lines)
        if n > 60:
          too_long.append(f"{path.relative_to(package)}:{node.name} ({n})")
  assert not too_long, too_long
