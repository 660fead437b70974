"""Smoke tests of the benchmark scripts: the smallest configurations run end to end.

They check structure and finiteness only, never timings: a benchmark is not a
timed unit test.
"""

import importlib.util
import json
import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_gsam

from benchmarks import accelerator  # the repository root is on sys.path (pyproject.toml)
from benchmarks import harness
from benchmarks import models
from benchmarks.compiled import memory_table
from benchmarks.compiled import tpu_live
from benchmarks.costs import microbatches
from benchmarks.costs import step_cost
from benchmarks.science import generalization
from benchmarks.science import pareto
from benchmarks.science import pareto_contenders

# Not in the README's suite: `python -m pytest -m benchmarks` (.ci/run runs them as a step).
pytestmark = pytest.mark.benchmarks


def test_step_cost_smoke(tmp_path):
  argv = ["--smoke", "--models", "resnet-small", "--contenders", "gsam", "optax.contrib.sam"]
  argv += ["--rounds", "1", "--steps", "1", "--out-dir", str(tmp_path), "--no-plot"]
  result = step_cost.main(argv)
  saved = json.loads((tmp_path / "step_cost_smoke.json").read_text())
  assert saved["rows"] == result["rows"]
  rows = {r["contender"]: r for r in saved["rows"]}
  assert list(rows) == ["base", "gsam", "optax.contrib.sam"]  # base joins for the ratios
  for row in rows.values():
    assert row["ms_per_step"] > 0 and math.isfinite(row["ms_per_step"])
    assert row["compile_s"] > 0 and row["reduce_ops"] > 0
  assert rows["base"]["ratio_to_base"] == 1.0
  assert rows["optax.contrib.sam"]["ratio_to_contrib_sam"] == 1.0
  # Deterministic: XLA counts two gradient evaluations in a sharpness-aware step.
  for name in ("gsam", "optax.contrib.sam"):
    assert 1.5 < rows[name]["flops_ratio_to_base"] < 2.5
  assert [c["target"] for c in saved["targets"]] == [
    "resnet-small: gsam / optax.contrib.sam <= 1.02",
    "resnet-small: gsam / base <= 2.05",
  ]
  assert all(isinstance(c["met"], bool) for c in saved["targets"])
  assert saved["machine"]["jax"]


def test_generalization_smoke(tmp_path, monkeypatch):
  # A contender added with one line, as the cheap variants will be.
  monkeypatch.setitem(
    generalization.CONTENDERS,
    "sam_adaptive",
    harness.Contender(
      harness.before_base(
        lambda hp: optax_gsam.sam(hp.rho, ascent=optax_gsam.adaptive_ascent("gsam"))
      ),
      "sam",
    ),
  )
  argv = ["--seeds", "1", "--epochs", "1", "--noise", "0.2", "--out-dir", str(tmp_path)]
  argv += ["--contenders", "sam_adaptive", "--no-plot"]  # base's protocol runs in step_cost
  result = generalization.main(argv)
  saved = json.loads((tmp_path / "generalization.json").read_text())
  assert saved["rows"] == result["rows"]
  assert [(r["noise"], r["contender"]) for r in saved["rows"]] == [(0.2, "sam_adaptive")]
  for row in saved["rows"]:
    assert row["seeds"] == 1 and len(row["accuracy_curve_mean"]) == 1
    assert 0.1 < row["accuracy_mean"] <= 1.0  # better than chance after an epoch
    for key in ("noise_fitted", "train_loss", "lambda_max", "trace", "m_sharpness", "gap"):
      assert math.isfinite(row[f"{key}_mean"]), key
    assert row["lambda_max_mean"] > 0
    assert row["m_sharpness_mean"] > 0 and row["trace_mean"] > 0
    assert len(row["density"]["weights"][0]) == generalization.DENSITY_ITERATIONS


