"""The environment for compiling ahead of time for a described TPU with no TPU attached.

Importing this module sets it (without overriding what the caller set): JAX itself runs on the
CPU, and libtpu, loaded to compile for a TPU topology, neither looks for TPU chips and their
metadata server nor refuses a second load in one process. The TPU scripts import it before
``jax``, which reads ``JAX_PLATFORMS`` when it is imported.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
