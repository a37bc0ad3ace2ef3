"""``hybrid-vla replay``: the main job. Bag -> prefix_node -> ring -> suffix_node -> Trajectory bag + report.

It starts the two node processes (or, with ``--attach``, uses nodes already running, e.g. started
with ``ros2 launch`` or ``ros2 run`` on a ROS 2 machine), drives them through configure and activate with
the standard ``lifecycle_msgs/srv/ChangeState`` services as a lifecycle manager would, replays a rosbag2
bag (MCAP or sqlite3, read with rosbags) at its recorded rate through rclpy publishers, looped
``--loops`` times with header stamps shifted so time keeps increasing, and publishes the bag's time on
``/clock`` (as ``ros2 bag play --clock`` does; the nodes it starts run with ``use_sim_time: true``, so
their output guard judges the recorded stamps against the bag's clock), records every published
Trajectory (and the per-frame timing) into an MCAP bag, and prints a report. It then deactivates
and cleans both nodes up and stops the processes. With ``--plots DIR`` it also draws what the
pipeline did (see :mod:`hybrid_vla_ros.tools.plots`).

With ``--attach`` the nodes are driven from whatever lifecycle state they are in, with only the
transitions needed (unconfigured: configure and activate; inactive: activate; active: none). A node in
a transition is waited for, and so is one that made a transition in the last ``--attach-wait`` seconds
while another lifecycle manager has a client on its ``change_state`` service (``ros2 launch`` keeps one
per node; its autostart configures and activates the nodes as soon as it sees them): that autostart is
waited for, not raced (``ATTACH_QUIET_S`` without another manager). After
the run each attached node is returned to the state it was found in (active stays active; one found
unconfigured is deactivated and cleaned up again), and the processes keep running. The report counts
this run only: the nodes' counters live as long as their processes, so the replay takes their
/diagnostics counters when the nodes are active, before playback, and subtracts them.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..util.bags import BagMessage, camera_topics, read_bag
from ..util.cores import parse_core_list, usable_cores
from ..util.paths import embedded_bag, package_file
from ..ros.graph import wait_for_subscribers
from .node_processes import launch_node, stop_processes
from .playback import ODOMETRY_TOPIC, play_bag
from .replay_report import frame_of, lifecycle_refused, print_report, resplit_report, run_counts, run_report

DEFAULT_BAG = embedded_bag()
ACCELERATION_TOPIC = "/localization/acceleration"  # played when the bag has it (the embedded bag does not) and
# the checkpoint takes the ego state
#: With --attach, a node is taken as settled once it has made no lifecycle transition for this long (s) (for
#: the graph to show whether another lifecycle manager is there); with another manager, --attach-wait.
ATTACH_QUIET_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hybrid-vla replay``."""
    p.add_argument("--model-path", required=True, help="checkpoint directory (see `hybrid-vla init-model`)")
    p.add_argument("--bag", default=str(DEFAULT_BAG), help="rosbag2 folder (MCAP or sqlite3); default: the embedded DGP bag")
    p.add_argument("--loops", type=int, default=1, help="play the bag this many times (stamps shifted each loop)")
    p.add_argument("--rate", type=float, default=1.0, help="playback speed factor (1.0 = recorded rate)")
    p.add_argument("--split-layer", type=int, default=None, help="split layer K (default: L // 2)")
    p.add_argument("--resplit", type=_resplit_event, action="append", default=[], metavar="FRAME:K",
                   help="live re-split: set split_layer K on the running suffix, then the prefix, just before "
                        "frame FRAME (0-based, counted over all loops) is played; repeatable. The report lists the "
                        "frames each move left without a trajectory; the nodes' logs give load and wait times")
    p.add_argument("--transport", choices=("compressed", "raw"), default="compressed",
                   help="camera topics to play: image_raw/compressed or image_raw")
    p.add_argument("--device", default="auto", help="prefix device: auto | cpu | cuda[:N]")
    p.add_argument("--fast-jpeg-decode", action="store_true",
                   help="the prefix decodes JPEGs scaled down when the model input is small (prefix parameter "
                        "fast_jpeg_decode; the picture differs slightly from a full decode)")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (both nodes)")
    p.add_argument("--suffix-cores", default=None,
                   help="cores for the suffix process, e.g. '1' or '2,3' (default: the last core)")
    p.add_argument("--prefix-threads", type=int, default=0, help="torch threads of a CPU prefix (0 = the other cores)")
    p.add_argument("--sync-tolerance-ms", type=float, default=50.0, help="camera synchronization tolerance (ms)")
    p.add_argument("--namespace", default="/hybrid_vla", help="namespace of the two nodes")
    p.add_argument("--output-topic", default="/planning/hybrid_vla/trajectory", help="trajectory topic")
    p.add_argument("--output", default="out/replay",
                   help="output folder: trajectories/ (MCAP bag, replaced on each run), node logs, params.yaml, report.json")
    p.add_argument("--attach", action="store_true", help="drive nodes that are already running instead of starting them")
    p.add_argument("--attach-wait", type=float, default=10.0, metavar="S",
                   help="with --attach: a node found unconfigured or inactive while another lifecycle manager (e.g. "
                        "ros2 launch, autostart or not) has a client on its change_state service is driven only "
                        "after S seconds without a transition, so that manager's autostart is waited for, not raced")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also write PNG pictures (trajectory on the front camera, bird's-eye view, timeline, "
                        "latency histograms) into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed for each lifecycle transition")


