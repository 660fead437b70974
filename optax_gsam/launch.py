"""Runs one script as N local JAX processes that form a multi-process runtime, as on a pod.

JAX's multi-process runtime (``jax.distributed``) is the one a TPU pod or a GPU
cluster uses, and it runs on one CPU machine too: N processes on 127.0.0.1,
each with its own CPU devices, exchange data through gloo collectives. This
launcher starts them::

    python -m optax_gsam.launch --local-processes 2 --devices-per-process 4 -- \\
      python -m benchmarks.costs.pod_launch --multihost --global-batch 16 --steps 3

A command whose first word ends in ``.py`` runs with this Python interpreter.
Process ``i`` gets the environment of the launcher plus:

* ``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=D`` and
  ``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``, which JAX reads as its config
  (an ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` is dropped,
  so an inherited device count cannot override ``D``);
* ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`` on a free port, which
  ``jax.distributed.initialize`` reads itself, and the same
  ``JAX_COORDINATOR_BIND_ADDRESS``, so that the coordinator listens on loopback
  only;
* ``JAX_NUM_PROCESSES=N`` and ``JAX_PROCESS_ID=i``, which :func:`initialize`
  reads (``jax.distributed.initialize`` has no variables for them).

So a script that calls :func:`initialize` runs unchanged under this launcher,
under SLURM or Open MPI, and on Cloud TPU, where JAX detects the cluster.

Each line a process prints is streamed with a ``[proc i]`` prefix. The
launcher exits with the status of the process that failed first (128 + N for
signal N) and ends every other process with its descendants (each runs in its
own session, and gets SIGTERM, then SIGKILL after ``--grace`` seconds, since
JAX catches SIGTERM as a preemption notice). This matters: when one process
dies, the others wait in a collective until JAX's heartbeat timeout (100 s by
default), and a process that raises or calls ``sys.exit(n)`` waits in JAX's
shutdown barrier (300 s by default) unless it exits at once, which
:func:`initialize` arranges in the processes this launcher starts (and nowhere
else unless asked: it replaces ``sys.exit`` and ``sys.excepthook``). SIGINT, SIGTERM and SIGHUP to the launcher stop
the job the same way (exit status 128 + the signal; one that the launcher
inherits as ignored, as under ``nohup``, stays ignored). On Linux the kernel
also kills each process the launcher started (not what those start) if the
launcher dies. ``--timeout S`` stops every process
after S seconds (status 124).

This module needs only the standard library (and JAX for :func:`initialize`).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TextIO

__all__ = ("free_port", "initialize", "launch", "main", "process_env")

_TAIL_LINES = 20
_POLL_S = 0.05


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on ``host`` now (the OS picks it for a socket bound to port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind((host, 0))
    return sock.getsockname()[1]


def process_env(
  process_id: int,
  num_processes: int,
  coordinator_address: str,
  devices_per_process: int,
  base: Mapping[str, str] | None = None,
) -> dict[str, str]:
  """The environment of local process ``process_id`` (see the module docstring).

  Args:
    process_id: this process's index, ``0 <= process_id < num_processes``.
    num_processes: how many processes form the runtime.
    coordinator_address: ``host:port`` of the coordinator (process 0).
    devices_per_process: CPU devices each process simulates.
    base: the environment to extend; ``os.environ`` by default.

  Returns:
    A new environment mapping.
  """
  env = dict(os.environ if base is None else base)
  xla_flags = [
    flag
    for flag in env.get("XLA_FLAGS", "").split()
    if not flag.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(xla_flags)
  env.update(
    JAX_PLATFORMS="cpu",
    JAX_NUM_CPU_DEVICES=str(devices_per_process),
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    JAX_COORDINATOR_ADDRESS=coordinator_address,
    # JAX binds the coordinator service to every interface unless told otherwise.
    JAX_COORDINATOR_BIND_ADDRESS=coordinator_address,
    JAX_NUM_PROCESSES=str(num_processes),
    JAX_PROCESS_ID=str(process_id),
    PYTHONUNBUFFERED="1",  # lines reach the launcher as they are printed
    # initialize() patches sys.exit and sys.excepthook only where this is set.
    OPTAX_GSAM_FAIL_FAST="1",
  )
  return env


def _exit_now(status: int) -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # its reader has gone: exit all the same
      pass
  os._exit(status)  # JAX's atexit barrier would wait up to 300 s for processes that never arrive


def _exit_now_on_failure() -> None:
  """An uncaught exception or a non-zero ``sys.exit`` skips JAX's shutdown barrier.

  Both would otherwise run JAX's atexit shutdown barrier, which waits for every
  other process while those wait in a collective for this one. An uncaught
  exception exits once its traceback is printed. A non-zero ``sys.exit`` in the
  main thread raises ``SystemExit`` as usual (``finally`` blocks and ``with``
  exits run) and records its status; an atexit hook registered after JAX's
  (so it runs before it) then exits with that status. Must run after
  ``import jax``.
  """
  previous_hook, previous_exit = sys.excepthook, sys.exit
  failed: list[int] = []

  def hook(kind, value, traceback):
    previous_hook(kind, value, traceback)
    _exit_now(1)

  def exit_(status=None):
    if status not in (None, 0) and threading.current_thread() is threading.main_thread():
      failed.append(status if isinstance(status, int) else 1)  # sys.exit("message") gives 1
    previous_exit(status)

  def skip_barrier():
    if failed:
      _exit_now(failed[-1])

  atexit.register(skip_barrier)
  sys.excepthook, sys.exit = hook, exit_


def _port(address: str) -> str:
  return address.rsplit(":", 1)[-1]


def _int_from_env(name: str) -> int | None:
  value = os.environ.get(name)
  if not value:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name} must be an integer, got {value!r}") from None


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  exit_on_uncaught_exception: bool | None = None,
) -> None:
  """``jax.distributed.initialize`` with the arguments of this launcher's environment.

  Arguments left ``None`` come from ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` when set; the rest is left to
  JAX's cluster detection (SLURM, Open MPI, Cloud TPU, Kubernetes). Call it
  before anything else touches JAX's backend.

  One process (``num_processes=1`` or ``JAX_NUM_PROCESSES=1``, no coordinator)
  starts no runtime, so the same script runs alone as well. With nothing set
  and no cluster detected it raises a ``ValueError`` that says how to run the
  script, rather than quietly training one independent copy per host.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator service.
    num_processes: the number of processes.
    process_id: this process's index.
    exit_on_uncaught_exception: make an uncaught exception (status 1, traceback
      printed) or a non-zero ``sys.exit(status)`` end this process at once
      instead of waiting in JAX's shutdown barrier for the other processes, so a
      launcher or scheduler sees it. This replaces ``sys.excepthook`` and
      ``sys.exit`` for the whole process, so it is never done unasked: ``None``
      (the default) does it only in processes started by ``python -m
      optax_gsam.launch``, which sets ``OPTAX_GSAM_FAIL_FAST=1`` for them;
      ``True`` or ``False`` decide for any process. ``finally`` blocks and ``with`` exits
      still run. ``sys.exit`` is wrapped for this (in the main thread only): a
      bare ``raise SystemExit(status)`` still waits in the barrier (up to
      300 s), and a non-zero ``sys.exit`` that the script catches and survives
      still sets the status the process ends with.

  Example:
    A script run by ``python -m optax_gsam.launch ... -- script.py``::

      import optax_gsam.launch
      optax_gsam.launch.initialize()
      import jax
      print(jax.process_index(), jax.process_count(), jax.device_count())
  """
  import jax

  if coordinator_address is None:
    coordinator_address = os.environ.get("JAX_COORDINATOR_ADDRESS") or None
  if num_processes is None:
    num_processes = _int_from_env("JAX_NUM_PROCESSES")
  if process_id is None:
    process_id = _int_from_env("JAX_PROCESS_ID")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be at least 1, got {num_processes}")
  if num_processes == 1 and coordinator_address is None:
    return  # nobody to connect to; jax.process_count() is 1 as it is
  if exit_on_uncaught_exception is None:
    exit_on_uncaught_exception = os.environ.get("OPTAX_GSAM_FAIL_FAST") == "1"
  if exit_on_uncaught_exception:
    _exit_now_on_failure()
  bind_address = None
  inherited = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "")
  if coordinator_address and inherited and _port(inherited) != _port(coordinator_address):
    bind_address = f"[::]:{_port(coordinator_address)}"  # JAX's default; not the launcher's port
  try:
    jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      coordinator_bind_address=bind_address,
    )
  except ValueError as error:
    if coordinator_address is not None:
      raise
    raise ValueError(
      "optax_gsam.launch.initialize: no coordinator_address was given, JAX_COORDINATOR_ADDRESS "
      "is not set and JAX detected no cluster (SLURM, Open MPI, Cloud TPU, Kubernetes). Run the "
      "script under `python -m optax_gsam.launch --local-processes N -- script.py`, pass "
      "coordinator_address, num_processes and process_id, or, for a single process, set "
      f"JAX_NUM_PROCESSES=1. (JAX said: {error})"
    ) from error


def _report_exit(index: int, process: subprocess.Popen, exits: queue.SimpleQueue[int]) -> None:
  """Waits for one process and puts its index on ``exits``."""
  process.wait()
  exits.put(index)


def _stream(index: int, pipe, tail: collections.deque, out: TextIO, lock: threading.Lock):
  """Copies one process's output to ``out`` line by line, with its prefix.

  When ``out`` closes (``| head``) the lines are still read and dropped: a pipe
  nobody drains would block the process on its next print.
  """
  writable = True
  for raw in iter(pipe.readline, b""):
    line = raw.decode(errors="replace").rstrip("\n")
    tail.append(line)
    if writable:
      with lock:
        writable = _write(out, f"[proc {index}] {line}\n")
  pipe.close()


def _write(stream: TextIO, text: str) -> bool:
  """Writes and flushes; False when the stream is closed or its reader has gone."""
  try:
    stream.write(text)
    stream.flush()
  except (OSError, ValueError):
    return False
  return True


def _signal_group(process: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(process.pid, sig)  # the process and everything it started
  except (ProcessLookupError, PermissionError):
    pass


def _stop(processes: Sequence[subprocess.Popen], grace: float) -> None:
  """SIGTERM to every process group, then SIGKILL to what is left after ``grace`` s."""
  for process in processes:
    _signal_group(process, signal.SIGTERM)
  deadline = time.monotonic() + grace
  try:
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
      time.sleep(_POLL_S)
  finally:  # also when interrupted: the grace period may end early, the SIGKILL may not
    for process in processes:
      _signal_group(process, signal.SIGKILL)  # also reaches descendants of exited leaders
      process.wait()


def _exit_status(returncode: int) -> int:
  """A ``Popen.returncode`` as a shell exit status: signal N gives 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:  # real-time signals have no name
      name = f"signal {-returncode}"
    return f"was killed by {name}"
  return f"exited with status {returncode}"


# Run by a fresh interpreter in front of each command: it asks Linux to SIGKILL it when the
# launcher dies (the setting survives exec), then becomes the command. Doing this in a
# preexec_fn instead would run Python in a child forked from a multithreaded parent.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, errno, os, signal, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[1]):
  os._exit(1)  # the launcher died before prctl took effect
for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; an ignored signal survives exec
  signal.signal(getattr(signal, name), signal.SIG_DFL)
try:
  os.execvp(sys.argv[2], sys.argv[2:])
except OSError as error:
  print(f"[launch] cannot run {sys.argv[2]!r}: {error}", file=sys.stderr, flush=True)
  os._exit(127 if error.errno == errno.ENOENT else 126)
"""


def _dies_with_launcher(command: list[str]) -> list[str]:
  """``command``, run so that it is killed when the launcher dies (on Linux).

  It covers what ``finally`` cannot: the launcher itself killed by SIGKILL.
  """
  if not sys.platform.startswith("linux"):
    return command
  launcher = str(os.getpid())
  return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, launcher, *command]


def launch(
  command: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int = 1,
  timeout: float | None = None,
  grace: float = 3.0,
  port: int | None = None,
  out: TextIO | None = None,
  err: TextIO | None = None,
) -> int:
  """Runs ``command`` as ``num_processes`` local processes of one JAX runtime.

  Args:
    command: the program and its arguments; a first word ending in ``.py``
      runs with ``sys.executable``.
    num_processes: how many processes to start (process ids ``0..N-1``).
    devices_per_process: CPU devices per process.
    timeout: seconds before every process is stopped (``None``: no limit).
    grace: seconds between SIGTERM and SIGKILL when stopping processes.
    port: the coordinator's port; a free one by default.
    out: where the prefixed output goes (``sys.stdout`` by default).
    err: where the launcher's own messages go (``sys.stderr`` by default).

  Returns:
    0 when every process exits with 0; otherwise the exit status of the first
    process that failed (128 + N for signal N), or 124 on timeout.

  Raises:
    ValueError: ``num_processes`` or ``devices_per_process`` below 1, or an
      empty ``command``.
    FileNotFoundError: the program is not an executable file or on ``PATH``.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise ValueError("num_processes and devices_per_process must be >= 1.")
  if not command:
    raise ValueError("command is empty.")
  out, err = out or sys.stdout, err or sys.stderr
  command = list(command)
  if command[0].endswith(".py"):
    command.insert(0, sys.executable)
  if shutil.which(command[0]) is None:
    raise FileNotFoundError(
      f"cannot run {command[0]!r}: not an executable file or a program on PATH"
    )
  coordinator = f"127.0.0.1:{port or free_port()}"
  lock = threading.Lock()
  exits: queue.SimpleQueue[int] = queue.SimpleQueue()  # process indices, in the order they end
  processes, tails, readers = [], [], []
  try:
    for i in range(num_processes):
      env = process_env(i, num_processes, coordinator, devices_per_process)
      process = subprocess.Popen(
        _dies_with_launcher(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, which _stop signals as a whole
      )
      processes.append(process)
    for i, process in enumerate(processes):
      tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
      reader = threading.Thread(
        target=_stream, args=(i, process.stdout, tail, out, lock), daemon=True
      )
      reader.start()
      waiter = threading.Thread(target=_report_exit, args=(i, process, exits), daemon=True)
      waiter.start()
      tails.append(tail)
      readers.append(reader)
    status = _watch(processes, exits, tails, readers, timeout, grace, err, lock)
  finally:
    _stop(processes, grace)  # also on Ctrl-C (a SIGKILLed launcher: _dies_with_launcher)
    for reader in readers:
      reader.join(timeout=5)
  return status


def _watch(processes, exits, tails, readers, timeout, grace, err, lock) -> int:
  """Waits for all processes to succeed, or for the first failure or the timeout."""
  deadline = None if timeout is None else time.monotonic() + timeout
  succeeded = 0
  while succeeded < len(processes):
    wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
    if wait <= 0:
      running = [i for i, p in enumerate(processes) if p.poll() is None]
      with lock:
        _write(err, f"[launch] timeout after {timeout:g} s; stopping processes {running}.\n")
      _stop(processes, grace)
      return 124
    try:
      first = exits.get(timeout=wait)  # short waits: Ctrl-C stays responsive
    except queue.Empty:
      continue
    code = processes[first].returncode
    if code == 0:
      succeeded += 1
      continue
    with lock:
      _write(
        err,
        f"[launch] process {first} (pid {processes[first].pid}) {_describe(code)}; "
        "stopping the others.\n",
      )
    _stop(processes, grace)
    readers[first].join(timeout=2)  # its last lines, before they are summarised
    with lock:
      lines = "".join(f"[launch]   {line}\n" for line in tails[first])
      _write(err, f"[launch] last output of process {first}:\n{lines}")
    return _exit_status(code)
  return 0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m optax_gsam.launch",
    description="Run a script as N local processes of one JAX multi-process runtime.",
  )
  parser.add_argument("--local-processes", type=int, required=True, metavar="N")
  parser.add_argument("--devices-per-process", type=int, default=1, metavar="D")
  parser.add_argument("--timeout", type=float, default=None, help="seconds; default: no limit")
  parser.add_argument("--grace", type=float, default=3.0, help="seconds from SIGTERM to SIGKILL")
  parser.add_argument("--port", type=int, default=None, help="coordinator port; default: free")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args...]")
  args = parser.parse_args(argv)
  for flag in ("local_processes", "devices_per_process"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
  if args.command[:1] == ["--"]:
    args.command = args.command[1:]
  if not args.command:
    parser.error(
      "give the command after --, e.g. -- python -m benchmarks.costs.pod_launch --multihost"
    )
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``python -m optax_gsam.launch --local-processes N ... -- command``."""
  args = _parse_args(argv)
  received: list[int] = []

  def stop(signum, frame):
    received.append(signum)
    if len(received) == 1:
      raise KeyboardInterrupt  # unwinds through launch(), which stops every process
    # Later signals are ignored: launch() is already stopping (within the grace period).

  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup, or a background job
      signal.signal(signum, stop)
  try:
    return launch(
      args.command,
      num_processes=args.local_processes,
      devices_per_process=args.devices_per_process,
      timeout=args.timeout,
      grace=args.grace,
      port=args.port,
    )
  except KeyboardInterrupt:
    return 128 + (received[0] if received else signal.SIGINT)
  except FileNotFoundError as error:  # the program does not exist
    _write(sys.stderr, f"[launch] {error}\n")
    return 127


if __name__ == "__main__":
  sys.exit(main())
