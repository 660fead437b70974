"""How gsam/sam call the user's loss function, and the errors for the usual mistakes.

Every check here runs while the update is traced, never in the compiled step.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.calls.placement import optax_frame_on_stack
from optax_gsam._src.core.validation import PARAMS_FIX

ValueAndGradFn = Callable[[optax.Params], tuple[Any, optax.Updates]]
# The same with the extra arguments (the group under ``num_groups``) passed on to the user's fn.
ValueAndGradWithArgsFn = Callable[..., tuple[Any, optax.Updates]]

MISSING_LOSS_HINT = (
  "If this update comes from flax.training.train_state.TrainState.apply_gradients, that "
  "method does not forward loss_fn: use optax_gsam.flax.TrainState instead. With Flax NNX, "
  "call nnx.Optimizer.update(model, grads, loss_fn=loss_fn)."
)

IGNORED_ARGUMENT = (
  "loss_fn's loss does not depend on its argument. gsam/sam call loss_fn(params + epsilon) "
  "and differentiate it with respect to that argument, so a loss_fn that closes over the "
  "step's own params (loss_fn=lambda p: loss(params, batch)) gives a zero perturbed gradient: "
  "GSAM would then step along -alpha * grads and SAM would not move. Use the argument: "
  "loss_fn=lambda p: loss(p, batch)."
)


class UpdateArguments(NamedTuple):
  """The keywords of ``update`` that gsam, sam and momentum_sam read, declared once.

  optax chains forward every keyword to every transform, so ``update`` takes
  ``**extra_args`` and reads these from them (:func:`read_update_arguments`);
  the others belong to the other transforms of the chain.
  """

  loss_fn: Callable | None = None
  value_and_grad_fn: Callable | None = None
  value: Any = None
  perturb: bool | None = None
  batch: Any = None
  key: jax.Array | None = None
  model_state: Any = None


UPDATE_KEYWORDS: tuple[str, ...] = UpdateArguments._fields
# How close (difflib ratio) a name must be to one of them to be taken for a misspelling:
# `valu`/`value` is 0.89, `value_fn` (optax's line searches read it)/`value` is 0.77.
TYPO_CUTOFF = 0.8


LOOKAHEAD_HINT = (
  "optax.lookahead calls its fast optimizer without extra arguments, so loss_fn cannot reach "
  "the transform through it: bind it into the fast optimizer, rebuilt in each train step, e.g. "
  "tx = optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1)); fast = "
  "optax.GradientTransformation(tx.init, functools.partial(tx.update, loss_fn=loss_fn)); "
  "optax.lookahead(fast, sync_period, slow_step_size) (docs/getting_started.md)."
)


def _missing_loss_hint() -> str:
  """The likely reason no loss function arrived: a wrapper that forwards no extra arguments."""
  if optax_frame_on_stack("lookahead.<locals>.update_fn"):
    return LOOKAHEAD_HINT
  return MISSING_LOSS_HINT


class MissingLossFunctionError(ValueError):
  """``update`` got neither ``loss_fn`` nor ``value_and_grad_fn``."""


def value_and_grad_from(
  loss_fn: Callable | None, value_and_grad_fn: Callable | None
) -> ValueAndGradWithArgsFn:
  """``(params, *args) -> (value, grads)`` from exactly one of the two user functions.

  ``loss_fn`` may return a scalar or ``(loss, aux)`` (a tuple or list, as Flax
  and big_vision losses do): the first element is differentiated and the whole
  output is returned as the value. Its loss must be a real scalar that depends
  on the argument (:func:`check_loss`, :func:`dependence_marker`); the gradient
  of a complex leaf is returned as the steepest-ascent direction
  (:func:`steepest_ascent`). ``value_and_grad_fn`` is called as it is: it
  computes its own gradient, in that convention.
  """
  if (loss_fn is None) == (value_and_grad_fn is None):
    error = MissingLossFunctionError if loss_fn is None else ValueError
    raise error(
      "Pass exactly one of loss_fn (params -> scalar loss, or (loss, aux)) or "
      "value_and_grad_fn (params -> (value, grads)) to update(); got "
      f"loss_fn={'set' if loss_fn is not None else None}, "
      f"value_and_grad_fn={'set' if value_and_grad_fn is not None else None}. "
      + (_missing_loss_hint() if loss_fn is None else "")
    )
  fn = loss_fn if loss_fn is not None else value_and_grad_fn
  if not callable(fn):
    name = "loss_fn" if loss_fn is not None else "value_and_grad_fn"
    raise ValueError(f"{name} must be callable, got {type(fn).__name__}.")
  if value_and_grad_fn is not None:
    return lambda params, *args: call_user_function(value_and_grad_fn, params, *args)

  def value_and_grad(params, *args):
    marker, reached = dependence_marker()

    def loss_and_output(params, *args):
      output = call_user_function(loss_fn, params, *args)
      return marker(check_loss(output)), output

    (_, output), grads = jax.value_and_grad(loss_and_output, has_aux=True)(params, *args)
    if not reached and has_float_leaves(params):
      raise ValueError(IGNORED_ARGUMENT)
    return output, steepest_ascent(grads)

  return value_and_grad


def steepest_ascent(grads: optax.Updates) -> optax.Updates:
  r"""JAX's gradient of a real loss with its complex leaves conjugated.

  For a real :math:`f` of :math:`z = x + iy`, ``jax.grad`` returns
  :math:`\partial f/\partial x - i\,\partial f/\partial y`, the conjugate of
  the direction :math:`\partial f/\partial x + i\,\partial f/\partial y` in
  which :math:`f` rises fastest over the pairs :math:`(x, y)`. gsam/sam add
  :math:`\rho g / \|g\|` to the params, so the gradients they read and output
  follow optax's convention for complex params (conjugate between ``jax.grad``
  and ``update``; see ``optax.contrib.split_real_and_imaginary``): the
  steepest-ascent direction. Real leaves are returned as they are.
  """
  return jax.tree.map(lambda g: jnp.conj(g) if jnp.iscomplexobj(g) else g, grads)


def dependence_marker() -> tuple[Callable[[jax.Array], jax.Array], list]:
  """An identity whose derivative rule records, at trace time, that it was reached.

  JAX calls a ``custom_jvp`` rule only when some input tangent is not a
  symbolic zero, so under ``jax.value_and_grad`` the returned list is non-empty
  exactly when the marked value depends on the differentiated argument (through
  an operation with a derivative: ``stop_gradient`` and ``round`` cut the
  path). The marker costs nothing at run time: it is the identity.
  """
  reached: list = []

  @jax.custom_jvp
  def marker(x):
    return x

  @marker.defjvp
  def marker_jvp(primals, tangents):
    reached.append(True)
    return primals[0], tangents[0]

  return marker, reached


def has_float_leaves(tree: Any) -> bool:
  """Whether ``tree`` has a leaf that can be differentiated (a float or complex array)."""
  return any(jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) for leaf in jax.tree.leaves(tree))


def check_loss(output: Any) -> jax.Array:
  """The loss in ``loss_fn``'s output (a scalar or ``(loss, aux)``), checked to be a real scalar."""
  loss = output[0] if isinstance(output, (tuple, list)) and output else output
  try:
    loss = jnp.asarray(loss)
  except TypeError as error:
    raise ValueError(
      f"loss_fn must return a scalar loss or a (loss, aux) pair, got {type(output).__name__}."
    ) from error
  if loss.shape != ():
    raise ValueError(
      f"loss_fn must return a scalar loss (or (loss, aux)), got shape {loss.shape}: reduce it "
      "to one number, e.g. jnp.mean(per_example_losses)."
    )
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise ValueError(f"loss_fn must return a real floating-point loss, got dtype {loss.dtype}.")
  return loss