def message_class(msgtype: str):
    """'sensor_msgs/msg/Image' -> the rclpy message class. Raises ImportError / AttributeError."""
    pkg, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


@dataclass
class Recorder:
    """What the replay node received, by camera stamp (ns)."""

    trajectories: dict[int, float] = field(default_factory=dict)  # stamp -> wall receive time (s)
    timings: dict[int, dict] = field(default_factory=dict)  # stamp -> stage ms, and t_*_ns CLOCK_MONOTONIC instants
    diagnostics: dict[str, dict] = field(default_factory=dict)  # status name -> key/values
    diagnostics_at: dict[str, float] = field(default_factory=dict)  # status name -> monotonic receive time (s)
    paths: dict[int, np.ndarray] = field(default_factory=dict)  # stamp -> (P, 3) time_from_start s, map x, y (m)
    odometry: list = field(default_factory=list)  # EgoState of each odometry message played (stamps as played)
    first_camera: dict[int, BagMessage] = field(default_factory=dict)  # played stamp -> first camera's image
    lock: threading.Lock = field(default_factory=threading.Lock)


def _parse_cores(text: str | None) -> list[int]:
    """``--suffix-cores`` -> core list (``util.cores.parse_core_list``); None -> the last usable core."""
    return usable_cores()[-1:] if text is None else parse_core_list(text)


def prefix_cores(suffix_cores: list[int]) -> list[int]:
    """The prefix's cores: every core this process may use that the suffix does not get ([] = not pinned,
    when none is left over), so the prefix's OpenCV and torch threads stay off the suffix's cores."""
    return sorted(set(usable_cores()) - set(suffix_cores))


def node_error_lines(log: Path, most: int = 3) -> list[str]:
    """The last ``most`` error lines of a node's log (rclpy's ``[ERROR]`` / ``[FATAL]`` lines and this package's
    'invalid parameters' line), to show why a node refused a transition; [] when the log is missing."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if "[ERROR]" in ln or "[FATAL]" in ln or "invalid parameters" in ln][-most:]


def _age_drop_hint(report: dict, rate: float, attach: bool) -> str:
    """Why the suffix's output guard may have dropped trajectories for their age (``guard_too_old`` /
    ``guard_future_stamp``), from the report's ``use_sim_time`` of each node."""
    sim = report.get("use_sim_time") or {}
    if not sim.get("suffix"):
        return ("the suffix node's output guard dropped trajectories for their stamps, and it does not run on "
                "the bag's clock: the replay plays the bag's recorded stamps and publishes the bag's time on "
                "/clock, so the nodes must run with use_sim_time:=true (the params.yaml a replay writes has it"
                + ("; start attached nodes so, e.g. `ros2 launch ... use_sim_time:=true`)" if attach else ")"))
    return (f"the suffix node's output guard dropped trajectories older than guard.max_age_s by the bag's clock. "
            f"At --rate {rate:g} the replay scales guard.max_age_s by {rate:g}, so the limit is still the same wall "
            "time from the camera stamp to publication (1 s as shipped); those frames took longer than that (is "
            "the machine busy with other work?): replay on a quieter machine, or at a lower --rate, where frames "
            "do not wait for the prefix")


