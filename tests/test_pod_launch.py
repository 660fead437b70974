"""The pod launch script (1 x 8 and 2 x 4 CPU devices) and the distributed benchmark."""

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from optax_gsam import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]  # python -m benchmarks.costs.<script> runs here


def load(name):
  return importlib.import_module(f"benchmarks.costs.{name}")


def test_params_and_optimizer_state_can_be_donated():
  """pod_launch donates both (``donate_argnums=(0, 1)``): no two leaves may share a buffer.

  XLA rejects donating one buffer twice once the step reads both leaves, and the process
  then crashes, so this names the leaves that share one before the pod test gets there.
  ``jax.device_put`` of the state keeps the sharing.
  """
  import jax
  import jax.numpy as jnp
  import optax

  import optax_gsam

  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  for sync in (False, True):
    tx = optax.chain(
      optax_gsam.gsam(0.1, 0.6, axis_name="data", sync_perturbation=sync), optax.adamw(1e-3)
    )
    leaves = jax.tree_util.tree_leaves_with_path((params, tx.init(params)))
    owners = {}
    for path, leaf in leaves:
      owners.setdefault(leaf.unsafe_buffer_pointer(), []).append(jax.tree_util.keystr(path))
    shared = [names for names in owners.values() if len(names) > 1]
    assert not shared, f"leaves that share a buffer (cannot be donated): {shared}"


@pytest.mark.benchmarks  # runs a benchmark script end to end: .ci/run's own step
def test_pod_launch_as_two_processes_prints_the_losses_of_one(tmp_path):
  """The documented 2 x 4 command (docs/distributed.md) against the 1 x 8 run in this process."""
  # No encoder blocks: the pod path is the point here, and a block triples compile time.
  tiny = ["--width", "12", "--depth", "0", "--global-batch", "16", "--steps", "3"]
  one = load("pod_launch").main(["--cpu-devices", "8", *tiny, "--out", str(tmp_path / "one.json")])
  assert one["devices"] == 8 and one["processes"] == 1
  assert np.all(np.isfinite(one["losses"])) and len(one["losses"]) == 3
  assert json.loads((tmp_path / "one.json").read_text())["model"] == "vit_tiny"

  launcher = ["-m", "optax_gsam.launch", "--local-processes", "2", "--devices-per-process", "4"]
  pod = [
    sys.executable,
    "-m",
    "benchmarks.costs.pod_launch",
    "--multihost",
    *tiny,
    "--out",
    str(tmp_path / "two.json"),
  ]
  result = subprocess.run(
    [sys.executable, *launcher, "--timeout", "300", "--", *pod],
    capture_output=True,
    text=True,
    timeout=360,
    cwd=ROOT,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  two = json.loads((tmp_path / "two.json").read_text())
  assert two["devices"] == 8 and two["processes"] == 2
  # Example i is drawn from seed i, so both runs see the same global batch.
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
  assert one["losses"][-1] < one["losses"][0]  # it trains: the comparison is not of constants
  printed = re.findall(r"^\[proc (\d)\] step (\d) loss (\S+)$", result.stdout, re.M)
  assert [(p, s) for p, s, _ in printed] == [("0", "1"), ("0", "2"), ("0", "3")]  # process 0's
  np.testing.assert_allclose([float(x) for *_, x in printed], one["losses"], atol=2e-6)

  # The same job started by hand, one command per host, with flags instead of the launcher's
  # variables (docs/distributed.md, "Without the launcher").
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  coordinator = f"127.0.0.1:{launch.free_port()}"
  host = [
    sys.executable,
    "-m",
    "benchmarks.costs.pod_launch",
    "--multihost",
    "--cpu-devices",
    "4",
    *tiny,
  ]
  host += ["--coordinator", coordinator, "--num-processes", "2"]
  hosts = [
    [*host, "--process-id", str(i), "--out", str(tmp_path / f"by_hand_{i}.json")] for i in range(2)
  ]
  logs = [tmp_path / f"by_hand_{i}.log" for i in range(2)]  # files: no pipe can fill up
  processes = [
    subprocess.Popen(host, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for host, log in zip(hosts, logs, strict=True)
  ]
  try:
    for process in processes:
      process.wait(timeout=300)
  finally:
    for process in processes:
      process.kill()
  outputs = [log.read_text()[-3000:] for log in logs]
  assert [process.returncode for process in processes] == [0, 0], outputs
  by_hand = json.loads((tmp_path / "by_hand_0.json").read_text())  # process 0 writes it
  assert by_hand["devices"] == 8 and by_hand["processes"] == 2
  np.testing.assert_allclose(by_hand["losses"], one["losses"], rtol=1e-5)


def test_pod_launch_rejects_flags_that_would_train_every_host_alone(capsys, monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  parse_args = load("pod_launch").parse_args
  for argv, message in [
    (
      ["--coordinator", "h:1", "--num-processes", "2"],
      "--coordinator, --num-processes need --multihost",
    ),
    (["--multihost", "--process-id", "0"], "--process-id need --coordinator HOST:PORT"),
    (["--steps", "1"], "--steps must be at least 2"),
  ]:
    with pytest.raises(SystemExit):
      parse_args(argv)
    assert message in capsys.readouterr().err
  assert parse_args(["--multihost", "--coordinator", "h:1", "--process-id", "1"]).process_id == 1


@pytest.mark.benchmarks  # runs a benchmark script end to end: .ci/run's own step
def test_collective_counts_per_device_vs_synchronized(tmp_path):
  result = load("distributed").main(
    [
      "--quick",
      "--width",
      "12",
      "--depth",
      "0",
      "--contenders",
      "sam",
      "gsam",
      "gsam sync",
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
