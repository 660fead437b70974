"""Adapter for big_vision's GSAM trainer and configs.

Two ways in:

* :func:`gsam_gradient` has the signature and the numerics of
  ``big_vision.trainers.proj.gsam.gsam.gsam_gradient`` (a zero gradient no
  longer produces NaN). The trainer also calls ``jax.tree_map`` and friends,
  which current JAX no longer has; ``docs/big_vision_migration.md`` lists the
  lines to change and every intentional difference from big_vision's function.
* :func:`gsam_from_config` builds the :func:`optax_gsam.gsam` transform from a
  big_vision config (``config.lr``, ``config.schedule``, ``config.gsam``). The
  transform goes first in the optax chain, reads rho at its own step count and
  derives ``lr_max``/``lr_min`` from the absolute learning-rate schedule
  (:func:`lr_schedule`), so the config no longer repeats them.

Configs may be ``ml_collections.ConfigDict`` or plain dicts. See
``docs/big_vision_migration.md`` for a before/after config and trainer.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any
from typing import TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_gsam._src.core.validation import check_non_negative
from optax_gsam._src.directions import perturbation as pert
from optax_gsam._src.directions.ascent import adaptive_ascent
from optax_gsam._src.policies.schedules import rho_from_lr
from optax_gsam._src.policies.schedules import schedule_extrema
from optax_gsam._src.transforms.sharpness import gsam
from optax_gsam.typing import AxisName

__all__ = (
  "gsam_from_config",
  "gsam_gradient",
  "lr_schedule",
  "num_train_steps",
  "rho_schedule",
)

DECAY_TYPES = ("linear", "polynomial", "cosine", "rsqrt", "stair")
SCHEDULE_KEYS = (
  "decay_type",
  "mult",
  "warmup_steps",
  "warmup_percent",
  "cooldown_steps",
  "cooldown_percent",
  "linear_end",
  "end",
  "power",
  "timescale",
  "shift",
  "steps",
  "mults",
  "scale_with_batchsize",
)
GSAM_KEYS = (
  "rho_max",
  "rho_min",
  "alpha",
  "lr_max",
  "lr_min",
  "eps",
  "adaptive_perturbation",
  "minimize_fp",
)
# A derived lr_max/lr_min may differ from a config's by float32 rounding only.
_EXTREMA_RTOL = 1e-3


def _is_config(value) -> bool:
  return hasattr(value, "keys") and hasattr(value, "__getitem__")


def _as_dict(value, name: str) -> dict[str, Any]:
  """A plain dict of the entries of a dict or ``ml_collections.ConfigDict``."""
  if not _is_config(value):
    raise ValueError(f"{name} must be a dict or an ml_collections.ConfigDict, got {value!r}.")
  return {key: value[key] for key in value.keys()}


def _is_int(value) -> TypeGuard[int]:
  # np.integer is no int subclass, but it does what the callers do with an int.
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_total_steps(total_steps) -> None:
  if not (_is_int(total_steps) and total_steps > 0):
    raise ValueError(f"total_steps must be a positive int, got {total_steps!r}.")


def _as_flag(name: str, value) -> bool:
  """A Python bool from a flag as big_vision passes it: bool, np.bool_, or the ints 0/1.

  big_vision reads its flags with ``if flag:``, so NumPy bools and 0/1 (from a
  config or a command line) behave as the bools they stand for; they do here too.
  Anything else (``None``, strings such as ``"False"``, which is truthy, floats,
  other ints, arrays with more than one value, traced values) is a mistake, and
  raises instead of being read as its truth value.
  """
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  dtype = getattr(value, "dtype", None)
  integral = isinstance(value, numbers.Integral) or (
    dtype is not None
    and np.ndim(value) == 0
    and (np.issubdtype(dtype, np.bool_) or np.issubdtype(dtype, np.integer))
  )
  if integral and not isinstance(value, jax.core.Tracer) and int(value) in (0, 1):
    return bool(value)
  raise ValueError(
    f"{name} must be a bool (True or False; np.bool_ and the ints 0 and 1 are accepted), "
    f"got {value!r}."
  )


def num_train_steps(config: Any, num_examples: int) -> int:
  """Total training steps as big_vision's trainers compute them.

  ``int(config.num_epochs * num_examples / config.batch_size)`` when
  ``num_epochs`` is set, else ``config.total_steps``.

  Args:
    config: a big_vision config (dict or ``ml_collections.ConfigDict``).
    num_examples: the size of the training split (big_vision reads it from the
      dataset; e.g. 1,281,167 for ImageNet-1k ``train``).

  Returns:
    The number of steps, an int.

  Example:
    >>> from optax_gsam import big_vision
    >>> big_vision.num_train_steps(dict(num_epochs=300, batch_size=4096), 1_281_167)
    93835
  """
  cfg = _as_dict(config, "config")
  if cfg.get("num_epochs"):
    if cfg.get("total_steps"):
      raise ValueError("Set either config.num_epochs or config.total_steps, not both.")
    batch_size = cfg.get("batch_size")
    if not (_is_int(batch_size) and batch_size > 0):
      raise ValueError(f"config.batch_size must be a positive int, got {batch_size!r}.")
    if not (_is_int(num_examples) and num_examples > 0):
      raise ValueError(f"num_examples must be a positive int, got {num_examples!r}.")
    return int(cfg["num_epochs"] * num_examples / batch_size)
  _check_total_steps(cfg.get("total_steps"))
  return int(cfg["total_steps"])


def _global_schedule(config: dict[str, Any]) -> dict[str, Any]:
  """The one schedule dict of ``config.schedule`` (a dict or (pattern, dict) pairs)."""
  schedule = config.get("schedule", {})
  if isinstance(schedule, (list, tuple)):
    active = [sched for _, sched in schedule if sched is not None]
    if len(active) != 1:
      raise ValueError(
        "config.schedule as (pattern, schedule) pairs must have exactly one schedule that "
        f"is not None (the others freeze parameters), got {len(active)}; big_vision's GSAM "
        "trainer supports one global learning rate."
      )
    schedule = active[0]
  if schedule is None:
    raise ValueError("config.schedule is None, which freezes every parameter.")
  return _as_dict(schedule, "config.schedule")


def _duration(schedule: dict[str, Any], prefix: str, total_steps: int) -> int:
  """``{prefix}_steps`` or ``{prefix}_percent`` of total_steps (big_vision rounding)."""
  in_steps = schedule.get(f"{prefix}_steps")
  percent = schedule.get(f"{prefix}_percent")
  if in_steps is not None and percent is not None:
    raise ValueError(f"Set only one of {prefix}_steps and {prefix}_percent in config.schedule.")
  if in_steps is not None:
    if not (_is_int(in_steps) and in_steps >= 0):
      raise ValueError(f"config.schedule.{prefix}_steps must be an int >= 0, got {in_steps!r}.")
    return in_steps
  if percent is not None:
    if not (_is_number(percent) and 0.0 <= percent <= 1.0):
      raise ValueError(f"config.schedule.{prefix}_percent must be in [0, 1], got {percent!r}.")
    return max(1, round(percent * total_steps)) if percent else 0
  return 0


def _schedule_config(config) -> tuple[float, dict[str, Any], str]:
  """``(config.lr, config.schedule, its decay_type)``, each checked against what is supported."""
  cfg = _as_dict(config, "config")
  if "lr" not in cfg:
    raise ValueError("config.lr is required: big_vision scales its schedule by it.")
  base_lr = cfg["lr"]
  if not (_is_number(base_lr) and math.isfinite(base_lr) and base_lr >= 0):
    raise ValueError(f"config.lr must be a finite number >= 0, got {base_lr!r}.")
  schedule = _global_schedule(cfg)
  for key in schedule:
    if key not in SCHEDULE_KEYS:
      hint = " Convert durations to *_steps." if key.endswith(("_epochs", "_examples")) else ""
      raise ValueError(
        f"Unsupported key config.schedule.{key}.{hint} Supported keys: {', '.join(SCHEDULE_KEYS)}."
      )
  if schedule.get("scale_with_batchsize", False):
    raise ValueError(
      "config.schedule.scale_with_batchsize=True is not supported; scale config.lr instead."
    )
  decay_type = schedule.get("decay_type", "stair")
  if decay_type not in DECAY_TYPES:
    raise ValueError(
      f"Unsupported config.schedule.decay_type {decay_type!r}; supported: {DECAY_TYPES}."
    )
  return base_lr, schedule, decay_type


def lr_schedule(config: Any, total_steps: int) -> optax.Schedule:
  r"""The absolute learning rate of a big_vision config, as an ``optax.Schedule``.

  big_vision's optimizer multiplies ``config.lr`` by a *relative* schedule
  built from ``config.schedule`` (``big_vision.utils.create_learning_rate_schedule``,
  applied with ``optax.scale_by_schedule``). This returns the product,
  :math:`\eta_t = \text{lr} \cdot s(t)`, with :math:`s` (``b`` = ``mult``,
  default 1; :math:`W` warmup and :math:`C` cooldown steps; :math:`T` =
  ``total_steps``; :math:`p = \mathrm{clip}((t - W)/(T - W), 0, 1)`):

  .. math::

    s(t) = d(t) \cdot \min(1, t / W) \cdot \min(1, (T - t) / C)

  where the warmup and cooldown factors apply only when :math:`W`, :math:`C`
  > 0 and the decay :math:`d` is, by ``decay_type``:

  * ``"linear"``/``"polynomial"``: :math:`e + (b - e)(1 - p)^{\text{power}}`,
    :math:`e` = ``end`` or ``linear_end`` (default 0), power default 1;
  * ``"cosine"``: :math:`b (1 + \cos \pi p) / 2`;
  * ``"rsqrt"``: :math:`b / \sqrt{1 + (t + \text{shift} - W)/\tau}` for
    :math:`t \ge W`, :math:`b / \sqrt{1 + \text{shift}/\tau}` before, with
    :math:`\tau` = ``timescale`` (default 10,000) and ``shift`` (default 0);
  * ``"stair"`` (big_vision's default): :math:`b \cdot m_i` with
    :math:`m = [1, \text{mults}]` and :math:`i` the number of entries of
    ``steps`` that are :math:`\le t`.

  Durations are read from ``warmup_steps``/``cooldown_steps`` or
  ``*_percent`` (of ``total_steps``). ``*_epochs``/``*_examples``,
  ``scale_with_batchsize=True``, unknown keys and unknown decay types raise a
  ValueError. ``config.schedule`` may also be big_vision's list of
  ``(pattern, schedule)`` pairs with exactly one schedule that is not ``None``.
  The values are float32, as in big_vision.

  Args:
    config: a big_vision config (dict or ``ml_collections.ConfigDict``) with
      ``lr`` and, optionally, ``schedule`` (absent: constant ``lr``).
    total_steps: the number of training steps (see :func:`num_train_steps`).

  Returns:
    An ``optax.Schedule`` mapping the optimizer's step count to the absolute
    learning rate.

  Example:
    >>> from optax_gsam import big_vision
    >>> config = dict(
    ...   lr=3e-3, schedule=dict(warmup_steps=100, decay_type="linear", linear_end=0.01)
    ... )
    >>> lr = big_vision.lr_schedule(config, total_steps=1000)
    >>> [round(float(lr(t)), 7) for t in (0, 50, 100, 1000)]
    [0.0, 0.0015, 0.003, 3e-05]

  References:
    Beyer et al., `Big Vision <https://github.com/google-research/big_vision>`_,
    2022 (``big_vision/utils.py``, ``create_learning_rate_schedule``).
  """
  _check_total_steps(total_steps)
  base_lr, schedule, decay_type = _schedule_config(config)
  base = schedule.get("mult", 1.0)
  warmup = _duration(schedule, "warmup", total_steps)
  cooldown = _duration(schedule, "cooldown", total_steps)
  if total_steps > 1 and warmup >= total_steps:
    raise ValueError(f"warmup ({warmup} steps) must be < total_steps ({total_steps}).")
  decay_steps = float(total_steps - warmup) if total_steps != warmup else 1.0
  end = schedule.get("end", schedule.get("linear_end", 0.0))
  power = schedule.get("power", 1)
  timescale = schedule.get("timescale", 10_000)
  shift = schedule.get("shift", 0)
  if decay_type == "rsqrt" and not (_is_number(timescale) and timescale > 0):
    raise ValueError(f"config.schedule.timescale must be > 0, got {timescale!r}.")
  boundaries = list(schedule.get("steps", []))
  mults = list(schedule.get("mults", []))
  if decay_type == "stair" and len(boundaries) != len(mults):
    raise ValueError(
      f"config.schedule.steps ({len(boundaries)}) and mults ({len(mults)}) must have the "
      "same length."
    )

  def relative(step):
    step = jnp.asarray(step)
    progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
    if decay_type in ("linear", "polynomial"):
      value = end + (base - end) * (1.0 - progress) ** power
    elif decay_type == "cosine":
      value = base * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    elif decay_type == "rsqrt":
      value = jnp.where(
        warmup <= step,
        base / jnp.sqrt(1.0 + (step + shift - warmup) / timescale),
        base / jnp.sqrt(1.0 + shift / timescale),
      )
    else:  # stair
      index = jnp.searchsorted(jnp.asarray(boundaries), step + 1)
      value = base * jnp.take(jnp.asarray([1.0, *mults], jnp.float32), index)
    if warmup:
      value = value * jnp.minimum(1.0, step / warmup)
    if cooldown:
      value = value * jnp.minimum(1.0, (total_steps - step) / cooldown)
    return jnp.asarray(value, jnp.float32)

  def schedule_fn(count):
    return (relative(count) * base_lr).astype(jnp.float32)

  return schedule_fn


def _gsam_config(config) -> dict[str, Any]:
  cfg = _as_dict(config, "config")
  if "gsam" not in cfg:
    raise ValueError("config.gsam is required (rho_max, rho_min, alpha, ...).")
  gsam_cfg = {k: v for k, v in _as_dict(cfg["gsam"], "config.gsam").items() if v is not None}
  for key in gsam_cfg:
    if key not in GSAM_KEYS:
      raise ValueError(f"Unsupported key config.gsam.{key}; supported: {', '.join(GSAM_KEYS)}.")
  for key in ("rho_max", "rho_min", "alpha"):
    if key not in gsam_cfg:
      raise ValueError(f"config.gsam.{key} is required.")
  return gsam_cfg


def rho_schedule(config: Any, total_steps: int, *, clamp: bool | None = None) -> optax.Schedule:
  r"""The GSAM radius of a big_vision config, as a schedule of the step count.

  :func:`optax_gsam.rho_from_lr` applied to :func:`lr_schedule`:

  .. math::

    \rho_t = \rho_{\min} + (\rho_{\max} - \rho_{\min})
             \frac{\eta_t - \eta_{\min}}{\eta_{\max} - \eta_{\min}}

  with :math:`\eta_t` the *absolute* learning rate. ``config.gsam.lr_max`` and
  ``lr_min`` are optional: absent, they are the schedule's peak and final
  value. Given, they must agree with those (to 0.1%), which catches a relative
  value where an absolute one is meant (the 300x perturbation of the original
  big_vision GSAM run).

  Args:
    config: a big_vision config with ``lr``, ``schedule`` and ``gsam``.
    total_steps: the number of training steps.
    clamp: keep rho within ``[rho_min, rho_max]``. ``None`` (default) means
      ``False`` when ``config.gsam`` gives both ``lr_max`` and ``lr_min`` (the
      legacy formula, exactly) and ``True`` otherwise.

  Returns:
    An ``optax.Schedule``.

  Example:
    >>> from optax_gsam import big_vision
    >>> config = dict(
    ...   lr=3e-3,
    ...   schedule=dict(warmup_steps=100, decay_type="linear", linear_end=0.01),
    ...   gsam=dict(rho_max=0.6, rho_min=0.1, alpha=0.6),
    ... )
    >>> rho = big_vision.rho_schedule(config, total_steps=1000)
    >>> [round(float(rho(t)), 4) for t in (0, 100, 1000)]
    [0.1, 0.6, 0.1]

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.
  """
  gsam_cfg = _gsam_config(config)
  lr = lr_schedule(config, total_steps)
  lr_max, lr_min = gsam_cfg.get("lr_max"), gsam_cfg.get("lr_min")
  if clamp is None:
    clamp = lr_max is None or lr_min is None
  if lr_max is not None or lr_min is not None:
    peak, final = schedule_extrema(lr, total_steps)
    for name, given, derived, what in (
      ("lr_max", lr_max, peak, "peak"),
      ("lr_min", lr_min, final, "final value"),
    ):
      if given is not None and not math.isclose(given, derived, rel_tol=_EXTREMA_RTOL):
        raise ValueError(
          f"config.gsam.{name}={given!r} differs from the {what} of the absolute learning-rate "
          f"schedule, config.lr * schedule = {derived!r}. lr_max/lr_min are absolute learning "
          "rates; remove them from config.gsam to derive them from the schedule."
        )
  return rho_from_lr(
    lr,
    gsam_cfg["rho_max"],
    gsam_cfg["rho_min"],
    num_steps=total_steps,
    lr_max=lr_max,
    lr_min=lr_min,
    clamp=clamp,
  )


def gsam_from_config(
  config: Any,
  total_steps: int,
  *,
  clamp: bool | None = None,
  axis_name: AxisName = None,
  sync_perturbation: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""The :func:`optax_gsam.gsam` transform of a big_vision config.

  Reads ``config.gsam`` (``rho_max``, ``rho_min``, ``alpha``; optional
  ``lr_max``, ``lr_min``, ``eps``, ``adaptive_perturbation``, ``minimize_fp``,
  the keyword arguments of big_vision's ``gsam_gradient``), with rho from
  :func:`rho_schedule`. ``adaptive_perturbation=True`` is
  ``ascent=optax_gsam.adaptive_ascent("gsam", eps)``: :math:`\epsilon = \rho |w| \odot g / (\|g\| + \varepsilon)`.

  Put it first in the optimizer chain, ``optax.chain(gsam_from_config(...),
  tx)``, and call ``update(grads, opt_state, params, loss_fn=..., value=...)``
  with the clean gradient. Its rho is read at its own count, the step whose
  learning rate the optimizer applies; the legacy trainer read it one step
  ahead.

  Args:
    config: a big_vision config with ``lr``, ``schedule`` and ``gsam``.
    total_steps: the number of training steps.
    clamp: see :func:`rho_schedule`.
    axis_name: the ``pmap`` axis (``"batch"`` in big_vision) or ``None``; with
      it the transform averages the GSAM gradient over devices itself.
    sync_perturbation: see :func:`optax_gsam.gsam`; ``False`` is the legacy
      per-device perturbation.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from optax_gsam import big_vision
    >>> config = dict(
    ...   lr=0.1, schedule=dict(warmup_steps=2, decay_type="cosine"),
    ...   gsam=dict(rho_max=0.1, rho_min=0.02, alpha=0.3),
    ... )
    >>> lr = big_vision.lr_schedule(config, total_steps=10)
    >>> tx = optax.chain(big_vision.gsam_from_config(config, 10), optax.sgd(lr))
    >>> loss_fn = lambda w: jnp.sum(jnp.cos(w))
    >>> w = jnp.ones(3)
    >>> updates, state = tx.update(jax.grad(loss_fn)(w), tx.init(w), w, loss_fn=loss_fn)

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.
  """
  gsam_cfg = _gsam_config(config)
  adaptive_perturbation = _as_flag(
    "config.gsam.adaptive_perturbation", gsam_cfg.get("adaptive_perturbation", False)
  )
  minimize_fp = _as_flag("config.gsam.minimize_fp", gsam_cfg.get("minimize_fp", True))
  eps = gsam_cfg.get("eps", 1e-12)
  return gsam(
    rho_schedule(config, total_steps, clamp=clamp),
    gsam_cfg["alpha"],
    eps=eps,
    ascent=adaptive_ascent("gsam", eps) if adaptive_perturbation else None,
    minimize_fp=minimize_fp,
    sync_perturbation=sync_perturbation,
    axis_name=axis_name,
  )


def _legacy_rho(lr, rho_max, rho_min, lr_max, lr_min):
  """big_vision's unclamped rho; rho_max when lr_max == lr_min."""
  if _is_number(lr_max) and _is_number(lr_min):
    if lr_max == lr_min:
      return rho_max
    return rho_min + (rho_max - rho_min) * (lr - lr_min) / (lr_max - lr_min)
  lr_range = jnp.asarray(lr_max) - jnp.asarray(lr_min)
  constant = lr_range == 0
  rho = rho_min + (rho_max - rho_min) * (lr - lr_min) / jnp.where(constant, 1.0, lr_range)
  return jnp.where(constant, rho_max, rho)


def gsam_gradient(
  loss_fn: Callable[[optax.Params, Any, Any], jax.Array],
  params: optax.Params,
  inputs: Any,
  targets: Any,
  rho_max: float,
  rho_min: float,
  alpha: float,
  lr: float | jax.Array,
  lr_max: float,
  lr_min: float,
  eps: float = 1e-12,
  adaptive_perturbation: bool = False,
  minimize_fp: bool = True,
) -> tuple[jax.Array, optax.Updates]:
  r"""big_vision's ``gsam_gradient``: same signature, same numerics, eps-safe.

  With :math:`f(w) =` ``loss_fn(w, inputs, targets)``, :math:`g_c = \nabla f(w)`
  and :math:`\eta` = ``lr``, the current *absolute* learning rate:

  .. math::

    \rho &= \rho_{\min} + (\rho_{\max} - \rho_{\min})
            \frac{\eta - \eta_{\min}}{\eta_{\max} - \eta_{\min}}
            \quad (\rho_{\max} \text{ if } \eta_{\max} = \eta_{\min};
            \text{ not clamped}) \\
    \epsilon &= \rho\, g_c / (\|g_c\| + \varepsilon), \text{ or }
            \rho\, |w| \odot g_c / (\|g_c\| + \varepsilon)
            \text{ with adaptive\_perturbation} \\
    g_p &= \nabla f(w + \epsilon), \qquad
    g = g_p - \alpha \Big(g_c - \frac{\langle g_c, g_p\rangle}{\|g_p\|^2} g_p\Big)
    \text{ (minimize\_fp) or }
    g_c + \alpha \Big(g_p - \frac{\langle g_p, g_c\rangle}{\|g_c\|^2} g_c\Big)

  The only numerical difference from big_vision is that the projections
  divide by :math:`\|\cdot\|(\|\cdot\| + \varepsilon)` (see
  :func:`optax_gsam.decompose`), so a zero gradient gives a finite result
  instead of NaN. As in big_vision, nothing is averaged across devices: call
  ``jax.lax.pmean`` on the result. Prefer :func:`gsam_from_config`, which reads
  rho at the optimizer's own step. ``docs/big_vision_migration.md`` lists every
  intentional difference from big_vision's function in one place.

  Args:
    loss_fn: ``loss_fn(params, inputs, targets) -> scalar loss``.
    params: the weights :math:`w`.
    inputs: passed to ``loss_fn`` in both passes.
    targets: passed to ``loss_fn`` in both passes.
    rho_max: rho at ``lr == lr_max``.
    rho_min: rho at ``lr == lr_min``.
    alpha: weight of the surrogate-gap term.
    lr: the current absolute learning rate (``config.lr`` times big_vision's
      relative schedule).
    lr_max: the peak absolute learning rate.
    lr_min: the final absolute learning rate.
    eps: :math:`\varepsilon` > 0.
    adaptive_perturbation: use the :math:`|w|`-scaled perturbation. A bool;
      ``np.bool_`` and the ints 0/1 are read as the bools they stand for, as
      big_vision's ``if adaptive_perturbation:`` reads them. Other values
      (``None``, ``"False"``, 2, 1.0) raise a ``ValueError``.
    minimize_fp: the decomposition branch (see above); a bool, read as
      ``adaptive_perturbation``.

  Returns:
    ``(clean_loss, gsam_grads)``: the loss at ``params`` and :math:`g`.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_gsam import big_vision
    >>> def loss_fn(w, x, y):
    ...   return jnp.mean((x @ w - y) ** 2)
    >>> x, y, w = jnp.eye(3), jnp.ones(3), jnp.zeros(3)
    >>> loss, grads = big_vision.gsam_gradient(
    ...   loss_fn, w, x, y, rho_max=0.6, rho_min=0.1, alpha=0.6,
    ...   lr=3e-3, lr_max=3e-3, lr_min=3e-5)
    >>> float(loss), grads.shape
    (1.0, (3,))

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.
  """
  if not callable(loss_fn):
    raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if _is_number(eps) and not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps!r}.")
  # Python numbers are checked here; arrays (a traced lr, say) have no value yet.
  for name, value in (("rho_max", rho_max), ("rho_min", rho_min), ("alpha", alpha)):
    check_non_negative(name, value)
  for name, value in (("lr_max", lr_max), ("lr_min", lr_min)):
    check_non_negative(name, value)
  if _is_number(rho_min) and _is_number(rho_max) and rho_min > rho_max:
    raise ValueError(f"rho_min ({rho_min}) must be <= rho_max ({rho_max}).")
  if _is_number(lr_min) and _is_number(lr_max) and lr_min > lr_max:
    raise ValueError(f"lr_min ({lr_min}) must be <= lr_max ({lr_max}).")
  adaptive_perturbation = _as_flag("adaptive_perturbation", adaptive_perturbation)
  minimize_fp = _as_flag("minimize_fp", minimize_fp)
  clean_loss, clean_grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
  rho = _legacy_rho(lr, rho_max, rho_min, lr_max, lr_min)
  epsilon = pert.perturbation(
    clean_grads, params, rho, adaptive="gsam" if adaptive_perturbation else None, eps=eps
  )
  _, perturbed_grads = jax.value_and_grad(loss_fn)(
    optax.apply_updates(params, epsilon), inputs, targets
  )
  grads = pert.decompose(clean_grads, perturbed_grads, alpha, minimize_fp=minimize_fp, eps=eps)
  return clean_loss, grads
