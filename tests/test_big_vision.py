"""optax_gsam.big_vision against references written from big_vision's formulas."""

import importlib.util
import itertools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

import optax_gsam
from optax_gsam import big_vision

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAPER_CONFIG = ROOT / "docs" / "configs" / "vit_b32_i1k_gsam.py"
EPS = 1e-12


# --- References, written from big_vision's formulas (numpy, float64) -------------------------


def reference_relative_lr(t, total_steps, sched):
  """big_vision's relative schedule (utils.create_learning_rate_schedule), vectorised."""
  t = np.asarray(t, np.float64)
  warmup = sched.get("warmup_steps", round(sched.get("warmup_percent", 0) * total_steps))
  cooldown = sched.get("cooldown_steps", 0)
  base = sched.get("mult", 1.0)
  p = np.clip((t - warmup) / (total_steps - warmup), 0.0, 1.0)
  kind = sched.get("decay_type", "stair")
  if kind in ("linear", "polynomial"):
    end = sched.get("end", sched.get("linear_end", 0.0))
    lr = end + (base - end) * (1.0 - p) ** sched.get("power", 1)
  elif kind == "cosine":
    lr = base * 0.5 * (1.0 + np.cos(np.pi * p))
  elif kind == "rsqrt":
    tau, shift = sched.get("timescale", 10_000), sched.get("shift", 0)
    lr = np.where(
      t >= warmup,
      base / np.sqrt(1.0 + (t + shift - warmup) / tau),
      base / np.sqrt(1.0 + shift / tau),
    )
  else:  # stair: the multiplier of the last boundary passed.
    passed = (np.asarray(sched.get("steps", []))[None, :] <= t[:, None]).sum(axis=1)
    lr = base * np.asarray([1.0, *sched.get("mults", [])])[passed]
  if warmup:
    lr = lr * np.minimum(1.0, t / warmup)
  if cooldown:
    lr = lr * np.minimum(1.0, (total_steps - t) / cooldown)
  return lr


def reference_legacy_rho(lr, rho_max, rho_min, lr_max, lr_min):
  """The unclamped rho of big_vision's gsam_gradient."""
  if lr_max == lr_min:
    return np.full_like(np.asarray(lr, np.float64), rho_max)
  return rho_min + (rho_max - rho_min) * (np.asarray(lr, np.float64) - lr_min) / (lr_max - lr_min)


def all_steps(schedule, total_steps):
  """A schedule at every step 0..total_steps, in one vectorised call."""
  steps = jnp.arange(total_steps + 1, dtype=jnp.int32)
  return np.asarray(jax.jit(jax.vmap(schedule))(steps), np.float64)


def make_problem(seed=0, n=16, d=5, k=3):
  """f(w, b; X, T) = mean(softplus(X w + b) * T) + 0.25 sum(w^4), with its analytic gradient."""
  rng = np.random.default_rng(seed)
  x, t = rng.normal(size=(n, d)), rng.normal(size=(n, k))
  params = {"w": rng.normal(size=(d, k)) * 0.7, "b": rng.normal(size=(k,)) * 0.3}

  def loss_jax(p, inputs, targets):
    z = inputs @ p["w"] + p["b"]
    return jnp.mean(jnp.logaddexp(0.0, z) * targets) + 0.25 * jnp.sum(p["w"] ** 4)

  def grad_np(w, b, inputs, targets):
    z = inputs @ w + b
    s = targets / (1.0 + np.exp(-z)) / z.size
    return inputs.T @ s + w**3, s.sum(axis=0)

  return params, x, t, loss_jax, grad_np