def test_accelerator_script_refuses_the_cpu_and_plans_every_benchmark(tmp_path):
  with pytest.raises(SystemExit, match="No accelerator"):
    accelerator.main([])
  plan = accelerator.plan(tmp_path, quick=True)
  assert set(plan) == {"step_cost", "generalization", "gradient_cache"}
  for name, args in plan.items():
    modules = (accelerator.BENCHMARKS[name], "benchmarks.reporting")
    source = "".join(Path(importlib.util.find_spec(m).origin).read_text() for m in modules)
    for flag in (a for a in args if a.startswith("--")):
      assert f'"{flag}"' in source, (name, flag)  # each script accepts what it is given


def test_pareto_smoke(tmp_path):
  argv = [
    "--quick",
    "--datasets",
    "mnist1d",
    "--noise",
    "0",
    "--contenders",
    "adaptive",
    "--no-vit",
  ]
  argv += ["--out-dir", str(tmp_path), "--no-plot"]
  result = pareto.main(argv)
  saved = json.loads((tmp_path / "pareto_quick.json").read_text())
  assert saved["rows"] == result["rows"]
  [row] = saved["rows"]
  assert (row["dataset"], row["noise"], row["contender"], row["seeds"]) == (
    "mnist1d",
    0.0,
    "adaptive",
    2,
  )
  assert 0.0 <= row["acc_mean"] <= 1.0 and row["acc_std"] >= 0
  assert 0.0 < row["full_fraction"] < 1.0  # AE-SAM's c_t starts at -1: some steps are full
  assert math.isfinite(row["step_cost"]) and row["step_cost"] > 0
  assert 1.0 < row["flops_cost"] < 2.5  # deterministic: between a base and a SAM step
  assert saved["targets"] == []  # no SAM row to compare with, no late-phase, no ViT
  assert saved["machine"]["jax"]


def test_pareto_joint_tuning_smoke(tmp_path):
  """--joint: every key tunes (lr, rho) over as many points as the base's learning rates."""
  argv = ["--quick", "--joint", "--base", "sgd", "--noise", "0.2", "--tune-seeds", "1"]
  argv += ["--seeds", "1", "--contenders", "base", "late-phase-5", "--no-vit"]
  argv += ["--rounds", "1", "--out-dir", str(tmp_path), "--no-plot"]
  pareto.main(argv)
  saved = json.loads((tmp_path / "pareto_quick_joint_sgd.json").read_text())
  sweep = saved["tuning"]["sweep"]["mnist1d-ln"]
  points = {key: [(p["lr"], p["rho"]) for p in sweep[key]] for key in ("base", "late-5")}
  assert {len(v) for v in points.values()} == {9}  # equal grid sizes
  assert len({lr for lr, _ in points["base"]}) == 9 and len({lr for lr, _ in points["late-5"]}) == 3
  rows = {r["contender"]: r for r in saved["rows"]}
  assert {r["base_optimizer"] for r in rows.values()} == {"sgd"}
  assert rows["base"]["base_steps"] == 1.0
  assert rows["late-phase-5"]["base_steps"] == pytest.approx(
    1 + rows["late-phase-5"]["full_fraction"]
  )
  assert saved["gain_shares"] == []  # no SAM row: no gain to share (tested on its own below)
  assert saved["targets"][-1]["target"].startswith("(e)")


def test_pareto_trajectory_smoke(tmp_path):
  """SAF and MESA under --joint: ids, SAF's store and MESA's EMA through the vmapped scan."""
  argv = ["--quick", "--joint", "--noise", "0.2", "--tune-seeds", "1", "--seeds", "1"]
  argv += ["--epochs", "4", "--contenders", "base", "saf", "mesa", "--no-vit", "--rounds", "1"]
  pareto.main([*argv, "--out-dir", str(tmp_path), "--no-plot"])  # 4 epochs: SAF's lag 3 passes
  saved = json.loads((tmp_path / "pareto_quick_joint.json").read_text())
  sweep = saved["tuning"]["sweep"]["mnist1d-ln"]
  assert {len(sweep[key]) for key in ("base", "saf", "mesa")} == {9}  # the same budget
  assert {p["rho"] for p in sweep["saf"]} == set(pareto.TRAJECTORY_GRIDS["saf"][0])  # lambda
  assert {p["alpha"] for p in sweep["mesa"]} == set(pareto.TRAJECTORY_GRIDS["mesa"][1])  # decay
  rows = {r["contender"]: r for r in saved["rows"]}
  assert rows["saf"]["base_steps"] == 1.0  # no extra pass
  assert 1.1 < rows["mesa"]["base_steps"] < 1.6  # one forward pass, by its FLOPs
  assert 1.1 < rows["mesa"]["flops_cost"] < 1.6 and rows["saf"]["flops_cost"] < 1.05
  for row in rows.values():
    assert 0.0 <= row["acc_mean"] <= 1.0 and math.isfinite(row["train_loss_mean"])
  with pytest.raises(SystemExit, match="No tuned values"):
    pareto.main([*argv, "--no-tune", "--out-dir", str(tmp_path), "--no-plot"])


