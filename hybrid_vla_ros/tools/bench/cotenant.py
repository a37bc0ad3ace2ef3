"""A co-tenant for the load-step cases: busy processes on chosen cores, started and stopped between frames."""
from __future__ import annotations

import signal
import subprocess
import sys

#: The co-tenant's loop: a busy process that only burns its core (no memory traffic, no threads).
_BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


class CoTenant:
    """Busy processes, one pinned to each core of ``cores``, standing in for other work on those cores (Autoware's
    perception or planning beside the suffix). :meth:`start` and :meth:`stop` are idempotent; :meth:`stop` kills
    the processes (SIGKILL) and reaps them."""

    def __init__(self, cores):
        self.cores = [int(c) for c in cores]
        self._procs: list[subprocess.Popen] = []

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        if self._procs:
            return
        for core in self.cores:  # each pins itself: the script sets its own affinity first
            self._procs.append(subprocess.Popen([sys.executable, "-S", "-c", _BUSY, str(core)],
                                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL))

    def stop(self) -> None:
        for p in self._procs:
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self._procs = []
