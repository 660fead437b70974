"""Every public factory refuses bad arguments at construction with a ValueError that names the
argument and the allowed values: one table of bad inputs per factory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _problems import all_finite

import optax_gsam
from optax_gsam import big_vision
from optax_gsam.flax import TrainState

mlp = lambda p, x: x @ p["w"]
sum_loss = lambda p, r: jnp.sum(r)

GSAM = {
  "gsam_rho_string": (
    lambda: optax_gsam.gsam("0.1"),
    r"rho must be a finite number >= 0.*schedule",
  ),
  "gsam_rho_none": (lambda: optax_gsam.gsam(None), r"rho must be .*schedule, got None"),
  "gsam_rho_vector": (lambda: optax_gsam.gsam(jnp.ones(3)), r"rho must be .*scalar array"),
  "gsam_alpha_none": (lambda: optax_gsam.gsam(0.1, None), r"alpha must be a finite number >= 0"),
  "gsam_alpha_list": (lambda: optax_gsam.gsam(0.1, [0.5]), r"alpha must be .*scalar array"),
  "gsam_eps_none": (lambda: optax_gsam.gsam(0.1, eps=None), r"eps must be a finite number > 0"),
  "gsam_eps_bool": (lambda: optax_gsam.gsam(0.1, eps=True), r"eps must be a finite number > 0"),
  "gsam_eps_inf": (lambda: optax_gsam.gsam(0.1, eps=float("inf")), r"eps must be a finite"),
  "gsam_reuse_weight_string": (  # None is the "not given" default since 0.2
    lambda: optax_gsam.gsam(0.1, perturb_every=2, reuse_weight="0.7"),
    r"reuse_weight must be .*schedule",
  ),
  "gsam_rho_concrete_nan_array": (
    lambda: optax_gsam.gsam(jnp.asarray(jnp.nan)),
    r"rho must be a finite number >= 0, got Array\(nan",
  ),
  "gsam_alpha_concrete_negative_array": (
    lambda: optax_gsam.gsam(jnp.asarray(0.1), alpha=jnp.asarray(-0.5)),
    r"alpha must be a finite number >= 0, got Array\(-0.5",
  ),
  "gsam_rho_complex_array": (  # its real part would be read silently
    lambda: optax_gsam.gsam(jnp.asarray(0.05 + 1j)),
    r"rho must be a finite number >= 0, a scalar array or a schedule, got Array\(0.05\+1.j",
  ),
  "gsam_alpha_complex_array": (
    lambda: optax_gsam.gsam(0.05, jnp.asarray(0.3 + 0j)),
    r"alpha must be a finite number >= 0 or a scalar array, got Array",
  ),
  "gsam_eps_concrete_zero_array": (
    lambda: optax_gsam.gsam(0.1, eps=jnp.asarray(0.0)),
    r"eps must be a finite number > 0",
  ),
  "gsam_perturb_every_float": (
    lambda: optax_gsam.gsam(0.1, perturb_every=2.0),
    r"perturb_every must be None or an int >= 1",
  ),
  "gsam_num_groups_zero": (
    lambda: optax_gsam.gsam(0.1, num_groups=0),
    r"num_groups must be None or an int >= 1",
  ),
  "gsam_num_groups_with_sync": (
    lambda: optax_gsam.gsam(0.1, num_groups=2, axis_name="data", sync_perturbation=True),
    r"num_groups .*sync_perturbation",
  ),
  "gsam_adaptive_choices": (
    lambda: optax_gsam.gsam(0.1, adaptive="ASAM"),
    r"adaptive must be one of \(None, 'gsam', 'asam'\)",
  ),
  "sam_eps_string": (lambda: optax_gsam.sam(0.1, eps="1e-12"), r"eps must be a finite number"),
  "gsam_kwargs_0_rho": (lambda: optax_gsam.gsam(rho=-0.1), "rho"),
  "gsam_kwargs_1_rho": (lambda: optax_gsam.gsam(rho=float("nan")), "rho"),
  "gsam_kwargs_2_alpha": (lambda: optax_gsam.gsam(rho=0.1, alpha=-1.0), "alpha"),
  "gsam_kwargs_3_alpha": (lambda: optax_gsam.gsam(rho=0.1, alpha=float("inf")), "alpha"),
  "gsam_kwargs_4_eps": (lambda: optax_gsam.gsam(rho=0.1, eps=0.0), "eps"),
  "gsam_kwargs_5_eps": (lambda: optax_gsam.gsam(rho=0.1, eps=-1e-9), "eps"),
  "gsam_kwargs_6_adaptive": (lambda: optax_gsam.gsam(rho=0.1, adaptive="bogus"), "adaptive"),
  "gsam_kwargs_7_adaptive": (lambda: optax_gsam.gsam(rho=0.1, adaptive=True), "adaptive"),
  "gsam_kwargs_8_minimize_fp": (lambda: optax_gsam.gsam(rho=0.1, minimize_fp="yes"), "minimize_fp"),
  "gsam_kwargs_9_sync_perturbation": (
    lambda: optax_gsam.gsam(rho=0.1, sync_perturbation=1),
    "sync_perturbation",
  ),
  "gsam_kwargs_10_axis_name": (
    lambda: optax_gsam.gsam(rho=0.1, sync_perturbation=True),
    "axis_name",
  ),
  "gsam_kwargs_11_axis_name": (lambda: optax_gsam.gsam(rho=0.1, axis_name=["batch"]), "axis_name"),
  "gsam_kwargs_12_rho": (lambda: optax_gsam.gsam(rho=True), "rho"),
  "gsam_perturb_every_zero": (lambda: optax_gsam.gsam(0.1, perturb_every=0), "perturb_every"),
  "gsam_perturb_every_negative": (lambda: optax_gsam.gsam(0.1, perturb_every=-2), "perturb_every"),
  "gsam_perturb_every_fraction": (lambda: optax_gsam.gsam(0.1, perturb_every=1.5), "perturb_every"),
  "gsam_perturb_every_bool": (lambda: optax_gsam.gsam(0.1, perturb_every=True), "perturb_every"),
  "gsam_reuse_weight_negative": (
    lambda: optax_gsam.gsam(0.1, perturb_every=2, reuse_weight=-1.0),
    "reuse_weight",
  ),
  "gsam_on_nonfinite_choice": (
    lambda: optax_gsam.gsam(0.1, on_nonfinite="skip"),
    "on_nonfinite must be one of",
  ),
  "sam_on_nonfinite_none": (
    lambda: optax_gsam.sam(0.1, on_nonfinite=None),
    "on_nonfinite must be one of",
  ),
  "sam_rho_negative": (lambda: optax_gsam.sam(-1.0), "rho"),
  "sam_adaptive_name": (lambda: optax_gsam.sam(0.1, adaptive="adam"), "adaptive"),
  "gsam_perturb_every_injected": (
    lambda: optax.inject_hyperparams(optax_gsam.gsam)(rho=0.1, perturb_every=2).init(jnp.ones(2)),
    "static_args",
  ),
}

POLICIES = {
  "k": (lambda: optax_gsam.every_k_policy(0), "k must be"),
  "k_float": (lambda: optax_gsam.every_k_policy(2.0), "k must be"),
  "cheap": (lambda: optax_gsam.every_k_policy(2, cheap="skip"), "cheap must be"),
  "weight": (lambda: optax_gsam.every_k_policy(2, reuse_weight=-1.0), "reuse_weight"),
  "decay": (lambda: optax_gsam.gradient_norm_policy(0.0, decay=1.0), "decay"),
  "threshold": (lambda: optax_gsam.gradient_norm_policy("high"), "threshold"),
  "spike_cap": (lambda: optax_gsam.gradient_norm_policy(spike_cap=1.0), "spike_cap must be"),
  "probability": (
    lambda: optax_gsam.random_policy(1.5, key=jax.random.key(0)),
    "probability",
  ),
  "key": (lambda: optax_gsam.random_policy(0.5, key=0), "key must be"),
  "key_float_array": (  # JAX's "invalid PRNG key data" came only at update
    lambda: optax_gsam.random_policy(0.5, key=jnp.zeros(2)),
    r"key must be one PRNG key.*dtype float32, shape \(2,\), not a key",
  ),
  "key_batch_of_keys": (
    lambda: optax_gsam.random_policy(0.5, key=jax.random.split(jax.random.key(0))),
    r"key must be one PRNG key.*\(2,\) keys",
  ),
  "skip": (lambda: optax_gsam.every_step_policy(skip_zero_rho=1), "skip_zero_rho"),
  "policy_type": (lambda: optax_gsam.gsam(0.1, policy="every_5"), "policy must be"),
  "policy_and_perturb_every": (
    lambda: optax_gsam.gsam(0.1, perturb_every=2, policy=optax_gsam.every_k_policy(2)),
    "either policy= or perturb_every",
  ),
  "policy_and_reuse_weight": (
    lambda: optax_gsam.sam(0.1, reuse_weight=0.5, policy=optax_gsam.every_k_policy(2)),
    "either policy= or perturb_every",
  ),
  "gradient_norm_groups": (
    lambda: optax_gsam.gsam(0.1, num_groups=2, policy=optax_gsam.gradient_norm_policy()),
    "num_groups",
  ),
}

MOMENTUM_SAM = {
  "momentum_sam_rho_complex_array": (
    lambda: optax_gsam.momentum_sam(jnp.asarray(0.05 + 0j)),
    r"rho must be a finite number >= 0",
  ),
  "momentum_sam_momentum_complex_array": (
    lambda: optax_gsam.momentum_sam(0.05, momentum=jnp.asarray(0.5 + 0j)),
    r"momentum must be a float in \[0, 1\)",
  ),
  "momentum_sam_momentum_concrete_array": (
    lambda: optax_gsam.momentum_sam(0.1, momentum=jnp.asarray(1.0)),
    r"momentum must be a float in \[0, 1\)",
  ),
}

RHO_FROM_LR = {
  "rho_from_lr_lr_string": (
    lambda: optax_gsam.rho_from_lr("3e-3", 0.6, 0.1, num_steps=10),
    r"lr_schedule must be a finite number >= 0.*schedule",
  ),
  "rho_from_lr_rho_max_none": (
    lambda: optax_gsam.rho_from_lr(3e-3, None, 0.1),
    r"rho_max must be a finite number >= 0",
  ),
  "rho_from_lr_lr_min_string": (
    lambda: optax_gsam.rho_from_lr(3e-3, 0.6, 0.1, lr_max=1.0, lr_min="0"),
    r"lr_min must be a finite number >= 0",
  ),
}

GRADIENT_CACHE = {
  "cached_embed_none": (
    lambda: optax_gsam.cached_value_and_grad(None, sum_loss, chunk_size=2),
    r"embed_fn must be callable",
  ),
  "cached_axis_list": (
    lambda: optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=2, axis_name=["d"]),
    r"axis_name must be None, a hashable axis name or a tuple",
  ),
  "cached_chunk_none": (
    lambda: optax_gsam.cached_value_and_grad(mlp, sum_loss, chunk_size=None),
    r"chunk_size must be a positive int",
  ),
}

BIG_VISION = {
  "big_vision_gradient_alpha": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, -0.5, 1e-3, 3e-3, 3e-5
    ),
    r"alpha must be a finite number >= 0",
  ),
  "big_vision_gradient_rho_max": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, float("nan"), 0.1, 0.5, 1e-3, 3e-3, 0.0
    ),
    r"rho_max must be a finite number >= 0",
  ),
  "big_vision_gradient_rho_order": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.1, 0.6, 0.5, 1e-3, 3e-3, 3e-5
    ),
    r"rho_min \(0.6\) must be <= rho_max \(0.1\)",
  ),
  "big_vision_gradient_lr_order": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, 0.5, 1e-3, 3e-5, 3e-3
    ),
    r"lr_min .* must be <= lr_max",
  ),
  "big_vision_gradient_lr_max_string": (
    lambda: big_vision.gsam_gradient(
      lambda w, x, y: jnp.sum(w), jnp.ones(2), None, None, 0.6, 0.1, 0.5, 1e-3, "3e-3", 3e-5
    ),
    r"lr_max must be a finite number >= 0",
  ),
  "big_vision_steps_batch_size": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, batch_size=0), 100),
    r"config.batch_size must be a positive int",
  ),
  "big_vision_steps_num_examples": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, batch_size=8), -1),
    r"num_examples must be a positive int",
  ),
  "big_vision_steps_both": (
    lambda: big_vision.num_train_steps(dict(num_epochs=1, total_steps=10, batch_size=8), 100),
    r"either config.num_epochs or config.total_steps",
  ),
  "big_vision_config_alpha": (
    lambda: big_vision.gsam_from_config(
      dict(lr=0.1, gsam=dict(rho_max=0.1, rho_min=0.0, alpha="0.5")), 10
    ),
    r"alpha must be a finite number >= 0",
  ),
  "big_vision_config_sync_without_axis": (
    lambda: big_vision.gsam_from_config(
      dict(lr=0.1, gsam=dict(rho_max=0.1, rho_min=0.0, alpha=0.5)), 10, sync_perturbation=True
    ),
    r"sync_perturbation=True needs axis_name",
  ),
}

TRAIN_STATE = {
  "flax_train_state_tx_factory": (
    lambda: TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd),
    r"tx must be an optax.GradientTransformation.*call it",
  ),
  "flax_train_state_tx_none": (
    lambda: TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=None),
    r"tx must be an optax.GradientTransformation",
  ),
}

TABLES = {
  "gsam": GSAM,
  "policies": POLICIES,
  "momentum_sam": MOMENTUM_SAM,
  "rho_from_lr": RHO_FROM_LR,
  "cached_value_and_grad": GRADIENT_CACHE,
  "big_vision": BIG_VISION,
  "train_state": TRAIN_STATE,
}
CASES = [(factory, name) for factory, table in TABLES.items() for name in table]


# Some rows give the deprecated keywords bad values on purpose: the aliases are validated too.
@pytest.mark.filterwarnings("ignore:optax_gsam.*deprecated keyword:DeprecationWarning")
@pytest.mark.parametrize("factory,name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_bad_construction_names_argument_and_allowed_values(factory, name):
  build, match = TABLES[factory][name]
  with pytest.raises(ValueError, match=match):
    build()


def test_scalar_arrays_are_accepted_for_inject_hyperparams():
  # The validation must not reject what optax.inject_hyperparams passes: 0-d arrays.
  tx = optax_gsam.gsam(jnp.float32(0.1), jnp.asarray(0.3), eps=jnp.asarray(1e-12))
  p = jnp.ones(3)
  loss_fn = lambda w: jnp.sum(jnp.sin(w))
  updates, _ = tx.update(jax.grad(loss_fn)(p), tx.init(p), p, loss_fn=loss_fn)
  assert all_finite(updates)
  assert optax_gsam.gsam(np.float32(0.1), np.float64(0.2)) is not None


def test_gsam_update_rejects_leaf_shape_mismatch_naming_the_leaf():
  p = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
  tx = optax_gsam.gsam(0.1, 0.3)
  loss_fn = lambda q: jnp.sum(q["w"] ** 2)
  grads = {"w": jnp.ones((2, 3)), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"leaf shapes.*\['w'\]: \(2, 3\) vs \(3, 2\)"):
    tx.update(grads, tx.init(p), p, loss_fn=loss_fn)
  with pytest.raises(ValueError, match="leaf shapes"):
    jax.jit(lambda g: tx.update(g, tx.init(p), p, loss_fn=loss_fn))(grads)


def test_gsam_update_rejects_state_of_other_params():
  tx = optax_gsam.gsam(0.1, 0.3, policy=optax_gsam.every_k_policy(2))
  stale = tx.init({"w": jnp.ones(3)})
  p = {"w": jnp.ones(4)}
  with pytest.raises(ValueError, match=r"initialised for other params.*tx.init\(params\)"):
    tx.update(p, stale, p, loss_fn=lambda q: jnp.sum(q["w"]))
