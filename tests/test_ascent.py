"""The ascent stage: every direction, the mask and n ascent steps against float64 references.

The references are written from the papers' formulas in numpy float64, with the
problem's hand-written gradient; nothing in them goes through the package. A
direction is one entry of ``DIRECTIONS`` (tests/_ascent_reference.py); the table
below checks each one with gsam and sam, masks, n ascent steps, micro-batches of
both semantics and 8 devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ascent_reference import ALPHA
from _ascent_reference import DIRECTIONS
from _ascent_reference import LR
from _ascent_reference import METHODS
from _ascent_reference import NUM_DEVICES
from _ascent_reference import RHO
from _ascent_reference import THETA
from _ascent_reference import flat
from _ascent_reference import loss_jax
from _ascent_reference import make_data
from _ascent_reference import reference_run

import optax_gsam


def run_gsam(params, x, t, num_steps=3, **kwargs):
  tx = optax.chain(optax_gsam.gsam(RHO, ALPHA, **kwargs), optax.sgd(LR))
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x), jnp.asarray(t))
  p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
  for _ in range(num_steps):
    updates, state = tx.update(jax.grad(loss_fn)(p), state, p, loss_fn=loss_fn)
    p = optax.apply_updates(p, updates)
  return p, state


# Every direction of the table is checked in every layout, with gsam and sam, masks and n
# ascent steps, but not in their full product: on one device (eager, cheap) with both methods at
# 1 and 3 ascent steps; in each compiled layout once, with 2 ascent steps, the method and the
# kind of mask rotating over the directions so that each layout meets both methods and both
# masks. The 8 devices perturb each of their micro-batches along its own gradient, which checks
# per-device and per-micro-batch perturbation in one compiled program.
K = 4  # micro-batches
LAYOUTS = {
  "one-device": dict(),
  "microbatches": dict(microbatches=K),  # whole-batch semantics: the reference's one replica
  "8-devices-per-microbatch": dict(axis_name="data", microbatches=2, perturb_each_microbatch=True),
}
REPLICAS = {"one-device": 1, "microbatches": 1, "8-devices-per-microbatch": 2 * NUM_DEVICES}
MASKS = {  # the mask given to the transform, by kind; the reference's is MASK_VECTOR
  "none": None,
  "pytree": {"b": False, "w": True},
  "function": lambda p: {"b": False, "w": True},
}
MASK_VECTOR = np.concatenate([np.zeros(3), np.ones(15)])  # "b" left out


def _cases():
  methods, masks = list(METHODS), list(MASKS)
  for j, name in enumerate(DIRECTIONS):
    for i, method in enumerate(methods):
      for steps in (1, 3):
        yield name, method, "one-device", steps, masks[(i + j + steps) % 3]
    for i, layout in enumerate(list(LAYOUTS)[1:]):
      yield name, methods[(i + j) % 2], layout, 2, masks[1 + (i + j) % 2]


CASES = list(_cases())


def run_layout(tx, layout, params, x, t, num_steps=3):
  """``num_steps`` steps of ``tx`` in the layout: the caller's g_c, or the micro-batches' own."""
  batch = (jnp.asarray(x), jnp.asarray(t))

  def step(p, opt_state, batch):
    loss_fn = lambda q, b=batch: loss_jax(q, *b)
    if "microbatches" in LAYOUTS[layout]:
      updates, opt_state = tx.update(
        None, opt_state, p, loss_fn=lambda q, b: loss_jax(q, *b), batch=batch
      )
    else:
      updates, opt_state = tx.update(jax.grad(loss_fn)(p), opt_state, p, loss_fn=loss_fn)
    return optax.apply_updates(p, updates), opt_state

  if layout.startswith("8-devices"):
    step = optax_gsam.data_parallel(step, jax.make_mesh((NUM_DEVICES,), ("data",)))
  elif layout != "one-device":
    step = jax.jit(step)
  p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
  for _ in range(num_steps):
    p, state = step(p, state, batch)
  return p, state


@pytest.mark.parametrize("name, method, layout, steps, mask", CASES)
def test_every_direction_matches_its_float64_reference(name, method, layout, steps, mask):
  direction, kwargs = DIRECTIONS[name]
  kwargs = dict(kwargs, ascent_steps=steps, mask=MASKS[mask], **LAYOUTS[layout])
  if method == "gsam":
    transform = optax_gsam.gsam(RHO, ALPHA, **kwargs)
  else:
    transform = optax_gsam.sam(RHO, **kwargs)
  tx = optax.chain(transform, optax.sgd(LR))
  with jax.enable_x64(True):
    params, x, t = make_data(1)
    p, state = run_layout(tx, layout, params, x, t)
    expected = reference_run(
      params,
      x,
      t,
      direction,
      steps,
      mask=None if mask == "none" else MASK_VECTOR,
      shards=REPLICAS[layout],
      alpha=METHODS[method],
    )
    np.testing.assert_allclose(flat(p), expected, rtol=1e-10)
    accumulated = 1 if "microbatches" in LAYOUTS[layout] else 0  # the clean pass, by the transform
    assert np.all(np.asarray(state[0].gradient_evaluations) == 3 * (steps + accumulated))


def test_the_table_meets_every_layout_method_and_mask():
  """The design above, checked: a direction added to the table gets all of them."""
  for name in DIRECTIONS:
    rows = [case for case in CASES if case[0] == name]
    assert {case[2] for case in rows} == set(LAYOUTS)
    assert {case[1] for case in rows if case[2] == "one-device"} == set(METHODS)
    assert {case[3] for case in rows} == {1, 2, 3}
    assert {case[4] for case in rows} == set(MASKS)
  for layout in LAYOUTS:
    assert {case[1] for case in CASES if case[2] == layout} == set(METHODS)
    assert len({case[4] for case in CASES if case[2] == layout}) >= 2


@pytest.mark.parametrize("mask", [None, {"b": True, "w": False}])
def test_rho_zero_equals_the_plain_optimizer(mask):
  params, x, t = make_data(4)
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
  plain, sharp = (
    optax.adam(1e-2),
    optax.chain(optax_gsam.gsam(0.0, ALPHA, mask=mask), optax.adam(1e-2)),
  )
  p_plain, p_sharp = params, params
  s_plain, s_sharp = plain.init(params), sharp.init(params)
  for _ in range(3):
    grads = jax.grad(loss_fn)(p_sharp)
    u_plain, s_plain = plain.update(grads, s_plain, p_plain)
    u_sharp, s_sharp = sharp.update(grads, s_sharp, p_sharp, loss_fn=loss_fn)
    jax.tree.map(np.testing.assert_array_equal, u_sharp, u_plain)
    p_plain, p_sharp = optax.apply_updates(p_plain, u_plain), optax.apply_updates(p_sharp, u_sharp)


def test_direction_state_is_kept_on_cheap_and_non_finite_steps():
  params, x, t = make_data(5)
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
  tx = optax_gsam.sam(
    RHO, ascent=optax_gsam.vasso_ascent(THETA), policy=optax_gsam.every_k_policy(2)
  )
  state = tx.init(params)
  grads = jax.grad(loss_fn)(params)
  _, full = tx.update(grads, state, params, loss_fn=loss_fn)  # count 0: full
  assert not np.allclose(full.ascent_state.smoothed_gradient["w"], 0.0)
  _, cheap = tx.update(grads, full, params, loss_fn=loss_fn)  # count 1: cheap
  jax.tree.map(np.testing.assert_array_equal, cheap.ascent_state, full.ascent_state)
  nan_grads = jax.tree.map(lambda g: g * jnp.nan, grads)
  _, bad = tx.update(nan_grads, cheap, params, loss_fn=loss_fn)  # count 2: full, not finite
  jax.tree.map(np.testing.assert_array_equal, bad.ascent_state, full.ascent_state)


def test_a_new_direction_is_an_optax_transformation():
  """Adam-preconditioned ascent (any optax chain that ends in a normalization)."""
  params, x, t = make_data(6)
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  ascent = optax.chain(optax.scale_by_adam(), optax_gsam.normalized_ascent())
  p, state = run_gsam(params, x, t, ascent=ascent)
  assert int(state[0].ascent_state[0].count) == 3
  assert np.all(np.isfinite(flat(p)))


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(ascent="sam"), "ascent must be an optax.GradientTransformation"),
    (dict(ascent_steps=0), "ascent_steps"),
    (dict(mask={"w": jnp.asarray(True)}), "mask must be a pytree of Python bools"),
    (dict(mask={"b": False, "w": False}), "mask selects no leaf"),
    (dict(mask=True), r"bare bool True.*mask=None"),
  ],
)
def test_bad_ascent_arguments_are_refused_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    optax_gsam.gsam(RHO, **kwargs)


@pytest.mark.parametrize(
  "factory, match",
  [
    (lambda: optax_gsam.friendly_ascent(sigma=-1.0), "sigma"),
    (lambda: optax_gsam.friendly_ascent(decay=1.0), "decay"),
    (lambda: optax_gsam.vasso_ascent(theta=0.0), "theta"),
    (lambda: optax_gsam.vasso_ascent(theta=1.5), "theta"),
    (lambda: optax_gsam.adaptive_ascent("sam"), "kind"),
  ],
)
def test_bad_direction_arguments_are_refused(factory, match):
  with pytest.raises(ValueError, match=match):
    factory()


def test_mask_that_does_not_match_params_is_named():
  params, x, t = make_data(7)
  with pytest.raises(ValueError, match="mask does not match params"):
    run_gsam(params, x, t, num_steps=1, mask={"w": True, "c": False})


def test_optax_masked_around_sam_names_the_mask_argument():
  params, x, t = make_data(8)
  tx = optax.chain(optax.masked(optax_gsam.sam(RHO), {"b": False, "w": True}), optax.sgd(LR))
  loss_fn = functools.partial(loss_jax, x=jnp.asarray(x), t=jnp.asarray(t))
  with pytest.raises(ValueError, match=r"optax.masked.*mask=mask"):
    tx.update(jax.grad(loss_fn)(params), tx.init(params), params, loss_fn=loss_fn)


def test_an_injected_eps_reaches_the_direction():
  params, x, t = make_data(9)
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  loss_fn = lambda p: loss_jax(p, jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
  grads = jax.grad(loss_fn)(params)
  plain = optax_gsam.gsam(RHO, ALPHA, eps=10.0)
  injected = optax.inject_hyperparams(optax_gsam.gsam)(rho=RHO, alpha=ALPHA, eps=10.0)
  expected, _ = plain.update(grads, plain.init(params), params, loss_fn=loss_fn)
  got, _ = injected.update(grads, injected.init(params), params, loss_fn=loss_fn)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


def test_a_stateful_direction_advances_once_per_step_from_the_clean_gradient():
  """With n ascent steps the state used to advance n times, from the intermediate gradients."""
  with jax.enable_x64(True):
    params, x, t = make_data(10)
    loss_fn = lambda p: loss_jax(p, jnp.asarray(x), jnp.asarray(t))
    grads = jax.grad(loss_fn)(params)
    friendly = optax_gsam.sam(RHO, ascent=optax_gsam.friendly_ascent(1.0, 0.9), ascent_steps=2)
    _, state = friendly.update(grads, friendly.init(params), params, loss_fn=loss_fn)
    expected = jax.tree.map(lambda g: 0.1 * np.asarray(g), grads)  # m_1 = (1 - 0.9) g_c
    jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-14),
      state.ascent_state.gradient_average,
      expected,
    )
    adam = optax_gsam.sam(
      RHO,
      ascent=optax.chain(optax.scale_by_adam(), optax_gsam.normalized_ascent()),
      ascent_steps=3,
    )
    _, state = adam.update(grads, adam.init(params), params, loss_fn=loss_fn)
    assert int(state.ascent_state[0].count) == 1


NOT_B = lambda q: jax.tree_util.tree_map_with_path(  # a mask by path, as users write them
  lambda path, _: "'b'" not in jax.tree_util.keystr(path), q
)


def test_a_mask_function_under_inject_hyperparams_is_refused_unless_static():
  """inject_hyperparams used to call it with the step count: mask=True, every leaf perturbed."""
  params, x, t = make_data(11)
  for factory in (optax_gsam.sam, optax_gsam.momentum_sam):
    with pytest.raises(ValueError, match=r"static_args=\('mask',\)"):
      optax.inject_hyperparams(factory)(rho=RHO, mask=NOT_B).init(params)
  direction, _ = DIRECTIONS["sam"]
  with jax.enable_x64(True):
    loss_fn = lambda p: loss_jax(p, jnp.asarray(x), jnp.asarray(t))
    injected = optax.inject_hyperparams(optax_gsam.gsam, static_args=("mask",))
    tx = optax.chain(injected(rho=RHO, alpha=ALPHA, mask=NOT_B), optax.sgd(LR))
    p, state = jax.tree.map(jnp.asarray, params), tx.init(params)
    for _ in range(3):
      updates, state = tx.update(jax.grad(loss_fn)(p), state, p, loss_fn=loss_fn)
      p = optax.apply_updates(p, updates)
    mask_vec = np.concatenate([np.zeros(3), np.ones(15)])  # "b" left out
    expected = reference_run(params, x, t, direction, mask=mask_vec)
    np.testing.assert_allclose(flat(p), expected, rtol=1e-11)


# The adversarial optimizer of optax.contrib.sam, at radius 1: an optimizer outputs -a.
PORTED = optax.chain(optax.contrib.normalize(), optax.sgd(1.0))


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax_gsam.sam(RHO, ascent=PORTED),
    lambda: optax.inject_hyperparams(optax_gsam.gsam)(rho=RHO, alpha=ALPHA, ascent=PORTED),
    lambda: optax.chain(optax_gsam.sam(RHO, ascent=optax.chain(optax.scale_by_adam(), PORTED))),
  ],
  ids=["sam", "inject_hyperparams", "adam-preconditioned"],
)
@pytest.mark.parametrize("jit", [False, True])
def test_an_optimizer_as_the_direction_is_refused_at_init_with_the_negation(make, jit):
  """It used to perturb downhill: a negative surrogate gap (-0.0508 where SAM gives +0.0511)."""
  params, _, _ = make_data(12)
  tx = make()
  init = jax.jit(tx.init) if jit else tx.init
  with pytest.raises(ValueError, match=r"descent direction.*optax.scale\(-1.0\)"):
    init(params)


def test_the_negated_optimizer_is_the_default_direction():
  with jax.enable_x64(True):
    params, x, t = make_data(13)
    ported, _ = run_gsam(params, x, t, ascent=optax.chain(PORTED, optax.scale(-1.0)))
    direction, _ = DIRECTIONS["sam"]
    np.testing.assert_allclose(flat(ported), reference_run(params, x, t, direction), rtol=1e-11)


def test_optax_masked_as_the_direction_is_refused_naming_mask():
  """Outside its mask optax.masked passed the raw gradient on: b moved by rho * g_b."""
  params, x, t = make_data(14)
  keep_w = {"b": False, "w": True}
  masked = optax.masked(optax_gsam.normalized_ascent(), keep_w)
  with pytest.raises(ValueError, match=r"params\['b'\] through unchanged.*mask=mask"):
    optax_gsam.sam(RHO, ascent=masked).init(params)
  with jax.enable_x64(True):  # with the transform's own mask, the same direction is right
    p, _ = run_gsam(params, x, t, ascent=masked, mask=keep_w)
    mask_vec = np.concatenate([np.zeros(3), np.ones(15)])
    expected = reference_run(params, x, t, DIRECTIONS["sam"][0], mask=mask_vec)
    np.testing.assert_allclose(flat(p), expected, rtol=1e-11)


def _per_leaf_unit():
  """A legitimate direction of the user's own: each leaf normalized on its own, bfloat16-safe."""

  def update_fn(grads, state, params=None):
    return jax.tree.map(lambda g: g / jnp.linalg.norm(g.astype(jnp.float32)), grads), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _synchronized_unit():
  """A direction averaged over a data axis: it cannot run on the probe, so it is not checked."""

  def update_fn(grads, state, params=None):
    grads = jax.lax.pmean(grads, "data")
    return jax.tree.map(lambda g: g / optax.tree.norm(grads), grads), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _random_unit(seed):
  """Random weight perturbation: the direction does not depend on the gradient at all."""

  def update_fn(grads, key, params=None):
    key, *keys = jax.random.split(key, 1 + len(jax.tree.leaves(grads)))
    leaves, treedef = jax.tree.flatten(grads)
    noise = [jax.random.normal(k, g.shape, jnp.float32) for k, g in zip(keys, leaves, strict=True)]
    noise = jax.tree.unflatten(treedef, noise)
    return jax.tree.map(lambda n: n / optax.tree.norm(noise), noise), key

  return optax.GradientTransformation(lambda params: jax.random.key(seed), update_fn)


@pytest.mark.parametrize(
  "ascent",
  [
    _per_leaf_unit(),
    _synchronized_unit(),
    _random_unit(0),  # <a, g> < 0 on the probe for both: a(-g) shows that they do not descend
    _random_unit(1),
    optax.chain(optax.scale_by_adam(), optax_gsam.normalized_ascent()),
    optax.chain(optax.masked(optax.scale(3.0), {"b": False, "w": True}), _per_leaf_unit()),
    optax_gsam.friendly_ascent(sigma=20.0, decay=0.9),  # the package's own: never probed
  ],
  ids=[
    "per-leaf",
    "needs-an-axis",
    "random-0",
    "random-1",
    "adam",
    "masked-preconditioner",
    "friendly",
  ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_directions_of_radius_one_are_accepted(ascent, dtype):
  params, _, _ = make_data(15)
  params = jax.tree.map(lambda v: jnp.asarray(v, dtype), params)
  optax_gsam.sam(RHO, ascent=ascent).init(params)
