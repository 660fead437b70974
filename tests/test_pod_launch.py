"""The pod launch script and the distributed benchmark run on the 8 simulated devices."""

import importlib.util
import json
import pathlib

import numpy as np

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name):
  spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_pod_launch_runs_the_gsam_step_on_the_simulated_mesh(tmp_path):
  out = tmp_path / "pod.json"
  result = load("pod_launch").main(
    ["--cpu-devices", "8", "--global-batch", "16", "--steps", "3", "--out", str(out)]
  )
  assert result["devices"] == 8 and result["processes"] == 1
  assert np.all(np.isfinite(result["losses"])) and len(result["losses"]) == 3
  assert json.loads(out.read_text())["model"] == "vit_tiny"


def test_collective_counts_per_device_vs_synchronized(tmp_path):
  result = load("distributed").main(
    [
      "--quick",
      "--width",
      "12",
      "--depth",
      "1",
      "--per-device-batch",
      "2",
      "--rounds",
      "1",
      "--steps-per-round",
      "1",
      "--no-pod-estimate",
      "--out",
      str(tmp_path / "d.json"),
    ]
  )
  rows = {r["contender"]: r for r in result["rows"]}
  base = rows["base"]["gradient_sized_ops"]
  # Per-device perturbation needs no more gradient-sized all-reduces than the base step...
  assert rows["gsam"]["gradient_sized_ops"] == base
  assert rows["sam"]["gradient_sized_ops"] == base
  # ...and synchronizing the perturbation adds exactly one.
  assert rows["gsam sync"]["gradient_sized_ops"] == base + 1
  extra = rows["gsam sync"]["gradient_sized_bytes"] - rows["gsam"]["gradient_sized_bytes"]
  assert abs(extra - rows["gsam"]["gradient_bytes"]) < 1024  # one more gradient, to a scalar
