"""Where gsam/sam/momentum_sam sit among other transformations: the placements that would be wrong.

The transforms recompute the gradient themselves, at the perturbed weights, from
``loss_fn``. Whatever an earlier stage of an ``optax.chain`` did to the
incoming gradient (clipping, weight decay) would therefore be lost, and
``optax.MultiSteps`` would hand them an accumulated gradient with only the last
micro-batch's ``loss_fn``. Neither can give the documented result, so both are
refused while the update is traced, with the fix. ``optax.masked`` around the
transform is refused where its params reach the loss (see
:func:`check_not_masked`).

What would lose nothing is accepted: stages before the transform that leave
the gradient as it is (``optax.identity()``, and any stage wrapped in
:func:`passthrough`, which discards its output), and ``optax.MultiSteps``
with ``every_k_schedule=1`` (an int), which accumulates nothing.

The checks read the Python call stack at trace time (never in the compiled
step): optax's ``chain``, ``named_chain`` and ``MultiSteps`` leave no other
trace in what the transform receives. They fail open: an optax release that
renames the frames' variables disables them rather than raising.
"""

from __future__ import annotations

import numbers
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import optax

OPTAX_DIR = f"{os.sep}optax{os.sep}"

# Raised here inside MICROBATCH_FIX, and alone by the micro-batch checks of a stateful
# step (microbatch_state.check_inputs).
HELPER_FIX = (
  "update() cannot return a new model_state (optax's update returns only the updates and "
  "the optimizer state): run the clean pass with (loss, new_model_state), grads = "
  "optax_gsam.accumulate_value_and_grad(loss_fn, params, batch, microbatches=k, "
  "model_state=model_state), then pass grads (not None) to update() with the same loss_fn, "
  "batch, model_state and key (docs/large_batches.md, 'State and randomness')."
)

MICROBATCH_FIX = (
  "For gradient accumulation, use the transform's own micro-batches: "
  "gsam(..., microbatches=k) and update(None, opt_state, params, "
  "loss_fn=lambda p, microbatch: ..., batch=batch), which accumulates the clean and the "
  "perturbed gradient exactly over the k micro-batches in one micro-batch's memory "
  "(docs/large_batches.md). With a model state (BatchNorm statistics), the loss is "
  "loss_fn(params, model_state, microbatch) -> (loss, new_model_state), and " + HELPER_FIX
)

CHAIN_FIX = (
  "gsam/sam/momentum_sam must come first in optax.chain: they take the gradient again at "
  "the perturbed weights from loss_fn, so whatever a stage before them did to the gradient "
  "(clipping, weight decay, ...) would be silently lost. Put those stages after the "
  "transform, e.g. optax.chain(optax_gsam.sam(0.05), optax.clip_by_global_norm(1.0), "
  "optax.add_decayed_weights(1e-4), optax.sgd(0.1)), where they apply to the sharpness-aware "
  "gradient (docs/design.md, 'Where the transform sits'). A stage that only reads the "
  "gradient (logging its norm, say) can stay before the transform wrapped in "
  "optax_gsam.passthrough(stage), which keeps its state and passes the gradient on unchanged."
)


def passthrough(
  tx: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  r"""A stage that runs ``tx`` for its state and passes the gradient on unchanged.

  .. math::

    (u, s_{t+1}) = \text{tx.update}(g, s_t, w), \qquad \text{output} = g

  ``gsam``, ``sam`` and ``momentum_sam`` refuse a stage before them in an
  ``optax.chain`` or ``optax.named_chain``, since they take the gradient again
  at the perturbed weights and whatever such a stage did to it would be lost.
  A stage that only reads the gradient (logging its norm, counting steps) is
  safe there once wrapped: the wrapper discards ``tx``'s output, so nothing
  can be lost, and the placement check lets it stand before the transform.
  ``optax.identity()`` needs no wrapper.

  Args:
    tx: any ``optax.GradientTransformation``; extra args reach it where it
      takes them.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with ``tx``'s state, whose
    output is its input ``updates``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> def log_norm():
    ...   def update_fn(updates, state, params=None):
    ...     return updates, optax.tree.norm(updates)  # the state holds the last norm
    ...   return optax.GradientTransformation(lambda p: jnp.zeros([]), update_fn)
    >>> tx = optax.chain(
    ...   optax_gsam.passthrough(log_norm()), optax_gsam.sam(0.05), optax.sgd(0.1)
    ... )
    >>> loss_fn = lambda w: jnp.sum(jnp.cos(w))
    >>> w = jnp.ones(4)
    >>> updates, state = tx.update(jax.grad(loss_fn)(w), tx.init(w), w, loss_fn=loss_fn)
    >>> round(float(state[0]), 4)  # the norm of the clean gradient
    1.6829
  """
  inner = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    _, state = inner.update(updates, state, params, **extra_args)
    return updates, state

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


_PASSTHROUGH_CODE = passthrough(optax.identity()).update.__code__


def closure_values(fn: Callable) -> dict[str, Any]:
  """The variables ``fn`` closes over, by name (an optax combinator's arguments)."""
  code = getattr(fn, "__code__", None)
  if code is None:
    return {}
  cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False)
  return {name: cell.cell_contents for name, cell in cells}


