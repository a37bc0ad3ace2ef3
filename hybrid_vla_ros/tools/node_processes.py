"""Starting and stopping the node processes that ``hybrid-vla replay`` (and the tests) run: each a
``python -m hybrid_vla_ros.ros.<node>`` child in its own session, its output to a log file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ..util.paths import REPO_ROOT
from ..util.process import EXIT_WITH_PARENT_ENV


def launch_node(name: str, ns: str, params_file: Path, ros_args: list[str], log_path: Path,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``prefix_node`` or ``suffix_node`` as a child process (``python -m``, this interpreter) in
    namespace ``ns`` with a params file and extra ``--ros-args`` (remaps); output goes to ``log_path``. ``env``:
    variables set (or, with value None, removed) for the child on top of this process's environment (e.g. another
    ``ROS_DOMAIN_ID``).
    The child runs in its own session so a terminal Ctrl-C reaches it only through :func:`stop_processes`, and
    gets SIGTERM from the kernel if this process exits without stopping it (killed, say:
    :func:`~hybrid_vla_ros.util.process.exit_with_parent`). Call it from the thread that lives as long as the
    child should (the kernel signals when the creating thread exits)."""
    extra, env = env or {}, dict(os.environ)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[EXIT_WITH_PARENT_ENV] = str(os.getpid())  # the node ends with this process (util.process)
    cmd = [sys.executable, "-m", f"hybrid_vla_ros.ros.{name}", "--ros-args", "-r", f"__ns:={ns}",
           "--params-file", str(params_file), *ros_args]
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 20.0) -> list[int]:
    """SIGINT each process (rclpy shuts the node down cleanly), wait, SIGKILL what remains; exit codes."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes
