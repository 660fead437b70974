"""Frozen parameters: neither perturbed nor differentiated by gsam, sam and momentum_sam.

Fine-tuning freezes part of the parameters (a pretrained backbone, the base
weights under LoRA adapters) with ``optax.partition`` and ``optax.set_to_zero()``.
The sharpness-aware transforms come first in the chain, before the stage that
freezes, so they must be told: with ``frozen=`` they run on the trained leaves
alone. Each frozen leaf stands in their computation as an empty array of its
dtype, so it has no perturbation, no share of the norms and inner products, no
gradient in the perturbed pass (the loss function receives the real frozen
values, held constant) and no state; its output is zero, as
``optax.set_to_zero()`` would make it.

A stage after the transform that freezes leaves the transform perturbs is
found while the update is traced, from the Python call stack as the placement
checks are (:mod:`optax_gsam._src.calls.placement`), and warned about.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gsam._src.calls import placement
from optax_gsam._src.directions.ascent import is_function
from optax_gsam._src.directions.ascent import resolve_mask

FrozenOrFn = Any  # a pytree of Python bools (a prefix of params), or params -> such a pytree

_STATIC_FIX = (
  "optax.inject_hyperparams calls a function it is given as a schedule, with the step count: "
  "pass static_args=('frozen',) to optax.inject_hyperparams."
)
_LABELS_FIX = (
  "To freeze the leaves whose optax.partition label maps to optax.set_to_zero(), pass the "
  "partition's own two arguments: frozen=optax_gsam.frozen_leaves(transforms, param_labels)."
)


def _inject_hyperparams_hint() -> str:
  """The ``static_args`` fix, where the transform is built inside ``optax.inject_hyperparams``.

  Only there is a function given as ``frozen`` called with the step count, so only there does
  the hint explain a bad ``frozen``.
  """
  inject = "inject_hyperparams.<locals>.wrapped_transform.<locals>."
  if any(placement.optax_frame_on_stack(inject + fn) for fn in ("init_fn", "update_fn")):
    return " Inside optax.inject_hyperparams: " + _STATIC_FIX
  return ""


class FrozenLeaf(NamedTuple):
  """What stands for a frozen leaf inside the transform: an empty node, no array."""


def check_frozen(frozen: FrozenOrFn) -> None:
  """``frozen`` is None, a callable, or a pytree of Python bools (True: frozen); else ValueError."""
  if frozen is None or is_function(frozen):
    return
  if isinstance(frozen, (bool, np.bool_)):
    raise ValueError(
      f"frozen is the bare bool {frozen!r}, not a pytree of bools over params: False freezes "
      "nothing (leave frozen=None) and True would leave nothing to train."
      + _inject_hyperparams_hint()
    )
  bad = [leaf for leaf in jax.tree.leaves(frozen) if not isinstance(leaf, (bool, np.bool_))]
  if bad and all(isinstance(leaf, str) for leaf in bad):
    raise ValueError(
      f"frozen got labels ({bad[0]!r}, ...), not Python bools: frozen= takes a pytree of bools "
      "(True: the leaf is frozen), or a function params -> such a pytree. " + _LABELS_FIX
    )
  if bad:
    raise ValueError(
      "frozen must be a pytree of Python bools (True: the leaf is frozen) with the structure of "
      "params or a prefix of it, or a function params -> such a pytree, as optax.freeze and "
      f"optax.selective_transform's freeze_mask take; got a leaf {bad[0]!r}. Arrays are not "
      "accepted: what is frozen decides the program's shape." + _inject_hyperparams_hint()
    )


def _expanded(prefix: Any, tree: Any) -> Any:
  """A bool at every leaf of ``tree``, read from ``prefix`` (a prefix of it)."""
  return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub), prefix, tree)


def resolve_frozen(frozen: FrozenOrFn, params: optax.Params) -> Any:
  """``frozen`` as a bool at every leaf of ``params``; refuses a tree that freezes every leaf."""
  function = is_function(frozen)
  tree = frozen(params) if function else frozen
  if function:
    check_frozen(tree)
  try:
    flags = _expanded(tree, params)
  except ValueError as error:
    raise ValueError(
      "frozen does not match params: it must have the structure of params, or of a prefix of "
      f"it, with a bool at each of its leaves ({error})." + _inject_hyperparams_hint()
    ) from error
  leaves = jax.tree.leaves(flags)
  if leaves and all(leaves):
    raise ValueError("frozen freezes every leaf of params: nothing would be trained.")
  return flags


def _trained(flags: Any, tree: Any) -> Any:
  return jax.tree.map(lambda f, x: FrozenLeaf() if f else x, flags, tree)


def trained_part(frozen: FrozenOrFn, tree: Any) -> Any:
  """``tree`` (params-shaped) as the transform sees it: each frozen leaf an empty array."""
  return _trained(resolve_frozen(frozen, tree), tree)


def _frozen_functions(extra_args: dict[str, Any], flags: Any, params: optax.Params) -> dict:
  """``loss_fn``/``value_and_grad_fn`` of the trained leaves: the frozen ones are held constant.

  Each keeps the user's signature (``functools.wraps``), which the micro-batch call-form check
  reads.
  """
  merged = lambda trained: jax.tree.map(lambda f, t, p: p if f else t, flags, trained, params)
  forwarded = dict(extra_args)
  loss_fn, value_and_grad_fn = extra_args.get("loss_fn"), extra_args.get("value_and_grad_fn")
  if callable(loss_fn):
    forwarded["loss_fn"] = functools.wraps(loss_fn)(
      lambda trained, *args: loss_fn(merged(trained), *args)
    )
  if callable(value_and_grad_fn):

    @functools.wraps(value_and_grad_fn)
    def trained_value_and_grad(trained, *args):
      value, grads = value_and_grad_fn(merged(trained), *args)
      return value, _trained(flags, grads)

    forwarded["value_and_grad_fn"] = trained_value_and_grad
  return forwarded


def with_frozen(
  tx: optax.GradientTransformationExtraArgs, name: str, frozen: FrozenOrFn, mask: Any
) -> optax.GradientTransformationExtraArgs:
  """``tx`` (gsam, sam or momentum_sam) run on the leaves that ``frozen`` leaves trained.

  Args:
    tx: the transform, over params whose frozen leaves are empty arrays.
    name: the transform's name, for the messages.
    frozen: the ``frozen`` argument (``None``: every leaf is trained).
    mask: the transform's ``mask`` (``None``: every leaf is perturbed).

  Returns:
    The transform over the whole params; the frozen leaves' output is zero.
  """

  def init_fn(params):
    if frozen is None:
      return tx.init(params)
    if not jax.tree.leaves(params):  # optax.tree_map_params' one placeholder for all params
      raise ValueError(
        f"{name} with frozen= builds its state from the params' structure, which "
        f"{type(params).__name__} does not have (optax.tree_map_params passes one placeholder "
        "for the whole params). Build the state with jax.jit(tx.init) on the sharded params "
        "(its leaves keep their shardings), or read its layout with jax.eval_shape(tx.init, "
        "params)."
      )
    return tx.init(_trained(resolve_frozen(frozen, params), params))

  def update_fn(updates, state, params=None, **extra_args):
    if params is not None:
      warn_if_frozen_later(name, frozen, mask, params)
    if frozen is None:
      return tx.update(updates, state, params, **extra_args)
    if params is None:
      raise ValueError(f"{name} with frozen= needs params: call update(updates, state, params).")
    flags = resolve_frozen(frozen, params)
    _check_mask_trains_something(mask, flags, params)
    trained_updates = None if updates is None else _trained(flags, updates)
    forwarded = _frozen_functions(extra_args, flags, params)
    output, state = tx.update(trained_updates, state, _trained(flags, params), **forwarded)
    like = params if updates is None else updates
    output = jax.tree.map(lambda f, o, u: jnp.zeros_like(u) if f else o, flags, output, like)
    return output, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_mask_trains_something(mask: Any, flags: Any, params: optax.Params) -> None:
  if mask is None:
    return
  perturbed = _expanded(resolve_mask(mask, params), params)
  pairs = zip(jax.tree.leaves(perturbed), jax.tree.leaves(flags), strict=True)
  if not any(selected and not frozen for selected, frozen in pairs):
    raise ValueError(
      "Every leaf that mask selects is frozen: nothing would be perturbed. Select trained "
      "leaves with mask=, or use the base optimizer."
    )


# --- frozen_leaves: the frozen leaves of an optax.partition, from its own arguments ---------


def _zeroes(update: Any) -> bool:
  """Whether ``update`` sends every update to exactly zero: ``optax.set_to_zero()``'s, or
  ``optax.scale``'s by a concrete zero (``optax.scale(0.0)``, a learning rate of 0.0), behind
  optax's extra-args wrapper or not, or a chain's whose last stage's is (``optax.sgd(0.0)``)."""
  update = placement.unwrapped_update(update)
  code = getattr(update, "__code__", None)
  if code is None or placement.OPTAX_DIR not in code.co_filename:
    return False
  if code.co_qualname == "set_to_zero.<locals>.update_fn":
    return True
  if code.co_qualname == "scale.<locals>.update_fn":
    return _is_concrete_zero(placement.closure_values(update).get("step_size"))
  stages = _chain_updates(update) or []
  return bool(stages) and _zeroes(stages[-1])


