"""optax_gsam.launch: environment, prefixed output, first failure, timeouts, process groups.

The children here are plain Python programs (no JAX), so these tests take seconds;
tests/test_multihost.py runs the launcher on real JAX processes.
"""

import contextlib
import io
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from optax_gsam import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python(code: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(code)]


def is_gone(pid: int) -> bool:
  """True when ``pid`` no longer runs (exited, or a zombie nobody has reaped yet)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return True
  status = pathlib.Path(f"/proc/{pid}/status")
  return status.exists() and "\nState:\tZ" in status.read_text()


def run_program(command, env=None, timeout=120):
  """Runs ``command`` from the repository root and returns its result, output as text."""
  return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run(command, out=None, **kwargs):
  out, err = out or io.StringIO(), io.StringIO()
  start = time.monotonic()
  status = launch.launch(command, out=out, err=err, **kwargs)
  return status, out.getvalue(), err.getvalue(), time.monotonic() - start


def test_process_env_sets_the_runtime_and_drops_an_inherited_device_count():
  base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1", "HOME": "/h"}
  env = launch.process_env(1, 2, "127.0.0.1:1234", 4, base=base)
  assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_NUM_CPU_DEVICES"] == "4"
  assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
  assert env["JAX_COORDINATOR_ADDRESS"] == env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:1234"
  assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("2", "1")
  assert env["XLA_FLAGS"] == "--xla_cpu_foo=1" and env["HOME"] == "/h"
  assert base["XLA_FLAGS"].startswith("--xla_force_host")  # the caller's mapping is untouched


def test_free_port_can_be_bound():
  import socket

  port = launch.free_port()
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", port))


def test_every_process_gets_its_id_and_its_lines_are_prefixed():
  code = """
    import os
    e = os.environ
    print(f"id={e['JAX_PROCESS_ID']} of {e['JAX_NUM_PROCESSES']} devices={e['JAX_NUM_CPU_DEVICES']}")
    print("coordinator", e["JAX_COORDINATOR_ADDRESS"])
  """
  status, out, err, _ = run(python(code), num_processes=3, devices_per_process=2, port=4321)
  assert status == 0, err
  for i in range(3):
    assert f"[proc {i}] id={i} of 3 devices=2\n" in out
    assert f"[proc {i}] coordinator 127.0.0.1:4321\n" in out


def test_first_failure_stops_the_others_and_their_children(tmp_path):
  pid_file = tmp_path / "grandchild.pid"
  code = f"""
    import os, subprocess, sys, time
    if os.environ["JAX_PROCESS_ID"] == "1":
      time.sleep(0.5)
      print("process 1 saw a bad thing", flush=True)
      sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open({str(pid_file)!r}, "w").write(str(child.pid))
    time.sleep(600)  # like a JAX process waiting in a collective for the dead one
  """
  status, _, err, seconds = run(python(code), num_processes=2, grace=1.0)
  assert status == 3
  assert "process 1" in err and "exited with status 3" in err
  assert "process 1 saw a bad thing" in err  # its last output is repeated in the summary
  assert seconds < 30
  grandchild = int(pid_file.read_text())
  deadline = time.monotonic() + 5
  while not is_gone(grandchild) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert is_gone(grandchild)


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal():
  code = """
    import os, signal, time
    if os.environ["JAX_PROCESS_ID"] == "0":
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
  """
  status, _, err, seconds = run(python(code), num_processes=2, grace=1.0)
  assert status == 128 + 9
  assert "process 0" in err and "killed by SIGKILL" in err
  assert seconds < 30


def test_timeout_kills_processes_that_ignore_sigterm():
  # JAX catches SIGTERM (a preemption notice) and keeps running, as this child does.
  code = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(600)
  """
  status, out, err, seconds = run(python(code), num_processes=2, timeout=1.0, grace=0.5)
  assert status == 124
  assert "timeout" in err and "[proc 1] ready" in out
  assert seconds < 20


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="num_processes"):
    launch.launch(["true"], num_processes=0)
  with pytest.raises(ValueError, match="empty"):
    launch.launch([], num_processes=1)


def test_command_line_runs_a_py_script_with_this_python(tmp_path):
  script = tmp_path / "hello.py"
  script.write_text("import os, sys\nprint('hello', os.environ['JAX_PROCESS_ID'], sys.argv[1:])\n")
  launcher = [sys.executable, "-m", "optax_gsam.launch", "--local-processes", "2"]
  result = run_program([*launcher, "--timeout", "60", "--", str(script), "--flag", "x"])
  assert result.returncode == 0, result.stderr
  assert "[proc 0] hello 0 ['--flag', 'x']" in result.stdout
  assert "[proc 1] hello 1 ['--flag', 'x']" in result.stdout