def test_pareto_gain_share_target():
  row = lambda name, acc, std, steps: {
    "base_optimizer": "sgd",
    "dataset": "d",
    "noise": 0.2,
    "contender": name,
    "acc_mean": acc,
    "acc_std": std,
    "base_steps": steps,
    "seeds": 5,
  }
  rows = [
    row("base", 0.80, 0.01, 1.0),
    row("sam", 0.90, 0.01, 2.0),
    row("late-phase-5", 0.895, 0.01, 1.05),  # keeps 95% at 1.05 base steps
    row("every-5", 0.90, 0.01, 1.2),  # keeps all, but costs too much
  ]
  [shares] = pareto.gain_shares(rows)
  assert shares["sam_gain"] == pytest.approx(0.1)
  assert shares["shares"]["late-phase-5"]["share"] == pytest.approx(0.95)
  [one] = pareto.check_gain_shares([shares], pareto.CONTENDERS)
  assert "late-phase-5 95%" in one["value"] and "every-5" not in one["value"] and not one["met"]
  [two] = pareto.check_gain_shares([shares, {**shares, "noise": 0.4}], pareto.CONTENDERS)
  assert two["met"]
  [worse] = pareto.gain_shares([*rows[:1], row("sam", 0.79, 0.01, 2.0), *rows[2:]])
  assert worse["shares"]["late-phase-5"]["share"] is None  # no gain: no share to keep
  small_gain = {**shares, "gain_std": 0.2}  # SAM within one std of the base: not counted
  assert pareto.check_gain_shares([small_gain], pareto.CONTENDERS)[0]["value"] == "no such setting"


def test_sgd_base_is_momentum_sgd_with_coupled_weight_decay():
  """SGD's base: d = g + wd w; m = mu m + d; w -= lr m (PyTorch's SGD), from the formula."""
  tx = harness.base_optimizer(0.1, "sgd")
  w, g = np.array([1.0, -2.0]), np.array([0.5, 0.25])
  state, params, momentum = tx.init(w), w.copy(), np.zeros(2)
  for _ in range(3):
    updates, state = tx.update(g, state, params)
    params = params + np.asarray(updates)
    momentum = harness.SGD_MOMENTUM * momentum + g + harness.SGD_WEIGHT_DECAY * w
    w = w - 0.1 * momentum
  np.testing.assert_allclose(params, w, rtol=1e-6)
  with pytest.raises(ValueError, match="adamw"):
    harness.base_optimizer(0.1, "lion")


def test_pareto_step_cost_formula():
  costs = {
    "base": {"ratio": 1.0, "flops_ratio": 1.0, "ms": 1.0},
    "p/full": {"ratio": 2.0, "flops_ratio": 2.0, "ms": 2.0},
    "p/cheap": {"ratio": 1.1, "flops_ratio": 1.0, "ms": 1.1},
  }
  cost = pareto.step_cost_of(pareto.CONTENDERS["adaptive"], costs, "p", 25.0, 100)
  assert cost["step_cost"] == pytest.approx((25 * 2.0 + 75 * 1.1) / 100)
  assert cost["flops_cost"] == pytest.approx(1.25)
  assert pareto.step_cost_of(pareto.CONTENDERS["base"], costs, "base", 0.0, 100)["step_cost"] == 1


