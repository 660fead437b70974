"""What a step carries through its micro-batches: a PRNG key per micro-batch, and model state.

With ``microbatches=k``, ``update`` and :func:`accumulate_value_and_grad` call
the user's function once per micro-batch ``i`` as

.. math::

  \\text{loss\\_fn}(w, [s_{i-1},]\\ b_i\\ [, \\text{fold\\_in}(\\text{key}, i)])

where ``[...]`` is present only when ``model_state=`` (:math:`s_0`) or ``key=``
was given. A stateful loss returns :math:`(f_i, s_i)`: the state passes
through the micro-batches as through k small steps, and the clean pass's
:math:`s_k` is the new state. The perturbed pass starts again from :math:`s_0`,
passes its own state along the same way (so an RNG counter in the state gives
micro-batch ``i`` the same value in both passes) and drops it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.placement import HELPER_FIX
from optax_gsam._src.calls.user_functions import ValueAndGradFn
from optax_gsam._src.calls.user_functions import ValueAndGradWithArgsFn
from optax_gsam._src.calls.user_functions import call_form_error
from optax_gsam._src.calls.user_functions import scalar_loss
from optax_gsam._src.calls.user_functions import value_and_grad_from
from optax_gsam._src.core.validation import check_params_leaves
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.microbatches.microbatch import MicrobatchFn
from optax_gsam._src.microbatches.microbatch import accumulated
from optax_gsam._src.microbatches.microbatch import check_batch
from optax_gsam._src.microbatches.microbatch import mean_and_state
from optax_gsam._src.microbatches.microbatch import microbatch_fns
from optax_gsam._src.microbatches.microbatch import microbatch_of

_ACCUMULATE = "optax_gsam.accumulate_value_and_grad"


class MicrobatchInputs(NamedTuple):
  """The micro-batched inputs of one step: ``batch=``, ``key=`` and ``model_state=``."""

  batch: Any = None
  key: jax.Array | None = None
  model_state: Any = None

  @property
  def given(self) -> list[str]:
    return [name for name in self._fields if getattr(self, name) is not None]


def check_inputs(
  inputs: MicrobatchInputs, k: int | None, updates: Any, params: Any, per_microbatch: bool
) -> None:
  """``batch``, ``key`` and ``model_state`` only where they are read, each error with its fix."""
  if k is None:
    if inputs.given:
      name = inputs.given[0]
      raise ValueError(
        f"update() got {name}=, which gsam/sam read only with microbatches=k: set it, or close "
        f"over the {name.replace('_', ' ')} in loss_fn."
      )
    return
  if updates is not None and not jax.tree.leaves(updates) and jax.tree.leaves(params):
    raise ValueError(
      "updates is empty while params are not: nnx.Optimizer.update(model, None, ...) turns "
      "grads=None into an empty State. With Flax NNX, run the clean pass with "
      "optax_gsam.accumulate_value_and_grad on the function of "
      "optax_gsam.flax.nnx_microbatch_loss_fn and pass its grads (docs/large_batches.md)."
    )
  if inputs.model_state is None:
    return
  if per_microbatch:
    raise ValueError(
      "model_state= is not supported with perturb_each_microbatch=True (num_groups): the "
      "transform computes each micro-batch's clean pass itself and cannot return the new "
      "state. Use the whole-batch semantics, or close over the state in loss_fn."
    )
  if updates is None:
    raise ValueError("update(None, ...) got model_state=. " + HELPER_FIX)


def describe_call(inputs: MicrobatchInputs) -> str:
  """How the user's function is called, e.g. ``loss_fn(params, model_state, microbatch, key)``."""
  parts = ["params"]
  if inputs.model_state is not None:
    parts.append("model_state")
  parts.append("microbatch" if inputs.batch is not None else "index")
  if inputs.key is not None:
    parts.append("key")
  return f"({', '.join(parts)})"


def check_call_form(
  fn: Callable | None, name: str, inputs: MicrobatchInputs, k: int, method: str = "gsam/sam"
) -> None:
  """Raises a ValueError where ``fn`` cannot take the arguments the micro-batches give it.

  ``method`` names the caller in the message (``momentum_sam``,
  ``optax_gsam.accumulate_value_and_grad``).
  """
  if fn is None:
    return
  call = describe_call(inputs)
  error = call_form_error(fn, call.count(",") + 1)
  if error is None:
    return
  index_form = ""
  if inputs.batch is None:
    index_form = (
      f" Without batch=, {name} receives the micro-batch index (an int32 scalar in "
      f"[0, {k})) in place of the micro-batch and selects its data itself; or pass batch= and "
      "take the micro-batch."
    )
  extras = ""
  if inputs.model_state is not None:
    extras += " With model_state=, it returns (loss, new_model_state)."
  if inputs.key is not None:
    extras += " With key=, the last argument is the micro-batch's own PRNG key."
  raise ValueError(
    f"With microbatches={k}, {method} calls {name}{call} once per micro-batch, but {name} "
    f"does not take these arguments ({error}).{index_form}{extras}"
  )


