"""optax_gsam: sharpness-aware training (GSAM, SAM) as optax transformations.

The whole public API is listed in ``__all__`` below; everything under
``optax_gsam._src`` is private.
"""

import types as _types

from optax_gsam._src.calls.placement import passthrough
from optax_gsam._src.directions.ascent import FriendlyAscentState
from optax_gsam._src.directions.ascent import VassoState
from optax_gsam._src.directions.ascent import adaptive_ascent
from optax_gsam._src.directions.ascent import friendly_ascent
from optax_gsam._src.directions.ascent import normalized_ascent
from optax_gsam._src.directions.ascent import vasso_ascent
from optax_gsam._src.directions.perturbation import GradientStats
from optax_gsam._src.directions.perturbation import decompose
from optax_gsam._src.directions.perturbation import gradient_stats
from optax_gsam._src.directions.perturbation import orthogonal_component
from optax_gsam._src.directions.perturbation import perturbation
from optax_gsam._src.directions.perturbation import reuse_direction
from optax_gsam._src.directions.perturbation import stable_global_norm
from optax_gsam._src.fine_tuning.frozen import frozen_leaves
from optax_gsam._src.gradient_cache.contrastive import clip_loss
from optax_gsam._src.gradient_cache.contrastive import siglip_loss
from optax_gsam._src.gradient_cache.gradient_cache import cached_value_and_grad
from optax_gsam._src.measures.hessian import SpectralDensity
from optax_gsam._src.measures.hessian import TraceEstimate
from optax_gsam._src.measures.hessian import hessian_eigenvalues
from optax_gsam._src.measures.hessian import hessian_spectral_density
from optax_gsam._src.measures.hessian import hessian_trace
from optax_gsam._src.measures.hessian import hessian_vector_product
from optax_gsam._src.measures.worst_case import m_sharpness
from optax_gsam._src.microbatches.microbatch_state import accumulate_value_and_grad
from optax_gsam._src.parallel.distributed import data_parallel
from optax_gsam._src.parallel.distributed import emulate_devices
from optax_gsam._src.policies.policies import GradientNormState
from optax_gsam._src.policies.policies import RandomPolicyState
from optax_gsam._src.policies.policies import SharpnessPolicy
from optax_gsam._src.policies.policies import every_k_policy
from optax_gsam._src.policies.policies import every_step_policy
from optax_gsam._src.policies.policies import gradient_norm_policy
from optax_gsam._src.policies.policies import random_policy
from optax_gsam._src.policies.schedules import rho_from_lr
from optax_gsam._src.policies.schedules import schedule_extrema
from optax_gsam._src.step.state import GSAMState
from optax_gsam._src.step.step_due import full_step_due
from optax_gsam._src.trajectory.loss import trajectory_loss
from optax_gsam._src.trajectory.mesa import MESAState
from optax_gsam._src.trajectory.mesa import mesa_ema
from optax_gsam._src.trajectory.mesa import mesa_targets
from optax_gsam._src.trajectory.saf import SAFStore
from optax_gsam._src.trajectory.saf import saf_record
from optax_gsam._src.trajectory.saf import saf_store
from optax_gsam._src.trajectory.saf import saf_targets
from optax_gsam._src.transforms.momentum_sam import MomentumSAMState
from optax_gsam._src.transforms.momentum_sam import momentum_sam
from optax_gsam._src.transforms.sharpness import gsam
from optax_gsam._src.transforms.sharpness import sam

__version__ = "0.1.0"

__all__ = (
  "FriendlyAscentState",
  "GSAMState",
  "GradientNormState",
  "GradientStats",
  "MESAState",
  "MomentumSAMState",
  "RandomPolicyState",
  "SAFStore",
  "SharpnessPolicy",
  "SpectralDensity",
  "TraceEstimate",
  "VassoState",
  "accumulate_value_and_grad",
  "adaptive_ascent",
  "cached_value_and_grad",
  "clip_loss",
  "data_parallel",
  "decompose",
  "emulate_devices",
  "every_k_policy",
  "every_step_policy",
  "friendly_ascent",
  "frozen_leaves",
  "full_step_due",
  "gradient_norm_policy",
  "gradient_stats",
  "gsam",
  "hessian_eigenvalues",
  "hessian_spectral_density",
  "hessian_trace",
  "hessian_vector_product",
  "m_sharpness",
  "mesa_ema",
  "mesa_targets",
  "momentum_sam",
  "normalized_ascent",
  "orthogonal_component",
  "passthrough",
  "perturbation",
  "random_policy",
  "reuse_direction",
  "rho_from_lr",
  "saf_record",
  "saf_store",
  "saf_targets",
  "sam",
  "schedule_extrema",
  "siglip_loss",
  "stable_global_norm",
  "trajectory_loss",
  "vasso_ascent",
)


# The integration modules load on first use, so that `import optax_gsam` alone makes
# `optax_gsam.flax` and `optax_gsam.big_vision` usable without the core import paying for
# flax.training and flax.nnx.
_SUBMODULES = ("big_vision", "flax")


def __getattr__(name: str) -> _types.ModuleType:
  if name in _SUBMODULES:
    import importlib

    return importlib.import_module(f"optax_gsam.{name}")
  raise AttributeError(f"module 'optax_gsam' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_SUBMODULES})