def _is_concrete_zero(step_size: Any) -> bool:
  """A step size known now to be zero: a number or a concrete array of zeros, not a tracer."""
  if isinstance(step_size, jax.core.Tracer):
    return False
  try:
    return bool(np.all(np.asarray(step_size) == 0))
  except (TypeError, ValueError):
    return False


def _chain_updates(update: Any) -> list[Callable] | None:
  """The stages' update functions of an ``optax.chain`` or ``named_chain`` update; else None."""
  code = getattr(update, "__code__", None)
  if code is None or code.co_qualname not in (
    "chain.<locals>.update_fn",
    "named_chain.<locals>.update_fn",
  ):
    return None
  values = placement.closure_values(update)
  return list(values.get("update_fns") or [tx.update for _, tx in values.get("transforms") or ()])


def _labels_frozen(transforms: Mapping[Any, Any], param_labels: Any, params: Any) -> Any:
  """A bool at every leaf of ``params``: whether its label's transform sends updates to zero."""
  # An Equinox module of labels is callable: it is a label function only where its leaves are.
  labels = param_labels(params) if is_function(param_labels) else param_labels
  zero = {label for label, tx in transforms.items() if _zeroes(getattr(tx, "update", None))}
  return _expanded(jax.tree.map(lambda label: label in zero, labels), params)


