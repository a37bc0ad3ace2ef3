"""The two nodes a ``hybrid-vla replay`` drives (:class:`ReplayNodes`): started by it, or found running with
``--attach``; brought to active through their lifecycle services and, after the run, returned (see
:mod:`hybrid_vla_ros.tools.replay` for what --attach does and waits for)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..ros.graph import running_pipeline
from .node_processes import launch_node, stop_processes
from .playback import ACCELERATION_TOPIC, ODOMETRY_TOPIC

#: With --attach, a node is taken as settled once it has made no lifecycle transition for this long (s) (for
#: the graph to show whether another lifecycle manager is there); with another manager, --attach-wait.
ATTACH_QUIET_S = 1.0


def node_params(args, ns: str, k: int, cams: list[str], prefix_cores: list[int], suffix_cores: list[int],
                odometry_period_s: float | None = None) -> dict:
    """The parameters of the two node processes a replay starts (node name -> ``ros__parameters``), as written to
    its params file: split layer ``k``, the ``cams`` camera topics, the cores of each (the prefix's: those the
    suffix does not get, [] = not pinned) and ``args``' model, dtype, device, transport, sync tolerance, suffix
    backend (when given) and, with ``--oracle logged-path``, the bag as the suffix's ``oracle_bag``.

    Both nodes run on the bag's clock (``use_sim_time: true``; the replay publishes ``/clock``), so the
    output guard's age check stays on. At ``--rate`` above 1 the bag's clock runs that much faster than
    the computer, so ``guard.max_age_s`` is scaled by the rate: it stays the same compute latency in
    wall time.

    ``odometry_period_s``: the bag's odometry spacing (s, median), when it has two messages or more. Until the
    suffix has two odometry messages it knows no period and waits ``odometry_wait_s`` for the one after the
    first frame's stamp; a bag with sparse odometry (the embedded one: 1 Hz, 91 ms after the cameras) on a busy
    machine could miss that and drop the first frame (``no_odometry``). The replay's wait is then 1.5 periods
    at ``--rate`` (the same bound the suffix applies once it knows the period), never below the default and at
    most the schema's maximum (5 s: a slow ``--rate`` such as 0.01 would ask for more); a wait ends as soon as
    the message arrives. The prefix's ``ego_state_wait_s`` (checkpoints that read the ego state or have the
    query heads) gets the same wait."""
    from ..ros.params import defaults, parameter_specs

    a, model = args, str(Path(args.model_path).resolve())
    prefix_threads = a.prefix_threads or max(1, len(prefix_cores) or len(os.sched_getaffinity(0)))
    suffix = {"model_path": model, "split_layer": k, "cpu_affinity": suffix_cores,
              "threads": len(suffix_cores), "dtype": a.dtype, "use_sim_time": True}
    if a.suffix_backend is not None:
        suffix["suffix_backend"] = a.suffix_backend
    if getattr(a, "decode_step", None) is not None:
        suffix["decode_step"] = a.decode_step
    if getattr(a, "oracle", None) == "logged-path":
        suffix["oracle_bag"] = str(Path(a.bag).resolve())
    if a.rate > 1.0:
        suffix["guard.max_age_s"] = round(defaults("suffix_node")["guard.max_age_s"] * a.rate, 6)
    prefix = {"model_path": model, "split_layer": k, "camera_topics": cams,
              "camera_transports": [a.transport], "sync_tolerance_ms": a.sync_tolerance_ms,
              "device": a.device, "dtype": a.dtype, "torch_threads": prefix_threads,
              "cpu_affinity": prefix_cores, "fast_jpeg_decode": a.fast_jpeg_decode, "use_sim_time": True}
    if odometry_period_s:
        wait_s = round(1.5 * odometry_period_s / a.rate, 3)
        for params, node, name in ((suffix, "suffix_node", "odometry_wait_s"),
                                   (prefix, "prefix_node", "ego_state_wait_s")):
            if wait_s > defaults(node)[name]:
                params[name] = min(wait_s, float(parameter_specs(node)[name]["maximum"]))
    return {
        f"{ns}/prefix_node": {"ros__parameters": prefix},
        f"{ns}/suffix_node": {"ros__parameters": suffix},
    }


def node_error_lines(log: Path, most: int = 3) -> list[str]:
    """The last ``most`` error lines of a node's log (rclpy's ``[ERROR]`` / ``[FATAL]`` lines and this package's
    'invalid parameters' line), to show why a node refused a transition; [] when the log is missing."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if "[ERROR]" in ln or "[FATAL]" in ln or "invalid parameters" in ln][-most:]


