"""Test-wide setup: eight simulated CPU devices, set before JAX starts a backend.

Lives at the repository root so that it runs before the doctests of the package
and the tests alike import JAX.
"""

import getpass
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are tiny and compiled once or twice each, so compiling is most of their
# time: LLVM at -O0 cuts the suite's CPU time by about a quarter. It changes no HLO pass, so
# the compiled HLO and its memory and cost analyses are those of the default level; the
# tests' tolerances are unchanged. Subprocesses (the multi-process and demo tests) inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()

# Many tests compile the same small programs (the same step on the same model, a page's example
# and a test's): a persistent compilation cache shared by the pytest-xdist workers and the
# multi-process tests' subprocesses compiles each once (488 s -> 436 s on 2 cores, empty). Its
# key holds the program, the flags and the versions of jax and jaxlib. No size limit: with one,
# JAX locks the folder and sums its size at every write, which made the suite slower, not faster.
# An entry read while another process writes it fails to load: JAX warns and compiles it (a test
# that turns warnings into errors while it compiles ignores that one). JAX_COMPILATION_CACHE_DIR
# set by the caller is kept.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR",
  os.path.join(tempfile.gettempdir(), f"optax_gsam-jax-cache-{getpass.getuser()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax

jax.config.update("jax_num_cpu_devices", 8)


import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402


@functools.cache
def float16_compiles() -> bool:
  """Whether XLA's CPU JIT can convert float16 here. Its float16 conversions are library calls
  (``__extendhfsf2``, ``__truncsfhf2``) that it has only with F16C, which
  ``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2`` turns off."""
  try:
    jax.jit(lambda x: (x.astype(jnp.float16) * 2).astype(jnp.float32))(
      jnp.ones(2)
    ).block_until_ready()
  except Exception as error:
    # The exception says "Failed to materialize symbols"; XLA's log names them.
    if any(text in str(error) for text in ("materialize symbols", "__extendhfsf2")):
      return False
    raise
  return True


# The fast selection, `python -m pytest -n 2 -m fast` (CONTRIBUTING.md): the public names, the
# house's rules, and the core maths (perturbation, ascent directions, the stages of a step, gsam
# and sam) against their float64 references, with the argument checks. Under a minute on two
# cores; the README's whole suite stays the contract.
FAST_FILES = frozenset(
  {
    "test_public_names.py",
    "test_layout.py",
    "test_perturbation.py",
    "test_ascent.py",
    "test_step.py",
    "test_sharpness.py",
    "test_validation.py",
  }
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  """Marks the fast selection; tests marked ``float16`` skip, saying why, where XLA's CPU JIT
  has no float16."""
  for item in items:
    if item.path.name in FAST_FILES:
      item.add_marker(pytest.mark.fast)
  marked = [item for item in items if item.get_closest_marker("float16")]
  if marked and not float16_compiles():
    reason = "XLA's CPU JIT converts float16 only with F16C (off under --xla_cpu_max_isa=SSE4_2)"
    for item in marked:
      item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def data_mesh():
  """The 8 simulated CPU devices as a one-axis mesh named "data"."""
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def no_compilation_cache():
  """The persistent compilation cache off from the first test that asks to the module's end (set
  up before the module's own fixtures, which compile). The TPU and GPU topology compiles (no
  device attached) write entries that a later run cannot load, a warning each time; a test that
  reads the source locations of a compiled program must compile it here, since the cache's key
  leaves them out and an entry may come from another checkout. JAX decides once per process
  whether it uses the cache (at its first compile), so the flag alone would not turn it off: the
  cache is reset both ways."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", enabled)
  compilation_cache.reset_cache()