def frozen_leaves(
  transforms: Mapping[Any, optax.GradientTransformation], param_labels: Any
) -> Callable[[optax.Params], Any]:
  r"""The ``frozen=`` of an ``optax.partition``: the leaves whose transform sends updates to zero.

  Fine-tuning freezes part of the model with ``optax.partition(transforms,
  param_labels)`` (``optax.multi_transform``), mapping the frozen labels to
  ``optax.set_to_zero()`` (or to ``optax.scale(0.0)``, a learning rate of
  ``0.0``, or a chain that ends in either, which are frozen too). Pass the same two arguments here, and the
  sharpness-aware transform before the partition perturbs and differentiates
  the trained leaves only:

  .. math::

    \epsilon_F = 0, \qquad
    \epsilon_T = \rho_t \, g_T / \|g_T\|, \qquad
    \text{output}_T = \nabla_T f(w_T + \epsilon_T, w_F), \qquad
    \text{output}_F = 0,

  for the trained leaves :math:`T` and the frozen ones :math:`F`.

  Args:
    transforms: the partition's mapping from labels to transformations.
    param_labels: the partition's labels: a pytree of labels with the
      structure of params (or a prefix of it), or a function params -> such
      a pytree.

  Returns:
    The ``frozen=`` of :func:`optax_gsam.gsam`, :func:`optax_gsam.sam` or
    :func:`optax_gsam.momentum_sam`, a function of the params that gives a
    pytree of bools, True where the leaf is frozen.

  Raises:
    ValueError: when no label's transform sends updates to zero: nothing would
      be frozen.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> params = {"base": jnp.ones(3), "adapter": jnp.zeros(3)}
    >>> labels = {"base": "frozen", "adapter": "trained"}
    >>> transforms = {"trained": optax.adam(1e-3), "frozen": optax.set_to_zero()}
    >>> tx = optax.chain(
    ...   optax_gsam.sam(0.05, frozen=optax_gsam.frozen_leaves(transforms, labels)),
    ...   optax.partition(transforms, labels),
    ... )
    >>> loss_fn = lambda p: jnp.sum((p["base"] * (1.0 + p["adapter"]) - 2.0) ** 2)
    >>> grads = jax.grad(loss_fn)(params)
    >>> updates, state = tx.update(grads, tx.init(params), params, loss_fn=loss_fn)
    >>> float(jnp.abs(updates["base"]).max())
    0.0
  """
  if not any(_zeroes(getattr(tx, "update", None)) for tx in transforms.values()):
    raise ValueError(
      f"No transformation among the labels {sorted(map(str, transforms))} sends updates to "
      "zero (optax.set_to_zero(), optax.scale(0.0)), so nothing is frozen. Map the frozen labels to "
      "optax.set_to_zero(), or pass frozen= a pytree of bools (True: frozen)."
    )

  def frozen_of(params: optax.Params) -> Any:
    try:
      return _labels_frozen(transforms, param_labels, params)
    except ValueError as error:
      raise ValueError(
        f"The labels of frozen_leaves do not match these params ({error})."
        + _inject_hyperparams_hint()
      ) from error

  return frozen_of