def config_file(name: str) -> Path:
    """A file of the package's config/ folder: the source tree's, else the installed share/ copy."""
    return package_file("config", name)


_ROS_NAMESPACE = re.compile(r"^/?([A-Za-z_][A-Za-z0-9_]*)(/[A-Za-z_][A-Za-z0-9_]*)*$")


def _resplit_event(text: str) -> tuple[int, int]:
    """``FRAME:K`` of ``--resplit`` -> (frame index >= 0, split layer >= 0)."""
    try:
        frame, k = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FRAME:K (two integers)") from None
    if frame < 0 or k < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: FRAME and K must be >= 0")
    return frame, k


def set_parameter(node, target: str, name: str, value, timeout: float = 10.0) -> tuple[bool, str]:
    """Set one parameter of node ``target`` through its SetParameters service (as ``ros2 param set``).
    Returns (successful, reason); (False, 'timed out ...') when the service does not answer in ``timeout`` s."""
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    client = node.create_client(SetParameters, f"{target}/set_parameters")
    try:
        if not client.wait_for_service(timeout):
            return False, f"timed out waiting for {target}/set_parameters"
        done = threading.Event()
        future = client.call_async(SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()]))
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            return False, f"timed out setting {name} on {target}"
        result = future.result().results[0]
        return result.successful, result.reason
    finally:
        node.destroy_client(client)


def check_arguments(args: argparse.Namespace) -> list[str]:
    """Problems with the command-line arguments that need no ROS and no model (one line each)."""
    problems = []
    if args.loops < 1:
        problems.append(f"--loops must be >= 1, got {args.loops}")
    if not args.rate > 0:
        problems.append(f"--rate must be > 0, got {args.rate}")
    if args.sync_tolerance_ms <= 0:
        problems.append(f"--sync-tolerance-ms must be > 0, got {args.sync_tolerance_ms}")
    if not args.attach_wait >= 0:
        problems.append(f"--attach-wait must be >= 0, got {args.attach_wait}")
    if not _ROS_NAMESPACE.match(args.namespace):
        problems.append(f"--namespace {args.namespace!r} is not a ROS namespace ([A-Za-z_][A-Za-z0-9_]* parts)")
    try:
        cores = _parse_cores(args.suffix_cores)
        missing = sorted(set(cores) - os.sched_getaffinity(0))
        if missing or not cores:
            problems.append(f"--suffix-cores {args.suffix_cores!r}: this process may use cores "
                            f"{sorted(os.sched_getaffinity(0))}")
    except ValueError as e:
        problems.append(f"--suffix-cores: {e}")
    if args.dtype not in ("fp32", "bf16", "fp16"):
        problems.append(f"--dtype must be one of fp32, bf16, fp16, got {args.dtype!r}")
    if args.prefix_threads < 0:
        problems.append(f"--prefix-threads must be >= 0 (0 = one per prefix core), got {args.prefix_threads}")
    if not args.timeout > 0:
        problems.append(f"--timeout must be > 0 s, got {args.timeout}")
    return problems