def call_user_function(fn: Callable, params: optax.Params, *args: Any) -> Any:
  """``fn(params, *args)``, explaining the Flax NNX and Equinox mistakes of a ``loss_fn(model)``."""
  try:
    return fn(params, *args)
  except (TypeError, AttributeError) as error:
    message = str(error)
    if "not callable" in message and type(params).__module__.startswith("flax"):
      raise TypeError(
        f"loss_fn received the params ({type(params).__name__}) and tried to call them: "
        "gsam/sam call loss_fn(params) with the parameter pytree, not the model. With Flax "
        "NNX, build the loss of params with optax_gsam.flax.nnx_loss_fn(loss_fn, model, "
        "*args) before the clean pass (docs/flax.md shows both NNX styles)."
      ) from error
    if "NoneType" in message and holds_equinox_module(params):
      raise TypeError(
        f"loss_fn received the params (an Equinox {type(params).__name__} filtered to its "
        "arrays, in which the activation functions and other non-array fields are None) "
        f"and used them as the model ({message}). gsam/sam call loss_fn with exactly what "
        "tx.update gets as params. " + PARAMS_FIX
      ) from error
    raise


def holds_equinox_module(tree: Any) -> bool:
  """Whether ``tree`` is or holds an ``equinox.Module`` (False when equinox is not imported)."""
  equinox = sys.modules.get("equinox")
  module_type = getattr(equinox, "Module", None)
  if module_type is None:
    return False
  is_module = lambda x: isinstance(x, module_type)
  return any(is_module(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_module))