def test_patch_convolution_is_a_convolution():
  x = jax.random.normal(jax.random.key(0), (3, 40, 2))
  conv = nn.Conv(7, (5,), strides=2, padding=1)
  params = conv.init(jax.random.key(1), x)["params"]
  patch = models.PatchConv1D(7, 5, stride=2, padding=1)
  as_dense = {
    "params": {"Dense_0": {"kernel": params["kernel"].reshape(10, 7), "bias": params["bias"]}}
  }
  np.testing.assert_allclose(patch.apply(as_dense, x), conv.apply({"params": params}, x), atol=1e-5)


def test_pareto_data_and_schedules():
  data = models.load_mnist1d(0.4, seed=0, num_samples=200)  # made locally, never downloaded
  assert data.x_train.shape == (160, 40) and data.x_test.shape == (40, 40)
  clean = models.load_mnist1d(0.0, seed=0, num_samples=200)
  assert 0.2 < np.mean(data.y_train != clean.y_train) < 0.6
  assert np.array_equal(data.y_test, clean.y_test)
  rho = pareto.late_rho(0.1, 100)
  assert float(rho(74)) == 0.0 and float(rho(75)) == pytest.approx(0.1)
  for name in ("every-2", "every-5", "every-10", "adaptive", "random", "late-phase"):
    assert name in harness.available(pareto.CONTENDERS), name
  for name, task in pareto.tasks("full").items():
    if name in pareto.DEFAULTS:  # mnist1d-ln is --joint's, which always tunes
      assert set(pareto.DEFAULTS[name]) == set(task.noise_levels)
      assert set(pareto.grids(name)) | {"base"} <= set(pareto.TUNED_WITH)
  assert set(pareto.joint_grids()) | {"base"} == set(pareto.TUNED_WITH)
  for name in pareto.JOINT_CONTENDERS:
    assert pareto.CONTENDERS[name].hparams in pareto.TUNED_WITH, name


def test_paper_rho_is_rho_from_lr_of_the_real_learning_rate():
  """GSAM's rho as its paper runs it, for a traced peak rho: the formula with rho_min = rho / 6."""
  num_steps, lr, rho = 200, 3e-3, 0.3
  unit = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, num_steps, end_value=0.01)
  hp = harness.HParams(lr=lr, rho=rho, num_steps=num_steps, unit_lr=unit)
  steps = np.arange(num_steps + 1)
  got = jax.jit(jax.vmap(harness.paper_rho(hp)))(steps)
  lr_t = lr * np.array([float(unit(t)) for t in steps], np.float64)
  lr_max, lr_min = lr_t.max(), lr_t[-1]
  want = rho / 6 + (rho - rho / 6) * (lr_t - lr_min) / (lr_max - lr_min)
  np.testing.assert_allclose(got, np.clip(want, rho / 6, rho), rtol=1e-5)
  assert harness.paper_rho(harness.HParams(rho=rho)) == rho  # a constant lr: constant rho


def test_interleaved_pairs_every_sample_with_a_base_run():
  calls = []
  timed = {
    name: harness.Timed((lambda s, name=name: calls.append(name) or s,))
    for name in ("base", "a", "b")
  }
  out = harness.interleaved(timed, "base", rounds=3, steps=2, paired=True)
  assert calls.count("base") == 2 * 3 * 2 and calls.count("a") == calls.count("b") == 3 * 2
  for i in range(0, len(calls), 4):  # each pair: base and the other, 2 steps each
    assert sorted(set(calls[i : i + 4])) in (["a", "base"], ["b", "base"])
  assert len(out["base"]["seconds"]) == 6 and len(out["a"]["seconds"]) == 3
  assert out["base"]["ratio"] == 1.0
  calls.clear()
  out = harness.interleaved(timed, "base", rounds=3, steps=1)
  assert sorted(calls) == sorted(["base", "a", "b"] * 3)
  assert all(len(t["seconds"]) == 3 for t in out.values())


def test_microbatches_smoke(tmp_path):
  result = microbatches.main(
    ["--quick", "--batch", "64", "--rounds", "1", "--out-dir", str(tmp_path)]
  )
  rows = result["rows"]
  assert set(rows) == {"base", "whole", "k=2", "k=4", "k=2 each", "k=4 each"}
  assert all(row["ms"] > 0 and row["temp_MiB"] > 0 for row in rows.values())
  assert (tmp_path / "microbatches_quick.json").is_file()


