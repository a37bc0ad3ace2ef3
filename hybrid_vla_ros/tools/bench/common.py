"""Plumbing shared by the bench parts: pinned worker processes and their message channel, percentiles, a
timing loop, the ROS environment of a worker and a meter of the machine's other load.

Nothing here imports torch or rclpy at module level: :mod:`.worker` imports this module before it pins itself.
"""
from __future__ import annotations

import json
import math
import os
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...util.paths import REPO_ROOT, embedded_bag, package_file
from ...util.stats import percentiles  # the bench parts import it from here

DEFAULT_BAG = embedded_bag()  # the source tree's, else the installed copy
NUSCENES_DIR = REPO_ROOT.parent / "shared" / "data" / "nuscenes_scene0061_mmdet3d_demo"
SHM_PROFILE = package_file("config", "fastdds_shm_large.xml")
#: Environment variables that select a Fast DDS configuration; stripped from every rclpy worker so that each
#: variant runs with exactly the settings it names and nothing inherited from the caller (e.g. the tests'
#: FASTDDS_DEFAULT_PROFILES_FILE).
FASTDDS_ENV_PREFIXES = ("FASTDDS_", "FASTRTPS_", "RMW_FASTRTPS_")


# ------------------------------------------------------------------------------------------------ statistics

def median(values) -> float:
    """Median of a non-empty sample (NaN when empty)."""
    return percentiles(values)["p50"]


#: Clocks of :func:`time_call`: "wall" (CLOCK_MONOTONIC) or "cpu" (CPU time of the whole process, all threads).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


def time_call(fn, *, repeats: int, min_sample_s: float = 0.02, warmup: int = 1, clock: str = "wall") -> dict:
    """Time of one call of ``fn`` (seconds): ``median``, ``min`` and the per-call ``samples``.

    ``warmup`` untimed calls, then ``repeats`` samples; each sample times ``n`` back-to-back calls and divides
    by ``n``, where ``n`` (``calls_per_sample``) is chosen from the last warm-up call so that a sample lasts at
    least ``min_sample_s`` (this keeps the clock's resolution and Python's loop overhead out of sub-ms calls).
    ``clock`` "wall": ``time.perf_counter_ns`` (CLOCK_MONOTONIC); "cpu": ``time.process_time_ns``, the CPU time
    of this process's threads, which for one compute thread on a pinned core leaves out the time other
    processes took the core away (equal to the wall time on an idle core; not for work that waits or spans
    several threads). Raises KeyError for another clock."""
    now = CLOCKS[clock]
    t_last = 0.0
    for _ in range(max(1, warmup)):
        t0 = now()
        fn()
        t_last = (now() - t0) / 1e9
    n = max(1, math.ceil(min_sample_s / max(t_last, 1e-7)))
    samples = []
    for _ in range(max(1, repeats)):
        t0 = now()
        for _ in range(n):
            fn()
        samples.append((now() - t0) / 1e9 / n)
    return {"median": median(samples), "min": min(samples), "samples": samples, "calls_per_sample": n,
            "clock": clock}


# ------------------------------------------------------------------------------------------------ host

