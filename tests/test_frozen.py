"""Frozen parameters: neither perturbed nor differentiated, against float64 references.

The references are written here from the formulas over the trained leaves T, with the frozen
leaves F held at their values: eps_T = rho g_T / ||g_T||, g_p = grad_T f(w_T + eps_T, w_F).
"""

import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam

RHO, ALPHA, LR = 0.07, 0.4, 0.1
LABELS = {
  "backbone": {"kernel": "frozen", "bias": "frozen"},
  "adapter": "trained",
  "head": "trained",
}
TRANSFORMS = {"trained": optax.sgd(LR), "frozen": optax.set_to_zero()}
FROZEN = {"backbone": True, "adapter": False, "head": False}  # a prefix of the params


def _params(dtype=jnp.float64):
  key = jax.random.key(0)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return {
    "backbone": {
      "kernel": jax.random.normal(k1, (3, 4), dtype),
      "bias": jax.random.normal(k2, (4,), dtype),
    },
    "adapter": jax.random.normal(k3, (4, 4), dtype) * 0.3,
    "head": jax.random.normal(k4, (4,), dtype),
  }


X = np.linspace(-1.0, 1.0, 15).reshape(5, 3)
Y = np.cos(np.arange(5.0))


def loss_fn(p):
  h = jnp.tanh(X @ p["backbone"]["kernel"] + p["backbone"]["bias"])
  h = h + h @ p["adapter"]
  return jnp.mean((h @ p["head"] - Y) ** 2)


def _trained(p):
  return {"adapter": p["adapter"], "head": p["head"]}


def _reference(params, alpha):
  """GSAM (alpha > 0) or SAM over the trained leaves, from the formulas, in float64."""
  frozen = params["backbone"]
  f = lambda t: loss_fn({"backbone": frozen, **t})
  w = _trained(params)
  flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])
  g_c = jax.grad(f)(w)
  eps = jax.tree.map(lambda g: RHO * g / jnp.linalg.norm(flat(g_c)), g_c)
  g_p = jax.grad(f)(jax.tree.map(jnp.add, w, eps))
  inner = jnp.dot(flat(g_c), flat(g_p)) / jnp.dot(flat(g_p), flat(g_p))
  out = jax.tree.map(lambda p, c: p - alpha * (c - inner * p), g_p, g_c)
  return {"backbone": jax.tree.map(jnp.zeros_like, frozen), **out}


def _assert_close(tree, expected):
  for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def _run(transform, params, **update_keywords):
  tx = optax.chain(transform, optax.partition(TRANSFORMS, LABELS))
  grads = jax.grad(loss_fn)(params)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p, loss_fn=loss_fn, **update_keywords))
  updates, state = update(grads, tx.init(params), params)
  return updates, state


FROZEN_FORMS = {
  "frozen_leaves": lambda: optax_gsam.frozen_leaves(TRANSFORMS, LABELS),
  "prefix tree": lambda: FROZEN,
  "function": lambda: lambda params: jax.tree.map(lambda _: False, params) | {"backbone": True},
}


@pytest.mark.parametrize("form", FROZEN_FORMS)
@pytest.mark.parametrize("alpha", [0.0, ALPHA], ids=["sam", "gsam"])
def test_trained_leaves_step_as_sharpness_over_them_alone(form, alpha):
  with jax.enable_x64(True):
    params = _params()
    updates, _ = _run(optax_gsam.gsam(RHO, alpha, frozen=FROZEN_FORMS[form]()), params)
    expected = jax.tree.map(lambda g: -LR * g, _reference(params, alpha))
    _assert_close(updates, expected)
    assert not np.any(np.asarray(updates["backbone"]["kernel"]))


def test_without_frozen_the_frozen_leaves_are_perturbed_and_a_warning_says_so():
  """Today's default perturbs every leaf: the trained leaves' step differs from the reference."""
  with jax.enable_x64(True):
    params = _params()
    with pytest.warns(UserWarning, match=r"later stage of the chain freezes.*'backbone'"):
      updates, _ = _run(optax_gsam.sam(RHO), params)
    expected = jax.tree.map(lambda g: -LR * g, _reference(params, 0.0))
    assert not np.allclose(updates["head"], expected["head"], rtol=1e-6)