def user_grad_fn(
  loss_fn: Callable | None,
  value_and_grad_fn: Callable | None,
  inputs: MicrobatchInputs,
  k: int | None,
  method: str = "gsam/sam",
) -> ValueAndGradWithArgsFn:
  """The user's function as ``(params, *args) -> (value, grads)``, its call form checked
  against ``k`` micro-batches (none to check when ``k`` is ``None``); ``method``, the transform
  whose ``update`` calls it, is named in the errors."""
  grad_fn = value_and_grad_from(loss_fn, value_and_grad_fn)
  if k is not None:
    name = "loss_fn" if loss_fn is not None else "value_and_grad_fn"
    fn = loss_fn if loss_fn is not None else value_and_grad_fn
    check_call_form(fn, name, inputs, k, method)
  return grad_fn


def _arguments_of(inputs: MicrobatchInputs, k: int, axis_name: Any) -> Callable:
  """``index -> (microbatch or index, [key])``: the arguments after params (and state)."""
  batch, key = inputs.batch, inputs.key
  microbatch = None
  if batch is not None:
    check_batch(batch, k, axis_name)
    microbatch = microbatch_of(batch, k)

  def of(index):
    item = index if microbatch is None else microbatch(index)
    return (item,) if key is None else (item, jax.random.fold_in(key, index))

  return of


def group_fns(
  grad_fn: ValueAndGradWithArgsFn, inputs: MicrobatchInputs, k: int, axis_name: Any = None
) -> MicrobatchFn:
  """``index -> (params -> grad_fn(params, microbatch[, key]))`` for stateless losses."""
  if inputs.key is None:
    return microbatch_fns(grad_fn, inputs.batch, k, axis_name)
  arguments_of = _arguments_of(inputs, k, axis_name)
  return lambda index: lambda params: grad_fn(params, *arguments_of(index))


def _check_same_state(new: Any, old: Any) -> None:
  same = jax.tree.structure(new) == jax.tree.structure(old) and all(
    jnp.shape(a) == jnp.shape(b)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=False)
  )
  if not same:
    raise ValueError(
      "loss_fn must return (loss, new_model_state) with new_model_state of model_state's "
      f"structure and shapes; got {jax.tree.structure(new)} for {jax.tree.structure(old)}. "
      "With Flax Linen, return the collection itself (updates['batch_stats']) when "
      "model_state is the collection."
    )


def stateful_accumulated(
  grad_fn: ValueAndGradWithArgsFn, inputs: MicrobatchInputs, k: int, axis_name: Any = None
) -> Callable[[optax.Params], tuple[jax.Array, optax.Updates, Any]]:
  """``params -> (mean loss, mean gradient, s_k)``, the state passed through in order."""
  arguments_of = _arguments_of(inputs, k, axis_name)

  def value_and_grad(params):
    def of(index, state):
      value, grads = grad_fn(params, state, *arguments_of(index))
      if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(
          "With model_state=, loss_fn must return (loss, new_model_state), got "
          f"{type(value).__name__}."
        )
      _check_same_state(value[1], state)
      return (scalar_loss(value, None), grads), value[1]

    like = (jnp.zeros([]), params)  # the sum's buffers (see mean_and_state)
    (loss, grads), state = mean_and_state(k, of, inputs.model_state, like)
    return loss, optax.tree.cast_like(grads, params), state

  return value_and_grad


def accumulating(
  grad_fn: ValueAndGradWithArgsFn, inputs: MicrobatchInputs, k: int, axis_name: Any = None
) -> Callable[[optax.Params], tuple[jax.Array, optax.Updates, Any]]:
  """``params -> (mean loss, mean gradient, s_k)``, ``s_k`` None without a model state; the
  loss in its compute dtype (float32 at least), the gradient in the params' dtypes."""
  if inputs.model_state is not None:
    return stateful_accumulated(grad_fn, inputs, k, axis_name)
  accumulate = accumulated(group_fns(grad_fn, inputs, k, axis_name), k)
  return lambda params: (*accumulate(params), None)


