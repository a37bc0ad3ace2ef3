"""The real ROS 2 tools for the tests: colcon, ``ros2 launch``, ``ros2 run``, ``ros2 lifecycle / param / topic``.

Tests that use them build this package with ``colcon build`` into an install space outside the repository
(once per process: :func:`colcon_install`) and run every command with the environment that
``source <install>/setup.bash`` gives (:func:`install_env`), as a user on a ROS 2 machine does. The tools
come from the wheels in ``../shared/ros2-tools`` (see scripts/bootstrap_venv.sh); where they are missing the
tests skip with the reason, and fail instead when ``CI=true`` (:func:`require_tools`).

Imported by test/conftest.py and by the test modules (test/ is on sys.path under pytest; test_launch_testing.py
puts it there itself for ``launch_test``). Keep it importable without the tools.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
#: Python modules and executables the tests need: launch, launch_ros, launch_testing, ros2cli, colcon.
TOOL_MODULES = ("launch", "launch_ros", "launch_testing", "ros2cli", "ros2launch", "ros2lifecycle", "ros2param",
                "colcon_core", "colcon_ros")
TOOL_EXECUTABLES = ("ros2", "colcon", "launch_test")


def ci() -> bool:
    """Whether this runs in CI (``CI=true``): there, missing tools fail the tests instead of skipping them."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def executable(name: str) -> str | None:
    """Path of a tool executable: beside this interpreter (the venv's bin), else on PATH; None when absent."""
    local = VENV_BIN / name
    return str(local) if local.exists() else shutil.which(name)


#: Names listed here (comma-separated) count as not installed: test/test_tools_check.py uses it to show the
#: skip / CI=true failure on a machine that has every tool.
HIDE_ENV = "HYBRID_VLA_TEST_HIDE_TOOLS"


def missing_tools() -> list[str]:
    """The tool modules and executables that are not installed ([] when all are)."""
    hidden = {n for n in os.environ.get(HIDE_ENV, "").split(",") if n}
    missing = [m for m in TOOL_MODULES if m in hidden or importlib.util.find_spec(m) is None]
    return missing + [e for e in TOOL_EXECUTABLES if e in hidden or executable(e) is None]


def missing_reason(missing: list[str]) -> str:
    return (f"the ROS 2 tools are not installed ({', '.join(missing)} missing): scripts/bootstrap_venv.sh installs "
            "launch, launch_ros, launch_testing and ros2cli from ../shared/ros2-tools (HYBRID_VLA_ROS2_TOOLS) "
            "and colcon from requirements.txt")


def require_tools() -> None:
    """Skip the calling test when a tool is missing (pytest.skip with the reason); with ``CI=true`` fail it."""
    import pytest

    missing = missing_tools()
    if not missing:
        return
    if ci():
        pytest.fail(missing_reason(missing) + "; CI=true: a test that needs them fails instead of skipping",
                    pytrace=False)
    pytest.skip(missing_reason(missing))


# ------------------------------------------------------------------------------------------- build
_install: Path | None = None


