"""Haiku train steps with GSAM, written the way Haiku users write them (docs/haiku.md).

A user's checks: the step trains, at a tiny rho with SGD it is the plain step to O(rho) (rho = 0
would not exercise the perturbed pass: there the transform outputs the clean gradient), both
passes draw the
same `hk.next_rng_key()`, BatchNorm's state comes from the clean pass only, and loss scaling is
undone in the perturbed pass too. Each check has the wrong variant beside it that it catches.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam

LR = 0.1
SGD = optax.sgd(LR)
RHO_TINY = 1e-5
GSAM_TINY_SGD = optax.chain(optax_gsam.gsam(RHO_TINY, 0.3), optax.sgd(LR))
GSAM_SGD = optax.chain(optax_gsam.gsam(0.2, 0.3), optax.sgd(LR))
SCALE = 2.0**10


def forward(x, is_training):
  h = hk.Linear(8)(x)
  h = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.5)(h, is_training)
  h = jax.nn.relu(h)
  if is_training:
    h = hk.dropout(hk.next_rng_key(), 0.5, h)
  return hk.Linear(1)(h)


NET = hk.transform_with_state(forward)
DROPOUT_NET = hk.transform(lambda x, is_training: hk.Linear(1)(
  hk.dropout(hk.next_rng_key(), 0.5, jax.nn.relu(hk.Linear(8)(x))) if is_training else x
))  # fmt: skip


def data(n=16, d=4):
  x = jax.random.normal(jax.random.key(0), (n, d))
  return x, jnp.sin(x.sum(axis=1, keepdims=True))


def loss(params, state, rng, x, y):
  pred, new_state = NET.apply(params, state, rng, x, is_training=True)
  return jnp.mean((pred - y) ** 2), new_state


@functools.cache
def make_step(tx):
  @jax.jit
  def step(params, state, opt_state, rng, perturbed_rng, x, y):
    (loss_value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(
      params, state, rng, x, y
    )
    updates, opt_state = tx.update(
      grads,
      opt_state,
      params,
      loss_fn=lambda p: loss(p, state, perturbed_rng, x, y),  # the clean pass's rng, or not
      value=loss_value,
    )
    return optax.apply_updates(params, updates), new_state, opt_state, loss_value

  return step


def run(tx, variant="right", steps=2, fixed_rng=False):
  x, y = data()
  params, state = NET.init(jax.random.key(1), x, is_training=True)
  opt_state = tx.init(params)
  losses = []
  for i in range(steps):
    rng = jax.random.key(50 + (0 if fixed_rng else i))
    perturbed_rng = jax.random.fold_in(rng, 1) if variant == "fresh_rng" else rng
    params, state, opt_state, loss_value = make_step(tx)(
      params, state, opt_state, rng, perturbed_rng, x, y
    )
    losses.append(float(loss_value))
  return params, state, opt_state, losses


def max_diff(a, b):
  return max(jax.tree.leaves(jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), a, b)))


def floats(state):
  return [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.inexact)]


def test_transform_with_state_tiny_rho_is_the_plain_step_and_catches_the_mistakes():
  plain = run(SGD)
  right = run(GSAM_TINY_SGD)
  assert max_diff(right[0], plain[0]) < 1e-5
  assert max_diff(floats(right[1]), floats(plain[1])) < 1e-4  # step 2 runs at O(rho)-apart params
  assert float(optax.tree.get(right[2], "cosine")) > 0.9999
  # Another dropout key in the perturbed pass: the step is no longer the plain step.
  assert max_diff(run(GSAM_TINY_SGD, "fresh_rng")[0], plain[0]) > 1e-3


def test_step_trains_and_the_state_comes_from_the_clean_pass():
  _, _, opt_state, losses = run(GSAM_SGD, steps=6, fixed_rng=True)
  assert losses[-1] < losses[0]
  assert float(optax.tree.get(opt_state, "perturbed_loss")) > 0
  x, y = data()
  params, state0 = NET.init(jax.random.key(1), x, is_training=True)
  rng = jax.random.key(50)
  _, one_state, _, _ = make_step(GSAM_SGD)(params, state0, GSAM_SGD.init(params), rng, rng, x, y)

  @jax.jit
  def clean_and_perturbed_states(params):
    grads = jax.grad(lambda p: loss(p, state0, rng, x, y)[0])(params)
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
    perturbed = jax.tree.map(lambda w, g: w + 0.2 * g / norm, params, grads)
    return loss(params, state0, rng, x, y)[1], loss(perturbed, state0, rng, x, y)[1]

  clean_state, perturbed_state = clean_and_perturbed_states(params)
  assert max_diff(floats(one_state), floats(clean_state)) < 1e-6
  assert max_diff(floats(clean_state), floats(perturbed_state)) > 1e-3


def test_hk_transform_dropout_draws_the_same_rng_key_in_both_passes():
  x, y = data()
  params = DROPOUT_NET.init(jax.random.key(2), x, is_training=True)

  def dropout_loss(p, rng):
    return jnp.mean((DROPOUT_NET.apply(p, rng, x, is_training=True) - y) ** 2)

  def step(tx, same_rng):
    @jax.jit
    def one(params, rng):
      loss_value, grads = jax.value_and_grad(dropout_loss)(params, rng)
      p_rng = rng if same_rng else jax.random.fold_in(rng, 1)
      updates, _ = tx.update(
        grads, tx.init(params), params, loss_fn=lambda p: dropout_loss(p, p_rng), value=loss_value
      )
      return optax.apply_updates(params, updates)

    return one(params, jax.random.key(3))

  plain = step(SGD, True)
  assert max_diff(step(GSAM_TINY_SGD, True), plain) < 1e-5
  assert max_diff(step(GSAM_TINY_SGD, False), plain) > 1e-3


# --- pmap --------------------------------------------------------------------------------------


def pmean_floats(tree, axis_name):
  is_float = lambda s: jnp.issubdtype(s.dtype, jnp.inexact)
  return jax.tree.map(lambda s: jax.lax.pmean(s, axis_name) if is_float(s) else s, tree)


@functools.cache
def pmap_step(tx, average_grads):
  @functools.partial(jax.pmap, axis_name="i")
  def step(params, state, opt_state, rng, x, y):
    rng = jax.random.fold_in(rng, jax.lax.axis_index("i"))
    (loss_value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(
      params, state, rng, x, y
    )
    if average_grads:
      grads = jax.lax.pmean(grads, "i")
    updates, opt_state = tx.update(
      grads, opt_state, params, loss_fn=lambda p: loss(p, state, rng, x, y), value=loss_value
    )
    return optax.apply_updates(params, updates), pmean_floats(new_state, "i"), opt_state

  return step


def test_pmap_step_at_tiny_rho_is_the_plain_pmap_step_and_replicas_agree():
  n = 2
  x, y = data(n=16)
  params, state = NET.init(jax.random.key(4), x, is_training=True)
  replicate = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), tree)
  shard = lambda a: a.reshape(n, -1, *a.shape[1:])
  rngs = replicate(jax.random.key_data(jax.random.key(5)))
  results = {}
  for name, tx, average in [
    ("plain", SGD, True),
    ("gsam", optax.chain(optax_gsam.gsam(RHO_TINY, 0.3, axis_name="i"), optax.sgd(LR)), False),
  ]:
    p, s, o = replicate(params), replicate(state), replicate(tx.init(params))
    for _ in range(2):
      p, s, o = pmap_step(tx, average)(p, s, o, jax.random.wrap_key_data(rngs), shard(x), shard(y))
    results[name] = (p, s)
  assert max_diff(results["gsam"][0], results["plain"][0]) < 1e-5
  assert max_diff(floats(results["gsam"][1]), floats(results["plain"][1])) < 1e-6
  assert all(bool(jnp.all(w == w[0])) for w in jax.tree.leaves(results["gsam"][0]))


# --- loss scaling --------------------------------------------------------------------------------


def test_loss_scaling_recipe_unscales_the_perturbed_pass():
  x, y = data()
  params, state = NET.init(jax.random.key(6), x, is_training=True)
  rng = jax.random.key(7)
  tx = optax_gsam.gsam(0.2, 0.3)

  def scaled_loss(p):
    loss_value, new_state = loss(p, state, rng, x, y)
    return loss_value * SCALE, (loss_value, new_state)

  def scaled_value_and_grad(p):
    (_, (loss_value, new_state)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(p)
    return (loss_value, new_state), jax.tree.map(lambda g: g / SCALE, grads)

  @jax.jit
  def outputs(params):
    (loss_value, _), grads = scaled_value_and_grad(params)
    opt_state = tx.init(params)
    recipe = tx.update(
      grads, opt_state, params, value_and_grad_fn=scaled_value_and_grad, value=loss_value
    )
    wrong = tx.update(grads, opt_state, params, loss_fn=scaled_loss, value=loss_value)
    unscaled = tx.update(
      grads, opt_state, params, loss_fn=lambda p: loss(p, state, rng, x, y), value=loss_value
    )
    return recipe, wrong, unscaled, loss_value

  recipe, wrong, unscaled, clean_loss = outputs(params)
  # A power-of-two scale is exact: the recipe is GSAM on the unscaled loss.
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), recipe[0], unscaled[0]
  )
  assert float(recipe[1].perturbed_loss) == float(unscaled[1].perturbed_loss)
  # The scaled loss as loss_fn: a perturbed loss and gradient SCALE times too large.
  ratio = float(wrong[1].perturbed_loss) / float(unscaled[1].perturbed_loss)
  assert ratio == np.float32(SCALE)
  assert float(wrong[1].perturbed_grad_norm) > 100 * float(unscaled[1].perturbed_grad_norm)
  assert float(clean_loss) > 0