def unwrapped_update(fn: Callable) -> Callable:
  """The update function that ``optax.with_extra_args_support`` wraps, or ``fn`` itself."""
  code = getattr(fn, "__code__", None)
  if code is None or code.co_qualname != "with_extra_args_support.<locals>.update":
    return fn
  return getattr(closure_values(fn).get("tx"), "update", fn)


def _leaves_gradient_unchanged(fn: Callable) -> bool:
  """``optax.identity()``'s update, or one of :func:`passthrough`: nothing before us is lost."""
  code = getattr(unwrapped_update(fn), "__code__", None)
  if code is None:
    return False
  if code is _PASSTHROUGH_CODE:
    return True
  return code.co_qualname == "identity.<locals>.update_fn" and OPTAX_DIR in code.co_filename


def _chain_stages(frame: Any) -> tuple[list[Callable], int] | None:
  """The update functions of the optax chain running in ``frame``, and the one it is calling."""
  code = frame.f_code
  if OPTAX_DIR not in code.co_filename:
    return None
  local = frame.f_locals
  if code.co_qualname == "chain.<locals>.update_fn":
    update_fns, current = local.get("update_fns"), local.get("fn")
    if not isinstance(update_fns, (tuple, list)) or current is None:
      return None
    fns = list(update_fns)
  elif code.co_qualname == "named_chain.<locals>.update_fn":
    transforms, current = local.get("transforms"), local.get("tx")
    if not isinstance(transforms, (tuple, list)) or current is None:
      return None
    fns, current = [t.update for _, t in transforms], current.update
  else:
    return None
  index = next((i for i, fn in enumerate(fns) if fn is current), None)
  return None if index is None else (fns, index)


def _earlier_stages(frame: Any) -> list[Callable] | None:
  """The update functions an optax chain ran before the one it is calling; None if not a chain."""
  stages = _chain_stages(frame)
  return None if stages is None else stages[0][: stages[1]]


def later_stages(frame: Any) -> list[Callable] | None:
  """The update functions an optax chain runs after the one it is calling; None if not a chain."""
  stages = _chain_stages(frame)
  return None if stages is None else stages[0][stages[1] + 1 :]


def _is_late_in_chain(frame: Any) -> bool:
  """Whether ``frame`` is an optax chain calling a transform after a stage that may change it."""
  earlier = _earlier_stages(frame)
  return earlier is not None and not all(_leaves_gradient_unchanged(fn) for fn in earlier)


_UNKNOWN = object()


def _accumulates(frame: Any) -> bool:
  """Whether a frame of ``optax.MultiSteps`` may accumulate over more than one call.

  ``every_k_schedule=1`` (a Python int) hands on each call's gradient as it is.
  The frames of its nested functions that do not read ``k_steps`` are left to
  ``update``'s own frame, which does.
  """
  k_steps = frame.f_locals.get("k_steps", _UNKNOWN)
  if k_steps is _UNKNOWN:
    return frame.f_code.co_name == "update"
  return not _is_one(k_steps)


def _is_one(k_steps: Any) -> bool:
  return isinstance(k_steps, numbers.Integral) and not isinstance(k_steps, bool) and k_steps == 1