def _traced_update(tx, grads, params, loss=loss_fn):
  """The update traced, not run: the warning is given while the update is traced."""
  return jax.eval_shape(lambda g, p: tx.update(g, tx.init(p), p, loss_fn=loss), grads, params)


@pytest.mark.parametrize(
  "make_tx",
  [
    lambda sam: optax.chain(sam, optax.partition(TRANSFORMS, LABELS)),
    lambda sam: optax.chain(sam, optax.multi_transform(TRANSFORMS, LABELS)),
    lambda sam: optax.chain(sam, optax.freeze(FROZEN), optax.sgd(LR)),
    lambda sam: optax.chain(sam, optax.selective_transform(optax.sgd(LR), freeze_mask=FROZEN)),
    lambda sam: optax.named_chain(("sam", sam), ("rest", optax.chain(optax.freeze(FROZEN)))),
  ],
  ids=["partition", "multi_transform", "freeze", "selective_transform", "named_chain"],
)
def test_a_later_freeze_of_perturbed_leaves_is_warned_and_frozen_silences_it(make_tx):
  params = _params(jnp.float32)
  grads = jax.grad(loss_fn)(params)
  with pytest.warns(UserWarning, match="optax_gsam.frozen_leaves"):
    _traced_update(make_tx(optax_gsam.sam(RHO)), grads, params)
  for quiet in (optax_gsam.sam(RHO, frozen=FROZEN), optax_gsam.sam(RHO, mask=FROZEN)):
    with warnings.catch_warnings():  # told what is frozen, or an explicit choice of what to perturb
      warnings.simplefilter("error")
      _traced_update(make_tx(quiet), grads, params)


def test_no_warning_when_nothing_after_the_transform_freezes():
  params = _params(jnp.float32)
  transforms = {"trained": optax.sgd(LR), "frozen": optax.adam(1e-3)}  # both trained
  tx = optax.chain(optax_gsam.sam(RHO), optax.partition(transforms, LABELS))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _traced_update(tx, jax.grad(loss_fn)(params), params)


def test_momentum_sam_perturbs_and_differentiates_only_the_trained_leaves():
  mu = 0.9
  with jax.enable_x64(True):
    params = _params()
    tx = optax_gsam.momentum_sam(RHO, mu, frozen=optax_gsam.frozen_leaves(TRANSFORMS, LABELS))
    state = tx.init(params)
    assert not jax.tree.leaves(state.momentum["backbone"])  # no state for a frozen leaf
    velocity = jax.tree.map(jnp.zeros_like, _trained(params))
    for step in range(3):
      w = jax.tree.map(lambda x: x + 0.01 * step * jnp.sign(x), params)  # noqa: B023
      norm = jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(velocity)))
      t = jax.tree.map(lambda x, v: x - RHO * v / (norm + 1e-12), _trained(w), velocity)  # noqa: B023
      expected = jax.grad(lambda t: loss_fn({"backbone": w["backbone"], **t}))(t)  # noqa: B023
      updates, state = tx.update(optax.tree.zeros_like(w), state, w, loss_fn=loss_fn)
      _assert_close(_trained(updates), expected)
      assert not np.any(np.asarray(updates["backbone"]["bias"]))
      velocity = jax.tree.map(lambda v, g: mu * v + g, velocity, expected)


def test_micro_batches_accumulate_the_trained_leaves_only():
  """updates=None: the transform takes the clean pass too, over the trained leaves."""
  with jax.enable_x64(True):
    params = _params()
    batch = {"x": jnp.asarray(X[:4]), "y": jnp.asarray(Y[:4])}

    def micro_loss(p, microbatch):
      h = jnp.tanh(microbatch["x"] @ p["backbone"]["kernel"] + p["backbone"]["bias"])
      h = h + h @ p["adapter"]
      return jnp.mean((h @ p["head"] - microbatch["y"]) ** 2)

    tx = optax_gsam.sam(RHO, frozen=FROZEN, microbatches=2)
    updates, _ = tx.update(None, tx.init(params), params, loss_fn=micro_loss, batch=batch)
    whole = lambda t: micro_loss({"backbone": params["backbone"], **t}, batch)
    w = _trained(params)
    g_c = jax.grad(whole)(w)
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(g_c)))
    expected = jax.grad(whole)(jax.tree.map(lambda x, g: x + RHO * g / norm, w, g_c))
    _assert_close(_trained(updates), expected)