def reference_gsam_gradient(params, x, t, grad_np, rho, alpha, adaptive, minimize_fp):
  shapes = [params["w"].shape, params["b"].shape]
  w = np.concatenate([params["w"].ravel(), params["b"].ravel()])

  def grad(v):
    gw, gb = grad_np(v[: w.size - shapes[1][0]].reshape(shapes[0]), v[-shapes[1][0] :], x, t)
    return np.concatenate([gw.ravel(), gb.ravel()])

  g_c = grad(w)
  e = rho * (np.abs(w) if adaptive else 1.0) * g_c / (np.linalg.norm(g_c) + EPS)
  g_p = grad(w + e)
  if minimize_fp:
    g = g_p - alpha * (g_c - (g_c @ g_p) / (g_p @ g_p) * g_p)
  else:
    g = g_c + alpha * (g_p - (g_p @ g_c) / (g_c @ g_c) * g_c)
  return {"w": g[: params["w"].size].reshape(shapes[0]), "b": g[params["w"].size :]}


def load_paper_config():
  spec = importlib.util.spec_from_file_location("vit_b32_i1k_gsam", PAPER_CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# --- lr_schedule -------------------------------------------------------------------------------

SCHEDULES = {
  "linear": dict(warmup_steps=100, decay_type="linear", linear_end=0.01),
  "polynomial": dict(warmup_steps=50, decay_type="polynomial", end=0.1, power=2.0),
  "cosine": dict(warmup_steps=100, decay_type="cosine"),
  "rsqrt": dict(warmup_steps=100, decay_type="rsqrt", timescale=200, shift=50),
  "stair": dict(decay_type="stair", steps=[300, 600], mults=[0.1, 0.01]),
  "percent_cooldown_mult": dict(
    warmup_percent=0.1, decay_type="cosine", cooldown_steps=200, mult=0.5
  ),
  "constant": {},
}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("as_configdict", [False, True])
def test_lr_schedule_matches_reference(name, as_configdict):
  total_steps, lr = 1000, 3e-3
  config = dict(lr=lr, schedule=SCHEDULES[name])
  if as_configdict:
    config = ml_collections.ConfigDict(config)
  values = all_steps(big_vision.lr_schedule(config, total_steps), total_steps)
  expected = lr * reference_relative_lr(np.arange(total_steps + 1), total_steps, SCHEDULES[name])
  np.testing.assert_allclose(values, expected, rtol=2e-6, atol=2e-6 * lr)


def test_lr_schedule_pairs_and_missing_schedule():
  total_steps = 200
  sched = dict(warmup_steps=10, decay_type="linear")
  pairs = dict(lr=0.1, schedule=[("head/.*", None), (".*", sched)])
  np.testing.assert_allclose(
    all_steps(big_vision.lr_schedule(pairs, total_steps), total_steps),
    0.1 * reference_relative_lr(np.arange(total_steps + 1), total_steps, sched),
    rtol=2e-6,
    atol=2e-6 * 0.1,
  )
  constant = all_steps(big_vision.lr_schedule(dict(lr=0.1), total_steps), total_steps)
  np.testing.assert_allclose(constant, 0.1, rtol=1e-7)


# --- The paper's ViT-B/32 row ------------------------------------------------------------------


def test_paper_config_file():
  module = load_paper_config()
  config = module.get_config()
  assert isinstance(config, ml_collections.ConfigDict)
  assert (config.batch_size, config.num_epochs, config.lr, config.wd) == (4096, 300, 3e-3, 1e-3)
  assert dict(config.schedule) == dict(warmup_steps=10_000, decay_type="linear", linear_end=0.01)
  assert dict(config.gsam) == dict(rho_max=0.6, rho_min=0.1, alpha=0.6)
  assert module.NUM_TRAIN_EXAMPLES == 1_281_167
  assert big_vision.num_train_steps(config, module.NUM_TRAIN_EXAMPLES) == 93_835


def legacy_paper_config(module):
  """The paper's config as big_vision wrote it: lr_max/lr_min repeated as references."""
  config = module.get_config()
  config.gsam.lr_max = config.get_ref("lr")
  config.gsam.lr_min = config.schedule.get_ref("linear_end") * config.get_ref("lr")
  return config


@pytest.mark.parametrize(
  "variant", ["derived_clamp_off", "explicit_configdict_refs", "explicit_plain_dict"]
)
def test_paper_rho_equals_legacy_formula_at_every_step(variant):
  module = load_paper_config()
  total_steps = big_vision.num_train_steps(module.get_config(), module.NUM_TRAIN_EXAMPLES)
  if variant == "derived_clamp_off":
    rho = big_vision.rho_schedule(module.get_config(), total_steps, clamp=False)
  elif variant == "explicit_configdict_refs":
    rho = big_vision.rho_schedule(legacy_paper_config(module), total_steps)
  else:
    rho = big_vision.rho_schedule(legacy_paper_config(module).to_dict(), total_steps)

  steps = np.arange(total_steps + 1)
  lr = 3e-3 * reference_relative_lr(
    steps, total_steps, dict(warmup_steps=10_000, decay_type="linear", linear_end=0.01)
  )
  expected = reference_legacy_rho(lr, 0.6, 0.1, lr_max=3e-3, lr_min=3e-5)
  values = all_steps(rho, total_steps)
  np.testing.assert_allclose(values, expected, rtol=0, atol=2e-6)
  # Unclamped: below rho_min while the warmup lr is below lr_min (steps < 100).
  assert values[0] == pytest.approx(0.1 - 0.5 * 3e-5 / (3e-3 - 3e-5), rel=1e-5)
  assert values[10_000] == pytest.approx(0.6, rel=1e-6)
  assert values[-1] == pytest.approx(0.1, rel=1e-5)


def test_paper_rho_default_is_clamped_and_lr_is_absolute():
  module = load_paper_config()
  config = module.get_config()
  total_steps = big_vision.num_train_steps(config, module.NUM_TRAIN_EXAMPLES)
  lr = all_steps(big_vision.lr_schedule(config, total_steps), total_steps)
  assert lr.max() == pytest.approx(3e-3, rel=1e-6) and int(lr.argmax()) == 10_000
  assert lr[-1] == pytest.approx(3e-5, rel=1e-5)
  values = all_steps(big_vision.rho_schedule(config, total_steps), total_steps)
  expected = np.clip(reference_legacy_rho(lr, 0.6, 0.1, 3e-3, 3e-5), 0.1, 0.6)
  np.testing.assert_allclose(values, expected, rtol=0, atol=2e-6)
  assert values.min() >= 0.1 - 1e-7


# --- gsam_gradient -----------------------------------------------------------------------------

GRADIENT_CASES = [
  dict(adaptive_perturbation=a, minimize_fp=m, alpha=al, lr=lr)
  for a, m, al, lr in itertools.product([False, True], [True, False], [0.0, 0.6], [2e-3, 3e-4])
]


@pytest.mark.parametrize(
  "case", GRADIENT_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_gsam_gradient_matches_float64_reference(case):
  with jax.enable_x64(True):
    params, x, t, loss_jax, grad_np = make_problem(seed=5)
    rho_max, rho_min, lr_max, lr_min = 0.6, 0.1, 3e-3, 3e-5
    loss, grads = big_vision.gsam_gradient(
      loss_jax,
      jax.tree.map(jnp.asarray, params),
      jnp.asarray(x),
      jnp.asarray(t),
      rho_max,
      rho_min,
      case["alpha"],
      case["lr"],
      lr_max,
      lr_min,
      adaptive_perturbation=case["adaptive_perturbation"],
      minimize_fp=case["minimize_fp"],
    )
    rho = rho_min + (rho_max - rho_min) * (case["lr"] - lr_min) / (lr_max - lr_min)
    expected = reference_gsam_gradient(
      params,
      x,
      t,
      grad_np,
      rho,
      case["alpha"],
      case["adaptive_perturbation"],
      case["minimize_fp"],
    )
    z = x @ params["w"] + params["b"]
    expected_loss = np.mean(np.logaddexp(0.0, z) * t) + 0.25 * np.sum(params["w"] ** 4)
  assert float(loss) == pytest.approx(expected_loss, rel=1e-12)
  for name in ("w", "b"):
    np.testing.assert_allclose(grads[name], expected[name], rtol=1e-10, atol=1e-13)


def test_gsam_gradient_constant_lr_uses_rho_max():
  with jax.enable_x64(True):
    params, x, t, loss_jax, grad_np = make_problem(seed=6)
    _, grads = big_vision.gsam_gradient(
      loss_jax, params, x, t, rho_max=0.3, rho_min=0.1, alpha=0.2, lr=1.0, lr_max=0.5, lr_min=0.5
    )
    expected = reference_gsam_gradient(params, x, t, grad_np, 0.3, 0.2, False, True)
  for name in ("w", "b"):
    np.testing.assert_allclose(grads[name], expected[name], rtol=1e-10)


@pytest.mark.parametrize("minimize_fp", [True, False])
@pytest.mark.parametrize("adaptive_perturbation", [False, True])
def test_gsam_gradient_zero_gradient_is_finite(minimize_fp, adaptive_perturbation):
  # A flat loss: g_c = g_p = 0, where big_vision's normalisation divides 0 by 0.
  def flat(w, inputs, targets):
    return jnp.sum(0.0 * w) + jnp.sum(inputs) * 0.0 + 1.0

  _, grads = big_vision.gsam_gradient(
    flat, jnp.ones(4), jnp.ones(2), None, 0.6, 0.1, 0.6, 1e-3, 3e-3, 3e-5,
    adaptive_perturbation=adaptive_perturbation, minimize_fp=minimize_fp,
  )  # fmt: skip
  np.testing.assert_array_equal(grads, np.zeros(4))


def test_gsam_gradient_zero_perturbed_gradient_is_finite():
  # f(w) = -(w - c)^2 / 2 with w = 0, c = rho: the ascent step lands on c, so g_p = 0 exactly
  # (big_vision divides by ||g_p|| there); g = g_p - alpha * g_c.
  rho, alpha = 0.5, 0.6

  def concave(w, inputs, targets):
    return -0.5 * jnp.sum((w - targets) ** 2)

  _, grads = big_vision.gsam_gradient(
    concave, jnp.zeros(1), None, jnp.full(1, rho), rho, rho, alpha, 1e-3, 3e-3, 3e-3
  )
  np.testing.assert_allclose(grads, -alpha * np.full(1, rho), rtol=1e-6)


# --- The transform and the legacy function, step for step ------------------------------------

SMALL = dict(
  lr=0.05,
  schedule=dict(warmup_steps=3, decay_type="linear", linear_end=0.1),
  gsam=dict(rho_max=0.3, rho_min=0.05, alpha=0.4, lr_max=0.05, lr_min=0.005),
)


@pytest.mark.parametrize(
  "adaptive_perturbation,minimize_fp", [(False, True), (True, True), (False, False)]
)
def test_transform_and_legacy_function_agree_step_for_step(adaptive_perturbation, minimize_fp):
  total_steps, num_updates = 12, 6
  config = ml_collections.ConfigDict(SMALL)
  config.gsam.adaptive_perturbation = adaptive_perturbation
  config.gsam.minimize_fp = minimize_fp
  with jax.enable_x64(True):
    params, x, t, loss_jax, _ = make_problem(seed=7)
    lr = big_vision.lr_schedule(config, total_steps)

    def base():  # big_vision's shape: adam, then the absolute lr.
      return optax.chain(optax.scale_by_adam(), optax.scale_by_learning_rate(lr))

    legacy_tx, tx = base(), optax.chain(big_vision.gsam_from_config(config, total_steps), base())
    p_legacy = p_ours = p_trainer = jax.tree.map(jnp.asarray, params)
    s_legacy, s_ours, s_trainer = legacy_tx.init(p_legacy), tx.init(p_ours), legacy_tx.init(p_ours)

    def loss_fn(p):
      return loss_jax(p, x, t)

    for k in range(num_updates):
      # The legacy function, fed the lr the optimizer applies at this update (count k).
      _, g = big_vision.gsam_gradient(loss_jax, p_legacy, x, t, lr=lr(jnp.int32(k)), **config.gsam)
      u, s_legacy = legacy_tx.update(g, s_legacy, p_legacy)
      p_legacy = optax.apply_updates(p_legacy, u)
      # big_vision's trainer: loop step k + 1, lr = sched(step) * config.lr.
      _, g = big_vision.gsam_gradient(
        loss_jax, p_trainer, x, t, lr=lr(jnp.int32(k + 1)), **config.gsam
      )
      u, s_trainer = legacy_tx.update(g, s_trainer, p_trainer)
      p_trainer = optax.apply_updates(p_trainer, u)
      # The transform.
      loss, g = jax.value_and_grad(loss_fn)(p_ours)
      u, s_ours = tx.update(g, s_ours, p_ours, loss_fn=loss_fn, value=loss)
      p_ours = optax.apply_updates(p_ours, u)

      for name in ("w", "b"):
        np.testing.assert_allclose(p_ours[name], p_legacy[name], rtol=1e-10, atol=1e-13)
      rho_k = float(optax.tree.get(s_ours, "last_rho"))
      expected = reference_legacy_rho(float(lr(jnp.int32(k))), 0.3, 0.05, 0.05, 0.005)
      assert rho_k == pytest.approx(float(expected), rel=1e-6)
    # The trainer's one-step-ahead rho is a different trajectory.
    gap = max(float(jnp.max(jnp.abs(p_trainer[n] - p_ours[n]))) for n in ("w", "b"))
    assert gap > 1e-6


def test_transform_matches_legacy_update_fn_under_pmap():
  """The migrated update_fn (local clean grads, axis_name) equals gsam_gradient + pmean."""
  n_dev = jax.local_device_count()
  total_steps = 12
  config = dict(SMALL, gsam=dict(SMALL["gsam"]))
  params, x, t, loss_jax, _ = make_problem(seed=8, n=2 * n_dev)
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  lr = big_vision.lr_schedule(config, total_steps)
  base = optax.sgd(lr)
  tx = optax.chain(big_vision.gsam_from_config(config, total_steps, axis_name="batch"), base)

  def legacy_update(p, s, xs, ts, lr_now):
    loss, g = big_vision.gsam_gradient(loss_jax, p, xs, ts, lr=lr_now, **config["gsam"])
    loss, g = jax.lax.pmean((loss, g), axis_name="batch")
    u, s = base.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  def new_update(p, s, xs, ts):
    def loss_fn(q):
      return loss_jax(q, xs, ts)

    loss, g = jax.value_and_grad(loss_fn)(p)  # local; the transform averages
    u, s = tx.update(g, s, p, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(p, u), s, jax.lax.pmean(loss, "batch")

  def replicate(tree):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n_dev, *jnp.shape(a))), tree)

  xs = jnp.asarray(x, jnp.float32).reshape(n_dev, 2, -1)
  ts = jnp.asarray(t, jnp.float32).reshape(n_dev, 2, -1)
  legacy = jax.pmap(legacy_update, axis_name="batch")
  new = jax.pmap(new_update, axis_name="batch")
  p_a, s_a = replicate(params), replicate(base.init(params))
  p_b, s_b = replicate(params), replicate(tx.init(params))
  for k in range(2):
    p_a, s_a, loss_a = legacy(p_a, s_a, xs, ts, replicate(lr(jnp.int32(k))))
    p_b, s_b, loss_b = new(p_b, s_b, xs, ts)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for name in ("w", "b"):
      np.testing.assert_allclose(p_a[name], p_b[name], rtol=2e-5, atol=1e-7)
  moved = float(jnp.max(jnp.abs(p_b["w"][0] - params["w"])))
  assert moved > 1e-4