def run_replay(args: argparse.Namespace) -> int:
    """Run the main job; returns a process exit code (0 when trajectories came out and nodes shut down cleanly)."""
    problems = check_arguments(args)
    if problems:
        for p in problems:
            print(f"hybrid-vla replay: {p}", file=sys.stderr)
        return 2
    from ..model.config import VLAConfig

    try:
        cfg = VLAConfig.load(args.model_path)
    except (OSError, ValueError) as e:
        print(f"hybrid-vla replay: cannot read the checkpoint config in {args.model_path}: {e}", file=sys.stderr)
        return 1
    try:
        messages = read_bag(args.bag)
        cams = camera_topics(messages, args.transport)
    except Exception as e:  # noqa: BLE001 - rosbags raises its own error types for unreadable bags
        print(f"hybrid-vla replay: cannot use the bag {args.bag}: {e}", file=sys.stderr)
        return 1
    bad_k = [f"{f}:{k}" for f, k in args.resplit if k > cfg.num_layers]
    if bad_k or (args.split_layer is not None and not 0 <= args.split_layer <= cfg.num_layers):
        print(f"hybrid-vla replay: split layers must be in [0, {cfg.num_layers}] for this model "
              f"(--split-layer {args.split_layer}, --resplit {' '.join(bad_k) or '-'})", file=sys.stderr)
        return 2
    if len(cams) != cfg.n_cameras:
        print(f"hybrid-vla replay: the bag has {len(cams)} {args.transport} cameras, the model takes {cfg.n_cameras}",
              file=sys.stderr)
        return 1
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"hybrid-vla replay: cannot create the output folder {out}: {e}", file=sys.stderr)
        return 1
    if args.plots:
        try:
            Path(args.plots).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"hybrid-vla replay: cannot create the plots folder {args.plots}: {e}", file=sys.stderr)
            return 1
    # Whole camera images over shared memory (see config/fastdds_shm_large.xml); the node processes inherit it.
    if "FASTDDS_DEFAULT_PROFILES_FILE" not in os.environ and "FASTRTPS_DEFAULT_PROFILES_FILE" not in os.environ:
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(config_file("fastdds_shm_large.xml"))
    if cfg.random_init:
        print("note: the checkpoint has RANDOM weights: the trajectories test the pipeline, they are not driving advice")
    session = ReplaySession(args, cfg, messages, cams, out)
    return session.run()


