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

Here: the options and their checks, :func:`run_replay` and the session (:class:`ReplaySession`). The parts:
:mod:`~hybrid_vla_ros.tools.replay_nodes` (the nodes: started or attached, their lifecycle, the params file),
:mod:`~hybrid_vla_ros.tools.playback` (publishing the bag), :mod:`~hybrid_vla_ros.tools.replay_recorder`
(what comes back), :mod:`~hybrid_vla_ros.tools.replay_report` (the report), :mod:`~hybrid_vla_ros.tools.sim_clock`
(``/clock``) and :mod:`~hybrid_vla_ros.tools.node_processes` (the processes).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ..model.config import takes_scene
from ..ros.params import camera_info_topic, parameter_specs
from ..util.bags import BagMessage, camera_topics, played_topic, read_bag
from ..util.cores import parse_core_list, usable_cores
from ..util.paths import embedded_bag, package_file
from ..util.stamps import header_stamp_ns
from ..vehicle.open_loop import LoggedPath, logged_future
from .evaluate import (GROUND_TRUTH_TOPIC, describe_path, logged_path, loop_path, open_loop_report,
                       replay_open_loop)
from .node_processes import launch_node, stop_processes
from .playback import (ACCELERATION_TOPIC, ODOMETRY_TOPIC, message_class, missing_calibration, play_bag,
                       publish_calibration, publishers_for)
from .replay_nodes import ATTACH_QUIET_S, ReplayNodes, node_error_lines, node_params
from .replay_recorder import Recorder, Statuses
from .replay_report import frame_of, hints, print_report, run_details, run_report

#: The public names, those kept here for the callers of this module included (``launch_node``,
#: ``stop_processes``, ``message_class``, ``node_error_lines``: their homes are the modules named above).
__all__ = ["ACCELERATION_TOPIC", "ATTACH_QUIET_S", "DEFAULT_BAG", "Recorder", "ReplaySession", "add_arguments",
           "check_arguments", "config_file", "launch_node", "message_class", "node_error_lines", "prefix_cores",
           "run_replay", "set_parameter", "stop_processes", "write_plots"]

