"""The perturbed pass as a conditional branch of its own (the GPU's program), run on the CPU.

``optax_gsam._src.step.isolation`` compiles the perturbed pass as the taken branch of a conditional
on the GPU only. Here the CPU is added to its platforms, so the same program runs on the CPU:
every composition gives the numbers of the inlined pass, the loss function's Python runs once
per trace, and the compiled program holds the conditional (and only with the CPU added).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam
from optax_gsam._src.step import isolation

RHO, ALPHA = 0.05, 0.3
X = jnp.linspace(-1.0, 1.0, 8 * 6).reshape(8, 6)
Y = jnp.cos(jnp.arange(8.0))


def _params():
  return {"w": jnp.linspace(-0.5, 0.5, 6 * 4).reshape(6, 4), "v": jnp.linspace(0.3, -0.2, 4)}


def _scanned_loss(p, x, y):
  """Two scanned, rematerialized layers: the model shape whose buffers the GPU shared."""

  def layer(h, scale):
    return jnp.tanh(h @ p["w"][:4] * scale + h), None

  h = jnp.tanh(x @ p["w"])
  h, _ = jax.lax.scan(jax.checkpoint(layer), h, jnp.array([1.0, 0.5]))
  return jnp.mean((h @ p["v"] - y) ** 2)


@pytest.fixture
def isolated_on_cpu(monkeypatch):
  monkeypatch.setattr(isolation, "ISOLATED_PLATFORMS", ("cpu", "cuda"))


def _step(tx, calls):
  def step(params, opt_state, x, y):
    def loss_fn(p):
      calls.append(1)
      return _scanned_loss(p, x, y)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state

  return step


def _run_twice(tx, run):
  """The same steps inlined and isolated; each run's loss_fn traces (calls per trace)."""
  results = []
  for platforms in (("cuda",), ("cpu", "cuda")):
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(isolation, "ISOLATED_PLATFORMS", platforms)
      calls: list = []
      results.append((run(tx, calls), len(calls)))
  return results


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7)  # two programs: float32 rounding


def _jit_run(tx, calls):
  params = _params()
  step = jax.jit(_step(tx, calls))
  state = tx.init(params)
  for _ in range(3):
    params, state = step(params, state, X, Y)
  return params, state


TRANSFORMS = {
  "gsam": lambda: optax_gsam.gsam(RHO, ALPHA),
  "sam diagnostics=False": lambda: optax_gsam.sam(RHO, diagnostics=False),
  "two ascent steps": lambda: optax_gsam.sam(RHO, ascent_steps=2),
  "every-2 lax.cond": lambda: optax_gsam.gsam(RHO, ALPHA, policy=optax_gsam.every_k_policy(2)),
  "frozen": lambda: optax_gsam.sam(RHO, frozen={"w": False, "v": True}),
  "rho schedule": lambda: optax_gsam.sam(optax.linear_schedule(0.0, RHO, 2)),
  "on_nonfinite=clean": lambda: optax_gsam.sam(RHO, on_nonfinite="clean"),
}


@pytest.mark.parametrize("name", TRANSFORMS)
def test_the_isolated_pass_gives_the_inlined_numbers(name):
  tx = optax.chain(TRANSFORMS[name](), optax.adamw(1e-2))
  (inlined, inlined_calls), (isolated, isolated_calls) = _run_twice(tx, _jit_run)
  _close(isolated, inlined)
  assert isolated_calls == inlined_calls  # the user's Python is traced no more often


def test_a_pass_without_a_loop_is_not_isolated(isolated_on_cpu):
  """Nothing to isolate without a scan: the pass is inlined, the program has no conditional."""
  tx = optax.chain(optax_gsam.sam(RHO), optax.sgd(0.1))
  params = _params()
  loss_fn = lambda p: jnp.mean((jnp.tanh(X @ p["w"]) @ p["v"] - Y) ** 2)

  def step(p, s):
    return tx.update(jax.grad(loss_fn)(p), s, p, loss_fn=loss_fn)

  text = jax.jit(step).lower(params, tx.init(params)).compile().as_text()
  assert " conditional(" not in text


def test_the_conditional_is_compiled_only_where_asked():
  tx = optax.chain(optax_gsam.sam(RHO), optax.sgd(0.1))
  params = _params()
  texts = []
  for platforms in (("cuda",), ("cpu", "cuda")):
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(isolation, "ISOLATED_PLATFORMS", platforms)
      step = jax.jit(_step(tx, []))
      texts.append(step.lower(params, tx.init(params), X, Y).compile().as_text())
  inlined, isolated = texts
  assert " conditional(" not in inlined
  assert " conditional(" in isolated