class ReplaySession:
    """One replay: node processes (unless attached), lifecycle management, playback, recording, report."""

    def __init__(self, args, cfg, messages: list[BagMessage], cams: list[str], out: Path):
        self.args, self.cfg, self.cams, self.out = args, cfg, cams, out
        self.messages = messages  # the whole bag: CameraInfo and /tf_static for the plots
        self.ns = "/" + args.namespace.strip("/")
        self.k = cfg.num_layers // 2 if args.split_layer is None else args.split_layer
        self.suffix_cores = _parse_cores(args.suffix_cores)
        self.prefix_cores = prefix_cores(self.suffix_cores)
        if not self.prefix_cores and not args.attach:
            print(f"warning: --suffix-cores {self.suffix_cores} takes every core this process may use: the prefix "
                  "runs unpinned, sharing the suffix's cores", file=sys.stderr)
        self.clock = None  # the bag's clock on /clock (tools.sim_clock.BagClock) while the replay runs
        play_topics = {f"{t}/compressed" if args.transport == "compressed" else t for t in cams} | {ODOMETRY_TOPIC}
        if cfg.ego_state_input:  # only a prefix with ego state input subscribes to the acceleration
            play_topics.add(ACCELERATION_TOPIC)
        self.play = [m for m in messages if m.topic in play_topics]
        self.rec = Recorder()
        self.procs: list[subprocess.Popen] = []
        self.bag = None
        self.interrupted = False
        self.found: dict[str, str] = {}  # node -> the settled lifecycle state it was found in
        self.refused_before: dict[str, int] = {}  # node -> lifecycle_requests_refused before this replay drove it
        self.baseline: dict[str, dict] = {}  # status name -> /diagnostics values before playback

    def write_params(self) -> Path:
        """The params file both node processes read (also a record of what was run).

        Both nodes run on the bag's clock (``use_sim_time: true``; the replay publishes ``/clock``), so the
        output guard's age check stays on. At ``--rate`` above 1 the bag's clock runs that much faster than
        the computer, so ``guard.max_age_s`` is scaled by the rate: it stays the same compute latency in
        wall time. The prefix is pinned to the cores the suffix does not get (:func:`prefix_cores`)."""
        import yaml

        from ..ros.params import defaults

        a, model = self.args, str(Path(self.args.model_path).resolve())
        prefix_threads = a.prefix_threads or max(1, len(self.prefix_cores) or len(os.sched_getaffinity(0)))
        suffix = {"model_path": model, "split_layer": self.k, "cpu_affinity": self.suffix_cores,
                  "threads": len(self.suffix_cores), "dtype": a.dtype, "use_sim_time": True}
        if a.rate > 1.0:
            suffix["guard.max_age_s"] = round(defaults("suffix_node")["guard.max_age_s"] * a.rate, 6)
        params = {
            f"{self.ns}/prefix_node": {"ros__parameters": {
                "model_path": model, "split_layer": self.k, "camera_topics": self.cams,
                "camera_transports": [a.transport], "sync_tolerance_ms": a.sync_tolerance_ms,
                "device": a.device, "dtype": a.dtype, "torch_threads": prefix_threads,
                "cpu_affinity": self.prefix_cores, "fast_jpeg_decode": a.fast_jpeg_decode, "use_sim_time": True}},
            f"{self.ns}/suffix_node": {"ros__parameters": suffix},
        }
        path = self.out / "params.yaml"
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        return path

    def run(self) -> int:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.signals import SignalHandlerOptions

        from .sim_clock import BagClock

        # No rclpy signal handler: Ctrl-C stays a KeyboardInterrupt here, so the replay can stop playback,
        # still take the nodes down through their lifecycle and write the report.
        context = rclpy.Context()
        rclpy.init(context=context, signal_handler_options=SignalHandlerOptions.NO)
        node = rclpy.create_node("hybrid_vla_replay", context=context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        spin = threading.Thread(target=executor.spin, daemon=True)
        spin.start()
        # The bag's clock on /clock before the nodes start (they run with use_sim_time: true), held at the
        # bag's first receive time until playback starts.
        self.clock = BagClock(node, self.play[0].t_ns).start()
        if not self.args.attach:
            params_file = self.write_params()
            # The prefix reads odometry (and acceleration) only for a checkpoint with ego_state_input.
            self.procs.append(launch_node(
                "prefix_node", self.ns, params_file,
                ["-r", f"~/input/kinematic_state:={ODOMETRY_TOPIC}",
                 "-r", f"~/input/acceleration:={ACCELERATION_TOPIC}"],
                self.out / "prefix_node.log"))
            self.procs.append(launch_node(
                "suffix_node", self.ns, params_file,
                ["-r", f"~/input/kinematic_state:={ODOMETRY_TOPIC}", "-r", f"~/output/trajectory:={self.args.output_topic}"],
                self.out / "suffix_node.log"))
        rc = 1
        try:
            rc = self._drive(node)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
        finally:
            self.clock.stop()
            if self.bag is not None:
                self.bag.close()
            executor.shutdown()
            spin.join(timeout=10)
            node.destroy_node()
            rclpy.try_shutdown(context=context)
            codes = stop_processes(self.procs)
            if any(c != 0 for c in codes):
                print(f"node processes exited with {codes}; logs in {self.out}", file=sys.stderr)
                rc = rc or 1
        return rc

    def _on_diagnostics(self, msg) -> None:
        t = time.monotonic()
        with self.rec.lock:
            for status in msg.status:
                self.rec.diagnostics[status.name] = {kv.key: kv.value for kv in status.values}
                self.rec.diagnostics_at[status.name] = t

    def _subscribe(self, node) -> None:
        from autoware_planning_msgs.msg import Trajectory
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rclpy.serialization import serialize_message

        from ..util.stamps import stamp_to_ns

        rec, bag = self.rec, self.bag
        timing_topic = f"{self.ns}/suffix_node/debug/frame_timing"
        traj_conn = bag.add_topic(self.args.output_topic, "autoware_planning_msgs/msg/Trajectory")
        timing_conn = bag.add_topic(timing_topic, "diagnostic_msgs/msg/DiagnosticArray")

        def on_trajectory(msg):
            stamp = stamp_to_ns(msg.header.stamp)
            t_recv = time.monotonic()
            path = np.array([(p.time_from_start.sec + p.time_from_start.nanosec * 1e-9, p.pose.position.x,
                              p.pose.position.y) for p in msg.points]).reshape(-1, 3)
            with rec.lock:
                rec.trajectories[stamp] = t_recv
                rec.paths[stamp] = path
            bag.write(traj_conn, stamp, serialize_message(msg))

        def on_timing(msg):
            stamp = stamp_to_ns(msg.header.stamp)
            # '<stage>_ms' -> stage: float ms; 't_<event>_ns' stays: int CLOCK_MONOTONIC ns
            values = {kv.key: int(kv.value) if kv.key.endswith("_ns") else float(kv.value)
                      for kv in msg.status[0].values}
            with rec.lock:
                rec.timings[stamp] = {k.removesuffix("_ms"): v for k, v in values.items()}
            bag.write(timing_conn, stamp, serialize_message(msg))

        node.create_subscription(Trajectory, self.args.output_topic, on_trajectory,
                                 QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        node.create_subscription(DiagnosticArray, timing_topic, on_timing, 50)

    def _bring_up(self, managers) -> bool:
        """Make both nodes active (see the module docstring for --attach); False (with a message) when not.
        Records the state each node was found in (``self.found``)."""
        from ..ros.lifecycle_client import BACK_FROM_ACTIVE

        t_start = time.monotonic()
        for m in managers:
            if self.args.attach:
                print(f"waiting up to {self.args.timeout:.0f} s for {m.name}'s lifecycle services "
                      f"(ROS_DOMAIN_ID={os.environ.get('ROS_DOMAIN_ID', '0 (unset)')}) ...", flush=True)
            if not m.wait_for_services(self.args.timeout, self.procs):
                dead = [(name, p.returncode) for name, p in zip(("prefix_node", "suffix_node"), self.procs)
                        if p.poll() is not None]
                if dead:
                    for name, code in dead:
                        tail = (self.out / f"{name}.log").read_text().strip().splitlines()[-3:]
                        print(f"hybrid-vla replay: {name} exited with {code}: " + " | ".join(tail), file=sys.stderr)
                else:
                    hint = (": is it running, in this namespace (--namespace) and ROS domain (ROS_DOMAIN_ID)?"
                            if self.args.attach else "")
                    print(f"hybrid-vla replay: {m.name} did not answer within {self.args.timeout:.0f} s{hint}",
                          file=sys.stderr)
                return False
        # lifecycle requests the nodes refused so far: more at the end than this replay's own refused ones means
        # another manager (a launch autostart this replay came before) was bringing a node up meanwhile
        if self.args.attach:  # (a node busy in a transition publishes no /diagnostics: its latest then)
            self.refused_before = {m.name: lifecycle_refused(d) for m, d in
                                   zip(managers, self._fresh_diagnostics(time.monotonic(), 3.0).values())}
        # nodes this replay started: nobody else drives them
        quiet, managed = (ATTACH_QUIET_S, self.args.attach_wait) if self.args.attach else (0.0, None)
        # The prefix first: the suffix waits for its ring. Each node gets the timeout for its own transitions.
        for m in managers:
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
        where = "attached to running nodes" if self.args.attach else f"suffix pinned to cores {self.suffix_cores}"
        print(f"nodes active after {time.monotonic() - t_start:.1f} s: split_layer={self.k}/{self.cfg.num_layers}, {where}")
        return True

    def _fresh_diagnostics(self, since: float, timeout: float = 10.0) -> dict[str, dict]:
        """The nodes' pipeline /diagnostics key/values received after monotonic time ``since`` (each node
        publishes them at 1 Hz), waiting up to ``timeout`` s; a node without one then maps to its latest."""
        names = [f"{self.ns}/{n}: pipeline" for n in ("prefix_node", "suffix_node")]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.rec.lock:
                if all(self.rec.diagnostics_at.get(n, -1.0) > since for n in names):
                    break
            time.sleep(0.05)
        with self.rec.lock:
            return {n: dict(self.rec.diagnostics.get(n, {})) for n in names}

    def _return_nodes(self, managers, final: dict | None = None) -> None:
        """After the run: attached nodes back to the state they were found in; started ones deactivated and
        cleaned up (their processes are stopped next). ``final``: the nodes' /diagnostics at the end (status
        name -> key/values); an attached node that refused more lifecycle requests than this replay's own was
        being brought up by another manager too (this replay came first): it is left active."""
        from ..ros.lifecycle_client import BACK_FROM_ACTIVE

        for m in managers:
            goal = self.found.get(m.name) if self.args.attach else "unconfigured"
            if goal not in BACK_FROM_ACTIVE:
                continue  # an attached node never settled: nothing to undo
            if self.args.attach and goal != "active" and final is not None:
                others = (lifecycle_refused(final.get(f"{m.name}: pipeline", {})) - self.refused_before.get(m.name, 0)
                          - m.refused)
                if others > 0:
                    print(f"{m.name}: left active: another lifecycle manager asked for {others} transition(s) while "
                          "this replay brought it up (a launch file's autostart this replay came before)")
                    continue
            ok, problem = m.return_to(goal, self.args.timeout)
            if not ok:
                print(f"hybrid-vla replay: {problem}", file=sys.stderr)
            elif self.args.attach:
                print(f"{m.name}: left {goal}" + (" (as found)" if goal == self.found.get(m.name) else ""))

    def _drive(self, node) -> int:
        from diagnostic_msgs.msg import DiagnosticArray

        from ..ros.lifecycle_client import LifecycleClient
        from .output_bag import OutputBag

        managers = [LifecycleClient(node, f"{self.ns}/prefix_node"), LifecycleClient(node, f"{self.ns}/suffix_node")]
        self.found = {}
        # /diagnostics from the start: the counters before playback are this run's baseline
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 50)
        if not self._bring_up(managers):
            self._return_nodes(managers)
            return 1
        self.baseline = self._fresh_diagnostics(time.monotonic())
        k = self.baseline.get(f"{self.ns}/prefix_node: pipeline", {}).get("split_layer", "")
        if self.args.attach and str(k).isdigit():
            self.k = int(k)  # the attached prefix's K, not this replay's default
        self.bag = OutputBag(self.out / "trajectories", overwrite=True)
        self._subscribe(node)
        publishers = {}
        for m in self.play:
            if m.topic not in publishers:
                cls = message_class(m.msgtype)
                publishers[m.topic] = (node.create_publisher(cls, m.topic, 10), cls)
        # with ego state input both nodes read the odometry
        wait_for_subscribers([pub for pub, _ in publishers.values() if not pub.topic_name.endswith("camera_info")],
                             10.0, {ODOMETRY_TOPIC: 2 if self.cfg.ego_state_input else 1})
        foreign = sorted(t for t, (pub, _) in publishers.items() if node.count_publishers(t) > 1)
        if foreign:
            print(f"warning: other publishers on {', '.join(foreign)}: their frames mix with this replay's",
                  file=sys.stderr)
        first_camera = f"{self.cams[0]}/compressed" if self.args.transport == "compressed" else self.cams[0]
        self.resplit_log = []
        published = play_bag(self.args, self.play, publishers, self.rec, self.ns, first_camera,
                          on_frame=lambda i: self._resplit(node, i) if self.args.resplit else None, clock=self.clock,
                          baseline=self.baseline)
        self.interrupted = published["interrupted"]
        if self.interrupted:
            print("\ninterrupted: playback stopped, shutting the nodes down", file=sys.stderr)
        frames = published["frames"]
        # Let frames in flight finish: stop when every frame has an answer or output stalls for 3 s.
        last_count, last_change = -1, time.monotonic()
        while time.monotonic() - last_change < 3.0 and len(self.rec.trajectories) < len(frames):
            if len(self.rec.trajectories) != last_count:
                last_count, last_change = len(self.rec.trajectories), time.monotonic()
            time.sleep(0.05)
        # this run's counts: the nodes' counters now (a report after the frames are done) minus the baseline
        final = self._fresh_diagnostics(time.monotonic())
        prefix, suffix = (run_counts(final[n], self.baseline.get(n, {}))
                          for n in (f"{self.ns}/prefix_node: pipeline", f"{self.ns}/suffix_node: pipeline"))
        self._return_nodes(managers, final)
        settings = {side: final[f"{self.ns}/{side}_node: pipeline"] for side in ("prefix", "suffix")}
        report = run_report(self.rec, frames, published, self.k, self.cfg, self.bag.path,
                         self.args.sync_tolerance_ms, prefix, suffix, settings)
        report["settings"] = {"dtype": self.args.dtype, "device": self.args.device, "rate": self.args.rate,
                              "loops": self.args.loops, "transport": self.args.transport,
                              "fast_jpeg_decode": self.args.fast_jpeg_decode}
        # the counters the nodes had before this run's playback (subtracted from the counts above)
        report["node_counters_at_start"] = {
            name: run_counts(self.baseline.get(f"{self.ns}/{name}: pipeline", {}), {})
            for name in ("prefix_node", "suffix_node")}
        report["resplits"] = resplit_report(self.resplit_log, frames, self.rec, self.args.sync_tolerance_ms)
        applied = {(e["frame"], e["split_layer"]) for e in self.resplit_log}
        report["resplits_not_reached"] = [f"{f}:{k}" for f, k in self.args.resplit if (f, k) not in applied]
        if report["resplits_not_reached"]:
            print(f"warning: --resplit {' '.join(report['resplits_not_reached'])} not applied: playback ended after "
                  f"{len(frames)} frames", file=sys.stderr)
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        print_report(report)
        if report["frames_published"] and not report["camera_messages_in"]:
            print("hint: the prefix received no camera messages: do its camera_topics / camera_transports match "
                  f"the played topics ({self.cams[0]}{'/compressed' if self.args.transport == 'compressed' else ''}, ...)?",
                  file=sys.stderr)
        if report["drops"].get("suffix.guard_too_old") or report["drops"].get("suffix.guard_future_stamp"):
            print("hint: " + _age_drop_hint(report, self.args.rate, self.args.attach), file=sys.stderr)
        if report["drops"].get("suffix.guard_no_clock"):
            print("hint: the suffix node's clock read 0 (use_sim_time without /clock): is this replay's /clock "
                  "reaching it (same ROS_DOMAIN_ID, discovery range)?", file=sys.stderr)
        plots_ok = self._write_plots(frames) if self.args.plots else True
        return 0 if report["trajectories_out"] > 0 and not self.interrupted and plots_ok else 1

    def _resplit(self, node, index: int) -> None:
        """Before frame ``index``: apply the ``--resplit`` events due (suffix first, so it loads blocks ahead)."""
        for frame, k in self.args.resplit:
            if frame != index:
                continue
            t0 = time.monotonic()
            results = [set_parameter(node, f"{self.ns}/{name}", "split_layer", k) for name in ("suffix_node", "prefix_node")]
            failed = [reason for ok, reason in results if not ok]
            if failed:
                print(f"\nre-split to K={k} before frame {index} refused: {'; '.join(failed)}", file=sys.stderr)
            self.resplit_log.append({"frame": index, "split_layer": k, "accepted": not failed,
                                     "set_ms": round((time.monotonic() - t0) * 1e3, 2)})

    def _write_plots(self, frames: dict[int, float]) -> bool:
        """Draw the pictures into ``--plots``; prints their paths. False (and a message) when that fails."""
        from . import plots

        rec = self.rec
        with rec.lock:
            received, timings, paths = dict(rec.trajectories), dict(rec.timings), dict(rec.paths)
            odometry, camera_images = list(rec.odometry), dict(rec.first_camera)
        tolerance_ns = self.args.sync_tolerance_ms * 1e6
        sent = {}  # trajectory stamp -> when the replay sent its frame's last image
        for stamp in received:
            key = frame_of(frames, stamp, tolerance_ns)
            if key is not None:
                sent[stamp] = frames[key]
        try:
            data = plots.collect(
                timings=timings, paths=paths, received=received, sent=sent, odometry=odometry,
                camera_images=camera_images, bag_messages=self.messages, tolerance_ns=tolerance_ns,
                extrinsics_yaml=config_file(plots.DEFAULT_EXTRINSICS),
                caption=f"split layer {self.k} of {self.cfg.num_layers}",
                random_init=self.cfg.random_init)
            written = plots.write_all(data, self.args.plots)
        except Exception as e:  # noqa: BLE001 - the report is out already; say what went wrong and fail
            print(f"hybrid-vla replay: cannot write the plots into {self.args.plots}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return False
        print("plots:")
        for path in written:
            print(f"  {path}")
        return True






















