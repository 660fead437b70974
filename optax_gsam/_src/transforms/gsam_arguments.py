"""The arguments of :func:`optax_gsam.gsam` and :func:`optax_gsam.sam`: checks and aliases.

Every check runs when the transform is built and names the argument it
refuses. The deprecated keywords (:data:`DEPRECATED_KEYWORDS`) keep working:
each call that gives one warns once, naming the replacement, and the keyword
is then read as its replacement would be, so both give the same program.
"""

from __future__ import annotations

import warnings
from typing import Any
from typing import TypedDict

import optax

from optax_gsam._src.calls.placement import check_not_masked
from optax_gsam._src.core.validation import check_axis_name
from optax_gsam._src.core.validation import check_data_axis_is_set
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.core.validation import check_update_inputs
from optax_gsam._src.directions import perturbation as pert
from optax_gsam._src.directions.ascent_checks import check_ascent
from optax_gsam._src.microbatches import microbatch_state as micro
from optax_gsam._src.policies.policies import SharpnessPolicy
from optax_gsam._src.step import step
from optax_gsam.typing import Adaptive
from optax_gsam.typing import AxisName

ON_NONFINITE_CHOICES = ("propagate", "clean")


class SharpnessOptions(TypedDict, total=False):
  """The keywords :func:`optax_gsam.gsam` and :func:`optax_gsam.sam` share, documented in gsam's
  docstring; their defaults are :data:`SHARPNESS_DEFAULTS`."""

  eps: float
  ascent: optax.GradientTransformation | None
  ascent_steps: int | None
  mask: Any
  frozen: Any
  policy: SharpnessPolicy | None
  microbatches: int | None
  perturb_each_microbatch: bool
  sync_perturbation: bool
  axis_name: AxisName
  check_axis: bool
  on_nonfinite: str
  diagnostics: bool
  # Deprecated aliases (DEPRECATED_KEYWORDS), kept working with a DeprecationWarning.
  adaptive: Adaptive
  perturb_every: int | None
  # Annotated as optax's common tests look for schedule arguments; None is "not given", which
  # optax.inject_hyperparams leaves static (a numeric default would be injected and "given").
  reuse_weight: optax.ScalarOrSchedule
  num_groups: int | None


SHARPNESS_DEFAULTS: dict[str, Any] = {
  "eps": 1e-12,
  "ascent": None,
  "ascent_steps": None,
  "mask": None,
  "frozen": None,
  "policy": None,
  "microbatches": None,
  "perturb_each_microbatch": False,
  "sync_perturbation": False,
  "axis_name": None,
  "check_axis": True,
  "on_nonfinite": "propagate",
  "diagnostics": True,
  "adaptive": None,
  "perturb_every": None,
  "reuse_weight": None,
  "num_groups": None,
}

# Deprecated keyword of gsam and sam -> what to write instead.
DEPRECATED_KEYWORDS = {
  "adaptive": "ascent=optax_gsam.adaptive_ascent(kind)",
  "perturb_every": "policy=optax_gsam.every_k_policy(k, reuse_weight=w)",
  "reuse_weight": "policy=optax_gsam.every_k_policy(k, reuse_weight=w)",
  "num_groups": "microbatches=G, perturb_each_microbatch=True",
}


def warn_deprecated(factory: str, given: Any, stacklevel: int) -> None:
  """One ``DeprecationWarning`` for the deprecated keywords in ``given`` (a mapping), if any.

  ``None`` means not given. ``stacklevel`` is ``warnings.warn``'s, from this function: the
  warning points at the caller of ``factory``.
  """
  used = [name for name in DEPRECATED_KEYWORDS if given.get(name) is not None]
  if not used:
    return
  fixes = "; ".join(f"{name}= (write {DEPRECATED_KEYWORDS[name]} instead)" for name in used)
  warnings.warn(
    f"optax_gsam.{factory}: deprecated keyword, to be removed after 1.0: {fixes}.",
    DeprecationWarning,
    stacklevel=stacklevel + 1,
  )


def check_call_arguments(rho, num_groups, perturb_every, check_axis) -> None:
  """The arguments of gsam that do not go into :class:`step.Settings`."""
  check_non_negative("rho", rho, allow_schedule=True)
  check_positive_int("num_groups", num_groups, allow_none=True)
  check_positive_int("perturb_every", perturb_every, allow_none=True)
  if not isinstance(check_axis, bool):
    raise ValueError(f"check_axis must be a bool, got {check_axis!r}.")