def test_command_line_needs_a_command():
  with pytest.raises(SystemExit):
    launch._parse_args(["--local-processes", "2", "--"])
  args = launch._parse_args(["--local-processes", "2", "--", "a.py", "--b"])
  assert args.command == ["a.py", "--b"] and args.local_processes == 2


def bare_environment(**extra: str) -> dict[str, str]:
  """This environment without the variables of a launcher or a cluster JAX could detect."""
  cluster = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_")
  env = {k: v for k, v in os.environ.items() if not k.startswith((*cluster, "KUBERNETES_"))}
  return env | {"JAX_PLATFORMS": "cpu"} | extra


INITIALIZE_THEN_COUNT = python("""
  import optax_gsam.launch
  optax_gsam.launch.initialize()
  import jax
  print("processes", jax.process_count())
""")


def test_initialize_runs_a_single_process_when_told_there_is_one():
  result = run_program(INITIALIZE_THEN_COUNT, env=bare_environment(JAX_NUM_PROCESSES="1"))
  assert result.returncode == 0, result.stderr
  assert "processes 1" in result.stdout


def test_initialize_without_a_coordinator_or_cluster_says_how_to_run_the_script():
  result = run_program(INITIALIZE_THEN_COUNT, env=bare_environment())
  assert result.returncode == 1  # at once, through the exit hook
  assert "processes" not in result.stdout
  assert "no coordinator_address was given" in result.stderr
  assert "python -m optax_gsam.launch" in result.stderr
  assert "JAX_NUM_PROCESSES=1" in result.stderr


def test_initialize_rejects_a_process_count_below_one():
  with pytest.raises(ValueError, match="num_processes must be at least 1, got 0"):
    launch.initialize(num_processes=0)


def test_the_first_process_to_fail_is_reported_even_when_another_fails_ms_later(tmp_path):
  marker = tmp_path / "process_1_exits"
  code = f"""
    import os, pathlib, sys, time
    marker = pathlib.Path({str(marker)!r})
    if os.environ["JAX_PROCESS_ID"] == "1":
      marker.touch()
      sys.exit(3)
    while not marker.exists():
      time.sleep(0.001)
    time.sleep(0.01)  # well inside one poll period of a launcher that polls
    sys.exit(1)
  """
  status, _, err, _ = run(python(code), num_processes=2, grace=1.0)
  assert status == 3, err
  assert "process 1" in err and "exited with status 3" in err


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals and /proc")


@LINUX
def test_a_signal_without_a_name_is_reported():
  code = """
    import os, signal
    os.kill(os.getpid(), signal.SIGRTMIN + 6)
  """
  status, _, err, _ = run(python(code), num_processes=1)
  number = int(__import__("signal").SIGRTMIN) + 6
  assert status == 128 + number
  assert f"was killed by signal {number}" in err


class ClosedPipe(io.StringIO):
  def write(self, text):
    raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_output_does_not_block_the_processes():
  code = """
    for i in range(100_000):  # far more than a pipe buffer holds
      print("x" * 50, i)
  """
  status, _, err, seconds = run(python(code), num_processes=2, timeout=60, out=ClosedPipe())
  assert status == 0, err
  assert seconds < 30


IGNORES_SIGTERM = """
  import os, signal, time
  signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX does: a preemption notice
  print("pid", os.getpid(), flush=True)
  time.sleep(600)
"""


