"""How gsam/sam call the user's loss function, and the errors for the usual mistakes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

ValueAndGradFn = Callable[[optax.Params], tuple[Any, optax.Updates]]
# The same with the extra arguments (the group under ``num_groups``) passed on to the user's fn.
ValueAndGradWithArgsFn = Callable[..., tuple[Any, optax.Updates]]

MISSING_LOSS_HINT = (
  "If this update comes from flax.training.train_state.TrainState.apply_gradients, that "
  "method does not forward loss_fn: use optax_gsam.flax.TrainState instead. With Flax NNX, "
  "call nnx.Optimizer.update(model, grads, loss_fn=loss_fn)."
)


def value_and_grad_from(
  loss_fn: Callable | None, value_and_grad_fn: Callable | None
) -> ValueAndGradWithArgsFn:
  """``(params, *args) -> (value, grads)`` from exactly one of the two user functions.

  ``loss_fn`` may return a scalar or ``(loss, aux)`` (a tuple or list, as Flax
  and big_vision losses do): the first element is differentiated and the whole
  output is returned as the value. The check happens while tracing, at no run
  time cost.
  """
  if (loss_fn is None) == (value_and_grad_fn is None):
    raise ValueError(
      "Pass exactly one of loss_fn (params -> scalar loss, or (loss, aux)) or "
      "value_and_grad_fn (params -> (value, grads)) to update(); got "
      f"loss_fn={'set' if loss_fn is not None else None}, "
      f"value_and_grad_fn={'set' if value_and_grad_fn is not None else None}. "
      + (MISSING_LOSS_HINT if loss_fn is None and value_and_grad_fn is None else "")
    )
  fn = loss_fn if loss_fn is not None else value_and_grad_fn
  if not callable(fn):
    name = "loss_fn" if loss_fn is not None else "value_and_grad_fn"
    raise ValueError(f"{name} must be callable, got {type(fn).__name__}.")
  if value_and_grad_fn is not None:
    return lambda params, *args: call_user_function(value_and_grad_fn, params, *args)

  def loss_and_output(params, *args):
    output = call_user_function(loss_fn, params, *args)
    loss = output[0] if isinstance(output, (tuple, list)) else output
    return loss, output

  def value_and_grad(params, *args):
    (_, output), grads = jax.value_and_grad(loss_and_output, has_aux=True)(params, *args)
    return output, grads

  return value_and_grad


def call_user_function(fn: Callable, params: optax.Params, *args: Any) -> Any:
  """``fn(params, *args)``, explaining the NNX mistake of a ``loss_fn(model)``."""
  try:
    return fn(params, *args)
  except TypeError as error:
    if "not callable" in str(error) and type(params).__module__.startswith("flax"):
      raise TypeError(
        f"loss_fn received the params ({type(params).__name__}) and tried to call them: "
        "gsam/sam call loss_fn(params) with the parameter pytree, not the model. With Flax "
        "NNX, build the loss of params with optax_gsam.flax.nnx_loss_fn(loss_fn, model, "
        "*args) before the clean pass (docs/flax.md shows both NNX styles)."
      ) from error
    raise


def scalar_loss(value: Any) -> jax.Array:
  """The loss of a value (a scalar or ``(loss, aux)``) as a float32 scalar."""
  if isinstance(value, (tuple, list)):
    value = value[0]
  value = jnp.asarray(value)
  if value.shape != ():
    raise ValueError(f"The loss must be a scalar, got shape {value.shape}.")
  return value.astype(jnp.float32)


def group_value_and_grad(
  loss_fn: Callable | None, value_and_grad_fn: Callable | None
) -> Callable[[jax.Array], ValueAndGradFn]:
  """``group -> (params -> (value, grads))`` for ``num_groups``: the user's fn takes the group."""
  grad_fn = value_and_grad_from(loss_fn, value_and_grad_fn)
  return lambda group: lambda params: grad_fn(params, group)