# --- Validation --------------------------------------------------------------------------------


def paper_like(**overrides):
  config = dict(
    lr=3e-3,
    schedule=dict(warmup_steps=10, decay_type="linear", linear_end=0.01),
    gsam=dict(rho_max=0.6, rho_min=0.1, alpha=0.6),
  )
  for key, value in overrides.items():
    section, _, name = key.partition("__")
    if name:
      config[section] = dict(config[section], **{name: value})
    else:
      config[section] = value
  return config


BAD_CONFIGS = {
  "epochs": (paper_like(schedule__warmup_epochs=1), "warmup_epochs"),
  "decay_type": (paper_like(schedule__decay_type="exponential"), "decay_type"),
  "batch_scaling": (paper_like(schedule__scale_with_batchsize=True), "scale_with_batchsize"),
  "warmup_too_long": (paper_like(schedule__warmup_steps=100), "warmup"),
  "stair_lengths": (paper_like(schedule=dict(steps=[10], mults=[])), "mults"),
  "two_schedules": (paper_like(schedule=[("a", {}), ("b", {})]), "exactly one"),
  "no_lr": ({k: v for k, v in paper_like().items() if k != "lr"}, "config.lr"),
  "negative_lr": (paper_like(lr=-1.0), "config.lr"),
  "unknown_gsam_key": (paper_like(gsam__rho=0.1), "config.gsam.rho"),
  "no_alpha": (paper_like(gsam=dict(rho_max=0.6, rho_min=0.1)), "config.gsam.alpha"),
  "relative_lr_max": (paper_like(gsam__lr_max=1.0), "absolute"),
  "stale_lr_min": (paper_like(gsam__lr_min=3e-3 * 3e-5), "lr_min"),
  "rho_order": (paper_like(gsam__rho_min=0.9), "rho_min"),
  "adaptive_flag": (paper_like(gsam__adaptive_perturbation="yes"), "adaptive_perturbation"),
  "not_a_config": ([("lr", 1.0)], "config"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS)
def test_gsam_from_config_rejects(name):
  config, match = BAD_CONFIGS[name]
  with pytest.raises(ValueError, match=match):
    big_vision.gsam_from_config(config, 100)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(eps=0.0), "eps"),
    (dict(minimize_fp=2), "minimize_fp"),
    (dict(minimize_fp="False"), "minimize_fp"),  # truthy: big_vision would read True
    (dict(minimize_fp=1.0), "minimize_fp"),
    (dict(adaptive_perturbation=None), "adaptive_perturbation"),
    (dict(adaptive_perturbation=np.array([True, False])), "adaptive_perturbation"),
  ],
)
def test_gsam_gradient_rejects(kwargs, match):
  args = dict(rho_max=0.6, rho_min=0.1, alpha=0.6, lr=1e-3, lr_max=3e-3, lr_min=3e-5)
  with pytest.raises(ValueError, match=match):
    big_vision.gsam_gradient(lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, **args, **kwargs)