def test_microbatches_memory_smoke(tmp_path):
  result = microbatches.main(["--memory", "--quick", "--batch", "64", "--out-dir", str(tmp_path)])
  assert set(result["rows"]) == {"k=2 micro=32", "k=4 micro=16"}
  mib = [value for row in result["rows"].values() for key, value in row.items() if "MiB" in key]
  assert all(value > 0 for value in mib)
  assert all(check["met"] for check in result["checks"]), result["checks"]
  assert (tmp_path / "microbatches_quick_memory.json").is_file()


def test_memory_table_reads_every_recorded_model_and_judges_each_row(tmp_path, monkeypatch):
  """The one memory table: the P over the reference is recomputed here from the raw JSON."""
  results = Path(memory_table.__file__).parents[1] / "results"
  for name in memory_table.FILES:
    (tmp_path / name).write_text((results / name).read_text())
  monkeypatch.setattr(memory_table, "RESULTS", tmp_path)
  rows = memory_table.main()
  assert {r["model"].split(",")[0] for r in rows} >= {
    "FSDP decoder 1.04B", "FSDP residual MLP 537M", "ViT-B/32 replicated", "CPU MLP"
  }  # fmt: skip
  decoder = json.loads((results / "tpu_sharded.json").read_text())["rows"]
  by = {(r["dtype"], r["contender"]): r for r in decoder}
  gsam = next(r for r in rows if r["model"].startswith("FSDP decoder") and r["step"] == "gsam")
  for dtype in ("f32", "bf16"):
    row, base = by[dtype, "gsam"], by[dtype, "adamw"]
    data = lambda r: r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
    over = (data(row) - data(base)) / row["param_bytes_per_core"]
    assert math.isclose(gsam[dtype]["over_P"], over)
    assert gsam[dtype]["met"] == (over <= 2)
  assert all(r["verdict"] != "not measured" for r in rows)
  # A missed TPU cell carries what is live at its peak (tpu_live.json), and its verdict says
  # whether the live excess stays within the need.
  for dtype in ("f32", "bf16"):
    assert not gsam[dtype]["met"] and "live_over_P" in gsam[dtype]
  assert gsam["verdict"] == "missed f32, bf16 (live within the need: packing)"
  assert json.loads((tmp_path / "memory_table.json").read_text())["rows"] == rows


def test_a_missed_cell_splits_into_live_buffers_and_packing():
  """``tpu_live.live_cell``: the live excess, the packing and the kinds of buffer held, in P."""
  mib = 2**20
  reference = {"data_peak_bytes": 100 * mib, "live_bytes": 60 * mib, "param_bytes": 10 * mib,
               "kinds": {"all-reduce": 20 * mib, "copy-start (argument copies)": 30 * mib}}  # fmt: skip
  step = {"data_peak_bytes": 150 * mib, "live_bytes": 75 * mib, "param_bytes": 10 * mib,
          "kinds": {"all-reduce": 40 * mib, "copy-start (argument copies)": 25 * mib,
                    "add": 5 * mib}}  # fmt: skip
  cell = tpu_live.live_cell(step, reference, 2)
  assert math.isclose(cell["over_P"], 5.0) and math.isclose(cell["live_over_P"], 1.5)
  assert math.isclose(cell["packing_P"], 3.5)
  assert cell["held"] == [["all-reduce", 2.0], ["add", 0.5]]
  assert cell["released"] == [["copy-start (argument copies)", -0.5]]
  ratio = tpu_live.live_cell(step, reference, "1.01x")
  assert math.isclose(ratio["ratio"], 1.5) and math.isclose(ratio["live_ratio"], 1.25)
  assert not memory_table.live_within_needs({"live_ratio": 1.25}, "1.01x")
  # Within the need up to 1 MiB (10 MiB parameters: 0.1 P), and no further.
  assert memory_table.live_within_needs({**cell, "live_over_P": 2.09}, 2)
  assert not memory_table.live_within_needs({**cell, "live_over_P": 2.11}, 2)
  assert memory_table.live_within_needs({"over_P": 3.0}, 2) is None
  names = ("all-reduce.781", "broadcast.149.clone.63", "cond/branch_0_fun/Block_11/Dense_0/dot")
  assert [tpu_live.kind(n) for n in names] == ["all-reduce", "broadcast", "Block_*/Dense_*/dot"]