DEFAULT_BAG = embedded_bag()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``hybrid-vla replay``."""
    p.add_argument("--model-path", "--model", dest="model_path", required=True,
                   help="checkpoint directory (see `hybrid-vla init-model`); the nodes' model_path")
    p.add_argument("--bag", default=str(DEFAULT_BAG),
                   help="rosbag2 folder (MCAP or sqlite3); default: the embedded DGP bag")
    p.add_argument("--loops", type=int, default=1, help="play the bag this many times (stamps shifted each loop)")
    p.add_argument("--rate", type=float, default=1.0, help="playback speed factor (1.0 = recorded rate)")
    p.add_argument("--split-layer", type=int, default=None, help="split layer K (default: L // 2)")
    p.add_argument("--resplit", type=_resplit_event, action="append", default=[], metavar="FRAME:K",
                   help="live re-split: set split_layer K on the running suffix, then the prefix, just before "
                        "frame FRAME (0-based, counted over all loops) is played; repeatable. The report lists the "
                        "frames each move left without a trajectory; the nodes' logs give load and wait times")
    p.add_argument("--transport", choices=("compressed", "raw"), default="compressed",
                   help="camera topics to play: <topic>/compressed (CompressedImage) or <topic> (Image)")
    p.add_argument("--camera-topic-suffix", default="image_raw", metavar="NAME",
                   help="camera i is /sensing/camera/camera<i>/NAME (default image_raw; Autoware's launch files use "
                        "image_rect_color), as the launch file's camera_topic_suffix")
    p.add_argument("--camera-topics", type=_topic_list, default=None, metavar="T0,T1,...",
                   help="the cameras' image topics one by one, in the model's camera order (without /compressed), "
                        "for a bag not named /sensing/camera/camera<i>/...")
    p.add_argument("--device", default="auto", help="prefix device: auto | cpu | cuda[:N]")
    p.add_argument("--fast-jpeg-decode", action="store_true",
                   help="the prefix decodes JPEGs scaled down when the model input is small (prefix parameter "
                        "fast_jpeg_decode; the picture differs slightly from a full decode)")
    p.add_argument("--dtype", default="fp32", help="fp32 | bf16 | fp16 (both nodes)")
    p.add_argument("--suffix-backend", choices=parameter_specs("suffix_node")["suffix_backend"]["enum"],
                   default=None,
                   help="the suffix node's suffix_backend (default: the node's, eager). With openvino the replay "
                        "waits, up to --timeout, for the compiled suffix before playing the bag, so every frame "
                        "runs through it; the report says which backend computed how many frames")
    p.add_argument("--decode-step", choices=parameter_specs("suffix_node")["decode_step"]["enum"], default=None,
                   help="the suffix node's decode_step for a decoding model (default: the node's, eager). With "
                        "inductor the replay waits, up to --timeout, for the compiled step of its K before playing "
                        "the bag; the report's decode part says which step ran")
    p.add_argument("--suffix-cores", default=None,
                   help="cores for the suffix process, e.g. '1' or '2,3' (default: the last core)")
    p.add_argument("--prefix-threads", type=int, default=0, help="torch threads of a CPU prefix (0 = the other cores)")
    p.add_argument("--sync-tolerance-ms", type=float, default=50.0, help="camera synchronization tolerance (ms)")
    p.add_argument("--namespace", default="/hybrid_vla", help="namespace of the two nodes")
    p.add_argument("--output-topic", default="",
                   help="trajectory topic (default /planning/<namespace>/trajectory, as the launch file's default)")
    p.add_argument("--output", default="out/replay",
                   help="output folder: trajectories/ (MCAP bag, replaced on each run), node logs, params.yaml, "
                        "report.json")
    p.add_argument("--attach", action="store_true",
                   help="drive nodes that are already running instead of starting them")
    p.add_argument("--attach-wait", type=float, default=10.0, metavar="S",
                   help="with --attach: a node found unconfigured or inactive while another lifecycle manager (e.g. "
                        "ros2 launch, autostart or not) has a client on its change_state service is driven only "
                        "after S seconds without a transition, so that manager's autostart is waited for, not raced")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="also write PNG pictures (trajectory on the front camera, bird's-eye view, timeline, "
                        "latency histograms) into DIR")
    p.add_argument("--oracle", choices=("logged-path",), default=None,
                   help="a check of the open-loop figures: the suffix publishes the drive the bag logged after each "
                        "frame instead of the model's plan (suffix parameter oracle_bag), through the same conversion "
                        "and output guard; its ADE / FDE must be ~0. One loop only; not with --attach")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds allowed for each node's lifecycle services to appear, for each lifecycle transition "
                        "and, with the openvino suffix backend or the inductor decode step, for their builds "
                        "before playing (one --timeout for both; an inductor step is built again by each "
                        "replay, 25-65 s for SmolLM2-135M: raise it for larger models)")


def _parse_cores(text: str | None) -> list[int]:
    """``--suffix-cores`` -> core list (``util.cores.parse_core_list``); None -> the last usable core."""
    return usable_cores()[-1:] if text is None else parse_core_list(text)


def prefix_cores(suffix_cores: list[int]) -> list[int]:
    """The prefix's cores: every core this process may use that the suffix does not get ([] = not pinned,
    when none is left over), so the prefix's OpenCV and torch threads stay off the suffix's cores."""
    return sorted(set(usable_cores()) - set(suffix_cores))


def config_file(name: str) -> Path:
    """A file of the package's config/ folder: the source tree's, else the installed share/ copy."""
    return package_file("config", name)


_ROS_NAMESPACE = re.compile(r"^/?([A-Za-z_][A-Za-z0-9_]*)(/[A-Za-z_][A-Za-z0-9_]*)*$")


def _topic_list(text: str) -> list[str]:
    """``--camera-topics`` -> absolute topic names (comma-separated, none empty)."""
    topics = [t.strip() for t in text.split(",")]
    if not all(t.startswith("/") and len(t) > 1 for t in topics):
        raise argparse.ArgumentTypeError(f"{text!r}: give absolute topics, comma-separated (/a/image,/b/image)")
    return topics


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
    Returns (successful, reason); (False, 'timed out ...') when the service does not answer in ``timeout`` s.
    A request unanswered after a third of ``timeout`` is sent once more (setting a value is idempotent): with
    rmw_fastrtps a request or response can be lost while the client's endpoints are still matching (seen under
    load in CI: a found service that never answered)."""
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    client = node.create_client(SetParameters, f"{target}/set_parameters")
    try:
        if not client.wait_for_service(timeout):
            return False, f"timed out waiting for {target}/set_parameters"
        done = threading.Event()
        request = SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()])
        futures = [client.call_async(request)]
        futures[0].add_done_callback(lambda _: done.set())
        if not done.wait(timeout / 3):  # unanswered: once more, for the rest of the timeout
            futures.append(client.call_async(request))
            futures[1].add_done_callback(lambda _: done.set())
            done.wait(timeout * 2 / 3)
        answered = [f for f in futures if f.done() and f.result() is not None]
        if not answered:
            return False, f"timed out setting {name} on {target}"
        result = answered[0].result().results[0]
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
    if args.attach and args.suffix_backend is not None:
        problems.append("--suffix-backend sets the nodes a replay starts; attached nodes keep their own: set "
                        "suffix_backend on them (e.g. `-p suffix_backend:=openvino`)")
    if args.attach and args.decode_step is not None:
        problems.append("--decode-step sets the nodes a replay starts; attached nodes keep their own: set "
                        "decode_step on them (e.g. `-p decode_step:=inductor`)")
    if getattr(args, "oracle", None) and (args.loops != 1 or args.attach):
        problems.append("--oracle compares each frame with the drive logged after it, in one loop of the bag that the "
                        "replay's own suffix reads: give --loops 1 and no --attach")
    if args.camera_topics and args.camera_topic_suffix != "image_raw":
        problems.append("give --camera-topics or --camera-topic-suffix, not both")
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
    from ..model.checkpoint import driving_config

    try:
        cfg = driving_config(args.model_path)
    except (OSError, ValueError) as e:
        print(f"hybrid-vla replay: cannot read the checkpoint config in {args.model_path}: {e}", file=sys.stderr)
        return 1
    try:
        messages = read_bag(args.bag)
        cams = camera_topics(messages, args.transport, args.camera_topic_suffix, args.camera_topics)
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
        # an earlier run's report and trajectories would read as this run's if this one fails before writing its own
        (out / "report.json").unlink(missing_ok=True)
        shutil.rmtree(out / "trajectories", ignore_errors=True)
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
        print("note: the checkpoint has RANDOM weights: the trajectories test the pipeline, "
              "they are not driving advice")
    session = ReplaySession(args, cfg, messages, cams, out)
    return session.run()


