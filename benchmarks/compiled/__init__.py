"""The compiled-program lab: steps compiled ahead of time for described TPU and GPU hosts."""

import os

# JAX's persistent compilation cache keys a program without its source locations by default, so
# an executable loaded from it carries the stack frames of whichever checkout compiled it first,
# and hlo.kernels_by_origin would attribute the kernels to that checkout's files. Locations in
# the key give each checkout its own entries. Set here, before a script of this folder imports
# jax (a process that already imported jax keeps its setting).
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "true")