def test_gpu_runtime_smoke(tmp_path):
  """The prepared GPU check runs end to end on the CPU (no peak statistics there)."""
  from benchmarks.compiled import gpu_runtime

  out = tmp_path / "gpu_runtime.json"
  argv = ["--quick", "--dtypes", "f32", "--steps", "1", "--rounds", "1", "--out", str(out)]
  result = gpu_runtime.main([*argv, "--contenders", "adamw", "optax.contrib.sam", "gsam"])
  rows = {r["contender"]: r for r in result["rows"]}
  assert set(rows) == {"adamw", "optax.contrib.sam", "gsam"}
  assert rows["adamw"]["time / adamw"] == 1.0 and rows["gsam"]["seconds_per_step"] > 0
  assert all(r["compiled"] > 0 for r in rows.values()) and out.is_file()


def test_fsdp_x_tp_layout_puts_the_hidden_dimension_over_model_and_the_next_over_data():
  from benchmarks.compiled import sharded_steps

  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, (sharded_steps.AXIS, sharded_steps.MODEL))
  spec = lambda shape: tuple(sharded_steps.layout_spec(shape, mesh))
  assert spec((24, 1024, 4096)) == (None, "data", "model")  # up: column-parallel
  assert spec((24, 4096, 1024)) == (None, "model", "data")  # down: row-parallel
  assert spec((24, 1024)) == ("data", "model")  # a vector per block, stacked
  assert spec((1024,)) == ("data",)  # a vector: FSDP only
  assert spec((7,)) == (None,)  # nothing divides it: replicated
  flat = jax.sharding.Mesh(np.array(jax.devices()[:8]), (sharded_steps.AXIS,))
  assert tuple(sharded_steps.layout_spec((24, 1024, 4096), flat)) == (None, None, "data")


def test_pareto_trajectory_pairs_smoke(tmp_path):
  """SAF and MESA beside momentum-SAM and every-20: the pair's knob fixed, lr x rho tuned."""
  pairs = list(pareto_contenders.TRAJECTORY_PAIRS)
  argv = ["--quick", "--joint", "--noise", "0.2", "--tune-seeds", "1", "--seeds", "1"]
  argv += ["--epochs", "4", "--contenders", "base", *pairs, "--no-vit", "--rounds", "1"]
  pareto.main([*argv, "--out-dir", str(tmp_path), "--no-plot"])
  saved = json.loads((tmp_path / "pareto_quick_joint.json").read_text())
  sweep = saved["tuning"]["sweep"]["mnist1d-ln"]
  assert {len(sweep[key]) for key in ("base", *pairs)} == {9}  # the same budget
  knobs = pareto_contenders.TRAJECTORY_KNOBS["adamw"][0.2]
  for name in pairs:
    kind = name.split("+")[0]
    assert {p["alpha"] for p in sweep[name]} == {knobs[kind]}  # the knob its own tuning chose
  assert {p["rho"] for p in sweep["saf+momentum-sam"]} == set(
    pareto_contenders.JOINT_RHO_GRIDS["msam"]
  )
  rows = {r["contender"]: r for r in saved["rows"]}
  forward = rows["mesa+momentum-sam"]["base_steps"] - 1.0  # MESA's teacher pass
  assert 0.1 < forward < 0.6
  # SAF beside momentum-SAM records clean logits: one forward pass, as MESA's teacher.
  assert rows["saf+momentum-sam"]["base_steps"] == pytest.approx(1.0 + forward)
  every = rows["saf+every-20"]
  assert every["base_steps"] == pytest.approx(1.0 + every["full_fraction"])
  mesa_every = rows["mesa+every-20"]
  assert mesa_every["base_steps"] == pytest.approx(1.0 + mesa_every["full_fraction"] + forward)
  for row in rows.values():
    assert 0.0 <= row["acc_mean"] <= 1.0 and math.isfinite(row["train_loss_mean"])
  with pytest.raises(SystemExit, match="add --joint"):
    pareto.main(["--quick", "--contenders", "saf+every-20", "--out-dir", str(tmp_path)])