def colcon_install(base: Path | None = None) -> Path:
    """Build this package with ``colcon build`` into ``<base>/install`` (build and log folders beside it,
    nothing written into the repository) and return the install space. Once per process: later calls return
    the first build's install space. ``base`` defaults to a temporary folder removed at exit. Raises
    RuntimeError with colcon's output when the build fails."""
    global _install
    if _install is not None:
        return _install
    if base is None:
        base = Path(tempfile.mkdtemp(prefix="hvla_colcon_"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
    env = _base_env()
    cmd = [executable("colcon"), "--log-base", str(base / "log"), "build", "--base-paths", str(REPO),
           "--build-base", str(base / "build"), "--install-base", str(base / "install")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=base)
    if out.returncode != 0:
        raise RuntimeError(f"colcon build failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    _install = base / "install"
    return _install


def _base_env() -> dict[str, str]:
    """This process's environment with the venv's bin on PATH, the venv on AMENT_PREFIX_PATH (the message
    packages' ament index) and the source tree taken off PYTHONPATH (the install space must stand alone)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(VENV_BIN), env.get("PATH", "")])
    env.setdefault("AMENT_PREFIX_PATH", sys.prefix)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    if not keep:
        del env["PYTHONPATH"]
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


_envs: dict[Path, dict[str, str]] = {}


def install_env(install: Path) -> dict[str, str]:
    """The environment after ``source <install>/setup.bash`` (colcon's own script, run by bash), on top of
    :func:`_base_env`: the install's prefix first on AMENT_PREFIX_PATH, its site-packages on PYTHONPATH."""
    if install not in _envs:
        out = subprocess.run(["bash", "-c", f'source "{install}/setup.bash" && env -0'], env=_base_env(),
                             capture_output=True, timeout=60, check=True)
        env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
        _envs[install] = env
    return dict(_envs[install])


# ------------------------------------------------------------------------------------ ros2 commands
#: ``ros2`` verbs that look the node up in the graph first and answer "Node not found" when it is not listed.
_NODE_VERBS = {("lifecycle", "get"), ("lifecycle", "set"), ("lifecycle", "list"), ("param", "get"),
               ("param", "set"), ("param", "list"), ("param", "dump")}


def ros2(env: dict, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``ros2 <args>`` with ``env``; the completed process (text output). Never raises on a non-zero exit.

    A verb that looks the node up (``_NODE_VERBS``) asks the ros2 daemon first, as a user's command does; when
    the daemon does not list the node, it is asked once more with ``--no-daemon`` (its own discovery for 2 s): a
    daemon that has served many launches can keep missing a node that is up and answering (ros2/ros2cli#582;
    seen in CI as a minute of 'Node not found' for nodes that a replay had just driven).

    A command still running after ``timeout`` s is killed and returned with exit code 124 and a line in its
    stderr: the ros2 CLI's service verbs wait without end for a reply that a killed node's still-listed service
    never sends (after a SIGKILL DDS lists the dead process's ``get_state`` for a while; seen in CI after a
    respawn), so a caller that polls asks again instead of failing on the CLI's hang."""
    def run(argv):
        command = [executable("ros2"), *argv]
        try:
            return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            killed = f"\n(ros2 {' '.join(argv)} killed after {timeout:.0f} s)"
            return subprocess.CompletedProcess(command, 124, text(e.stdout), text(e.stderr) + killed)

    out = run(args)
    if tuple(args[:2]) in _NODE_VERBS and out.returncode != 0 and "Node not found" in out.stdout + out.stderr:
        out = run([*args[:2], "--no-daemon", "--spin-time", "2", *args[2:]])
    return out


def lifecycle_state(env: dict, node: str, timeout: float = 60.0) -> str:
    """The state label ``ros2 lifecycle get <node>`` prints ('active', 'unconfigured', ...). A call that does not
    find the node yet (the ros2 daemon it starts discovers the graph first), or that hangs past 20 s (see
    :func:`ros2`), is repeated for up to ``timeout`` s; '' when it never answers."""
    deadline = time.monotonic() + timeout
    while True:
        out = ros2(env, "lifecycle", "get", node, timeout=20)
        match = re.match(r"(\w+) \[\d+\]", out.stdout.strip())
        if out.returncode == 0 and match:
            return match.group(1)
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.5)


def wait_lifecycle_state(env: dict, node: str, state: str, timeout: float, alive=None) -> str:
    """Poll ``ros2 lifecycle get`` until ``node`` reports ``state`` (or ``timeout`` s pass, or ``alive()``
    turns False); the last state seen."""
    deadline, seen = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        seen = lifecycle_state(env, node, timeout=0)
        if seen == state or (alive is not None and not alive()):
            return seen
        time.sleep(0.5)
    return seen


def stop_daemon(env: dict) -> None:
    """``ros2 daemon stop`` (the ros2 CLI starts a daemon for the domain on first use)."""
    ros2(env, "daemon", "stop", timeout=60)


def _default_sigint() -> None:
    # A child inherits an ignored SIGINT (bash ignores it for background jobs, and Python then installs no
    # handler): ros2 launch would ignore our SIGINT. Restore the default before exec.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    """Start ``cmd`` (``ros2 launch ...``, ``ros2 run ...``) in its own session with SIGINT at its default,
    stdout and stderr into ``log_path``."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_default_sigint)
    finally:
        log.close()


class Launched:
    """A ``ros2 launch hybrid_vla_ros hybrid_vla.launch.py <arguments>`` process and its output."""

    def __init__(self, arguments: list[str], env: dict, log_path: Path):
        self.cmd = [executable("ros2"), "launch", "hybrid_vla_ros", "hybrid_vla.launch.py", *arguments]
        self.env, self.log_path = env, log_path
        self.t_start = time.monotonic()
        self.proc = spawn(self.cmd, env, log_path)
        self.tree = []  # psutil.Process of every descendant seen (launch's node processes)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def node_pids(self) -> dict[str, int]:
        """Node name -> pid from launch's 'process started with pid [N]' lines (e.g. 'prefix_node-1')."""
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"\[INFO\] \[([\w-]+)\]: process started with pid "
                                                                 r"\[(\d+)\]", self.log())}

    def wait_log(self, pattern: str, timeout: float) -> re.Match | None:
        """Wait until the output matches regular expression ``pattern`` (or launch exits); the match or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match or not self.alive():
                return match or re.search(pattern, self.log())
            time.sleep(0.2)
        return None

    def record_tree(self) -> list:
        """Remember launch's descendant processes as they are now (for the orphan check after stop)."""
        import psutil

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if all(child.pid != p.pid for p in self.tree):
                    self.tree.append(child)
        except psutil.NoSuchProcess:
            pass
        return self.tree

    def stop(self, timeout: float = 90.0) -> int:
        """SIGINT to ``ros2 launch`` (what Ctrl-C does) and wait for it; its exit code. After ``timeout`` s the
        whole session is killed (and -9 returned)."""
        self.record_tree()
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def survivors(self) -> list:
        """Descendants recorded by :meth:`record_tree` that still run (orphans when launch has exited)."""
        return [p for p in self.tree if p.is_running() and p.status() != "zombie"]

    def kill(self) -> None:
        """SIGKILL launch's session and every recorded descendant (clean-up after a failure)."""
        self.record_tree()
        for p in [self.proc] + self.tree:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass


def ring_segments(namespace: str) -> list[str]:
    """The /dev/shm files of the shared-memory ring of ``namespace`` (segment, and any ``.init-*`` leftover)."""
    from hybrid_vla_ros.transport.ring import segment_name

    name = segment_name("prefix_states", namespace)
    return sorted(p.name for p in Path("/dev/shm").glob(f"{name}*"))


# ------------------------------------------------------------------------------------ the test's own node
class SpunNode:
    """The test's own rclpy node, in a context of its own (in ROS domain ``domain_id``; None: ROS_DOMAIN_ID), spun by
    a SingleThreadedExecutor in a daemon thread.

    Subclasses create their subscriptions and publishers on ``self.node`` and keep what arrives under
    ``self.lock`` (``keep`` appends a message to a list); ``wait`` polls a predicate under that lock. ``close``
    stops the executor and shuts the context down. Needs rclpy (import it only where the tests have it).
    """

    def __init__(self, name: str, domain_id: int | None = None):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)  # None: ROS_DOMAIN_ID
        self.node = rclpy.create_node(f"{name}_{uuid.uuid4().hex[:6]}", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        # reentrant: a wait() predicate may read this node's state through methods that take the lock themselves
        self.lock = threading.RLock()
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def keep(self, bucket: list, msg) -> None:
        """Append ``msg`` to ``bucket`` under the lock (a subscription callback)."""
        with self.lock:
            bucket.append(msg)

    def wait(self, predicate, timeout: float = 30.0) -> bool:
        """Poll ``predicate()`` under the lock every 50 ms until it holds (True) or ``timeout`` s pass (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        import rclpy

        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