def test_a_frozen_leaf_costs_no_gradient_and_no_state():
  """The perturbed pass differentiates the trained leaves only: the frozen kernel's weight
  gradient (a 64 x 512 x 512 matmul) is not computed, and a reuse policy stores nothing
  for it."""
  n, d, r = 64, 512, 4
  params = {
    "kernel": jnp.ones((d, d)) / d,
    "lora_a": jnp.full((d, r), 0.01),
    "lora_b": jnp.full((r, d), 0.01),
  }
  x = jnp.linspace(-1.0, 1.0, n * d).reshape(n, d)
  loss = lambda p, x: jnp.mean(jnp.square(x @ p["kernel"] + (x @ p["lora_a"]) @ p["lora_b"]))
  grads = jax.grad(loss)(params, x)  # the caller's clean pass, outside the measured program
  frozen = {"kernel": True, "lora_a": False, "lora_b": False}

  def flops(frozen):
    tx = optax_gsam.sam(0.05, frozen=frozen, policy=optax_gsam.every_k_policy(2))
    state = tx.init(params)

    def step(grads, state, params, x):
      return tx.update(grads, state, params, loss_fn=lambda p: loss(p, x), perturb=True)

    compiled = jax.jit(step).lower(grads, state, params, x).compile()
    return compiled.cost_analysis()["flops"], state

  with_frozen, state = flops(frozen)
  without, _ = flops(None)
  assert without - with_frozen > 0.9 * 2 * n * d * d
  assert not jax.tree.leaves(state.stored_direction["kernel"])


@pytest.mark.parametrize(
  ("frozen", "match"),
  [
    (True, "bare bool"),
    ({"backbone": jnp.array(True), "adapter": False, "head": False}, "Python bools"),
  ],
)
def test_bad_frozen_is_refused_when_built(frozen, match):
  with pytest.raises(ValueError, match=match):
    optax_gsam.sam(RHO, frozen=frozen)
  with pytest.raises(ValueError, match=match):
    optax_gsam.momentum_sam(RHO, frozen=frozen)


def test_freezing_everything_or_masking_only_frozen_leaves_is_refused():
  params = _params(jnp.float32)
  everything = {"backbone": True, "adapter": True, "head": True}
  with pytest.raises(ValueError, match="nothing would be trained"):
    optax_gsam.sam(RHO, frozen=everything).init(params)
  tx = optax_gsam.sam(RHO, frozen=FROZEN, mask={"backbone": True, "adapter": False, "head": False})
  with pytest.raises(ValueError, match="Every leaf that mask selects is frozen"):
    tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
  with pytest.raises(ValueError, match="does not match params"):
    optax_gsam.sam(RHO, frozen={"backbone": True}).init(params)


def test_frozen_leaves_needs_a_set_to_zero_label():
  with pytest.raises(ValueError, match="nothing is frozen"):
    optax_gsam.frozen_leaves({"a": optax.sgd(0.1), "b": optax.adam(0.1)}, LABELS)


def test_sam_inside_one_group_of_a_partition_names_the_chain_form():
  params = _params(jnp.float32)
  inside = optax.partition(
    {"trained": optax.chain(optax_gsam.sam(RHO), optax.sgd(LR)), "frozen": optax.set_to_zero()},
    LABELS,
  )
  with pytest.raises(ValueError, match=r"inside one group of optax.partition.*frozen_leaves"):
    inside.update(jax.grad(loss_fn)(params), inside.init(params), params, loss_fn=loss_fn)


def test_full_step_due_reads_the_trained_leaves_as_update_does():
  """gradient_norm_policy decides on ||g_T||: with frozen=, full_step_due agrees with update,
  also at a step where only the frozen leaves' gradient spikes (which would otherwise decide)."""
  params = _params(jnp.float32)
  policy = optax_gsam.gradient_norm_policy(1.0, decay=0.5)
  tx = optax_gsam.sam(RHO, frozen=FROZEN, policy=policy)
  state = tx.init(params)
  answers = []
  for scale in [1.0, 1.0, 1.0, 1000.0]:  # the frozen leaves' gradient spikes at the last step
    grads = jax.grad(loss_fn)(params)
    grads = {**grads, "backbone": jax.tree.map(lambda g: scale * g, grads["backbone"])}  # noqa: B023
    due = optax_gsam.full_step_due(state, grads, policy=policy, rho=RHO, frozen=FROZEN)
    reading_all = optax_gsam.full_step_due(state, grads, policy=policy, rho=RHO)
    before = int(state.full_steps)
    _, state = tx.update(grads, state, params, loss_fn=loss_fn)
    assert bool(due) == (int(state.full_steps) == before + 1)
    answers.append((bool(due), bool(reading_all)))
  assert answers[-1] == (False, True)