def test_trajectory_pair_steps_follow_the_formulas():
  """A pair's step: SAM's gradient of CE + the SAF term; beside momentum-SAM, clean logits kept."""
  model = nn.Dense(3)
  x = jax.random.normal(jax.random.key(0), (4, 5))
  y = np.array([0, 1, 2, 1])
  ids = np.arange(4, dtype=np.int32)
  params = model.init(jax.random.key(1), x)
  store = optax_gsam.saf_store(4, 3, lag_epochs=1)
  past = jax.random.normal(jax.random.key(2), (4, 3))
  store = optax_gsam.saf_record(store, ids, past, 0)  # targets valid at epoch 1
  rho, lam, lr = 0.1, 0.5, 0.3
  trajectory = harness.Trajectory("saf", weight="alpha")

  def total(p):  # the formulas, written out: CE + lam tau^2 KL(softmax(t/tau) || softmax(z/tau))
    z, tau = model.apply(p, x), trajectory.temperature
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))
    t = jax.nn.softmax(past / tau)
    kl = jnp.sum(t * (jnp.log(t) - jax.nn.log_softmax(z / tau)), axis=1)
    return ce + lam * tau**2 * jnp.mean(kl)

  g = jax.grad(total)(params)
  ascent = jax.tree.map(lambda w, gi: w + rho * gi / optax.tree.norm(g), params, g)
  expected = jax.tree.map(lambda w, gi: w - lr * gi, params, jax.grad(total)(ascent))
  tx = optax.chain(optax_gsam.sam(rho), optax.sgd(lr))
  step = harness.trajectory_step(model, tx, trajectory, lam, 1, "loss_fn", True)
  new, _, recorded, _ = step(params, tx.init(params), store, x, y, ids, 1)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(recorded.outputs[:, 0], model.apply(params, x), rtol=1e-6)

  msam = optax.chain(optax_gsam.momentum_sam(rho), optax.sgd(lr))
  step = harness.trajectory_step(model, msam, trajectory, lam, 1, "no_clean")
  new, _, recorded, _ = step(params, msam.init(params), store, x, y, ids, 1)
  expected = jax.tree.map(lambda w, gi: w - lr * gi, params, g)  # v_0 = 0: no perturbation
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(recorded.outputs[:, 0], model.apply(params, x), rtol=1e-6)
  grad_fn_contender = harness.Contender(lambda base, hp: base, protocol="grad_fn")
  with pytest.raises(ValueError, match="beside must take loss_fn"):
    harness.with_trajectory("saf", grad_fn_contender)


# An executable loaded from the persistent cache carries the frames of the checkout that compiled
# it first (the cache's key leaves source locations out): compiled here, the frames are ours.
@pytest.mark.usefixtures("no_compilation_cache")
def test_program_size_and_kernels_by_origin_read_the_optimized_hlo():
  from benchmarks.compiled import hlo

  def step(tree):
    return optax_gsam.stable_global_norm(tree) * jnp.tanh(tree["a"]).sum()

  tree = {"a": jnp.ones((64, 32)), "b": jnp.ones(7)}
  cache_events = []

  def listener(event, **_):
    if "compilation_cache" in event:
      cache_events.append(event)

  jax.monitoring.register_event_listener(listener)
  try:
    text = jax.jit(step).lower(tree).compile().as_text()
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert not cache_events  # the fixture kept the persistent cache out, even after earlier compiles
  size = hlo.program_size(text)
  origins = hlo.kernels_by_origin(text)
  assert size["kernels"] == text.count(" fusion(") + text.count(" custom-call(") > 0
  assert sum(origins.values()) == size["kernels"]
  # The norm's kernels are traced in the package's perturbation module; tanh's are not.
  assert any(name.startswith("_src/directions/perturbation.py:") for name in origins)
  plain = jax.jit(lambda tree: jnp.tanh(tree["a"]).sum()).lower(tree).compile().as_text()
  assert not any(name.startswith("_src/") for name in hlo.kernels_by_origin(plain))