def whole_batch_grad_fn(
  grad_fn: ValueAndGradWithArgsFn, inputs: MicrobatchInputs, k: int, axis_name: Any = None
) -> ValueAndGradFn:
  """``params -> (mean loss, mean gradient)``, the loss in float32 as the transforms record
  it; a model state's final value is dropped."""
  accumulate = accumulating(grad_fn, inputs, k, axis_name)

  def value_and_grad(params):
    loss, grads, _ = accumulate(params)
    return scalar_loss(loss), grads

  return value_and_grad


def _recording_loss_dtype(grad_fn: ValueAndGradWithArgsFn) -> tuple[ValueAndGradWithArgsFn, list]:
  """``grad_fn``, and the list in which it records its loss's dtype each time it is traced."""
  dtypes: list = []

  def recording(params, *args):
    value, grads = grad_fn(params, *args)
    dtypes.append(scalar_loss(value, None).dtype)
    return value, grads

  return recording, dtypes


def accumulate_value_and_grad(
  loss_fn: Callable[..., Any],
  params: optax.Params,
  batch: Any = None,
  *,
  microbatches: int,
  model_state: Any = None,
  key: jax.Array | None = None,
) -> tuple[tuple[jax.Array, Any], optax.Updates]:
  r"""The clean pass of a micro-batched step: mean loss and gradient, and the new model state.

  ``batch`` is split along its leading axis into ``microbatches`` = k equal
  micro-batches :math:`b_i`, evaluated one at a time in a ``lax.scan``:

  .. math::

    (f_i, s_i) = \text{loss\_fn}(w, s_{i-1}, b_i, \text{fold\_in}(\text{key}, i)), \qquad
    f = \frac{1}{k} \sum_i f_i, \qquad g_c = \frac{1}{k} \sum_i \nabla_w f_i

  with the state argument present only when ``model_state`` (:math:`s_0`) is
  given and the key only when ``key`` is (``loss_fn(params, microbatch)``
  otherwise; without ``batch``, the micro-batch index replaces :math:`b_i`).
  The state passes through the micro-batches as through k small steps: with
  BatchNorm, each micro-batch is normalized with its own statistics (ghost
  batch norm) and the running averages are updated k times.

  Pass ``g_c`` to :func:`optax_gsam.gsam` (built with the same
  ``microbatches``) with the same ``loss_fn``, ``batch``, ``model_state`` and
  ``key``: its perturbed pass starts from :math:`s_0` and draws the same keys.

  Args:
    loss_fn: ``loss_fn(params, [model_state,] microbatch [, key])``; returns
      ``(loss, new_model_state)`` with ``model_state``, else a scalar loss or
      ``(loss, aux)`` (aux dropped).
    params: the parameters :math:`w`.
    batch: a pytree of arrays with one leading (example) size, or ``None``.
    microbatches: k, the number of micro-batches.
    model_state: the state carried through the micro-batches (Flax
      ``batch_stats``, Haiku state, ``eqx.nn.State``), or ``None``.
    key: the step's PRNG key; micro-batch i gets ``jax.random.fold_in(key, i)``.

  Returns:
    ``((loss, new_model_state), grads)``, as ``jax.value_and_grad(...,
    has_aux=True)``; ``new_model_state`` is ``None`` without ``model_state``.
    As there, the loss has the dtype ``loss_fn`` returns (the mean is taken
    in float32 at least, float64 under x64) and ``grads`` the params' dtypes.

  Raises:
    ValueError: where a leaf of ``params`` is not a float array (a whole
      Equinox model, whose non-array fields are leaves: pass
      ``eqx.partition(model, eqx.is_inexact_array)[0]``), or where
      ``loss_fn`` cannot take the arguments of its call form.

  Example:
    >>> import jax, jax.numpy as jnp, optax_gsam
    >>> def loss_fn(w, count, microbatch):
    ...   return jnp.mean((microbatch * w) ** 2), count + 1
    >>> (loss, count), grads = optax_gsam.accumulate_value_and_grad(
    ...   loss_fn, jnp.ones(()), jnp.arange(8.0), microbatches=4, model_state=jnp.zeros(()))
    >>> int(count)
    4
  """
  check_positive_int("microbatches", microbatches)
  check_params_leaves(params, f"{_ACCUMULATE} differentiates")
  inputs = MicrobatchInputs(batch, key, model_state)
  check_call_form(loss_fn, "loss_fn", inputs, microbatches, _ACCUMULATE)
  grad_fn, loss_dtypes = _recording_loss_dtype(value_and_grad_from(loss_fn, None))
  loss, grads, state = accumulating(grad_fn, inputs, microbatches)(params)
  # The mean is taken in float32 at least; returned in the loss's dtype, as jax.value_and_grad.
  return (loss.astype(loss_dtypes[-1]), state), grads