# --- A later stage that freezes what the transform perturbs ---------------------------------


def _frozen_by(update: Any, params: optax.Params) -> Any:
  """The leaves that the stage with this update function freezes (bools), or None if none."""
  update = placement.unwrapped_update(update)
  code = getattr(update, "__code__", None)
  if code is None or placement.OPTAX_DIR not in code.co_filename:
    return None
  value = placement.closure_values(update).get
  if code.co_qualname == "partition.<locals>.update_fn":
    transforms, labels = value("transforms"), value("param_labels")
    if isinstance(transforms, Mapping):
      return _labels_frozen(transforms, labels, params)
  elif code.co_qualname == "masked.<locals>.update_fn" and _zeroes(
    getattr(value("inner"), "update", None)
  ):
    mask: Any = value("mask")
    return _expanded(mask(params) if is_function(mask) else mask, params)
  elif (fns := _chain_updates(update)) is not None:
    if fns and _zeroes(fns[-1]):
      return jax.tree.map(lambda _: True, params)
    return _any_of([_frozen_by(fn, params) for fn in fns])
  return None


def _any_of(trees: list[Any]) -> Any:
  """Leafwise or of the bool trees that are not None; None if all are."""
  found = [tree for tree in trees if tree is not None]
  if not found:
    return None
  return jax.tree.map(lambda *flags: any(flags), *found)


def _later_stages() -> list[Callable]:
  """The update functions that the optax chains around the transform run after it, from the
  innermost chain out."""
  frame: types.FrameType | None = sys._getframe(1)
  stages: list[Callable] = []
  while frame is not None:
    stages += placement.later_stages(frame) or []
    frame = frame.f_back
  return stages


def warn_if_frozen_later(name: str, frozen: FrozenOrFn, mask: Any, params: optax.Params) -> None:
  """Warns where a later stage of the chain freezes leaves that the default mask perturbs.

  Those leaves' perturbation changes the trained leaves' gradient, and their own
  perturbed gradient is computed and thrown away. An explicit ``mask`` says
  which leaves to perturb, so it is not second-guessed.
  """
  if mask is not None:
    return
  try:
    later = _any_of([_frozen_by(fn, params) for fn in _later_stages()])
  except Exception:  # a label function of the user's that fails here: no warning, no error
    return
  if later is None:
    return
  trained = jax.tree.map(lambda _: False, params)
  if frozen is not None:
    trained = resolve_frozen(frozen, params)
  paths = [
    jax.tree_util.keystr(path)
    for (path, late), told in zip(
      jax.tree_util.tree_leaves_with_path(later), jax.tree.leaves(trained), strict=True
    )
    if late and not told
  ]
  if paths:
    warnings.warn(
      f"{name} perturbs leaves that a later stage of the chain freezes (optax.set_to_zero() "
      f"or optax.scale(0.0) in optax.partition, or optax.freeze): {', '.join(paths[:5])}"
      f"{' ...' if len(paths) > 5 else ''}. Their perturbation changes the trained leaves' "
      "gradient, and their own gradient is taken and discarded. To perturb and differentiate "
      "only what is trained, pass frozen=optax_gsam.frozen_leaves(transforms, param_labels) "
      "(the partition's own arguments) or frozen=freeze_mask; to perturb them on purpose, "
      "select them with mask= (docs/fine_tuning.md).",
      UserWarning,
      stacklevel=4,
    )
