"""The pod path on JAX's multi-process runtime: 2 processes x 4 CPU devices against 1 x 8.

One launch of tests/_multihost_worker.py runs every check in both processes (real
cross-process gloo collectives); the same checks run here, in this 8-device process,
as the reference. The launched processes set their own JAX platform and device count
from the launcher's environment; nothing of this process's JAX config reaches them.
"""

import pathlib
import subprocess
import sys
import time

import _multihost_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_multihost_worker.py"
LAUNCH = [sys.executable, "-m", "optax_gsam.launch", "--local-processes", "2"]
TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32, summed in another order across processes


def launch_worker(*args, timeout_s=240):
  command = [*LAUNCH, "--devices-per-process", "4", "--timeout", str(timeout_s)]
  command += ["--", str(WORKER), *map(str, args)]
  start = time.monotonic()
  result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s + 60, cwd=ROOT)
  return result, time.monotonic() - start


def dense_clip(params, images, texts):
  """CLIP's loss on the whole batch, from the formula (the test's own reference)."""
  unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
  x = unit(jnp.tanh(images @ params["w_image"]))
  y = unit(jnp.tanh(texts @ params["w_text"]))
  logits = jnp.exp(params["t"]) * x @ y.T
  diagonal = jnp.diag(logits)
  rows = jax.nn.logsumexp(logits, axis=1) - diagonal
  columns = jax.nn.logsumexp(logits, axis=0) - diagonal
  return (rows.mean() + columns.mean()) / 2


def assert_close(two, one, key):
  np.testing.assert_allclose(two[key], one[key], **TOL, err_msg=f"2x4 vs 1x8: {key}")


def test_two_processes_match_one_process(tmp_path):
  result, seconds = launch_worker(tmp_path)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  runs = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2)]
  for key in runs[0]:  # both processes hold the same replicated results
    np.testing.assert_array_equal(runs[0][key], runs[1][key], err_msg=key)
  two = runs[0]
  assert int(two["process_count"]) == 2 and int(two["device_count"]) == 8
  assert jax.device_count() == 8 and jax.process_count() == 1
  one = worker.run_checks(ckpt_dir=tmp_path / "one_process")
  data = worker.problem()

  # Per-device and synchronized GSAM through data_parallel, several steps.
  for mode in ("per_device", "sync"):
    assert_close(two, one, f"{mode}/losses")
    for name in ("w1", "w2"):
      key = f"{mode}/params/{name}"
      assert_close(two, one, key)
      assert np.max(np.abs(two[key] - data[name])) > 1e-2, f"{key} did not train"
  # The two modes differ by far more than the tolerance, so neither stands in for the other.
  assert np.max(np.abs(two["per_device/params/w1"] - two["sync/params/w1"])) > 1e-4

  # The gradient cache with a global contrastive batch: the all-gather crosses processes.
  keys = [k for k in one if k.startswith("clip/")]
  for key in keys:
    assert_close(two, one, key)
  params = {"w_image": data["w_image"], "w_text": data["w_text"], "t": np.float32(1.0)}
  value, grads = jax.value_and_grad(dense_clip)(params, data["images"], data["texts"])
  np.testing.assert_allclose(two["clip/value"], value, rtol=1e-5)
  for name in params:
    np.testing.assert_allclose(two[f"clip/grads/{name}"], grads[name], rtol=1e-4, atol=1e-6)

  # Micro-batched GSAM (2 a device, both semantics) across processes, against float64 numpy.
  for mode, replicas in (("whole", 8), ("each", 16)):
    expected = microbatch_reference(data, replicas)
    for name in ("w1", "w2"):
      key = f"microbatch/{mode}/params/{name}"
      assert_close(two, one, key)
      np.testing.assert_allclose(two[key], expected[name], rtol=2e-4, atol=1e-6, err_msg=key)

  # The orbax checkpoint written by both processes at step 2, restored, resumes bit for bit.
  assert int(two["resumed/count"]) == worker.SAVE_AT
  assert (tmp_path / "checkpoints" / f"step_{worker.SAVE_AT}").is_dir()
  for name in ("w1", "w2"):
    np.testing.assert_array_equal(two[f"resumed/params/{name}"], two[f"per_device/params/{name}"])
  print(f"2 x 4 launch: {seconds:.1f} s")


def mlp_grad(w1, w2, x, y):
  """The gradient of worker.mlp_loss, by hand (float64)."""
  h = np.tanh(x @ w1)
  d_out = 2.0 * (h @ w2 - y) / y.size
  d_h = d_out @ w2.T * (1.0 - h**2)
  return x.T @ d_h, h.T @ d_out


def microbatch_reference(data, replicas, steps=2):
  """Per-replica GSAM (each replica perturbed along its own gradient), averaged; SGD."""
  w1, w2 = (data[k].astype(np.float64) for k in ("w1", "w2"))
  x, y = data["x"].astype(np.float64), data["y"].astype(np.float64)
  size = len(x) // replicas
  flat = lambda a, b: np.concatenate([a.ravel(), b.ravel()])
  for _ in range(steps):
    outputs = []
    for i in range(replicas):
      xs, ys = x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]
      g_c = flat(*mlp_grad(w1, w2, xs, ys))
      e = worker.RHO * g_c / np.linalg.norm(g_c)
      e1, e2 = e[: w1.size].reshape(w1.shape), e[w1.size :].reshape(w2.shape)
      g_p = flat(*mlp_grad(w1 + e1, w2 + e2, xs, ys))
      outputs.append(g_p - worker.ALPHA * (g_c - g_c @ g_p / (g_p @ g_p) * g_p))
    g = np.mean(outputs, axis=0)
    w1 = w1 - worker.LR * g[: w1.size].reshape(w1.shape)
    w2 = w2 - worker.LR * g[w1.size :].reshape(w2.shape)
  return {"w1": w1, "w2": w2}


@pytest.mark.parametrize("how", ["kill", "raise", "exit"])
def test_a_dead_process_ends_the_job_within_the_bound(tmp_path, how):
  result, seconds = launch_worker(tmp_path, "--crash", how, timeout_s=120)
  assert seconds < 60, f"the launcher took {seconds:.0f} s"
  assert result.returncode == {"kill": 128 + 9, "raise": 1, "exit": 3}[how]
  assert "[launch] process 1 (pid" in result.stderr
  if how == "kill":
    assert "killed by SIGKILL" in result.stderr
  elif how == "raise":  # the traceback, not a 300 s wait in JAX's shutdown barrier
    assert "exited with status 1" in result.stderr
    assert "RuntimeError: process 1 fails on purpose" in result.stderr
  else:  # sys.exit(3), at once rather than after JAX's shutdown barrier
    assert "exited with status 3" in result.stderr