def test_a_frozen_function_under_inject_hyperparams_needs_static_args():
  params = _params(jnp.float32)
  frozen = optax_gsam.frozen_leaves(TRANSFORMS, LABELS)
  static = optax.inject_hyperparams(optax_gsam.sam, static_args=("frozen",))(rho=RHO, frozen=frozen)
  grads = jax.grad(loss_fn)(params)
  got, _ = static.update(grads, static.init(params), params, loss_fn=loss_fn)
  plain = optax_gsam.sam(RHO, frozen=FROZEN)
  want, _ = plain.update(grads, plain.init(params), params, loss_fn=loss_fn)
  _assert_close(got, want)
  with pytest.raises(ValueError, match=r"static_args=\('frozen',\)"):
    optax.inject_hyperparams(optax_gsam.sam)(rho=RHO, frozen=frozen).init(params)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_sharded_lora_step_keeps_the_layout_and_the_unsharded_numbers(axis_type):
  """A kernel and an adapter sharded over a model axis, the batch over a data axis."""
  kind = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
  spec = {"kernel": P(None, "model"), "lora_a": P(), "lora_b": P(None, "model")}
  params = {
    "kernel": jnp.linspace(-0.2, 0.2, 8 * 16).reshape(8, 16),
    "lora_a": jnp.full((8, 2), 0.05),
    "lora_b": jnp.linspace(0.0, 0.1, 32).reshape(2, 16),
  }
  x = jnp.linspace(-1.0, 1.0, 64 * 8).reshape(64, 8)
  explicit = kind == jax.sharding.AxisType.Explicit

  def loss(p, x, out=None):  # out: the contraction's sharding, which explicit axes ask for
    h = jnp.matmul(x, p["kernel"], out_sharding=out)
    h = h + jnp.matmul(x @ p["lora_a"], p["lora_b"], out_sharding=out)
    return jnp.mean(jnp.square(jnp.tanh(h) - 0.3))

  labels = {"kernel": "frozen", "lora_a": "trained", "lora_b": "trained"}
  tx = optax.chain(
    optax_gsam.sam(RHO, frozen=optax_gsam.frozen_leaves(TRANSFORMS, labels)),
    optax.partition(TRANSFORMS, labels),
  )

  def step(p, s, x, out=None):
    grads = jax.grad(loss)(p, x, out)
    updates, s = tx.update(grads, s, p, loss_fn=lambda q: loss(q, x, out))
    return optax.apply_updates(p, updates), s

  with jax.set_mesh(mesh):
    sharded = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in params.items()}
    sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = P("data", "model") if explicit else None
    got, _ = jax.jit(lambda p, s, x: step(p, s, x, out))(sharded, tx.init(sharded), sharded_x)
    assert got["lora_b"].sharding.spec == spec["lora_b"]
  want, _ = jax.jit(step)(params, tx.init(params), x)
  for name in params:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(got["kernel"], params["kernel"])