def check_extra_args(
  extra_args: Iterable[str], known: tuple[str, ...] = UPDATE_KEYWORDS, method: str = "gsam/sam"
) -> None:
  """Raises a TypeError for an extra keyword of ``update`` that is a near miss of a known one.

  optax chains forward every keyword to every transform, so unknown keywords
  (another transform's) are accepted; ``valu=`` for ``value=`` is not, since
  nothing would read it and the surrogate gap would silently stay 0.
  """
  for name in extra_args:
    close = difflib.get_close_matches(name, known, n=1, cutoff=TYPO_CUTOFF)
    if close and name not in known:
      raise TypeError(
        f"update() got {name}=, which no argument of {method} reads; did you mean "
        f"{close[0]}=? ({', '.join(known)} are read; other keywords are left to the other "
        "transforms of the chain.)"
      )


def read_update_arguments(
  extra_args: Mapping[str, Any], method: str, reads: tuple[str, ...] = UPDATE_KEYWORDS
) -> UpdateArguments:
  """The keywords in ``reads`` from all that ``update`` was given, near misses refused.

  A keyword of :class:`UpdateArguments` outside ``reads`` is dropped, as another
  transform's is (``value=`` for ``momentum_sam``, which has no clean loss to record).
  """
  check_extra_args([name for name in extra_args if name not in UPDATE_KEYWORDS], reads, method)
  return UpdateArguments(**{name: extra_args[name] for name in reads if name in extra_args})


def scalar_loss(value: Any, dtype: Any = jnp.float32) -> jax.Array:
  """The loss of a value (a scalar or ``(loss, aux)``) as a scalar of ``dtype``: float32, as
  the transforms record losses, or the loss's own dtype where ``dtype`` is None."""
  if isinstance(value, (tuple, list)):
    value = value[0]
  value = jnp.asarray(value)
  if value.shape != ():
    raise ValueError(f"The loss must be a scalar, got shape {value.shape}.")
  return value if dtype is None else value.astype(dtype)


def call_form_error(fn: Callable, count: int) -> str | None:
  """Why ``fn`` cannot be called with ``count`` positional arguments, in Python's words.

  None where it can, or where its signature cannot be read (a builtin or an
  opaque callable: the call itself decides). Read before the call, so that a
  ``TypeError`` raised inside ``fn`` is never taken for a wrong call form.
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  try:
    signature.bind(*range(count))
  except TypeError as error:
    return str(error)
  return None
