"""A child process that ends with the process that started it.

:func:`~hybrid_vla_ros.tools.node_processes.launch_node` starts the nodes in their own session (a terminal's
Ctrl-C reaches them only through the replay), so nothing would stop them if the replay itself were killed.
It names itself in ``EXIT_WITH_PARENT_ENV``; a node that finds its parent's pid there asks the kernel for
SIGTERM when that parent exits (``prctl(PR_SET_PDEATHSIG)``, Linux, man 2 prctl) and shuts down as it does on
any SIGTERM. Started any other way (``ros2 launch``, ``ros2 run``) the variable is unset and nothing changes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["EXIT_WITH_PARENT_ENV", "exit_with_parent"]

#: Environment variable holding the pid of the process whose exit should end this one.
EXIT_WITH_PARENT_ENV = "HYBRID_VLA_EXIT_WITH_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def exit_with_parent() -> bool:
    """If ``EXIT_WITH_PARENT_ENV`` holds a pid, have the kernel send this process SIGTERM when its parent exits,
    and send it now if the parent is no longer that pid (it exited before this call). Returns True when the
    request is in place; False where the variable is unset or not a pid, or off Linux (nothing is done)."""
    value = os.environ.get(EXIT_WITH_PARENT_ENV, "")
    if not value.isdigit() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(value):  # the parent is gone already (this process was re-parented)
        os.kill(os.getpid(), signal.SIGTERM)
    return True