FLAG_SPELLINGS = {
  "numpy": (np.False_, np.True_),
  "int": (0, 1),
  "numpy_int": (np.int32(0), np.int64(1)),
  "jax_array": (jnp.asarray(False), jnp.asarray(1)),
}


def test_gsam_gradient_flags_as_big_vision_reads_them():
  """np.bool_ and 0/1 give what the Python bools give (big_vision reads flags with `if`)."""
  params, x, t, loss_jax, _ = make_problem(seed=4, n=4, d=3, k=2)
  params, x, t = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, x, t))
  args = dict(rho_max=0.6, rho_min=0.1, alpha=0.6, lr=1e-3, lr_max=3e-3, lr_min=3e-5)
  # Both flags at both values; the two cases give different gradients.
  cases = [(False, True), (True, False)]
  expected = [
    big_vision.gsam_gradient(loss_jax, params, x, t, **args, adaptive_perturbation=a, minimize_fp=m)
    for a, m in cases
  ]
  assert float(jnp.max(jnp.abs(expected[0][1]["w"] - expected[1][1]["w"]))) > 1e-6
  loss_fn = lambda q: loss_jax(q, x, t)
  grads = jax.grad(loss_fn)(params)

  def config_update(adaptive, minimize_fp):
    config = paper_like(gsam__adaptive_perturbation=adaptive, gsam__minimize_fp=minimize_fp)
    tx = big_vision.gsam_from_config(config, 100)
    return tx.update(grads, tx.init(params), params, loss_fn=loss_fn)[0]

  for spelling, (false, true) in FLAG_SPELLINGS.items():
    for (adaptive, minimize_fp), want in zip(cases, expected, strict=True):
      got = big_vision.gsam_gradient(
        loss_jax, params, x, t, **args,
        adaptive_perturbation=true if adaptive else false,
        minimize_fp=true if minimize_fp else false,
      )  # fmt: skip
      check = lambda a, b, spelling=spelling: np.testing.assert_array_equal(a, b, err_msg=spelling)
      jax.tree.map(check, got, want)
  # gsam_from_config reads config.gsam's flags the same way.
  jax.tree.map(
    np.testing.assert_array_equal, config_update(np.True_, 0), config_update(True, False)
  )


