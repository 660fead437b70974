"""The deprecated keywords of gsam and sam: each warns once, naming its replacement, and gives
bitwise the result of the replacement."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ascent_reference import ALPHA
from _ascent_reference import LR
from _ascent_reference import RHO
from _ascent_reference import loss_jax
from _ascent_reference import make_data

import optax_gsam

# (deprecated keywords, the keywords that replace them, what the warning names)
ALIASES = {
  "adaptive": (
    dict(adaptive="asam"),
    dict(ascent=optax_gsam.adaptive_ascent("asam")),
    r"adaptive=.*ascent=optax_gsam.adaptive_ascent\(kind\)",
  ),
  "adaptive-with-eps": (
    dict(adaptive="gsam", eps=1e-3),
    dict(ascent=optax_gsam.adaptive_ascent("gsam", eps=1e-3), eps=1e-3),
    r"adaptive=.*ascent=optax_gsam.adaptive_ascent\(kind\)",
  ),
  "perturb_every": (
    dict(perturb_every=2),
    dict(policy=optax_gsam.every_k_policy(2)),
    r"perturb_every=.*policy=optax_gsam.every_k_policy\(k, reuse_weight=w\)",
  ),
  "perturb_every-1": (dict(perturb_every=1), dict(), r"perturb_every="),
  "reuse_weight": (
    dict(perturb_every=3, reuse_weight=0.3),
    dict(policy=optax_gsam.every_k_policy(3, reuse_weight=0.3)),
    r"perturb_every=.*reuse_weight=.*policy=optax_gsam.every_k_policy",
  ),
  "num_groups": (
    dict(num_groups=2),
    dict(microbatches=2, perturb_each_microbatch=True),
    r"num_groups=.*microbatches=G, perturb_each_microbatch=True",
  ),
}
FACTORIES = {
  "gsam": lambda **kw: optax_gsam.gsam(RHO, ALPHA, **kw),
  "sam": lambda **kw: optax_gsam.sam(RHO, **kw),
}


def run(tx, microbatched, num_steps=3):
  """``num_steps`` jitted SGD steps; the transform splits the batch itself where micro-batched."""
  params, x, t = make_data(21)
  params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), params)
  batch = (jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
  loss = lambda p, b: loss_jax(p, *b)
  tx = optax.chain(tx, optax.sgd(LR))

  @jax.jit
  def step(p, state):
    if microbatched:
      updates, state = tx.update(None, state, p, loss_fn=loss, batch=batch)
    else:
      loss_fn = lambda q: loss(q, batch)
      updates, state = tx.update(jax.grad(loss_fn)(p), state, p, loss_fn=loss_fn)
    return optax.apply_updates(p, updates), state

  state = tx.init(params)
  for _ in range(num_steps):
    params, state = step(params, state)
  return params, state


@pytest.mark.parametrize(
  "alias, factory",
  [
    ("adaptive", "gsam"),
    ("adaptive-with-eps", "sam"),
    ("perturb_every", "sam"),
    ("perturb_every-1", "gsam"),
    ("reuse_weight", "gsam"),
    ("num_groups", "sam"),
  ],
)
def test_an_alias_warns_once_and_equals_its_replacement_bitwise(alias, factory):
  old, new, match = ALIASES[alias]
  make = FACTORIES[factory]
  with pytest.warns(DeprecationWarning, match=match) as record:
    deprecated = make(**old)
  assert len(record) == 1
  assert record[0].filename == __file__  # it points at the caller's line
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the replacement does not warn
    replacement = make(**new)
  microbatched = "microbatches" in new
  got, expected = run(deprecated, microbatched), run(replacement, microbatched)
  jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_every_alias_is_tested_with_both_factories():
  cases = test_an_alias_warns_once_and_equals_its_replacement_bitwise.pytestmark[0].args[1]
  assert {alias for alias, _ in cases} == set(ALIASES)
  assert {factory for _, factory in cases} == set(FACTORIES)


def test_reuse_weight_stays_injectable_through_the_alias():
  """inject_hyperparams injects reuse_weight as it did; the policy's weight is its equal."""
  injected = optax.inject_hyperparams(optax_gsam.gsam, static_args=("perturb_every",))
  with pytest.warns(DeprecationWarning, match="perturb_every=.*reuse_weight="):
    tx = injected(rho=RHO, alpha=ALPHA, perturb_every=3, reuse_weight=0.3)
    got, state = run(tx, microbatched=False)
  assert float(state[0].hyperparams["reuse_weight"]) == pytest.approx(0.3)
  policy = optax_gsam.every_k_policy(3, reuse_weight=0.3)
  replacement = optax.inject_hyperparams(optax_gsam.gsam)(rho=RHO, alpha=ALPHA, policy=policy)
  expected, _ = run(replacement, microbatched=False)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(ascent=optax_gsam.normalized_ascent(), adaptive="gsam"), "adaptive and ascent"),
    (dict(policy=optax_gsam.every_k_policy(2), perturb_every=2), "either policy= or"),
    (dict(microbatches=2, num_groups=2), "num_groups=G is microbatches=G"),
  ],
)
def test_an_alias_with_its_replacement_is_refused(kwargs, match):
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=match):
    optax_gsam.gsam(RHO, **kwargs)