def read_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Memory read bandwidth of one core, GB/s: the best of ``repeats`` sums over ``mib`` MiB of float64 (beyond
    the caches; numpy's sum reads each byte once), on the calling thread."""
    import numpy as np

    a = np.ones(mib * 2**20 // 8)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


class NoiseMeter:
    """How busy the machine was with *other* work while a part ran.

    Reads /proc/stat (system-wide CPU time by state) and the CPU time of this process and its waited-for
    children (``os.times``) at enter and exit. ``foreign_cpu_share`` = (busy CPU time of the whole machine -
    CPU time of this process tree) / (wall time x logical CPUs): 0 means nothing else ran, 0.5 means other
    processes used one of two cores. ``steal_share`` = hypervisor steal time / (wall x CPUs). ``loadavg``: the
    1-minute load average at exit. Children still running at exit are not in ``os.times`` (wait for them)."""

    def __init__(self):
        self.result: dict = {}

    @staticmethod
    def _proc_stat() -> tuple[float, float]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields]
        hz = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal guest guest_nice; guest time is inside user already
        busy = sum(ticks[:3]) + sum(ticks[5:7]) + (ticks[7] if len(ticks) > 7 else 0)
        steal = ticks[7] if len(ticks) > 7 else 0
        return busy / hz, steal / hz

    @staticmethod
    def _own_cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> NoiseMeter:
        self._t0 = time.monotonic()
        self._busy0, self._steal0 = self._proc_stat()
        self._own0 = self._own_cpu()
        return self

    def __exit__(self, *exc) -> bool:
        wall = time.monotonic() - self._t0
        busy, steal = self._proc_stat()
        own = self._own_cpu() - self._own0
        ncpu = os.cpu_count() or 1
        denom = max(wall * ncpu, 1e-9)
        self.result = {"wall_s": wall, "foreign_cpu_share": max(0.0, (busy - self._busy0 - own) / denom),
                       "steal_share": max(0.0, (steal - self._steal0) / denom), "loadavg_1min": os.getloadavg()[0]}
        return False


# ------------------------------------------------------------------------------------------------ workers

class Channel:
    """Newline-delimited JSON messages over a connected stream socket (one end per process)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = b""

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def send(self, obj: dict) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def poll(self) -> bool:
        """True when a whole message is waiting (never blocks)."""
        if b"\n" in self._buf:
            return True
        r, _, _ = select.select([self.sock], [], [], 0)
        if not r:
            return False
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise EOFError("channel closed")
        self._buf += chunk
        return b"\n" in self._buf

    def recv(self, timeout: float | None = None) -> dict:
        """Next message; raises TimeoutError after ``timeout`` seconds (None: wait forever), EOFError when the
        other end closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([self.sock], [], [], wait)
            if not r:
                raise TimeoutError(f"no message within {timeout} s")
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("channel closed")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.sock.close()


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its error and the tail of its log."""


class Worker:
    """One pinned worker process running a task of :mod:`hybrid_vla_ros.tools.bench.worker`.

    The child is pinned to ``cores`` in ``preexec_fn`` (between fork and exec), so the interpreter and every
    thread it starts later (OpenMP, DDS) run only there; the worker pins itself again first thing. ``env``:
    the whole environment of the child (default: this one plus PYTHONPATH = the repository). ``extra_fds``:
    further inheritable descriptors (e.g. one end of an acknowledgement socket). Output goes to a log file
    whose tail is attached to errors. Use as a context manager: exit kills the child if it still runs (this
    child only, by its pid).
    """

    def __init__(self, task: str, args: dict, *, cores: list[int] | None = None, env: dict | None = None,
                 extra_fds: tuple[int, ...] = (), log_dir: str | None = None):
        self.task = task
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.chan = Channel(parent)
        spec = {"task": task, "cores": cores, "fd": child.fileno(), "args": args}
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p and p != str(REPO_ROOT)])
        log_dir = log_dir or tempfile.gettempdir()
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench_{task}_", suffix=".log", dir=log_dir)
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "hybrid_vla_ros.tools.bench.worker", json.dumps(spec)],
                                         stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env, cwd=str(REPO_ROOT),
                                         pass_fds=(child.fileno(), *extra_fds), preexec_fn=pin)
        finally:
            os.close(fd)
            child.close()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def recv(self, timeout: float | None = None, expect: str | None = None) -> dict:
        """Next message of the worker. Raises WorkerError when it reports an error, dies or stays silent for
        ``timeout`` s, or sends another type than ``expect``."""
        try:
            msg = self.chan.recv(timeout)
        except (TimeoutError, EOFError, OSError) as e:
            rc = self.proc.poll()
            raise WorkerError(f"worker {self.task} ({'exit code ' + str(rc) if rc is not None else 'running'}): "
                              f"{e}\n--- log tail ---\n{self.log_tail()}") from None
        if msg.get("type") == "error":
            raise WorkerError(f"worker {self.task} failed: {msg.get('error')}\n{msg.get('traceback', '')}"
                              f"\n--- log tail ---\n{self.log_tail()}")
        if expect is not None and msg.get("type") != expect:
            raise WorkerError(f"worker {self.task}: expected a {expect!r} message, got {msg.get('type')!r}")
        return msg

    def send(self, obj: dict) -> None:
        self.chan.send(obj)

    def result(self, timeout: float | None = None, log=None) -> dict:
        """Wait for the task's return value (its ``result`` message) and for the process to exit. ``progress``
        messages on the way are passed to ``log`` (their ``line``); ``timeout`` applies to each message."""
        while True:
            msg = self.recv(timeout)
            if msg.get("type") == "progress":
                if log is not None:
                    log(msg["line"])
                continue
            if msg.get("type") != "result":
                raise WorkerError(f"worker {self.task}: expected a 'result' message, got {msg.get('type')!r}")
            break
        self.wait(30)
        return msg["data"]

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            if self.wait(10) is None:
                self.proc.kill()
                self.wait(10)
        self.chan.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def measured_precisions(dtypes, cpu=None) -> tuple[dict, dict]:
    """What a part measures for ``dtypes`` (names: fp32, bf16, fp16) on this CPU (``cpu``: a
    :class:`~hybrid_vla_ros.util.precision.CpuFeatures`, read when None): ({name: InferencePrecision the suffix node
    computes it in}, ``computed_as`` {name: {"precision", "reason"}} of the names computed in another name of
    ``dtypes``, which the part does not time twice). Raises ValueError for an unknown dtype."""
    from ...model.checkpoint import parse_dtype
    from ...util.precision import inference_precision

    precision = {n: inference_precision(parse_dtype(n), cpu=cpu) for n in dtypes}
    return precision, {n: {"precision": p.name, "reason": p.reason} for n, p in precision.items()
                       if p.widened and p.name in precision}


def attach_consumer(segment: str, timeout_s: float, **options):
    """A :class:`~hybrid_vla_ros.transport.consumer.RingConsumer` on ``segment`` (``options`` passed on), retried
    every 10 ms until the producer process has created the segment. Raises FileNotFoundError when it has not
    within ``timeout_s`` seconds."""
    from ...transport.ring import RingConsumer

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RingConsumer(segment, **options)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def ros_env(domain_id: int | None = None, extra: dict | None = None) -> dict:
    """Environment of an rclpy worker: this one without any Fast DDS selection (:data:`FASTDDS_ENV_PREFIXES`),
    with a ROS_DOMAIN_ID of its own (random in 1..100 unless given; Fast DDS maps domains 0..232 to ports, the
    range avoids 0, the default, so the bench never meets other nodes), discovery on this host only
    (ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST), AMENT_PREFIX_PATH = the interpreter's prefix (the venv is the
    ROS install prefix, as the Makefile sets it), then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FASTDDS_ENV_PREFIXES)}
    env["ROS_DOMAIN_ID"] = str(domain_id if domain_id is not None else random.randint(1, 100))
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env.setdefault("AMENT_PREFIX_PATH", sys.prefix)
    env.update(extra or {})
    return env
