"""Test-wide setup: eight simulated CPU devices, set before JAX starts a backend.

Lives at the repository root so that it runs before the doctests of the package
and the tests alike import JAX.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402


@pytest.fixture
def data_mesh():
  """The 8 simulated CPU devices as a one-axis mesh named "data"."""
  return jax.make_mesh((8,), ("data",))
