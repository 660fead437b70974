"""When to take the full (perturbed) step: the cheap-step policies of gsam and sam.

A sharpness-aware step costs two gradient evaluations. A policy decides, at
each step, between the *full* step (perturb, evaluate the loss again,
decompose) and a *cheap* step that needs only the clean gradient the caller
already has. The cheap step either outputs the clean gradient, so the chain
takes a plain base-optimizer step (``cheap="clean"``), or adds back the stored
component of the last full step's output that is orthogonal to the clean
gradient (``cheap="reuse"``, LookSAM).

A policy is a :class:`SharpnessPolicy`: a small bundle of pure functions,
shaped like optax's own ``(init, update)`` pairs. Its state lives in
``GSAMState.policy_state``. Every policy except the default skips the
perturbed pass where :math:`\\rho_t = 0` (a perturbation of radius 0 changes
nothing), so "SAM only late in training" is a rho schedule that starts at 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_gsam._src.core.keywords import runtime_signature
from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.core.validation import check_positive
from optax_gsam._src.core.validation import check_positive_int
from optax_gsam._src.core.validation import check_prng_key
from optax_gsam._src.core.validation import check_unit_interval
from optax_gsam._src.core.validation import is_real_number
from optax_gsam._src.directions.perturbation import DEFAULT_MAX_AMPLIFICATION
from optax_gsam._src.directions.perturbation import REUSE_SCALES
from optax_gsam._src.policies.schedules import value_at
from optax_gsam.typing import DecideFn

CHEAP_CHOICES = ("reuse", "clean")
DEFAULT_REUSE_WEIGHT = 0.7
DEFAULT_REUSE_STEPS = 2  # every_k_policy: the cheap steps after a full step that reuse
# gradient_norm_policy: the most one ||g_c||^2 may weigh in the statistics, as a multiple of their
# bias-corrected mean (10: a gradient norm about 3.2 times its recent RMS). A 1e10 spike then stops
# full steps for 9 steps at decay 0.9 and threshold 0, not 417; docs/policies.md has the figures.
DEFAULT_SPIKE_CAP = 10.0


class SharpnessPolicy(NamedTuple):
  """When :func:`optax_gsam.gsam` takes the full step, and what its cheap step does.

  Attributes:
    name: a short label for messages and tables.
    init: ``() -> policy_state``, a pytree of arrays (``optax.EmptyState()``
      when the policy keeps none).
    decide: ``(policy_state, count, grad_sq_norm) -> (due, new_policy_state)``,
      pure and jittable. ``due`` is a bool scalar array, or the Python bool
      ``True`` for a policy that always takes the full step (no conditional is
      traced then). ``grad_sq_norm`` is :math:`\\|g_c\\|^2`, averaged over the
      data axis, when ``uses_grad_norm``; ``None`` otherwise.
    cheap: ``"clean"`` (output :math:`g_c`) or ``"reuse"`` (output :math:`g_c`
      plus the stored direction, rescaled: :func:`optax_gsam.reuse_direction`).
    reuse_weight: :math:`\\lambda_t` of ``cheap="reuse"``, a float or schedule.
    reuse_scale: how ``cheap="reuse"`` rescales the stored direction:
      ``"relative"``, ``"global"`` or ``"per_leaf"`` (see
      :func:`optax_gsam.reuse_direction`).
    max_amplification: the most a reuse step may enlarge the stored direction
      over the size its full step gave it; beyond it the step outputs
      :math:`g_c` (``None``: no limit).
    uses_grad_norm: whether ``decide`` reads :math:`\\|g_c\\|^2`.
    skip_zero_rho: whether a step with :math:`\\rho_t = 0` takes the cheap
      step (as ``cheap="clean"``: the clean gradient, which is exactly the
      full step's output at radius 0).
  """

  name: str
  init: Callable[[], Any]
  decide: DecideFn
  cheap: str = "clean"
  reuse_weight: optax.ScalarOrSchedule = DEFAULT_REUSE_WEIGHT
  uses_grad_norm: bool = False
  skip_zero_rho: bool = True
  reuse_scale: str = "relative"
  max_amplification: float | None = DEFAULT_MAX_AMPLIFICATION

  @property
  def always_full(self) -> bool:
    """True where no step can be cheap: no conditional and no stored direction."""
    return self.name == "every_step" and not self.skip_zero_rho

  @property
  def stores_direction(self) -> bool:
    return self.cheap == "reuse"


class GradientNormState(NamedTuple):
  """Running statistics of :math:`s_t = \\|g_c\\|^2` kept by :func:`gradient_norm_policy`.

  Attributes:
    mean: :math:`\\mu_t`, the moving mean of :math:`s_t`.
    std: :math:`\\sigma_t`, the square root of the moving variance. It is kept
      rather than :math:`\\sigma_t^2`, which is of the order of
      :math:`\\|g_c\\|^4` and would overflow float32 at a gradient norm of
      about :math:`10^{10}`.
  """

  mean: jax.Array
  std: jax.Array


class RandomPolicyState(NamedTuple):
  """The PRNG key of :func:`random_policy`, split once per decision.

  Attributes:
    key: the key's raw data (``jax.random.key_data``, uint32), so that the
      state serializes with ``flax.serialization`` and orbax alike; the policy
      rewraps it with the key's implementation.
  """

  key: jax.Array


def _check_cheap(cheap: str, reuse_weight) -> None:
  if cheap not in CHEAP_CHOICES:
    raise ValueError(f"cheap must be one of {CHEAP_CHOICES}, got {cheap!r}.")
  check_non_negative("reuse_weight", reuse_weight, allow_schedule=True)


def every_step_policy(*, skip_zero_rho: bool = False) -> SharpnessPolicy:
  r"""The full step at every step: plain GSAM/SAM (the default).

  With ``skip_zero_rho=True``, steps where :math:`\rho_t = 0` output the clean
  gradient :math:`g_c` without the perturbed pass (a perturbation of radius 0
  leaves :math:`g = g_c`), so they cost what a base step costs. That needs a
  ``lax.cond`` in the jitted step, which XLA's CPU backend runs slowly around
  convolutions (jax-ml/jax#12868), so it is opt-in here; the static
  ``update(..., perturb=False)`` does the same without a conditional.

  Args:
    skip_zero_rho: skip the perturbed pass where :math:`\rho_t = 0`.

  Returns:
    A :class:`SharpnessPolicy` for ``gsam(..., policy=...)``.

  Example:
    >>> import optax, optax_gsam
    >>> late = optax.join_schedules(
    ...   [optax.constant_schedule(0.0), optax.constant_schedule(0.05)], [750])
    >>> tx = optax_gsam.sam(late, policy=optax_gsam.every_step_policy(skip_zero_rho=True))

  References:
    Zhou et al., `Sharpness-Aware Minimization Efficiently Selects Flatter
    Minima Late in Training <https://arxiv.org/abs/2410.10373>`_, ICLR 2025.
  """
  if not isinstance(skip_zero_rho, bool):
    raise ValueError(f"skip_zero_rho must be a bool, got {skip_zero_rho!r}.")
  return SharpnessPolicy(
    name="every_step",
    init=optax.EmptyState,
    decide=lambda state, count, grad_sq_norm: (True, state),
    skip_zero_rho=skip_zero_rho,
  )


def _check_reuse_scale(reuse_scale: str, max_amplification) -> None:
  if reuse_scale not in REUSE_SCALES:
    raise ValueError(f"reuse_scale must be one of {REUSE_SCALES}, got {reuse_scale!r}.")
  if max_amplification is not None:
    check_positive("max_amplification", max_amplification)


@runtime_signature
def every_k_policy(
  k: int,
  *,
  reuse_weight: optax.ScalarOrSchedule = DEFAULT_REUSE_WEIGHT,
  cheap: str = "reuse",
  reuse_scale: str = "relative",
  max_amplification: float | None = DEFAULT_MAX_AMPLIFICATION,
  reuse_steps: int | None = DEFAULT_REUSE_STEPS,
) -> SharpnessPolicy:
  r"""The full step every ``k`` steps (LookSAM).

  The full step is taken at steps :math:`t \equiv 0 \pmod k`. With
  ``cheap="reuse"`` it stores :math:`u = g^{\perp g_c} / \|g_c\|`: the part of
  its output :math:`g` orthogonal to its clean gradient, relative to that
  gradient's norm. The steps in between output, at their own clean gradient
  :math:`g_c` and reuse weight :math:`\lambda_t`,

  .. math::

    g = \begin{cases}
      g_c + \lambda_t \|g_c\|\, u / \max(\|u\|, 1)
        & \text{reuse\_scale="relative" (the default)} \\
      g_c + \lambda_t \|g_c\|\, u / \|u\|
        & \text{reuse\_scale="global" (LookSAM)} \\
      g_{c,i} + \lambda_t \|g_{c,i}\|\, u_i / \|u_i\| \ \text{for each leaf } i
        & \text{reuse\_scale="per\_leaf" (LookSAM's layer-wise form)}
    \end{cases}

  The relative form reuses the full step's orthogonal component at the share
  of the gradient the full step gave it, times :math:`\lambda_t`, and at most
  at LookSAM's share :math:`\lambda_t`. LookSAM's forms always rescale it to
  that share (of each leaf's gradient, per leaf), which enlarges it
  :math:`a_t = \lambda_t / \|u\|` times over the size the full step gave it.
  On the MNIST-1D CNN trained with AdamW at its tuned learning rate,
  :math:`\|u\|` was 0.2 to 0.4 and fell to 0.005 once training degraded, so
  minibatch noise was pushed at 70% of the gradient on every cheap step and
  the runs ended at chance (``benchmarks/README.md``).

  **Detection.** A cheap step whose :math:`a_t` (:math:`\lambda_t / \max(\|u\|,
  1)` for the relative form) exceeds ``max_amplification`` outputs :math:`g_c`
  instead: a plain base step, and no error. That step still counts as a cheap
  step (``full_steps`` does not grow). :math:`\|u\|` of the last full step is
  in the state: ``optax_gsam.stable_global_norm(optax.tree.get(opt_state,
  "stored_direction"))``, so :math:`a_t` can be logged.

  **Staleness.** Only the first ``reuse_steps`` cheap steps after a full step
  reuse :math:`u`; the others output :math:`g_c` (:math:`\lambda_t = 0` at
  :math:`t \bmod k >` ``reuse_steps``). At batch 100 on MNIST-1D the stored
  direction's cosine with the current step's own orthogonal part was 0.2 one
  step later and 0.1 two to four steps later; every 10 reusing all nine cheap
  steps lost 5 to 18 points to the base optimizer, reusing two lost none.

  Give it to :func:`optax_gsam.gsam` or :func:`optax_gsam.sam` as ``policy=``
  (the deprecated ``perturb_every=k, reuse_weight=w`` is this policy with the
  default ``reuse_scale``, ``max_amplification`` and ``reuse_steps``).

  Args:
    k: the period, an int >= 1.
    reuse_weight: :math:`\lambda_t`, a float >= 0 or a schedule.
    cheap: ``"reuse"`` (LookSAM) or ``"clean"`` (a plain base step in between).
    reuse_scale: ``"relative"``, ``"global"`` or ``"per_leaf"``.
    max_amplification: the largest :math:`a_t` that reuses, a float > 0, or
      ``None`` for no limit (LookSAM's forms exactly as published).
    reuse_steps: how many cheap steps after each full step reuse, an int >= 1,
      or ``None`` for all of them (LookSAM as published).

  Returns:
    A :class:`SharpnessPolicy`.

  Example:
    >>> import optax_gsam
    >>> tx = optax_gsam.gsam(0.05, 0.3, policy=optax_gsam.every_k_policy(5))
    >>> looksam = optax_gsam.every_k_policy(5, reuse_scale="per_leaf", max_amplification=None)

  References:
    Liu et al., `Towards Efficient and Scalable Sharpness-Aware Minimization
    <https://arxiv.org/abs/2203.02714>`_, CVPR 2022.
  """
  check_positive_int("k", k)
  _check_cheap(cheap, reuse_weight)
  _check_reuse_scale(reuse_scale, max_amplification)
  check_positive_int("reuse_steps", reuse_steps, allow_none=True)
  weight = reuse_weight
  if reuse_steps is not None and reuse_steps < k - 1:
    weight = lambda count: jnp.where(count % k <= reuse_steps, value_at(reuse_weight, count), 0.0)
  return SharpnessPolicy(
    name=f"every_{k}",
    init=optax.EmptyState,
    decide=lambda state, count, grad_sq_norm: (count % k == 0, state),
    cheap=cheap,
    reuse_weight=weight,
    reuse_scale=reuse_scale,
    max_amplification=max_amplification,
  )


def _capped(signal: jax.Array, mean: jax.Array, count: jax.Array, decay: float, cap: float):
  """``signal``, at most ``cap`` times the bias-corrected mean; uncapped while that mean is 0."""
  # mu_{t-1} weighs the t observations so far by 1 - decay^t in all: divide it out.
  weight = 1.0 - jnp.asarray(decay, jnp.float32) ** jnp.asarray(count, jnp.float32)
  limit = cap * mean / jnp.where(weight > 0, weight, 1.0)
  return jnp.where((mean > 0) & (weight > 0), jnp.minimum(signal, limit), signal)


@runtime_signature
def gradient_norm_policy(
  threshold: optax.ScalarOrSchedule = 0.0,
  *,
  decay: float = 0.9,
  cheap: str = "clean",
  reuse_weight: optax.ScalarOrSchedule = DEFAULT_REUSE_WEIGHT,
  spike_cap: float | None = DEFAULT_SPIKE_CAP,
) -> SharpnessPolicy:
  r"""The full step where the clean gradient is large for its recent history (AE-SAM).

  With :math:`s_t = \|g_c\|^2` (averaged over the data axis), the policy keeps
  exponential moving estimates of its mean and variance,

  .. math::

    \mu_t = \delta \mu_{t-1} + (1 - \delta) \tilde s_t, \qquad
    \sigma_t^2 = \delta \sigma_{t-1}^2 + (1 - \delta)(\tilde s_t - \mu_t)^2,
    \qquad \tilde s_t = \min\Big(s_t,\ \kappa \frac{\mu_{t-1}}{1 - \delta^t}\Big)

  (from :math:`\mu_{-1} = \sigma_{-1}^2 = 0`) and takes the full step when
  :math:`s_t \ge \mu_t + c_t \sigma_t`: a large gradient norm signals a sharp
  region. The paper raises :math:`c_t` linearly from -1 to 1 over training
  (``threshold=optax.linear_schedule(-1.0, 1.0, num_steps)``), so SAM is used
  often early and rarely late.

  The cap :math:`\kappa` (``spike_cap``) bounds what one observation may add to
  the statistics: at most :math:`\kappa` times their bias-corrected mean (no cap
  at :math:`t = 0` or while :math:`\mu_{t-1} = 0`). The step of a spike is
  still compared uncapped (it takes the full step), but the spike no longer
  holds :math:`\mu_t` and :math:`\sigma_t` above the usual :math:`s_t` for
  :math:`\log s / \log(1/\delta)` steps: with :math:`\kappa = 10` and
  :math:`\delta = 0.9`, full steps resume 9 steps after a spike of any size at
  :math:`c = 0` (41 at :math:`c = 1`). ``spike_cap=None`` is the paper's rule.
  A non-finite :math:`s_t` leaves the statistics unchanged. The state keeps
  :math:`\sigma_t` (as a ``hypot``), so no square overflows it.
  ``cheap="reuse"`` gives AE-LookSAM.

  Args:
    threshold: :math:`c_t`, a float or a schedule.
    decay: :math:`\delta` in [0, 1).
    cheap: ``"clean"`` (AE-SAM) or ``"reuse"`` (AE-LookSAM).
    reuse_weight: :math:`\lambda_t` of ``cheap="reuse"``.
    spike_cap: :math:`\kappa` > 1, the largest multiple of the statistics' mean
      that one observation enters them with, or ``None`` for no cap.

  Returns:
    A :class:`SharpnessPolicy` with state :class:`GradientNormState`.

  Example:
    >>> import optax, optax_gsam
    >>> policy = optax_gsam.gradient_norm_policy(optax.linear_schedule(-1.0, 1.0, 1000))
    >>> tx = optax.chain(optax_gsam.sam(0.05, policy=policy), optax.sgd(0.1))

  References:
    Jiang et al., `An Adaptive Policy to Employ Sharpness-Aware Minimization
    <https://arxiv.org/abs/2304.14647>`_, ICLR 2023.
  """
  if not callable(threshold) and not is_real_number(threshold):
    raise ValueError(f"threshold must be a float or a schedule, got {threshold!r}.")
  check_unit_interval("decay", decay, include_one=False)
  _check_cheap(cheap, reuse_weight)
  if spike_cap is not None and not (is_real_number(spike_cap) and 1 < spike_cap < math.inf):
    raise ValueError(
      f"spike_cap must be a float > 1, or None for no cap, got {spike_cap!r}: a cap at or below "
      "the mean would hold the statistics down for good."
    )

  def init():
    # Separate buffers, so that a donated state never holds one twice.
    return GradientNormState(mean=jnp.zeros([], jnp.float32), std=jnp.zeros([], jnp.float32))

  def decide(state, count, grad_sq_norm):
    signal = grad_sq_norm.astype(jnp.float32)
    observed = signal if spike_cap is None else _capped(signal, state.mean, count, decay, spike_cap)
    mean = decay * state.mean + (1 - decay) * observed
    # sigma_t^2 = decay sigma_{t-1}^2 + (1 - decay)(s_t - mu_t)^2, as a hypot: no square overflows.
    std = jnp.hypot(math.sqrt(decay) * state.std, math.sqrt(1 - decay) * (observed - mean))
    due = signal >= mean + value_at(threshold, count) * std
    finite = jnp.isfinite(signal) & jnp.isfinite(mean) & jnp.isfinite(std)
    new_state = GradientNormState(
      mean=jnp.where(finite, mean, state.mean), std=jnp.where(finite, std, state.std)
    )
    return due, new_state

  return SharpnessPolicy(
    name="gradient_norm",
    init=init,
    decide=decide,
    cheap=cheap,
    reuse_weight=reuse_weight,
    uses_grad_norm=True,
  )


@runtime_signature
def random_policy(
  probability: optax.ScalarOrSchedule,
  *,
  key: jax.Array,
  cheap: str = "clean",
  reuse_weight: optax.ScalarOrSchedule = DEFAULT_REUSE_WEIGHT,
) -> SharpnessPolicy:
  r"""The full step with probability :math:`p_t` (randomized sharpness-aware training).

  Each step draws :math:`u_t \sim U[0, 1)` from a key kept in the state and
  takes the full step when :math:`u_t < p_t`. The expected cost is
  :math:`1 + \bar p` gradient evaluations a step. The key is split once per
  step on every replica alike, so all devices take the same branch.

  Args:
    probability: :math:`p_t` in [0, 1], a float or a schedule.
    key: the PRNG key the draws start from (``jax.random.key(seed)``).
    cheap: ``"clean"`` (the paper: a plain base step) or ``"reuse"``.
    reuse_weight: :math:`\lambda_t` of ``cheap="reuse"``.

  Returns:
    A :class:`SharpnessPolicy` with state :class:`RandomPolicyState`.

  Example:
    >>> import jax, optax_gsam
    >>> policy = optax_gsam.random_policy(0.3, key=jax.random.key(0))
    >>> tx = optax_gsam.sam(0.05, policy=policy)

  References:
    Zhao et al., `Randomized Sharpness-Aware Training for Boosting
    Computational Efficiency in Deep Learning <https://arxiv.org/abs/2203.09962>`_, 2022.
  """
  if not callable(probability):
    check_unit_interval("probability", probability, include_one=True)
  check_prng_key("key", key)
  _check_cheap(cheap, reuse_weight)

  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  impl = jax.random.key_impl(key) if typed else None
  raw_key = jax.random.key_data(key) if typed else key

  def decide(state, count, grad_sq_norm):
    current = jax.random.wrap_key_data(state.key, impl=impl) if typed else state.key
    current, draw = jax.random.split(current)
    due = jax.random.uniform(draw) < value_at(probability, count)
    return due, RandomPolicyState(key=jax.random.key_data(current) if typed else current)

  return SharpnessPolicy(
    name="random",
    init=lambda: RandomPolicyState(key=jnp.copy(raw_key)),  # a copy: the state may be donated
    decide=decide,
    cheap=cheap,
    reuse_weight=reuse_weight,
  )


def keep_unless_counted(counted: jax.Array, new_state: Any, old_state: Any) -> Any:
  """The policy's new state where the step counted, else the old one.

  A step whose output is not finite does not count (``GSAMState.count`` stays),
  so it leaves the policy's state as it was too: a random policy does not
  spend a draw on it, and running statistics do not absorb it. The run after
  such a step is the one that never saw it.
  """
  return jax.tree.map(lambda new, old: jnp.where(counted, new, old), new_state, old_state)


def policy_from_arguments(
  policy: SharpnessPolicy | None,
  perturb_every: int | None,
  reuse_weight: optax.ScalarOrSchedule | None,
) -> SharpnessPolicy:
  """The policy of gsam's arguments: ``policy=``, or the shorthand ``perturb_every``/``reuse_weight``.

  ``reuse_weight=None`` means not given (0.7 for ``perturb_every``).
  """
  if reuse_weight is not None:
    check_non_negative("reuse_weight", reuse_weight, allow_schedule=True)
  if policy is None:
    if perturb_every is not None and perturb_every > 1:
      weight = DEFAULT_REUSE_WEIGHT if reuse_weight is None else reuse_weight
      return every_k_policy(perturb_every, reuse_weight=weight)
    return every_step_policy()
  if not isinstance(policy, SharpnessPolicy):
    raise ValueError(
      "policy must be a SharpnessPolicy (e.g. optax_gsam.every_k_policy(5)), "
      f"got {type(policy).__name__}."
    )
  if perturb_every is not None or reuse_weight is not None:
    raise ValueError(
      "Pass either policy= or perturb_every=/reuse_weight=, not both: "
      "policy=optax_gsam.every_k_policy(k, reuse_weight=w) is perturb_every=k, reuse_weight=w."
    )
  return policy