def test_the_state_with_frozen_leaves_round_trips_through_orbax():
  """A frozen leaf's place in the state is an empty node: orbax refuses zero-size arrays."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params, frozen = _params(jnp.float32), FROZEN
  for transform in (
    optax_gsam.momentum_sam(RHO, frozen=frozen),
    optax_gsam.sam(RHO, frozen=frozen, policy=optax_gsam.every_k_policy(2)),
    optax_gsam.gsam(RHO, ALPHA, frozen=frozen, ascent=optax_gsam.friendly_ascent()),
  ):
    tx = optax.chain(transform, optax.adam(1e-3))
    _, state = tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
    directory = tempfile.mkdtemp() + "/state"
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(directory, state)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(directory, tx.init(params))
    jax.tree.map(np.testing.assert_array_equal, restored, state)


def test_the_forms_optax_takes_and_the_chains_around_the_transform():
  """A callable pytree of bools (an Equinox module) is a tree, not a function, as optax.masked
  reads it; the warning finds a freeze in an enclosing chain and a label mapped to a chain that
  ends in set_to_zero; a frozen leaf that is not a float is left alone."""
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda p: jnp.mean(jax.vmap(eqx.combine(p, static))(jnp.ones((4, 3))) ** 2)
  layer = lambda m: (m.layers[0].weight, m.layers[0].bias)
  frozen = eqx.tree_at(layer, jax.tree.map(lambda _: False, params), (True, True))
  grads = jax.grad(loss)(params)
  tx = optax.chain(optax_gsam.sam(RHO, frozen=frozen), optax.freeze(frozen), optax.sgd(LR))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # conftest.py's shared compilation cache: an entry another test process is writing.
    warnings.filterwarnings("ignore", "Error reading persistent compilation cache entry")
    updates, _ = tx.update(grads, tx.init(params), params, loss_fn=loss)
  assert not np.any(np.asarray(updates.layers[0].weight))
  for tx in (
    optax.chain(optax.chain(optax_gsam.sam(RHO), optax.sgd(LR)), optax.freeze(frozen)),
    optax.chain(optax_gsam.sam(RHO), optax.freeze(frozen), optax.sgd(LR)),
  ):
    with pytest.warns(UserWarning, match=r"layers\[0\]"):
      _traced_update(tx, grads, params, loss)
  chained_zero = {"trained": optax.sgd(LR), "frozen": optax.chain(optax.set_to_zero())}
  tx = optax.chain(optax_gsam.sam(RHO), optax.partition(chained_zero, LABELS))
  small = _params(jnp.float32)
  with pytest.warns(UserWarning, match="backbone"):
    _traced_update(tx, jax.grad(loss_fn)(small), small)
  assert optax_gsam.frozen_leaves(chained_zero, LABELS)(small)["backbone"]["kernel"]
  with_step = {"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)}
  tx = optax_gsam.sam(RHO, frozen={"w": False, "step": True})
  step_loss = lambda p: jnp.sum(jnp.sin(p["w"]))
  grads = jax.grad(step_loss, allow_int=True)(with_step)
  updates, _ = tx.update(grads, tx.init(with_step), with_step, loss_fn=step_loss)
  assert updates["step"].dtype == grads["step"].dtype and np.all(np.asarray(updates["w"]) != 0)


def test_errors_keep_naming_the_fix_with_frozen_leaves():
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  tx = optax_gsam.sam(RHO, microbatches=2, frozen={"a": False, "b": True})
  with pytest.raises(ValueError, match=r"calls loss_fn\(params, microbatch\)"):
    tx.update(
      None, tx.init(params), params, loss_fn=lambda p: jnp.sum(p["a"]), batch=jnp.ones((4, 2))
    )
  tx = optax.chain(optax_gsam.sam(RHO, frozen={"a": True, "b": False}), optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"jax.jit\(tx.init\)"):
    optax.tree_map_params(tx, lambda p, s: s, tx.init(params), params)


def test_linen_lora_adapters_step_as_sam_over_the_adapters_in_float64():
  """The fine-tuning page's model: LoRA adapters over frozen Dense kernels, in Linen."""
  nn = pytest.importorskip("flax.linen")
  from flax import traverse_util

  class LoRADense(nn.Module):
    features: int
    rank: int = 2

    @nn.compact
    def __call__(self, x):
      kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
      lora_a = self.param("lora_a", nn.initializers.normal(0.1), (x.shape[-1], self.rank))
      lora_b = self.param("lora_b", nn.initializers.normal(0.1), (self.rank, self.features))
      return x @ kernel + (x @ lora_a) @ lora_b

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return LoRADense(3)(jnp.tanh(LoRADense(8)(x)))

  def labels(params):
    return traverse_util.path_aware_map(
      lambda path, _: "trained" if path[-1].startswith("lora") else "frozen", params
    )

  with jax.enable_x64(True):
    x = jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float64).reshape(6, 4)
    y = jnp.cos(jnp.arange(18.0)).reshape(6, 3)
    model = Model()
    params = model.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: p.astype(jnp.float64), params)
    loss = lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
    tx = optax.chain(
      optax_gsam.sam(RHO, frozen=optax_gsam.frozen_leaves(TRANSFORMS, labels)),
      optax.partition(TRANSFORMS, labels),
    )
    updates, _ = tx.update(jax.grad(loss)(params), tx.init(params), params, loss_fn=loss)
    flat = traverse_util.flatten_dict(params)
    adapters = {k: v for k, v in flat.items() if k[-1].startswith("lora")}
    of_adapters = lambda a: loss(traverse_util.unflatten_dict({**flat, **a}))
    g = jax.grad(of_adapters)(adapters)
    norm = jnp.sqrt(sum(jnp.sum(v**2) for v in g.values()))
    g_p = jax.grad(of_adapters)({k: v + RHO * g[k] / (norm + 1e-12) for k, v in adapters.items()})
    moved = traverse_util.flatten_dict(updates)
    for key, value in moved.items():
      want = -LR * g_p[key] if key in adapters else jnp.zeros_like(value)
      np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-15)