@contextlib.contextmanager
def started_launcher(*options, child=IGNORES_SIGTERM, shell_prefix=""):
  """The command-line launcher over two children, and their pids; nothing survives the test."""
  command = [sys.executable, "-m", "optax_gsam.launch", "--local-processes", "2", *options, "--"]
  command = [*command, *python(child)]
  if shell_prefix:  # e.g. a signal disposition set by the shell, inherited across exec
    command = ["sh", "-c", f"{shell_prefix} exec {shlex.join(command)}"]
  launcher = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
  pids = []
  try:
    pids += [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
    yield launcher, pids
  finally:
    for pid in [launcher.pid, *pids]:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    launcher.wait(timeout=30)


def wait_until_gone(pids, seconds=10):
  deadline = time.monotonic() + seconds
  while not all(map(is_gone, pids)) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [pid for pid in pids if not is_gone(pid)]


def test_a_second_sigterm_does_not_leave_the_processes_running():
  with started_launcher("--grace", "3") as (launcher, pids):
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # inside the grace period
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    assert wait_until_gone(pids) == []


@LINUX
def test_the_processes_die_with_a_killed_launcher():
  with started_launcher() as (launcher, pids):
    launcher.kill()  # no finally runs: the kernel's parent-death signal ends them
    launcher.wait(timeout=30)
    assert wait_until_gone(pids) == []


def test_a_signal_inherited_as_ignored_stays_ignored():
  finishes = """
    import os, time
    print("pid", os.getpid(), flush=True)
    time.sleep(2)
    print("done", flush=True)
  """
  with started_launcher(child=finishes, shell_prefix="trap '' HUP;") as (launcher, _):
    launcher.send_signal(signal.SIGHUP)  # as nohup leaves it: ignored
    assert launcher.wait(timeout=60) == 0
    assert launcher.stdout.read().count("done") == 2


@LINUX
def test_commands_get_default_sigpipe_and_sigxfsz():
  # Python ignores both at startup; a command exec'd from Python would inherit that.
  status, out, err, _ = run(["sh", "-c", "grep SigIgn /proc/self/status"], num_processes=1)
  assert status == 0, err
  ignored = int(out.split()[-1], 16)
  assert not ignored & (1 << (signal.SIGPIPE - 1)) and not ignored & (1 << (signal.SIGXFSZ - 1))


def test_a_file_that_cannot_be_executed_gives_126(tmp_path):
  script = tmp_path / "no_shebang"
  script.write_text("echo hi\n")
  script.chmod(0o755)
  status, _, err, _ = run([str(script)], num_processes=1)
  assert status == 126
  assert f"cannot run {str(script)!r}" in err


def test_sys_exit_after_initialize_unwinds_then_skips_the_barrier(tmp_path):
  written = tmp_path / "written.txt"
  code = f"""
    import atexit, sys, threading, time
    atexit.register(time.sleep, 120)  # stands in for JAX's shutdown barrier
    from optax_gsam import launch
    launch._exit_now_on_failure()
    try:
      sys.exit(2)
    except SystemExit:
      print("caught", flush=True)
    worker = threading.Thread(target=sys.exit, args=(5,))
    worker.start()
    worker.join()
    print("the thread ended alone", flush=True)
    with open({str(written)!r}, "w") as f:
      f.write("data")
      try:
        sys.exit(3)
      finally:
        print("finally ran", flush=True)
  """
  start = time.monotonic()
  result = run_program(python(code), timeout=100)
  assert time.monotonic() - start < 60
  assert result.returncode == 3, result.stderr
  assert result.stdout.split("\n")[:3] == ["caught", "the thread ended alone", "finally ran"]
  assert written.read_text() == "data"  # the with block closed the file


def test_an_explicit_coordinator_ignores_an_inherited_bind_address():
  port, other = launch.free_port(), launch.free_port()
  code = f"""
    from optax_gsam import launch
    launch.initialize("127.0.0.1:{port}", num_processes=1, process_id=0)
    import jax
    print("processes", jax.process_count())
  """
  env = bare_environment(JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{other}")
  result = run_program(python(code), env=env, timeout=100)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "processes 1" in result.stdout


def test_command_line_errors_name_the_flag_or_the_program(capsys):
  with pytest.raises(SystemExit):
    launch._parse_args(["--local-processes", "0", "--", "a.py"])
  assert "--local-processes must be at least 1, got 0" in capsys.readouterr().err
  launcher = [sys.executable, "-m", "optax_gsam.launch", "--local-processes", "1"]
  result = run_program([*launcher, "--", "/no/such/program"])
  assert result.returncode == 127
  assert "[launch] cannot run '/no/such/program'" in result.stderr


def test_initialize_names_a_variable_that_is_not_an_integer(monkeypatch):
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'two'"):
    launch.initialize()


def test_initialize_patches_nothing_unless_asked(monkeypatch):
  """Outside the launcher, initialize() leaves sys.exit and sys.excepthook alone."""
  import jax

  monkeypatch.delenv("OPTAX_GSAM_FAIL_FAST", raising=False)
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
  before = (sys.exit, sys.excepthook)
  launch.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
  launch.initialize(
    coordinator_address="127.0.0.1:1",
    num_processes=2,
    process_id=0,
    exit_on_uncaught_exception=False,
  )
  assert (sys.exit, sys.excepthook) == before
  env = launch.process_env(0, 2, "127.0.0.1:1", 4, base={})
  assert env["OPTAX_GSAM_FAIL_FAST"] == "1"  # the launcher's processes opt in
