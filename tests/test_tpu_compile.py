"""The TPU compiler's view of a data-parallel GSAM step (needs the ``tpu-compile`` extra).

A small ViT's step is compiled ahead of time for a described TPU v3-8 (8
TensorCores, no TPU attached) and the all-reduces in the compiled HLO are
summed in bytes: the TPU combiner splits and merges them differently from the
CPU backend, so the claims are checked in bytes, not in op counts.
"""

import importlib.util
import re
from pathlib import Path

import pytest

# conftest.py: no persistent compilation cache for compiles of a described TPU.
pytestmark = pytest.mark.usefixtures("no_compilation_cache")

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed; pip install -e '.[tpu-compile]' to compile for a TPU topology",
)


@pytest.fixture(scope="module")
def tpu_compile():
  return importlib.import_module("benchmarks.compiled.tpu_compile")


@pytest.fixture(scope="module")
def all_reduce_bytes(tpu_compile):
  mesh = tpu_compile.tpu_mesh("v3-8")
  assert mesh.size == 8 and mesh.devices.flat[0].platform == "tpu"
  out = {}
  for name in ("adamw", "gsam", "gsam sync"):
    compiled, param_bytes, _ = tpu_compile.compile_step(
      mesh, tpu_compile.VIT_QUICK, tpu_compile.DTYPES["f32"], tpu_compile.CONTENDERS[name], 4
    )
    found = tpu_compile.collectives(compiled.as_text())
    assert set(found) == {"all-reduce"}, found  # Data parallelism needs no other collective.
    out[name] = found["all-reduce"]["bytes"]
  return out, param_bytes


@needs_libtpu
def test_per_device_gsam_all_reduces_the_base_steps_gradient_bytes(all_reduce_bytes):
  got, param_bytes = all_reduce_bytes
  assert got["adamw"] == param_bytes + 4  # the float32 gradient and the loss
  # The same gradient, plus its scalars (perturbed loss, gap, cosine, norms) in the same ops.
  assert 0 < got["gsam"] - got["adamw"] <= 64


@needs_libtpu
def test_synchronized_gsam_adds_exactly_one_gradient(all_reduce_bytes):
  got, param_bytes = all_reduce_bytes
  assert got["gsam sync"] - got["gsam"] == param_bytes


@needs_libtpu
@pytest.mark.parametrize("semantics", ["whole", "each"])
def test_micro_batched_gsam_all_reduces_one_gradient(tpu_compile, all_reduce_bytes, semantics):
  """Per-device micro-batches are summed on the core: still one gradient all-reduced."""
  mesh = tpu_compile.tpu_mesh("v3-8")
  contender = tpu_compile.microbatch_contender(2, semantics)
  compiled, _, _ = tpu_compile.compile_step(
    mesh, tpu_compile.VIT_QUICK, tpu_compile.DTYPES["f32"], contender, 4
  )
  found = tpu_compile.collectives(compiled.as_text())
  assert set(found) == {"all-reduce"}, found
  got = all_reduce_bytes[0]
  assert 0 < found["all-reduce"]["bytes"] - got["adamw"] <= 64, (found, got)


def test_collective_parser_reads_tuple_and_async_all_reduces(tpu_compile):
  hlo = """
  %a = f32[256,256]{1,0:T(8,128)} all-reduce(f32[256,256]{1,0} %x), to_apply=%add
  %b = (f32[10]{0:T(256)}, bf16[4,8]{1,0:T(8,128)(2,1)}, f32[]) all-reduce(%y, %z, %w)
  %c = f32[16]{0} all-reduce-start(f32[16]{0} %v)
  %d = f32[16]{0} all-reduce-done(f32[16]{0} %c)
  ROOT %e = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %u)
  """
  assert tpu_compile.collectives(hlo) == {
    "all-reduce": {"count": 3, "bytes": 4 * 256 * 256 + 40 + 64 + 4 + 64},
    "all-gather": {"count": 1, "bytes": 256},
  }


@needs_libtpu
def test_docs_ahead_of_time_example_compiles_for_a_tpu():
  """docs/distributed.md's blocks, run in order, with libtpu: the TPU branch runs."""
  page = Path(__file__).resolve().parents[1] / "docs" / "distributed.md"
  blocks = re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)
  namespace = {"__name__": "docs_distributed_tpu"}
  for block in blocks:
    exec(compile(block, str(page), "exec"), namespace)
  assert namespace["pod_mesh"].devices.flat[0].platform == "tpu"
  assert namespace["peak"] > 0 and namespace["all_reduces"] >= 1