class ReplaySession:
    """One replay: node processes (unless attached), lifecycle management, playback, recording, report.

    ``args``: the options of :func:`add_arguments` (checked); ``cfg``: the checkpoint's VLAConfig; ``messages``:
    the whole bag (:class:`~hybrid_vla_ros.util.bags.BagMessage`, by receive time); ``cams``: its camera topics,
    one per model camera; ``out``: the output folder (it exists). :meth:`run` returns the exit code. The nodes'
    side is :class:`~hybrid_vla_ros.tools.replay_nodes.ReplayNodes`, what comes back a :class:`Recorder`.
    """

    def __init__(self, args, cfg, messages: list[BagMessage], cams: list[str], out: Path):
        self.args, self.cfg, self.cams, self.out = args, cfg, cams, out
        self.messages = messages  # the whole bag: CameraInfo and /tf_static for the plots
        self.ns = "/" + args.namespace.strip("/")
        if not args.output_topic:  # the launch file's default, so --attach finds what it publishes
            args.output_topic = f"/planning/{self.ns.strip('/') or 'hybrid_vla'}/trajectory"
        self.k = cfg.num_layers // 2 if args.split_layer is None else args.split_layer
        self.suffix_cores = _parse_cores(args.suffix_cores)
        self.prefix_cores = prefix_cores(self.suffix_cores)
        if not self.prefix_cores and not args.attach:
            print(f"warning: --suffix-cores {self.suffix_cores} takes every core this process may use: the prefix "
                  "runs unpinned, sharing the suffix's cores", file=sys.stderr)
        self.clock = None  # the bag's clock on /clock (tools.sim_clock.BagClock) while the replay runs
        #: the camera topics as played, in model camera order
        self.camera_play = [played_topic(t, args.transport) for t in cams]
        play_topics = set(self.camera_play) | {ODOMETRY_TOPIC}
        self.scene = takes_scene(cfg)  # the query heads read CameraInfo and /tf_static (published before playback)
        self.info_topics = [camera_info_topic(t) for t in cams] if self.scene else []
        play_topics |= set(self.info_topics)
        missing = missing_calibration(messages, self.info_topics) if self.scene else []
        if missing:
            print(f"warning: the checkpoint has the published query heads, which need each camera's CameraInfo and "
                  f"/tf_static (base_link -> each camera's optical frame); the bag has no {', '.join(missing)}: "
                  "unless another node publishes them, every frame is dropped (no_camera_info / "
                  "no_camera_transform)", file=sys.stderr)
        if cfg.ego_state_input or self.scene:  # only such a prefix subscribes to the acceleration
            play_topics.add(ACCELERATION_TOPIC)
        self.play = [m for m in messages if m.topic in play_topics]
        self.rec = Recorder()
        self.nodes = ReplayNodes(args, self.ns, out, self.rec)  # processes, lifecycle, the states found
        self.bag = None
        self.interrupted = False
        self.baseline = Statuses()  # the nodes' /diagnostics statuses before playback
        #: by trajectory stamp, (Q, 3) rows of time from the stamp (s), map x, y (m): the drive the bag logged
        self.logged_drives: dict[int, np.ndarray] = {}
        #: the open-loop figures of each trajectory compared (vehicle.open_loop.FrameErrors); None: no logged drive
        self.open_loop_frames: list | None = None

    def write_params(self) -> Path:
        """Write ``params.yaml``, the params file both node processes read (also a record of what was run:
        :func:`~hybrid_vla_ros.tools.replay_nodes.node_params`); returns its path."""
        import yaml

        stamps = [m.t_ns for m in self.play if m.topic == ODOMETRY_TOPIC]
        period_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:])) / 1e9 if len(stamps) > 1 else None
        params = node_params(self.args, self.ns, self.k, self.cams, self.prefix_cores, self.suffix_cores, period_s)
        path = self.out / "params.yaml"
        path.write_text(yaml.safe_dump(params, sort_keys=False))
        return path

    def run(self) -> int:
        """The whole replay (see the module docstring); 0 when trajectories came out and the nodes shut down
        cleanly. Ctrl-C stops playback; the nodes are still taken down and the report written."""
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
        rc = 1
        # SIGTERM (`timeout`, systemd, a cancelled CI job) ends the replay as Ctrl-C does: the nodes it started
        # are taken down and the report written; they would also end with it (util.process) if it were killed
        in_main = threading.current_thread() is threading.main_thread()  # (only there can a handler be set)
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main else None
        try:
            self.nodes.connect(node)
            if self.args.attach:
                rc = self._drive(node)
            elif self.nodes.others_running(node):
                rc = 2
            else:
                self.nodes.launch(self.write_params())
                rc = self._drive(node)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            self.clock.stop()
            if self.bag is not None:
                self.bag.close()
            executor.shutdown()
            spin.join(timeout=10)
            node.destroy_node()
            rclpy.try_shutdown(context=context)
            codes = self.nodes.stop()
            if any(c != 0 for c in codes):
                print(f"node processes exited with {codes}; logs in {self.out}", file=sys.stderr)
                rc = rc or 1
        return rc

    def _other_model(self, running_id: str, running_layers: int | None) -> str:
        """Why the attached prefix's model (its /diagnostics ``model_id``, ``num_layers``) is not ``--model-path``
        ('' when it is, or when the node does not say): the report's split layers and plots would describe
        another model."""
        from ..model.checkpoint import model_id
        from ..util.ids import model_id_text

        given = model_id_text(model_id(self.args.model_path))
        if not running_id or running_id == given:
            return ""
        return (f"the attached nodes run model {running_id} ({running_layers} blocks), not --model-path "
                f"{self.args.model_path} (model {given}, {self.cfg.num_layers} blocks): "
                "give the checkpoint they loaded")

    def _drive(self, node) -> int:
        """Nodes up, the bag played, frames in flight let finish, nodes returned, the report; the exit code."""
        from diagnostic_msgs.msg import DiagnosticArray

        from .output_bag import OutputBag

        # /diagnostics from the start: the counters before playback are this run's baseline
        node.create_subscription(DiagnosticArray, "/diagnostics", self.rec.on_diagnostics, 50)
        t_start = time.monotonic()
        if not self.nodes.bring_up(node):
            self.nodes.return_all()
            return 1
        active_s = time.monotonic() - t_start
        self.baseline = self.rec.fresh_statuses(self.ns, time.monotonic())
        prefix = self.baseline.prefix
        if self.args.attach and prefix is not None:
            problem = self._other_model(prefix.model_id, prefix.num_layers)
            if problem:
                print(f"hybrid-vla replay: {problem}", file=sys.stderr)
                self.nodes.return_all()
                return 2
            if prefix.split_layer is not None:
                self.k = prefix.split_layer  # the attached prefix's K, not this replay's default
        where = "attached to running nodes" if self.args.attach else f"suffix pinned to cores {self.suffix_cores}"
        print(f"nodes active after {active_s:.1f} s: split_layer={self.k}/{self.cfg.num_layers}, {where}")
        waits_from = time.monotonic()  # both builds share one --timeout
        if self._wait_for_compiled_suffix():
            self.baseline = self.rec.fresh_statuses(self.ns, time.monotonic())
        if self._wait_for_decode_step(self.args.timeout - (time.monotonic() - waits_from)):
            self.baseline = self.rec.fresh_statuses(self.ns, time.monotonic())
        self.bag = OutputBag(self.out / "trajectories", overwrite=True)
        decodes = bool(getattr(self.cfg, "decode", None))
        self.rec.record_outputs(node, self.bag, self.args.output_topic, f"{self.ns}/suffix_node/debug/frame_timing",
                                f"{self.ns}/suffix_node/output/reasoning" if decodes else "",
                                (f"{self.ns}/suffix_node/debug/trajectory_markers",)
                                + ((f"{self.ns}/suffix_node/debug/reasoning_text",) if decodes else ()))
        if not self.rec.wait_outputs_matched():
            print("warning: the trajectory or frame-timing subscription found no publisher within 10 s: the first "
                  "answers may not be recorded", file=sys.stderr)
        # with ego state input both nodes read the odometry
        publishers = publishers_for(node, self.play, set(self.camera_play),
                                    2 if self.cfg.ego_state_input or self.scene else 1, camera_info_read=self.scene)
        if self.scene:
            self.tf_static_publisher, ok = publish_calibration(node, self.messages, self.info_topics, publishers,
                                                               lambda: self.rec.statuses(self.ns).prefix)
            if not ok:
                print("warning: the prefix did not report the bag's CameraInfo and /tf_static within 10 s: frames "
                      "may be dropped for want of a calibration", file=sys.stderr)
        first_camera = self.camera_play[0]
        self.resplit_log = []
        published = play_bag(self.args, self.play, publishers, self.rec, self.ns, self.camera_play,
                             on_frame=lambda i: self._resplit(node, i) if self.args.resplit else None,
                             clock=self.clock, baseline=self.baseline)
        self.interrupted = published["interrupted"]
        if self.interrupted:
            print("\ninterrupted: playback stopped, shutting the nodes down", file=sys.stderr)
        frames = published["frames"]
        # Let frames in flight finish: stop when every frame has an answer or output stalls for 3 s, or for 1.5x
        # the slowest answer so far (a whole published model on a CPU takes tens of seconds a frame).
        self.rec.wait_for_answers(len(frames), max(3.0, 1.5 * self._slowest_answer_s(frames)))
        # this run's counts: the nodes' counters now (a report after the frames are done) minus the baseline
        final = self.rec.fresh_statuses(self.ns, time.monotonic())
        prefix, suffix = (None if now is None else now.since(before)
                          for now, before in ((final.prefix, self.baseline.prefix),
                                              (final.suffix, self.baseline.suffix)))
        self.nodes.return_all(final)
        self._write_ground_truth()
        report = self._report(frames, published, prefix, suffix)
        for hint in hints(report, first_camera, self.args.rate, self.args.attach):
            print(f"hint: {hint}", file=sys.stderr)
        plots_ok = (write_plots(self.rec, frames, self.messages, self.args.plots, self.args.sync_tolerance_ms,
                                f"split layer {self.k} of {self.cfg.num_layers}", self.cfg.random_init,
                                self.logged_drives, self.open_loop_frames,
                                (report["open_loop"]["logged_path"] or {}).get("what", ""))
                    if self.args.plots else True)
        return 0 if report["trajectories_out"] > 0 and not self.interrupted and plots_ok else 1

    def _wait_for_compiled_suffix(self) -> bool:
        """When the suffix node's ``suffix_backend`` is ``openvino`` and its compiled suffix is still being built
        (``suffix_backend_building``, /diagnostics), wait for the build, up to ``--timeout`` s, so that the frames run
        through the compiled model rather than eagerly while it builds. Prints how it ended: ready (the K it
        covers, its precision, the wait), failed (the node's ``suffix_backend_error``; frames run eagerly) or not
        ready in time (frames run eagerly until it is); with a compiled suffix ready at once (from the cache) it says
        so. Returns whether the suffix's backend is openvino (the baseline is then taken again)."""
        st = self.baseline.suffix
        if st is None or st.suffix_backend != "openvino":
            return False
        waits = st.suffix_backend_building is not None
        if waits:
            print(f"waiting for the compiled suffix (blocks [{st.suffix_backend_building}, {self.cfg.num_layers}), "
                  f"OpenVINO) before playing the bag; up to {self.args.timeout:g} s")
        st, waited = self._suffix_while(st, lambda s: s.suffix_backend_building is not None, self.args.timeout)
        if st is None:
            return True
        if st.suffix_backend_in_use == "openvino":
            print(f"compiled suffix ready{f' after {waited:.1f} s' if waits else ''}: blocks "
                  f"[{st.suffix_backend_k}, {self.cfg.num_layers}), {st.suffix_backend_precision}")
        elif st.suffix_backend_error:
            print(f"warning: the compiled suffix is not in use ({st.suffix_backend_error}): the suffix computes "
                  "eagerly", file=sys.stderr)
        elif st.suffix_backend_building is not None:
            print(f"warning: the compiled suffix was not ready after {waited:.1f} s (--timeout): frames run eagerly "
                  "until it is", file=sys.stderr)
        return True

    def _wait_for_decode_step(self, timeout_s: float) -> bool:
        """When the suffix node builds a decoding model's compiled decode step (``decode_step: inductor``;
        ``suffix_decode_step_building`` on /diagnostics), wait for it, up to ``timeout_s`` (what is left of
        ``--timeout``), so that the frames' tokens run through it rather than eagerly meanwhile. Prints how it
        ended: ready (``suffix_decode_step_k``), not in use (``suffix_decode_step_error``: e.g. refused for a VLM's
        multimodal positions, or ``inductor`` on a model that does not decode) or not ready in time. It waits only
        for the step of the node's K (``split_layer``), and not when none is built for it yet (a suffix at K = L,
        or a node moved to a K whose build has not started): that step builds at the next frame, which it says.
        Returns whether it waited (the baseline is then taken again)."""
        st = self.baseline.suffix
        if st is None or st.decode_step != "inductor":
            return False
        if st.suffix_decode_step_k is not None:
            print(f"compiled decode step ready: {st.suffix_decode_step}")
            return False
        if st.suffix_decode_step_error:
            print(f"warning: the compiled decode step is not in use; the suffix node's decode step: "
                  f"{st.suffix_decode_step}", file=sys.stderr)
            return False
        if st.suffix_decode_step_building is None or st.suffix_decode_step_building != st.split_layer:
            print(f"the compiled decode step builds at the next frame ({st.suffix_decode_step}): the first frames' "
                  "tokens run eagerly")
            return False

        def building(s) -> bool:  # the step of the node's K is being built
            return s.suffix_decode_step_k is None and s.suffix_decode_step_building == s.split_layer

        print(f"waiting for the compiled decode step (K={st.suffix_decode_step_building}, TorchInductor) before "
              f"playing the bag; up to {max(timeout_s, 0.0):g} s")
        st, waited = self._suffix_while(st, building, timeout_s)
        if st is None:
            return True
        if st.suffix_decode_step_k is not None:
            print(f"compiled decode step ready after {waited:.1f} s: {st.suffix_decode_step}")
        elif building(st):
            print(f"warning: the compiled decode step was not ready after {waited:.1f} s (--timeout): tokens run "
                  "eagerly until it is", file=sys.stderr)
        else:
            print(f"warning: the compiled decode step is not in use; the suffix node's decode step: "
                  f"{st.suffix_decode_step}", file=sys.stderr)
        return True

    def _suffix_while(self, st, busy, timeout_s: float) -> tuple:
        """Poll the suffix node's /diagnostics status while ``busy(status)`` holds, up to ``timeout_s`` s, from
        ``st`` (its SuffixStatus now, or None). Returns (the last status, None once the node falls silent; the
        seconds waited)."""
        t0 = time.monotonic()
        while st is not None and busy(st) and time.monotonic() - t0 < timeout_s:
            left = timeout_s - (time.monotonic() - t0)
            st = self.rec.fresh_statuses(self.ns, time.monotonic(), timeout=min(1.5, max(0.1, left))).suffix
        return st, time.monotonic() - t0

    def _slowest_answer_s(self, frames: dict[int, float]) -> float:
        """The longest time (s) from a frame's playback to its trajectory so far, 0 before any answer; ``frames``:
        stamp (ns) -> the time it was played, as ``play_bag`` returns them."""
        with self.rec.lock:
            answers = dict(self.rec.trajectories)
        waits = [t_recv - frames[key] for stamp, t_recv in answers.items()
                 if (key := frame_of(frames, stamp, self.args.sync_tolerance_ms * 1e6)) is not None]
        return max(waits, default=0.0)

    def _report(self, frames: dict[int, float], published: dict, prefix, suffix) -> dict:
        """This run's report (:func:`~hybrid_vla_ros.tools.replay_report.run_report` and
        :func:`~hybrid_vla_ros.tools.replay_report.run_details`), written to ``report.json`` and printed.
        ``prefix`` / ``suffix``: the nodes' statuses at the end with their counts of this run (ros/status.py)."""
        report = run_report(self.rec, frames, published, self.k, self.cfg, self.bag.path,
                            self.args.sync_tolerance_ms, prefix, suffix)
        report.update(run_details(self.args, self.baseline, self.resplit_log, frames, self.rec))
        report["open_loop"] = self._open_loop(published.get("loop_ns", 0))
        if report["resplits_not_reached"]:
            print(f"warning: --resplit {' '.join(report['resplits_not_reached'])} not applied: playback ended after "
                  f"{len(frames)} frames", file=sys.stderr)
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        print_report(report)
        return report

    def _write_ground_truth(self) -> None:
        """Into the output bag: the odometry played (``/localization/kinematic_state``, stamps as played) and, for
        each of those messages, the drive logged after it in its own loop on ``/ground_truth/trajectory`` (the
        topic and form autoware_planning_data_analyzer's ``add_gt_trajectory_to_bag.py`` adds: 8 s at 0.1 s,
        the odometry's frame and stamp), so that analyzer or ``hybrid-vla evaluate`` runs on the output bag alone."""
        from rclpy.serialization import serialize_message

        from ..ros.msg_conv import pose_trajectory_to_msg

        with self.rec.lock:
            played = list(self.rec.played_odometry)
        if not played:
            return
        odom_conn = self.bag.add_topic(ODOMETRY_TOPIC, "nav_msgs/msg/Odometry")
        gt_conn = self.bag.add_topic(GROUND_TRUTH_TOPIC, "autoware_planning_msgs/msg/Trajectory")
        for loop in sorted({p.loop for p in played}):
            msgs = [(p.t_ns, p.msg) for p in played if p.loop == loop]
            path, _ = LoggedPath.from_odometry([msg for _, msg in msgs])
            for t_ns, msg in msgs:
                self.bag.write(odom_conn, t_ns, serialize_message(msg))
                try:
                    stamp = header_stamp_ns(msg)
                except ValueError:
                    continue  # dropped from the path too
                t, xy, yaw = logged_future(path, stamp) if path is not None else ((), None, None)
                if len(t):
                    gt = pose_trajectory_to_msg(t, xy, yaw, stamp, path.frame_id)
                    self.bag.write(gt_conn, t_ns, serialize_message(gt))

    def _open_loop(self, loop_ns: int) -> dict:
        """The report's ``open_loop`` section (:mod:`~hybrid_vla_ros.tools.evaluate`): each trajectory against the
        odometry the bag logged after its stamp, in its own loop."""
        path, dropped = logged_path(self.play, ODOMETRY_TOPIC)
        with self.rec.lock:
            planned, unreadable = dict(self.rec.planned), dict(self.rec.unreadable)
            firsts = list(self.rec.first_camera)
        # a frame's cameras may be stamped up to the sync tolerance before its first camera's image
        first = min(firsts, default=0) - int(self.args.sync_tolerance_ms * 1e6)
        frames, not_compared = replay_open_loop(planned, path, loop_ns, self.args.loops, first)
        self.open_loop_frames = frames if path is not None else None
        if path is not None:  # the pictures draw each frame's logged drive beside its trajectory
            for stamp, plan in planned.items():
                drive = loop_path(path, stamp, loop_ns, self.args.loops, first)
                t, xy, _ = logged_future(drive, stamp, float(plan.t_s[-1]))
                if len(t):
                    self.logged_drives[stamp] = np.column_stack([t, xy])
        for reason, n in unreadable.items():
            not_compared[reason] = not_compared.get(reason, 0) + n
        return open_loop_report(frames, not_compared, describe_path(path, dropped))

    def _resplit(self, node, index: int) -> None:
        """Before frame ``index``: apply the ``--resplit`` events due (suffix first, so it loads blocks ahead)."""
        for frame, k in self.args.resplit:
            if frame != index:
                continue
            t0 = time.monotonic()
            results = [set_parameter(node, f"{self.ns}/{name}", "split_layer", k)
                       for name in ("suffix_node", "prefix_node")]
            failed = [reason for ok, reason in results if not ok]
            if failed:
                print(f"\nre-split to K={k} before frame {index} refused: {'; '.join(failed)}", file=sys.stderr)
            self.resplit_log.append({"frame": index, "split_layer": k, "accepted": not failed,
                                     "set_ms": round((time.monotonic() - t0) * 1e3, 2)})