def test_gsam_gradient_rejects_a_traced_flag():
  args = dict(rho_max=0.6, rho_min=0.1, alpha=0.6, lr=1e-3, lr_max=3e-3, lr_min=3e-5)

  @jax.jit
  def traced(flag):
    return big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w**2), jnp.ones(2), None, None, **args, minimize_fp=flag
    )

  with pytest.raises(ValueError, match="minimize_fp"):
    traced(True)


@pytest.mark.parametrize("total_steps", [0, -5, 2.5, True])
def test_total_steps_validated(total_steps):
  with pytest.raises(ValueError, match="total_steps"):
    big_vision.lr_schedule(paper_like(), total_steps)


def test_gsam_from_config_matches_hand_built_transform():
  total_steps = 100
  config = paper_like(gsam__adaptive_perturbation=True, gsam__minimize_fp=False)
  lr = big_vision.lr_schedule(config, total_steps)
  by_hand = optax_gsam.gsam(
    optax_gsam.rho_from_lr(lr, 0.6, 0.1, num_steps=total_steps),
    0.6,
    ascent=optax_gsam.adaptive_ascent("gsam"),
    minimize_fp=False,
  )
  ours = big_vision.gsam_from_config(ml_collections.ConfigDict(config), total_steps)
  params, x, t, loss_jax, _ = make_problem(seed=9)
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)

  def loss_fn(q):
    return loss_jax(q, jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))

  grads = jax.grad(loss_fn)(p)
  s_a, s_b = by_hand.init(p), ours.init(p)
  for _ in range(3):  # rho changes with the count during warmup
    u_a, s_a = by_hand.update(grads, s_a, p, loss_fn=loss_fn)
    u_b, s_b = ours.update(grads, s_b, p, loss_fn=loss_fn)
    jax.tree.map(np.testing.assert_array_equal, u_a, u_b)
  assert float(s_b.last_rho) > 0.1


# --- The package import ------------------------------------------------------------------------

FRESH_PROCESS = """
import sys
import jax.numpy as jnp
import optax
import optax_gsam

assert "optax_gsam.big_vision" not in sys.modules and "optax_gsam.flax" not in sys.modules
config = dict(lr=0.1, schedule=dict(warmup_steps=2, decay_type="cosine"),
              gsam=dict(rho_max=0.1, rho_min=0.02, alpha=0.3))
tx = optax.chain(optax_gsam.big_vision.gsam_from_config(config, 10), optax.sgd(0.1))
state = optax_gsam.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
loss_fn = lambda p: jnp.sum(p["w"] ** 2)
grads = {"w": 2 * state.params["w"]}
state = state.apply_gradients(grads=grads, loss_fn=loss_fn, value=loss_fn(state.params))
assert int(state.step) == 1 and callable(optax_gsam.flax.nnx_loss_fn)
assert {"flax", "big_vision"} <= set(dir(optax_gsam))
print("ok")
"""


def test_import_optax_gsam_alone_exposes_big_vision_and_flax():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120, env=env
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "ok"
  with pytest.raises(AttributeError, match="no attribute 'flaxx'"):
    optax_gsam.flaxx  # noqa: B018