def test_bisection_finds_the_largest_fitting_batch_in_few_compiles(tpu_compile):
  """A fake compiler: peak linear in the batch, plus a kink, and refusals above some batch."""
  gib = 2**30

  def probe(batch, slope, refuse_above):
    if batch > refuse_above:
      return {"batch": batch, "compiles": False}
    peak = 2 * gib + slope * batch + (gib // 4 if batch > 300 else 0)
    return {"batch": batch, "compiles": True, "peak_bytes": peak}

  for slope, refuse_above, most in (
    (gib // 40, 10**6, 5),
    (gib // 100, 10**6, 6),
    (gib // 40, 200, 10),
  ):
    calls = []

    def counted(batch, slope=slope, refuse_above=refuse_above, calls=calls):
      calls.append(batch)
      return probe(batch, slope, refuse_above)

    best, probes = tpu_compile.largest_batch(counted, 64, 8)
    fitting = [b for b in range(8, 4096, 8) if tpu_compile.fits(probe(b, slope, refuse_above))]
    assert best == max(fitting), (slope, refuse_above, calls)
    assert len(probes) == len(calls) <= most and calls[0] == 64, calls
    assert all(b % 8 == 0 for b in calls)


def test_out_of_memory_is_read_from_the_compilers_message(tpu_compile):
  error = RuntimeError(  # libtpu 0.0.42.1's words, for a 48000 x 48000 matmul on one v3 core
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (17.17G) exceeds available HBM (15.48G)."
  )
  found = tpu_compile.out_of_memory(error)
  assert found["used_bytes"] == int(17.17 * 2**30)
  assert found["hbm_limit_bytes"] == int(15.48 * 2**30)
  assert tpu_compile.out_of_memory(ValueError("shapes do not match")) is None


def test_max_batch_table_gives_each_contenders_batch_relative_to_adamw(tpu_compile):
  gib = 2**30
  probe = lambda batch, peak, ok=True: {"batch": batch, "compiles": ok, "peak_bytes": peak * gib}
  rows = [
    {"contender": "gsam", "dtype": "f32", "largest_batch": 96,
     "probes": [probe(64, 10), probe(96, 15), probe(128, 17)]},
    {"contender": "adamw", "dtype": "f32", "largest_batch": 128,
     "probes": [probe(64, 8), probe(128, 14), probe(160, 0, ok=False)]},
  ]  # fmt: skip
  lines = tpu_compile.format_max_batch_table(rows, 32).splitlines()
  assert lines[2].split() == ["f32", "adamw", "128", "1.000", "14.000", "160", "3"]
  assert lines[3].split() == ["f32", "gsam", "96", "0.750", "15.000", "128", "3"]


def test_bisection_aims_at_the_reported_limit_and_caps_a_flat_line(tpu_compile):
  """Peaks flatten near the limit (rematerialization) and refusals report 15.48G."""
  gib = 2**30
  calls = []

  def probe(batch):
    calls.append(batch)
    if batch > 1000:
      return {"batch": batch, "compiles": False, "hbm_limit_bytes": int(15.48 * gib)}
    peak = 3 * gib + min(batch, 500) * gib // 40 + max(batch - 500, 0) * gib // 4000
    return {"batch": batch, "compiles": True, "peak_bytes": peak}

  best, probes = tpu_compile.largest_batch(probe, 64, 32)
  assert best == 992 and len(probes) <= 12, calls
  fitting = 0
  for p in probes:  # before the first refusal, no probe beyond 4x the largest fitting one
    if not p["compiles"]:
      break
    assert fitting == 0 or p["batch"] <= 4 * fitting, calls
    fitting = max(fitting, p["batch"])


def test_bisection_stops_if_nothing_ever_fails(tpu_compile):
  best, probes = tpu_compile.largest_batch(
    lambda b: {"batch": b, "compiles": True, "peak_bytes": 1}, 64, 32
  )
  assert best >= tpu_compile.MAX_PROBE_BATCH and len(probes) < 20
