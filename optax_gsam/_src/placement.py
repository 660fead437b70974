"""Where gsam/sam/momentum_sam sit among other transformations: the placements that would be wrong.

The transforms recompute the gradient themselves, at the perturbed weights, from
``loss_fn``. Whatever an earlier stage of an ``optax.chain`` did to the
incoming gradient (clipping, weight decay) would therefore be lost, and
``optax.MultiSteps`` would hand them an accumulated gradient with only the last
micro-batch's ``loss_fn``. Neither can give the documented result, so both are
refused while the update is traced, with the fix. ``optax.masked`` around the
transform is refused where its params reach the loss (see
:func:`check_not_masked`).

The checks read the Python call stack at trace time (never in the compiled
step): optax's ``chain`` and ``MultiSteps`` leave no other trace in what the
transform receives. They fail open: an optax release that renames the frames'
variables disables them rather than raising.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import jax
import optax

_OPTAX_DIR = f"{os.sep}optax{os.sep}"

MICROBATCH_FIX = (
  "For gradient accumulation, use the transform's own micro-batches: "
  "gsam(..., microbatches=k) and update(None, opt_state, params, "
  "loss_fn=lambda p, microbatch: ..., batch=batch), which accumulates the clean and the "
  "perturbed gradient exactly over the k micro-batches in one micro-batch's memory "
  "(docs/large_batches.md)."
)

CHAIN_FIX = (
  "gsam/sam/momentum_sam must come first in optax.chain: they take the gradient again at "
  "the perturbed weights from loss_fn, so whatever a stage before them did to the gradient "
  "(clipping, weight decay, ...) would be silently lost. Put those stages after the "
  "transform, e.g. optax.chain(optax_gsam.sam(0.05), optax.clip_by_global_norm(1.0), "
  "optax.add_decayed_weights(1e-4), optax.sgd(0.1)), where they apply to the sharpness-aware "
  "gradient (docs/design.md, 'Where the transform sits')."
)


def _is_multisteps(value: Any) -> bool:
  return isinstance(value, optax.MultiSteps)


def _is_late_in_chain(frame: Any) -> bool:
  """Whether ``frame`` is optax.chain's update calling a transform that is not its first."""
  code = frame.f_code
  if code.co_qualname != "chain.<locals>.update_fn" or _OPTAX_DIR not in code.co_filename:
    return False
  local = frame.f_locals
  update_fns, current = local.get("update_fns"), local.get("fn")
  if not isinstance(update_fns, (tuple, list)) or current is None or not update_fns:
    return False
  return current is not update_fns[0]


def check_not_in_multisteps(name: str) -> None:
  """Raises a ValueError where ``name``'s init runs inside ``optax.MultiSteps``.

  Its ``update`` would be refused anyway; at ``init`` the refusal comes before
  ``MultiSteps.update`` can fail on its own (on ``update(None, ...)``, the
  micro-batched call, with a pytree-structure error that does not name the fix).
  """
  frame: types.FrameType | None = sys._getframe(1)
  while frame is not None:
    if _is_multisteps(frame.f_locals.get("self")):
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
    if _is_multisteps(frame.f_locals.get("self")):
      raise ValueError(
        f"{name} runs inside optax.MultiSteps, which would give a silently wrong step: it "
        "passes the gradient accumulated over k calls, but the perturbed pass would evaluate "
        "only the last call's loss_fn (and run on every call). " + MICROBATCH_FIX
      )
    if _is_late_in_chain(frame):
      raise ValueError(f"{name} is not the first transformation of its optax.chain. " + CHAIN_FIX)
    frame = frame.f_back


def check_not_masked(params: optax.Params) -> None:
  """``optax.masked`` around the transform hands it params with ``optax.MaskedNode`` holes."""
  is_hole = lambda x: isinstance(x, optax.MaskedNode)
  if any(is_hole(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_hole)):
    raise ValueError(
      "gsam/sam got params with optax.MaskedNode leaves: optax.masked around the transform "
      "would call loss_fn on params with holes. Perturb a subset of the parameters with the "
      "transform's own mask instead, e.g. optax_gsam.sam(0.05, mask=mask), where every leaf's "
      "gradient is still taken at the perturbed point (docs/directions.md)."
    )