ZERO_STAGES = {
  "scale(0.0)": lambda: optax.scale(0.0),
  "sgd(0.0)": lambda: optax.sgd(0.0),
  "adamw(0.0)": lambda: optax.adamw(0.0, weight_decay=1e-2),
  "chain ending in scale(0)": lambda: optax.chain(optax.clip(1.0), optax.scale(np.float32(0.0))),
  "scale(array zero)": lambda: optax.scale(jnp.zeros(())),
}


@pytest.mark.parametrize("zero", ZERO_STAGES)
@pytest.mark.parametrize("alpha", [0.0, ALPHA], ids=["sam", "gsam"])
def test_a_label_sent_to_exactly_zero_is_frozen_as_set_to_zero_is(zero, alpha):
  """optax.scale(0.0) and a learning rate of 0.0 freeze as set_to_zero() does: frozen_leaves reads
  them (the trained leaves step as the float64 reference), and without frozen= a warning names
  the leaves and the fix."""
  transforms = {"trained": optax.sgd(LR), "frozen": ZERO_STAGES[zero]()}
  with jax.enable_x64(True):
    params = _params()
    frozen = optax_gsam.frozen_leaves(transforms, LABELS)
    tx = optax.chain(
      optax_gsam.gsam(RHO, alpha, frozen=frozen), optax.partition(transforms, LABELS)
    )
    updates, _ = tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)
    expected = jax.tree.map(lambda g: -LR * g, _reference(params, alpha))
    _assert_close(_trained(updates), _trained(expected))
    assert not np.any(np.asarray(updates["backbone"]["kernel"]))
  small = _params(jnp.float32)
  plain = optax.chain(optax_gsam.gsam(RHO, alpha), optax.partition(transforms, LABELS))
  with pytest.warns(UserWarning, match=r"freezes.*'backbone'.*frozen_leaves"):
    _traced_update(plain, jax.grad(loss_fn)(small), small)


def test_a_nonzero_or_scheduled_scale_is_not_read_as_frozen():
  """Only a step size known to be zero freezes: a schedule may leave zero later."""
  for stage in (optax.scale(1e-3), optax.sgd(optax.constant_schedule(0.0))):
    with pytest.raises(ValueError, match="nothing is frozen"):
      optax_gsam.frozen_leaves({"trained": optax.sgd(LR), "frozen": stage}, LABELS)


def test_frozen_errors_name_inject_hyperparams_only_inside_it():
  params = _params(jnp.float32)
  for bad in ({"backbone": True}, {"backbone": jnp.array(True), "adapter": False, "head": False}):
    with pytest.raises(ValueError, match="frozen") as error:
      optax_gsam.sam(RHO, frozen=bad).init(params)
    assert "inject_hyperparams" not in str(error.value)
  with pytest.raises(ValueError, match="bare bool") as error:
    optax_gsam.sam(RHO, frozen=True)
  assert "inject_hyperparams" not in str(error.value)


@pytest.mark.parametrize(
  "labels", [LABELS, lambda params: LABELS], ids=["label tree", "label function"]
)
def test_labels_given_as_frozen_point_to_frozen_leaves(labels):
  params = _params(jnp.float32)
  fix = r"frozen=optax_gsam.frozen_leaves\(transforms, param_labels\)"
  with pytest.raises(ValueError, match=r"got labels \('\w+', \.\.\.\).*" + fix):
    optax_gsam.sam(RHO, frozen=labels).init(params)