def test_microbatches_and_the_gradient_cache_through_the_branch():
  def microbatched(tx, calls):
    params = _params()
    loss = lambda p, batch: (calls.append(1), _scanned_loss(p, batch[0], batch[1]))[1]
    state = tx.init(params)
    update = jax.jit(lambda p, s: tx.update(None, s, p, loss_fn=loss, batch=(X, Y)))
    return update(params, state)

  tx = optax_gsam.gsam(RHO, ALPHA, microbatches=2)
  (inlined, _), (isolated, _) = _run_twice(tx, microbatched)
  _close(isolated, inlined)

  def cached(tx, calls):
    params = _params()
    value_and_grad = jax.value_and_grad(lambda p: _scanned_loss(p, X, Y))
    state = tx.init(params)
    _, grads = value_and_grad(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, value_and_grad_fn=value_and_grad))
    return update(grads, state, params)

  (inlined, _), (isolated, _) = _run_twice(optax_gsam.sam(RHO), cached)
  _close(isolated, inlined)


@pytest.mark.parametrize("sync", [False, True], ids=["per-device", "synchronized"])
def test_shard_map_and_vmap_axes_through_the_branch(data_mesh, sync):
  tx = optax.chain(
    optax_gsam.gsam(RHO, ALPHA, axis_name="data", sync_perturbation=sync), optax.sgd(0.1)
  )

  def per_device(tx, calls):
    step = optax_gsam.data_parallel(_step(tx, calls), data_mesh, batch_argnums=(2, 3))
    params = _params()
    return step(params, tx.init(params), X, Y)

  (inlined, _), (isolated, _) = _run_twice(tx, per_device)
  _close(isolated, inlined)

  def emulated(tx, calls):
    step = jax.jit(optax_gsam.emulate_devices(_step(tx, calls), 4, batch_argnums=(2, 3)))
    params = _params()
    return step(params, tx.init(params), X, Y)

  (inlined, _), (isolated, _) = _run_twice(tx, emulated)
  _close(isolated, inlined)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_sharded_params_keep_their_layout_through_the_branch(axis_type):
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
  specs = {"w": P(None, "model"), "v": P()}

  def sharded(tx, calls):
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in _params().items()}
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    y = jax.device_put(Y, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
      out = jax.jit(_step(tx, calls))(params, tx.init(params), x, y)
    if axis_type == "Explicit":  # the layout is in the type: the branch must keep it
      for k, v in out[0].items():
        assert v.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), v.ndim), k
    return out

  tx = optax.chain(optax_gsam.gsam(RHO, ALPHA), optax.adamw(1e-2))
  (inlined, _), (isolated, _) = _run_twice(tx, sharded)
  _close(isolated, inlined)


def test_pmap_through_the_branch():
  tx = optax.chain(optax_gsam.sam(RHO, axis_name="i"), optax.sgd(0.1))

  def pmapped(tx, calls):
    params = _params()
    replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * 8), t)
    step = jax.pmap(_step(tx, calls), axis_name="i")
    return step(replicate(params), replicate(tx.init(params)), X.reshape(8, 1, 6), Y.reshape(8, 1))

  (inlined, _), (isolated, _) = _run_twice(tx, pmapped)
  _close(isolated, inlined)


def test_integer_leaves_and_aux_outputs_through_the_branch(isolated_on_cpu):
  """A float0 gradient and a (loss, aux) value: the branch never taken matches their types."""
  params = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}

  def loss(p):  # a scan, so that the pass is isolated
    total, _ = jax.lax.scan(lambda c, w: (c + jnp.sin(w), None), 0.0, p["w"])
    return total, {"norm": jnp.linalg.norm(p["w"])}

  value_and_grad = jax.value_and_grad(loss, has_aux=True, allow_int=True)
  out = isolation.isolated_on_gpu(value_and_grad, params)
  (value, aux), grads = jax.jit(functools.partial(isolation.isolated_on_gpu, value_and_grad))(
    params
  )
  np.testing.assert_allclose(value, out[0][0], rtol=1e-6)
  assert grads["step"].dtype == jax.dtypes.float0 and set(aux) == {"norm"}