def _raise_keyboard_interrupt(signum, frame):
    """SIGTERM handler of a replay: stop as on Ctrl-C."""
    raise KeyboardInterrupt


def write_plots(rec: Recorder, frames: dict[int, float], messages: list[BagMessage], plots_dir: str,
                tolerance_ms: float, caption: str, random_init: bool, logged: dict | None = None,
                open_loop: list | None = None, open_loop_source: str = "") -> bool:
    """Draw what a replay recorded (``rec``; ``frames``: played frame stamp -> wall time its last image went out)
    into ``plots_dir`` (:mod:`~hybrid_vla_ros.tools.plots`; ``messages``: the whole bag, for CameraInfo and
    /tf_static; ``logged``: by trajectory stamp, the drive logged after it, drawn beside it; ``open_loop``: the
    FrameErrors of the trajectories compared (None: no logged drive) and ``open_loop_source`` what that drive was,
    drawn against time) and print their paths. False (and a message) when that fails."""
    from . import plots

    with rec.lock:
        received, timings, paths = dict(rec.trajectories), dict(rec.timings), dict(rec.paths)
        odometry, camera_images = list(rec.odometry), dict(rec.first_camera)
    tolerance_ns = tolerance_ms * 1e6
    sent = {}  # trajectory stamp -> when the replay sent its frame's last image
    for stamp in received:
        key = frame_of(frames, stamp, tolerance_ns)
        if key is not None:
            sent[stamp] = frames[key]
    answered = {frame_of(frames, stamp, tolerance_ns) for stamp in received}
    unanswered = {key: t for key, t in frames.items() if key not in answered}
    try:
        data = plots.collect(
            timings=timings, paths=paths, received=received, sent=sent, odometry=odometry,
            camera_images=camera_images, bag_messages=messages, tolerance_ns=tolerance_ns,
            extrinsics_yaml=config_file(plots.DEFAULT_EXTRINSICS), caption=caption, random_init=random_init,
            unanswered=unanswered, logged=logged)
        data.open_loop, data.open_loop_source = open_loop, open_loop_source
        written = plots.write_all(data, plots_dir)
    except Exception as e:  # noqa: BLE001 - the report is out already; say what went wrong and fail
        print(f"hybrid-vla replay: cannot write the plots into {plots_dir}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return False
    print("plots:")
    for path in written:
        print(f"  {path}")
    return True