def check_not_in_multisteps(name: str) -> None:
  """Raises a ValueError where ``name``'s init runs inside ``optax.MultiSteps``.

  Its ``update`` would be refused anyway; at ``init`` the refusal comes before
  ``MultiSteps.update`` can fail on its own (on ``update(None, ...)``, the
  micro-batched call, with a pytree-structure error that does not name the fix).
  """
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None:
    owner = frame.f_locals.get("self")
    # At init no frame reads k_steps; an int schedule is wrapped as a function returning it.
    if isinstance(owner, optax.MultiSteps) and not _is_one(owner._every_k_schedule(0)):
      raise ValueError(
        f"{name} inside optax.MultiSteps would give a silently wrong step: MultiSteps passes "
        "the gradient accumulated over k calls, but the perturbed pass would evaluate only the "
        "last call's loss_fn (and run on every call). " + MICROBATCH_FIX
      )
    frame = frame.f_back


def check_placement(name: str) -> None:
  """Raises a ValueError where ``name``'s update runs inside optax.MultiSteps or late in a chain."""
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None:
    if isinstance(frame.f_locals.get("self"), optax.MultiSteps) and _accumulates(frame):
      raise ValueError(
        f"{name} runs inside optax.MultiSteps, which would give a silently wrong step: it "
        "passes the gradient accumulated over k calls, but the perturbed pass would evaluate "
        "only the last call's loss_fn (and run on every call). " + MICROBATCH_FIX
      )
    if _is_late_in_chain(frame):
      raise ValueError(f"{name} is not the first transformation of its optax.chain. " + CHAIN_FIX)
    frame = frame.f_back


def check_last_in_chain(name: str, fix: str) -> None:
  """Raises a ValueError where ``name``'s update runs before a stage that may change the updates.

  A transform that reads ``params + updates`` as the new weights (an average of the weights,
  say) is right only where nothing after it changes the updates; ``optax.identity()`` and
  :func:`passthrough` stages after it are allowed. Nested chains are checked at every level.
  """
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None:
    later = later_stages(frame)
    if later and not all(_leaves_gradient_unchanged(fn) for fn in later):
      raise ValueError(f"{name} is not the last transformation of its optax.chain. " + fix)
    frame = frame.f_back


def optax_frame_on_stack(qualname: str) -> bool:
  """Whether a function of optax with this ``__qualname__`` is on the call stack."""
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None:
    code = frame.f_code
    if code.co_qualname == qualname and OPTAX_DIR in code.co_filename:
      return True
    frame = frame.f_back
  return False


def check_not_masked(params: optax.Params, name: str = "gsam/sam") -> None:
  """``optax.masked`` around the transform hands it params with ``optax.MaskedNode`` holes.

  So does ``optax.partition``, which runs each group's transformation inside
  ``optax.masked``; the message then gives the fine-tuning form.
  """
  is_hole = lambda x: isinstance(x, optax.MaskedNode)
  if not any(is_hole(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_hole)):
    return
  if optax_frame_on_stack("partition.<locals>.update_fn"):
    raise ValueError(
      f"{name} runs inside one group of optax.partition (optax.multi_transform), which hands "
      "it params with holes: loss_fn would be called on part of the model. Put the transform "
      "first in a chain, before the partition, and tell it which leaves are frozen: "
      "optax.chain(optax_gsam.sam(0.05, frozen=optax_gsam.frozen_leaves(transforms, labels)), "
      "optax.partition(transforms, labels)), with the frozen labels mapped to "
      "optax.set_to_zero(). To perturb only some of the trained leaves, add mask= "
      "(docs/fine_tuning.md)."
    )
  raise ValueError(
    f"{name} got params with optax.MaskedNode leaves: optax.masked around the transform "
    "would call loss_fn on params with holes. Perturb a subset of the parameters with the "
    "transform's own mask instead, e.g. optax_gsam.sam(0.05, mask=mask) or "
    "optax_gsam.momentum_sam(0.05, mask=mask), where every leaf's "
    "gradient is still taken at the perturbed point (docs/directions.md); to freeze leaves "
    "(optax.freeze), pass the same mask as frozen= (docs/fine_tuning.md)."
  )