class ReplayNodes:
    """``<ns>/prefix_node`` and ``<ns>/suffix_node`` of one replay: their processes when the replay starts them
    (``procs``, logs under ``out``), their lifecycle clients, and the state each was found in (``found``: node ->
    settled primary state) with the lifecycle requests it had refused before (``refused_before``).

    ``args``: the replay's options (``attach``, ``attach_wait``, ``timeout`` in s, ``output_topic``); ``rec``:
    the :class:`~hybrid_vla_ros.tools.replay_recorder.Recorder` whose /diagnostics are read.
    """

    def __init__(self, args, ns: str, out: Path, rec):
        self.args, self.ns, self.out, self.rec = args, ns, out, rec
        self.procs: list[subprocess.Popen] = []
        self.managers: list = []
        self.found: dict[str, str] = {}  # node -> the settled lifecycle state it was found in
        self.refused_before: dict[str, int] = {}  # node -> lifecycle_requests_refused before this replay drove it

    def launch(self, params_file: Path) -> None:
        """Start both node processes with ``params_file`` (the prefix first), output into ``<out>/<node>.log``."""
        # The prefix reads odometry (and acceleration) only for a checkpoint with ego_state_input.
        self.procs.append(launch_node(
            "prefix_node", self.ns, params_file,
            ["-r", f"~/input/kinematic_state:={ODOMETRY_TOPIC}",
             "-r", f"~/input/acceleration:={ACCELERATION_TOPIC}"],
            self.out / "prefix_node.log"))
        self.procs.append(launch_node(
            "suffix_node", self.ns, params_file,
            ["-r", f"~/input/kinematic_state:={ODOMETRY_TOPIC}",
             "-r", f"~/output/trajectory:={self.args.output_topic}"],
            self.out / "suffix_node.log"))

    def connect(self, node) -> None:
        """Lifecycle clients of both nodes on the replay's rclpy ``node`` (spun in another thread)."""
        from ..ros.lifecycle_client import LifecycleClient

        self.managers = [LifecycleClient(node, f"{self.ns}/prefix_node"),
                         LifecycleClient(node, f"{self.ns}/suffix_node")]

    def _say_unanswered(self, m) -> None:
        """Why node ``m`` did not offer its lifecycle services: a process of this replay exited, or no answer."""
        dead = [(name, p.returncode) for name, p in zip(("prefix_node", "suffix_node"), self.procs)
                if p.poll() is not None]
        if dead:
            for name, code in dead:
                tail = (self.out / f"{name}.log").read_text().strip().splitlines()[-3:]
                print(f"hybrid-vla replay: {name} exited with {code}: " + " | ".join(tail), file=sys.stderr)
        else:
            hint = (": is it running, in this namespace (--namespace) and ROS domain (ROS_DOMAIN_ID)?"
                    if self.args.attach else "")
            print(f"hybrid-vla replay: {m.name} did not answer within {self.args.timeout:g} s{hint}",
                  file=sys.stderr)

    def others_running(self, node, discovery_s: float = 2.0) -> bool:
        """Before this replay starts its own nodes: True (with a message) when a node of either name already runs
        in this namespace (a ``ros2 launch`` or a replay that was killed; it would answer this replay's lifecycle
        requests and mix its counts into the report): the ring's owner and consumer, and the graph as the
        replay's rclpy ``node`` discovers it within ``discovery_s`` seconds (``ros.graph.running_pipeline``). A
        node found later is caught by the same check after bring-up."""
        domain = node.context.get_domain_id()
        found = running_pipeline(node, self.ns, "prefix_states", domain, discovery_s)
        if found:
            print(f"hybrid-vla replay: {' and '.join(found)} {'is' if len(found) == 1 else 'are'} already running "
                  f"in ROS domain {domain}: stop it, drive it with --attach, or give this replay another "
                  "--namespace", file=sys.stderr)
            return True
        return False

    def _names_unique(self, node) -> bool:
        """False (with a message) when the graph, as the replay's rclpy ``node`` sees it, holds more than one
        node of either name in this namespace: another pair already running there (a ``ros2 launch``, a
        replay that was killed) would answer this replay's lifecycle requests and mix its counts into the
        report."""
        names = node.get_node_names_and_namespaces()
        for m in self.managers:
            ns, name = m.name.rsplit("/", 1)
            count = sum(1 for n, s in names if n == name and s == (ns or "/"))
            if count > 1:
                domain = os.environ.get("ROS_DOMAIN_ID", "0")
                what = ("attach to one pair only" if self.args.attach
                        else "stop it, drive it with --attach, or give this replay another --namespace (or "
                             "another ROS_DOMAIN_ID, e.g. `ROS_DOMAIN_ID=57 make demo`)")
                print(f"hybrid-vla replay: {count} nodes named {m.name} are running in ROS domain {domain}: {what}",
                      file=sys.stderr)
                return False
        return True

    def bring_up(self, node) -> bool:
        """Make both nodes active (see :mod:`hybrid_vla_ros.tools.replay` for --attach); False (with a message)
        when not, or when another node of the same name runs in the namespace. Records the state each node was
        found in (``found``). ``node``: the replay's rclpy node (for the graph)."""
        from ..ros.lifecycle_client import BACK_FROM_ACTIVE

        for m in self.managers:
            if self.args.attach:
                print(f"waiting up to {self.args.timeout:g} s for {m.name}'s lifecycle services "
                      f"(ROS_DOMAIN_ID={os.environ.get('ROS_DOMAIN_ID', '0 (unset)')}) ...", flush=True)
            if not m.wait_for_services(self.args.timeout, self.procs):
                self._say_unanswered(m)
                return False
        # lifecycle requests the nodes refused so far: more at the end than this replay's own refused ones means
        # another manager (a launch autostart this replay came before) was bringing a node up meanwhile
        if self.args.attach:  # (a node busy in a transition publishes no /diagnostics: its latest then)
            before = self.rec.fresh_statuses(self.ns, time.monotonic(), 3.0)
            self.refused_before = {m.name: st.lifecycle_requests_refused if (st := before.of(m.name)) else 0
                                   for m in self.managers}
        # nodes this replay started: nobody else drives them
        quiet, managed = (ATTACH_QUIET_S, self.args.attach_wait) if self.args.attach else (0.0, None)
        # The prefix first: the suffix waits for its ring. Each node gets the timeout for its own transitions.
        for m in self.managers:
            found, made, problem = m.bring_to_active(2 * self.args.timeout + (managed or 0.0), quiet, managed)
            self.found[m.name] = found
            if self.args.attach:
                print(f"{m.name}: found {found or 'not settled'}"
                      + (f", {' and '.join(made)} done by this replay" if made else "")
                      + (f"; it goes back to {found} after the run" if made and found in BACK_FROM_ACTIVE else "")
                      + (f" (waited {m.waited_s:.1f} s for it to settle)" if m.waited_s >= 0.5 and not made else ""))
            if problem:
                print(f"hybrid-vla replay: {problem}; see {self.out if self.procs else 'the node output'}",
                      file=sys.stderr)
                if self.procs:  # the node's own reason, from the log of the process this replay started
                    for line in node_error_lines(self.out / f"{m.name.rsplit('/', 1)[-1]}.log"):
                        print(f"  {line}", file=sys.stderr)
                return False
        return self._names_unique(node)

    def return_all(self, final=None) -> None:
        """After the run: attached nodes back to the state they were found in; started ones deactivated and
        cleaned up (their processes are stopped next). ``final``: the nodes' statuses at the end
        (replay_recorder.Statuses); an attached node that refused more lifecycle requests than this replay's own was
        being brought up by another manager too (this replay came first): it is left active."""
        from ..ros.lifecycle_client import BACK_FROM_ACTIVE

        goals = {}  # manager -> the state to return it to
        for m, proc in zip(self.managers, self.procs or [None] * len(self.managers)):
            if m.name not in self.found or (proc is not None and proc.poll() is not None):
                continue  # never brought up by this replay, or its process has exited: nothing to undo
            goal = self.found.get(m.name) if self.args.attach else "unconfigured"
            if goal not in BACK_FROM_ACTIVE:
                continue  # an attached node never settled: nothing to undo
            if self.args.attach and goal != "active" and final is not None:
                st = final.of(m.name)
                others = ((st.lifecycle_requests_refused if st else 0) - self.refused_before.get(m.name, 0)
                          - m.refused)
                if others > 0:
                    print(f"{m.name}: left active: another lifecycle manager asked for {others} transition(s) while "
                          "this replay brought it up (a launch file's autostart this replay came before)")
                    continue
            goals[m] = goal
        # Both deactivated first (prefix, then suffix), then cleaned up (suffix, then prefix): an active node never
        # sees its peer go (it would log it as a lost peer), and the suffix detaches before the prefix removes
        # the ring.
        failed = set()
        steps = [(m, "inactive") for m in self.managers if goals.get(m) in ("inactive", "unconfigured")]
        steps += [(m, "unconfigured") for m in self.managers[::-1] if goals.get(m) == "unconfigured"]
        for m, state in steps:
            if m not in failed:
                ok, problem = m.return_to(state, self.args.timeout)
                if not ok:
                    failed.add(m)
                    print(f"hybrid-vla replay: {problem}", file=sys.stderr)
        if self.args.attach:
            for m, goal in goals.items():
                if m not in failed:
                    print(f"{m.name}: left {goal}" + (" (as found)" if goal == self.found.get(m.name) else ""))

    def stop(self) -> list[int]:
        """Stop the processes this replay started (:func:`~.node_processes.stop_processes`); their exit codes."""
        return stop_processes(self.procs)