# An optimized module's kernels and the stack tables that end its text. JAX prints each frame's
# parent as the stored index plus one; only a frame's own location is read.
_HLO_WITH_FRAMES = """HloModule jit_step

%fused_add (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %add.1 = f32[4]{0} add(%p, %p)
}

ENTRY %main (x: f32[4]) -> (f32[4], f32[4], f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %norm = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="a" stack_frame_id=3}
  %model = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add, metadata={op_name="b" stack_frame_id=4}
  %gemm = f32[4]{0} custom-call(%x), custom_call_target="__cublas$gemm", metadata={op_name="c" stack_frame_id=2}
  %bare = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_add
  ROOT %out = (f32[4], f32[4], f32[4], f32[4]) tuple(%norm, %model, %gemm, %bare)
}

FileNames
1 "/site/optax_gsam/_src/step/step.py"
2 "/site/optax_gsam/_src/directions/perturbation.py"
3 "/home/me/optax_gsam/model.py"

FunctionNames
1 "full_step"
2 "_range_sums"
3 "loss"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=2 end_line=2 column=1 end_column=2}
3 {file_name_id=3 function_name_id=3 line=3 end_line=3 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=2}
3 {file_location_id=2 parent_frame_id=3}
4 {file_location_id=3 parent_frame_id=2}
"""


def test_kernels_by_origin_reads_each_kernels_own_frame_under_the_package_folder():
  from benchmarks.compiled import hlo

  assert hlo.program_size(_HLO_WITH_FRAMES) == {"instructions": 8, "kernels": 4}
  origins = hlo.kernels_by_origin(_HLO_WITH_FRAMES, package_dir="/site/optax_gsam")
  assert origins == {
    "_src/directions/perturbation.py:_range_sums": 1,  # its own frame, under a caller's
    "_src/step/step.py:full_step": 1,  # a library call traced in the package
    "other": 1,  # the user's model, though the package called it and its folder is named alike
    "unrecorded": 1,  # no frame
  }
  assert hlo.kernels_by_origin(_HLO_WITH_FRAMES, package_dir="/elsewhere") == {
    "other": 3,
    "unrecorded": 1,
  }


def test_all_reduce_origins_name_the_operand_kind_the_groups_and_the_operation():
  from benchmarks.compiled import hlo

  text = """
  %ar.1 = (f32[], f32[]) all-reduce(%a, %b), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/reduce_sum"}
  %ar.2 = f32[128,1]{1,0} all-reduce(%c), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add, metadata={op_name="jit(step)/gather"}
  %ar.3 = (f32[], f32[]) all-reduce-start(%d, %e), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(step)/reduce_sum"}
  ROOT %ar.4 = f32[] all-reduce(%f), replica_groups={}, to_apply=%add
  """
  assert hlo.all_reduce_origins(text) == {
    "scalars over [2,4]<=[8]: jit(step)/reduce_sum": 2,
    "arrays over {{0,4},{1,5},{2,6},{3,7}}: jit(step)/gather": 1,
    "scalars over {}: ?": 1,
  }
  assert sum(hlo.all_reduce_origins(text).values()) == hlo.collectives(text)["all-reduce"]["count"]


def test_a_contender_compiled_several_times_is_judged_on_its_median_seconds():
  from benchmarks.compiled import sharded

  def row(name, seconds):
    return {"dtype": "f32", "contender": name, "compile_s": seconds, "trace_s": 0.1,
            "compile_cpu_s": seconds, "collectives": {}}  # fmt: skip

  rows = [row("optax.contrib.sam", s) for s in (5.0, 9.0, 6.0)]
  rows += [row("gsam", s) for s in (6.0, 7.2, 30.0)]
  found = {t["target"]: t["value"] for t in sharded.targets(rows)}
  assert found["f32: gsam compile CPU s / optax.contrib.sam's <= 1.2"] == pytest.approx(7.2 / 6.0)
