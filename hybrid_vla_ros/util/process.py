"""A child process that ends with the process that started it.

:func:`~hybrid_vla_ros.tools.node_processes.launch_node` starts the nodes in their own session, so nothing would
stop them if the replay were killed; it puts its pid in ``EXIT_WITH_PARENT_ENV``, and a node that finds it there
asks for SIGTERM when that parent exits (``prctl(PR_SET_PDEATHSIG)``, Linux, man 2 prctl).
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
    """If ``EXIT_WITH_PARENT_ENV`` holds a pid, get SIGTERM when the parent exits (now, if it already has).
    Returns whether the request is in place (False: unset, not a pid, or off Linux; nothing done)."""
    value = os.environ.get(EXIT_WITH_PARENT_ENV, "")
    if not value.isdigit() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(value):  # the parent is gone already (this process was re-parented)
        os.kill(os.getpid(), signal.SIGTERM)
    return True