def microbatch_settings(microbatches, perturb_each_microbatch, num_groups, sync_perturbation):
  """``(num_groups, microbatches)`` of :class:`step.Settings`: per-micro-batch or whole-batch.

  The deprecated ``num_groups=G`` is ``microbatches=G, perturb_each_microbatch=True``.
  """
  check_positive_int("microbatches", microbatches, allow_none=True)
  if not isinstance(perturb_each_microbatch, bool):
    raise ValueError(f"perturb_each_microbatch must be a bool, got {perturb_each_microbatch!r}.")
  if microbatches is None:
    if perturb_each_microbatch:
      raise ValueError("perturb_each_microbatch=True needs microbatches=k (the number of them).")
    return num_groups, None
  if num_groups is not None:
    raise ValueError(
      "microbatches and num_groups both split the step; num_groups=G is microbatches=G with "
      "perturb_each_microbatch=True (and loss_fn(params, index) when no batch is passed)."
    )
  if perturb_each_microbatch and sync_perturbation:
    raise ValueError(
      "perturb_each_microbatch=True perturbs each micro-batch along its own gradient, and "
      "sync_perturbation=True along the global one: choose one."
    )
  return (microbatches, None) if perturb_each_microbatch else (None, microbatches)


def check_perturb(perturb: Any, policy: SharpnessPolicy) -> None:
  """``update``'s ``perturb=``: ``None`` or a static bool, and never a branch the policy lacks."""
  if perturb is not None and not isinstance(perturb, bool):
    raise ValueError(
      f"perturb must be None or a Python bool (static; not an array), got {perturb!r}."
    )
  if perturb is False and policy.always_full:
    raise ValueError(
      "perturb=False takes the cheap step, which the default policy never takes: set "
      "policy= (e.g. optax_gsam.every_k_policy(k), or optax_gsam.every_step_policy("
      "skip_zero_rho=True) for a plain base step at rho_t == 0)."
    )


def validated(settings: step.Settings) -> step.Settings:
  """Validates gsam's static arguments eagerly; every error names its argument."""
  check_non_negative("alpha", settings.alpha)
  check_positive("eps", settings.eps)
  if settings.adaptive not in pert.ADAPTIVE_CHOICES:
    raise ValueError(f"adaptive must be one of {pert.ADAPTIVE_CHOICES}, got {settings.adaptive!r}.")
  check_ascent(settings)
  for name, flag in (
    ("minimize_fp", settings.minimize_fp),
    ("sync_perturbation", settings.sync_perturbation),
    ("diagnostics", settings.diagnostics),
  ):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}.")
  check_axis_name(settings.axis_name)
  if settings.sync_perturbation and settings.axis_name is None:
    raise ValueError(
      "sync_perturbation=True needs axis_name: it averages the clean gradient over that axis."
    )
  if settings.num_groups is not None and settings.sync_perturbation:
    raise ValueError(
      "num_groups perturbs each group along its own gradient, and sync_perturbation=True "
      "along the global one: choose one."
    )
  if settings.num_groups is not None and settings.policy.uses_grad_norm:
    raise ValueError(
      f"policy={settings.policy.name!r} reads the clean gradient's norm, which per-micro-batch "
      "perturbation (num_groups, perturb_each_microbatch) never forms before its per-micro-batch passes; use it with "
      "perturb_each_microbatch=False, or pick another policy."
    )
  if settings.on_nonfinite not in ON_NONFINITE_CHOICES:
    raise ValueError(
      f"on_nonfinite must be one of {ON_NONFINITE_CHOICES}, got {settings.on_nonfinite!r}."
    )
  return settings


def check_update(updates, state, params, perturb, settings, check_axis, inputs):
  """Everything ``update`` can refuse before tracing anything, each with the fix.

  ``inputs`` are the micro-batch inputs (``batch=``, ``key=``, ``model_state=``).
  """
  check_perturb(perturb, settings.policy)
  check_not_masked(params)
  k = settings.split
  if updates is None and k is None:
    raise ValueError(
      "updates is None: pass the clean gradient of loss_fn at params (the usual "
      "jax.value_and_grad pass), or set microbatches=k so that the transform accumulates it "
      "over the micro-batches of batch=."
    )
  micro.check_inputs(inputs, k, updates, params, settings.num_groups is not None)
  check_update_inputs(params if updates is None else updates, params, state.stored_direction)
  if check_axis:
    check_data_axis_is_set(settings.axis_name)
