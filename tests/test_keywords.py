"""The keyword groups that gsam/sam (and the measures) share: one declaration, full signatures."""

import inspect
import typing

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_gsam
from optax_gsam._src.transforms.gsam_arguments import SHARPNESS_DEFAULTS

FACTORIES = [optax_gsam.gsam, optax_gsam.sam]


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
def test_signature_lists_every_shared_keyword_with_its_default(factory):
  parameters = inspect.signature(factory).parameters
  for name, default in SHARPNESS_DEFAULTS.items():
    assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert parameters[name].default == default, name
  assert not [p for p in parameters.values() if p.kind is p.VAR_KEYWORD]
  hints = typing.get_type_hints(factory)  # every annotation resolves
  assert set(hints) == {*parameters, "return"}
  assert hints["diagnostics"] is bool


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
def test_unknown_keyword_is_a_type_error_naming_the_function(factory):
  with pytest.raises(
    TypeError, match=rf"{factory.__name__}\(\) got an unexpected keyword .*'epsilon'"
  ):
    factory(0.05, epsilon=1e-8)


def test_sam_refuses_the_keywords_only_gsam_has():
  for name, value in (("alpha", 0.3), ("minimize_fp", False)):
    with pytest.raises(TypeError, match=f"'{name}'"):
      optax_gsam.sam(0.05, **{name: value})


def test_inject_hyperparams_sees_the_shared_numeric_keywords():
  tx = optax.inject_hyperparams(optax_gsam.sam)(rho=0.05, eps=1e-6)
  state = tx.init(jnp.ones(3))
  assert set(state.hyperparams) == {"rho", "eps"}  # numbers are injected; the rest is static
  loss_fn = lambda w: jnp.sum(jnp.sin(w))
  w = jnp.ones(3)
  updates, _ = tx.update(jax.grad(loss_fn)(w), state, w, loss_fn=loss_fn)
  expected, _ = optax_gsam.sam(0.05, eps=1e-6).update(
    jax.grad(loss_fn)(w), optax_gsam.sam(0.05).init(w), w, loss_fn=loss_fn
  )
  assert jnp.allclose(updates, expected, rtol=1e-6)


# The schedulable arguments of each public function, as optax's common optimizer tests find
# them: by the signature's annotation object, `annotation in (ScalarOrSchedule, Schedule)`.
SCHEDULABLE = {
  optax_gsam.gsam: {"rho", "reuse_weight"},
  optax_gsam.sam: {"rho", "reuse_weight"},
  optax_gsam.momentum_sam: {"rho"},
  optax_gsam.every_k_policy: {"reuse_weight"},
  optax_gsam.gradient_norm_policy: {"threshold", "reuse_weight"},
  optax_gsam.random_policy: {"probability", "reuse_weight"},
  optax_gsam.rho_from_lr: {"lr_schedule"},
  optax_gsam.full_step_due: {"rho"},
  optax_gsam.schedule_extrema: {"schedule"},
}


def _schedulable(factory):
  parameters = inspect.signature(factory).parameters.items()
  return {n for n, p in parameters if p.annotation in (optax.ScalarOrSchedule, optax.Schedule)}


@pytest.mark.parametrize("factory", SCHEDULABLE, ids=lambda f: f.__name__)
def test_signature_carries_the_schedule_annotation_object(factory):
  assert _schedulable(factory) == SCHEDULABLE[factory]


def test_every_public_schedulable_argument_is_found_by_its_annotation():
  """A public function whose written annotation names a schedule shows the object at run time."""
  for name in optax_gsam.__all__:
    function = getattr(optax_gsam, name)
    if not inspect.isfunction(function):
      continue
    namespace = inspect.unwrap(function).__globals__
    written = {  # each annotation as written, evaluated where the function is defined
      n: eval(a, namespace) if isinstance(a, str) else a
      for n, a in function.__annotations__.items()
    }
    expected = {
      n for n, hint in written.items() if hint in (optax.ScalarOrSchedule, optax.Schedule)
    } - {"return"}
    assert _schedulable(function) == expected, name
    assert expected == SCHEDULABLE.get(function, set()), name


def _parabola_run(tx, steps=10):
  """optax's schedule test: ten steps on a parabola, the sharpness-aware keywords given."""
  loss_fn = lambda w: jnp.sum(jnp.square(w - jnp.array([1.0, -2.0, 0.5])) * jnp.arange(1.0, 4.0))
  w = jnp.array([0.3, 0.1, -0.2])

  @jax.jit
  def step(w, state):
    value, grads = jax.value_and_grad(loss_fn)(w)
    updates, state = tx.update(grads, state, w, loss_fn=loss_fn, value=value)
    return optax.apply_updates(w, updates), state

  state = tx.init(w)
  for _ in range(steps):
    w, state = step(w, state)
  return w


# (factory, the schedulable argument, how the transform is built from that argument's value)
SCHEDULE_CASES = [
  (optax_gsam.gsam, "rho", lambda v: optax_gsam.gsam(rho=v, alpha=0.3)),
  (optax_gsam.sam, "rho", lambda v: optax_gsam.sam(rho=v)),
  (optax_gsam.momentum_sam, "rho", lambda v: optax_gsam.momentum_sam(rho=v)),
  (
    optax_gsam.every_k_policy,
    "reuse_weight",
    lambda v: optax_gsam.sam(0.05, policy=optax_gsam.every_k_policy(3, reuse_weight=v)),
  ),
  (
    optax_gsam.gradient_norm_policy,
    "threshold",
    lambda v: optax_gsam.sam(0.05, policy=optax_gsam.gradient_norm_policy(v, cheap="reuse")),
  ),
  (
    optax_gsam.gradient_norm_policy,
    "reuse_weight",
    lambda v: optax_gsam.sam(
      0.05, policy=optax_gsam.gradient_norm_policy(0.5, cheap="reuse", reuse_weight=v)
    ),
  ),
  (
    optax_gsam.random_policy,
    "probability",
    lambda v: optax_gsam.sam(0.05, policy=optax_gsam.random_policy(v, key=jax.random.key(3))),
  ),
  (
    optax_gsam.random_policy,
    "reuse_weight",
    lambda v: optax_gsam.sam(
      0.05,
      policy=optax_gsam.random_policy(0.5, key=jax.random.key(3), cheap="reuse", reuse_weight=v),
    ),
  ),
]


@pytest.mark.parametrize(
  ("factory", "argument", "build"),
  SCHEDULE_CASES,
  ids=[f"{c[0].__name__}-{c[1]}" for c in SCHEDULE_CASES],
)
def test_optax_schedule_test_finds_and_passes_every_schedulable_argument(factory, argument, build):
  """optax's `test_optimizers_accept_learning_rate_schedule_if_type_annotated_as_such`, for
  every schedulable argument: gated on the annotation as optax gates it, which must not skip."""
  annotation = inspect.signature(factory).parameters[argument].annotation
  assert annotation in (optax.ScalarOrSchedule, optax.Schedule), "optax's test would skip it"
  value = 0.4
  tx_with_schedule = optax.chain(build(optax.constant_schedule(value)), optax.sgd(0.05))
  tx_with_value = optax.chain(build(value), optax.sgd(0.05))
  with_schedule, with_value = _parabola_run(tx_with_schedule), _parabola_run(tx_with_value)
  assert jnp.allclose(with_schedule, with_value, rtol=1e-6, atol=1e-7)
