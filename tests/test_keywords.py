"""The keyword groups that gsam/sam (and the measures) share: one declaration, full signatures."""

import inspect
import typing

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_gsam
from optax_gsam._src.gsam_arguments import SHARPNESS_DEFAULTS

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
