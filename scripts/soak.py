#!/usr/bin/env python3
"""Soak benchmark of the real pipeline: many frames through prefix_node -> ring -> suffix_node.

Starts both node processes (``replay.launch_node``), drives them through their lifecycle services and
plays the embedded bag's 6 compressed cameras (with the odometry around each frame) in a loop, with
stamps shifted so time keeps increasing, at a fixed frame rate. Every few seconds it samples the node
processes' resident memory (psutil), open file descriptors, the /dev/shm files they map and the
/dev/shm entries. At the end it prints frames in / out / dropped by cause (with every published frame
accounted for), memory, fd and shm growth after warm-up, and latency early vs late in the run.

    scripts/soak.py --frames 10000              # steady run, cameras at 0.8x the sustained rate
    scripts/soak.py --frames 2000 --load 2.0    # overload: cameras at 2x the rate the pipeline sustains
    scripts/soak.py --frames 150 --fps 20 --json out.json

``--load X`` first measures the rate the pipeline sustains (a short calibration with cameras flooding at
``--calibration-fps``), then plays at X times it; ``--fps F`` plays at F frames/s without calibrating.
Run from the repository root with the venv's python (see README); a random-init ``tiny`` checkpoint is
written to a temporary folder unless ``--model-path`` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybrid_vla_ros.ros.status import FrameTiming, PrefixStatus, SuffixStatus, pipeline_status_name  # noqa: E402
from hybrid_vla_ros.tools.frame_player import LoopingFramePlayer  # noqa: E402
from hybrid_vla_ros.transport.segment import segment_name  # noqa: E402
from hybrid_vla_ros.util.stats import percentiles  # noqa: E402

# Causes counted per camera or odometry message, not per frame (see core/sync.py and the suffix node).
MESSAGE_CAUSES = {"prefix": {"unsynced", "queue_overflow", "out_of_order", "duplicate", "time_jump", "bad_stamp"},
                  "suffix": {"bad_odometry"}}
SHM = Path("/dev/shm")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=600, help="frames to play in the measured run (default 600)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--fps", type=float, default=None, help="camera frame rate (frames/s); no calibration")
    rate.add_argument("--load", type=float, default=None,
                      help="camera rate as a multiple of the measured sustained rate (default 0.8)")
    p.add_argument("--calibration-s", type=float, default=12.0, help="length of the calibration run (s)")
    p.add_argument("--calibration-fps", type=float, default=40.0, help="camera rate while calibrating (flood)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    p.add_argument("--warmup-frames", type=int, default=None,
                   help="frames before the memory baseline and the 'early' latency window (default 10%%, >= 30)")
    p.add_argument("--model-path", default=None, help="checkpoint (default: a random-init tiny one in a temp dir)")
    p.add_argument("--split-layer", type=int, default=2, help="split layer K (tiny has 4 blocks)")
    p.add_argument("--output", default=None, help="folder for node logs and params.yaml (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    p.add_argument("--seed", type=int, default=None, help="seed of the (per-run random) ROS namespace suffix")
    args = p.parse_args(argv)
    if args.fps is None and args.load is None:
        args.load = 0.8
    if args.frames < 1 or (args.fps is not None and args.fps <= 0) or (args.load is not None and args.load <= 0):
        p.error("--frames, --fps and --load must be positive")
    return args


# ------------------------------------------------------------------------------------------ ROS side

class Graph:
    """The soak's own rclpy node (own context), spun in a background thread."""

    def __init__(self, ns: str):
        import rclpy
        from autoware_planning_msgs.msg import Trajectory
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        self.rclpy = rclpy
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(f"soak_{uuid.uuid4().hex[:6]}", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.lock = threading.Lock()
        self.received: dict[int, float] = {}  # trajectory stamp -> time.monotonic() at receipt
        self.timings: dict[int, FrameTiming] = {}  # stamp -> the suffix's ~/debug/frame_timing
        self.diag: dict[str, dict] = {}
        self.diag_count: dict[str, int] = {}
        self.node.create_subscription(Trajectory, f"{ns}/suffix_node/output/trajectory", self._on_traj,
                                      QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
        self.node.create_subscription(DiagnosticArray, f"{ns}/suffix_node/debug/frame_timing", self._on_timing, 50)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_traj(self, msg):
        t = time.monotonic()
        with self.lock:
            self.received[msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec] = t

    def _on_timing(self, msg):
        timing = FrameTiming.from_key_values((kv.key, kv.value) for kv in msg.status[0].values)
        with self.lock:
            self.timings[msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec] = timing

    def _on_diag(self, msg):
        with self.lock:
            for s in msg.status:
                self.diag[s.name] = {kv.key: kv.value for kv in s.values}
                self.diag_count[s.name] = self.diag_count.get(s.name, 0) + 1

    def fresh_diag(self, name: str, timeout: float = 10.0) -> dict:
        """The next /diagnostics report of status ``name`` (waits up to ``timeout``; the latest one if none)."""
        with self.lock:
            seen = self.diag_count.get(name, 0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.diag_count.get(name, 0) > seen:
                    return dict(self.diag[name])
            time.sleep(0.05)
        with self.lock:
            return dict(self.diag.get(name, {}))

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()
        self.rclpy.try_shutdown(context=self.context)


# ------------------------------------------------------------------------------------------ resources

#: Fast DDS's shared-memory files (its SHM transport's per-participant port segments and their locks): a process
#: maps another participant's segment when it discovers it, so their count follows the ROS graph, not a leak here.
FASTDDS_SHM = ("fastdds_", "sem.fastdds_", "fastrtps_", "sem.fastrtps_")


def shm_maps(pid: int) -> tuple[int, int, int]:
    """(/dev/shm files a process maps other than Fast DDS's, of which orphaned, Fast DDS's files it maps), from
    /proc/<pid>/maps. Fast DDS's (:data:`FASTDDS_SHM`) are counted apart: the count grows by the segments of every
    participant discovered meanwhile (a CLI daemon, another node: +3 in one CI run), which is not a leak of the
    nodes'; orphans are counted over all files.

    Counted by inode. Orphaned: no name in /dev/shm points at the inode any more, so the mapping only keeps
    memory alive (e.g. an old ring segment still mapped). The prefix maps its ring through the temporary
    ``.init-*`` name it then unlinks, so /proc shows that path as "(deleted)" although the segment is linked:
    that is why this looks at inodes, not at the "(deleted)" mark.
    """
    inodes, dds = set(), set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    name = fields[5].strip()[len("/dev/shm/"):]
                    (dds if name.startswith(FASTDDS_SHM) else inodes).add(int(fields[4]))
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0, 0
    linked = set()
    for entry in os.scandir(SHM):
        try:
            linked.add(entry.inode())
        except OSError:
            pass
    return len(inodes), len((inodes | dds) - linked), len(dds)


class Monitor:
    """Samples the node processes every ``period_s`` in a background thread."""

    def __init__(self, procs: dict, player: LoopingFramePlayer, graph: Graph, period_s: float, ring_prefix: str):
        import psutil

        self.ring_prefix = ring_prefix  # this run's ring segment (and any .init-* file of it)
        self.ps = {role: psutil.Process(p.pid) for role, p in procs.items()}
        self.player, self.graph, self.period_s = player, graph, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        s = {"t": time.monotonic(), "frames": self.player.count}
        with self.graph.lock:
            s["received"] = len(self.graph.received)
        for role, proc in self.ps.items():
            try:
                with proc.oneshot():
                    s[f"{role}_rss_mib"] = proc.memory_info().rss / 2**20
                    s[f"{role}_fds"] = proc.num_fds()
                    s[f"{role}_threads"] = proc.num_threads()
            except Exception:  # noqa: BLE001 - the process ended: no sample
                continue
            s[f"{role}_shm_maps"], s[f"{role}_shm_orphaned_maps"], s[f"{role}_shm_fastdds_maps"] = shm_maps(proc.pid)
        entries = os.listdir(SHM)
        s["shm_entries"] = len(entries)
        s["shm_hybrid_vla"] = sum(e.startswith("hybrid_vla.") for e in entries)
        s["shm_hybrid_vla_ours"] = sum(e.startswith(self.ring_prefix) for e in entries)
        s["shm_fastdds"] = sum(e.startswith(("fastdds_", "sem.fastdds_")) for e in entries)
        return s

    def _run(self):
        while not self._stop.wait(self.period_s):
            self.samples.append(self.sample())

    def start(self):
        self.samples.append(self.sample())
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.samples.append(self.sample())


# ------------------------------------------------------------------------------------------ the run

class Pipeline:
    """The two node processes and their lifecycle clients."""

    def __init__(self, graph: Graph, ns: str, model: Path, split_layer: int, out: Path):
        import yaml

        from hybrid_vla_ros.ros.lifecycle_client import LifecycleClient
        from hybrid_vla_ros.tools.replay import launch_node

        common = {"model_path": str(model), "split_layer": split_layer, "dtype": "fp32"}
        params = {
            f"{ns}/prefix_node": {"ros__parameters": {
                **common, "camera_transports": ["compressed"], "torch_threads": 1,
                "camera_topics": [f"{ns}/cam{i}" for i in range(6)]}},
            # stamps are the bag's (years old by the clock): the output guard's age check is off, as in replay
            f"{ns}/suffix_node": {"ros__parameters": {**common, "threads": 1, "guard.check_age": False}},
        }
        (out / "params.yaml").write_text(yaml.safe_dump(params))
        self.out = out
        self.procs = {
            "prefix": launch_node("prefix_node", ns, out / "params.yaml", [], out / "prefix_node.log"),
            "suffix": launch_node("suffix_node", ns, out / "params.yaml",
                                  ["-r", f"~/input/kinematic_state:={ns}/odom"], out / "suffix_node.log")}
        self.clients = {role: LifecycleClient(graph.node, f"{ns}/{role}_node") for role in self.procs}

    def bring_up(self, timeout: float = 120.0) -> None:
        for role, client in self.clients.items():
            if not client.wait_for_services(timeout, list(self.procs.values())):
                raise RuntimeError(f"{role}_node did not come up; see {self.out}")
        for transition in ("configure", "activate"):
            for role, client in self.clients.items():
                ok, detail = client.change_state(transition, timeout)
                if not ok:
                    raise RuntimeError(f"{transition} of {role}_node failed ({detail}); see {self.out}")

    def shut_down(self) -> list[int]:
        from hybrid_vla_ros.tools.replay import stop_processes

        for transition in ("deactivate", "cleanup"):
            for role, client in self.clients.items():
                if self.procs[role].poll() is None:
                    client.change_state(transition, 30)
        return stop_processes(list(self.procs.values()))


def ring_prefix(ns: str) -> str:
    """Start of the names of every ring segment of namespace ``ns`` (this ROS domain) in /dev/shm
    (transport.segment.segment_name)."""
    return segment_name("x", ns).removesuffix("x")


def _statuses(graph: Graph, ns: str) -> tuple[PrefixStatus, SuffixStatus]:
    """Both nodes' statuses from a fresh /diagnostics report of each (ros/status.py)."""
    return tuple(cls.from_key_values(graph.fresh_diag(pipeline_status_name(f"{ns}/{role}_node")))
                 for role, cls in (("prefix", PrefixStatus), ("suffix", SuffixStatus)))


def _drain(graph: Graph, player: LoopingFramePlayer, stamps: list[int], quiet_s: float = 3.0) -> None:
    """Wait until every frame has its trajectory or nothing new arrived for ``quiet_s``."""
    want = set(stamps)
    last, since = -1, time.monotonic()
    while time.monotonic() - since < quiet_s:
        with graph.lock:
            n = len(want & graph.received.keys())
        if n == len(want):
            return
        if n != last:
            last, since = n, time.monotonic()
        time.sleep(0.05)


def account(published: int, received: int, prefix: PrefixStatus, suffix: SuffixStatus, n_cameras: int) -> dict:
    """Where every published frame went: output, a drop counted per frame, or lost before synchronization.

    ``prefix`` / ``suffix``: the nodes' statuses with their counters of the run (``after.since(before)``).
    """
    frame_drops, message_drops = {}, {}
    for role, status in (("prefix", prefix), ("suffix", suffix)):
        for cause, n in status.drops.items():
            (message_drops if cause in MESSAGE_CAUSES[role] else frame_drops)[f"{role}.{cause}"] = n
    if prefix.ring_dropped_oldest:
        frame_drops["ring.dropped_oldest"] = prefix.ring_dropped_oldest
    unsynchronized = published - prefix.frames_synchronized
    return {
        "frames_published": published,
        "camera_messages_in": prefix.frames_in,
        "camera_messages_lost_in_transport": published * n_cameras - prefix.frames_in,
        "frames_synchronized": prefix.frames_synchronized,
        "frames_through_prefix": prefix.frames_out,
        "trajectories_published": suffix.trajectories_out,
        "trajectories_received": received,
        "frame_drops": frame_drops,
        "message_drops": message_drops,
        "frames_unsynchronized": unsynchronized,
        # published = received + counted frame drops + never synchronized (those show as message drops)
        "unaccounted": published - received - sum(frame_drops.values()) - unsynchronized,
    }


def _growth(samples: list[dict], start_frame: int, warm_frames: int) -> dict:
    """Resource change from the first sample at or after ``warm_frames`` frames of the measured run (which
    began at the player's frame ``start_frame``, after any calibration) to the last sample."""
    after = [s for s in samples if s["frames"] - start_frame >= warm_frames] or samples[-1:]
    base, last = after[0], samples[-1]
    out = {"baseline_frames": base["frames"] - start_frame, "last_frames": last["frames"] - start_frame,
           "samples_after_warmup": len(after)}
    for role in ("prefix", "suffix"):
        key = f"{role}_rss_mib"
        if key not in base or key not in last:
            continue
        rss = [s[key] for s in after if key in s]
        frames = [s["frames"] for s in after if key in s]
        slope = float(np.polyfit(frames, rss, 1)[0]) * 1000 if len(set(frames)) > 1 else 0.0
        out[role] = {
            "rss_mib_baseline": round(base[key], 1), "rss_mib_last": round(last[key], 1),
            "rss_mib_peak": round(max(rss), 1),
            "rss_growth_pct": round((last[key] - base[key]) / base[key] * 100, 2),
            "rss_peak_growth_pct": round((max(rss) - base[key]) / base[key] * 100, 2),
            "rss_slope_mib_per_1000_frames": round(slope, 2),
            "fds_baseline": base[f"{role}_fds"], "fds_last": last[f"{role}_fds"],
            "fds_max": max(s[f"{role}_fds"] for s in after if f"{role}_fds" in s),
            "threads_baseline": base[f"{role}_threads"], "threads_last": last[f"{role}_threads"],
            "shm_maps_baseline": base[f"{role}_shm_maps"], "shm_maps_last": last[f"{role}_shm_maps"],
            "shm_maps_max": max(s[f"{role}_shm_maps"] for s in after if f"{role}_shm_maps" in s),
            "shm_orphaned_maps_max": max(s[f"{role}_shm_orphaned_maps"] for s in after
                                         if f"{role}_shm_orphaned_maps" in s),
            "shm_fastdds_maps_baseline": base[f"{role}_shm_fastdds_maps"],
            "shm_fastdds_maps_last": last[f"{role}_shm_fastdds_maps"],
        }
    for key in ("shm_entries", "shm_hybrid_vla", "shm_fastdds"):
        out[key] = {"baseline": base[key], "last": last[key], "max": max(s[key] for s in after)}
    return out


def _latency(graph: Graph, player: LoopingFramePlayer, stamps: list[int], warm_frames: int) -> dict:
    """Latency p50/p90 (ms) early (the quarter of the run after warm-up) and late (the last quarter)."""
    with graph.lock:
        received, timings = dict(graph.received), dict(graph.timings)
    measured = stamps[warm_frames:] or stamps
    q = max(1, len(measured) // 4)
    windows = {"early": measured[:q], "late": measured[-q:]}
    out = {}
    for name, window in windows.items():
        e2e = [(received[s] - player.sent[s]) * 1e3 for s in window if s in received]
        out[name] = {"frames": len(window), "end_to_end": percentiles(e2e, finite_only=True)}
        for stage in ("preprocess", "prefix", "handoff", "suffix"):
            out[name][stage] = percentiles([timings[s].stage_ms()[stage] for s in window if s in timings],
                                          finite_only=True)
    return out


def run(args) -> dict:
    """Run the soak; returns the results (also printed by main)."""
    os.environ.setdefault("FASTDDS_DEFAULT_PROFILES_FILE", str(REPO / "config" / "fastdds_shm_large.xml"))
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random(os.getpid()).randint(1, 100)))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    rng = random.Random(args.seed)
    ns = f"/soak_{rng.getrandbits(32):08x}"
    tmp = tempfile.TemporaryDirectory(prefix="soak_")
    out = Path(args.output) if args.output else Path(tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    if args.model_path:
        model = Path(args.model_path)
    else:
        from hybrid_vla_ros.model.checkpoint import init_model

        model = Path(tmp.name) / "tiny"
        init_model("tiny", model)
    warm = args.warmup_frames if args.warmup_frames is not None else max(30, args.frames // 10)
    graph = Graph(ns)
    pipeline = None
    results: dict = {"namespace": ns, "frames_requested": args.frames, "warmup_frames": warm,
                     "ros_domain_id": os.environ["ROS_DOMAIN_ID"]}
    try:
        pipeline = Pipeline(graph, ns, model, args.split_layer, out)
        player = LoopingFramePlayer(graph.node, ns, REPO / "data" / "dgp_scene02_6cam_mcap")
        t_up = time.monotonic()
        pipeline.bring_up()
        if not player.wait_for_subscribers():
            raise RuntimeError("the nodes never subscribed to the cameras / odometry")
        results["bring_up_s"] = round(time.monotonic() - t_up, 2)
        monitor = Monitor(pipeline.procs, player, graph, args.sample_s, ring_prefix(ns))
        monitor.start()

        fps = args.fps
        if fps is None:  # calibration: flood the cameras, measure what comes out
            n_cal = max(10, int(args.calibration_s * args.calibration_fps))
            print(f"calibrating: {n_cal} frames at {args.calibration_fps:g} fps ...", flush=True)
            stamps, wall = player.play(n_cal, args.calibration_fps)
            _drain(graph, player, stamps, quiet_s=2.0)
            with graph.lock:
                got = sorted(graph.received[s] for s in stamps if s in graph.received)
            steady = got[len(got) // 4:]  # skip the start-up transient
            sustained = (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 2 else 1.0
            fps = args.load * sustained
            results["calibration"] = {"frames": n_cal, "fps_offered": args.calibration_fps,
                                      "sustained_fps": round(sustained, 2)}
            print(f"sustained {sustained:.2f} frames/s -> cameras at {args.load:g} x = {fps:.2f} fps", flush=True)
        results["fps_target"] = round(fps, 3)
        results["load"] = args.load

        before = _statuses(graph, ns)
        start_frame = player.count
        print(f"playing {args.frames} frames at {fps:.2f} fps (~{args.frames / fps / 60:.1f} min) ...", flush=True)
        stop = threading.Event()
        progress = threading.Thread(target=_progress, args=(player, graph, start_frame, args.frames, stop),
                                    daemon=True)
        progress.start()
        try:
            stamps, wall = player.play(args.frames, fps)
        finally:
            stop.set()
            progress.join()
        _drain(graph, player, stamps)
        after = _statuses(graph, ns)
        monitor.stop()
        with graph.lock:
            received = sum(s in graph.received for s in stamps)
        results["fps_achieved"] = round(len(stamps) / wall, 3)
        results["wall_s"] = round(wall, 1)
        results["accounting"] = account(len(stamps), received, *(a.since(b) for a, b in zip(after, before)),
                                         player.n_cameras)
        results["resources"] = _growth(monitor.samples, start_frame, warm)
        results["latency_ms"] = _latency(graph, player, stamps, warm)
        results["samples"] = monitor.samples
    finally:
        codes = pipeline.shut_down() if pipeline is not None else []
        graph.close()
        results["exit_codes"] = codes
        results["segments_left"] = sorted(e for e in os.listdir(SHM) if e.startswith(ring_prefix(ns)))
        tmp.cleanup()
    return results


def _progress(player: LoopingFramePlayer, graph: Graph, start: int, total: int, stop: threading.Event) -> None:
    t0 = time.monotonic()
    with graph.lock:
        got0 = len(graph.received)
    while not stop.wait(30.0):
        with graph.lock:
            got = len(graph.received) - got0
        done = player.count - start
        print(f"  {done}/{total} frames, {got} trajectories so far, {time.monotonic() - t0:.0f} s", flush=True)


def print_results(r: dict) -> None:
    a, res, lat = r["accounting"], r["resources"], r["latency_ms"]
    print()
    print("soak report (random-init model unless --model-path: not driving advice)")
    cal = r.get("calibration")
    if cal:
        print(f"  sustained rate          {cal['sustained_fps']:.2f} frames/s (calibration: {cal['frames']} frames "
              f"offered at {cal['fps_offered']:g} fps)")
    print(f"  cameras                 {r['fps_achieved']:.2f} fps achieved (target {r['fps_target']:.2f}), "
          f"{r['wall_s']:.0f} s")
    print(f"  frames published        {a['frames_published']}")
    print(f"  camera messages in      {a['camera_messages_in']} "
          f"(lost in transport: {a['camera_messages_lost_in_transport']})")
    print(f"  frames synchronized     {a['frames_synchronized']}")
    print(f"  frames through prefix   {a['frames_through_prefix']}")
    print(f"  trajectories out        {a['trajectories_received']} received ({a['trajectories_published']} published)")
    drops = ", ".join(f"{k} {v}" for k, v in sorted(a["frame_drops"].items())) or "none"
    print(f"  frame drops by cause    {drops}")
    if a["message_drops"]:
        print(f"  message drops           {', '.join(f'{k} {v}' for k, v in sorted(a['message_drops'].items()))}")
    print(f"  never synchronized      {a['frames_unsynchronized']}")
    print(f"  unaccounted frames      {a['unaccounted']}")
    print(f"  after warm-up ({res['baseline_frames']} -> {res['last_frames']} frames, "
          f"{res['samples_after_warmup']} samples):")
    for role in ("prefix", "suffix"):
        m = res.get(role)
        if not m:
            continue
        print(f"    {role:<7} RSS {m['rss_mib_baseline']:.1f} -> {m['rss_mib_last']:.1f} MiB "
              f"({m['rss_growth_pct']:+.2f} %, peak {m['rss_peak_growth_pct']:+.2f} %, "
              f"{m['rss_slope_mib_per_1000_frames']:+.2f} MiB/1000 frames); "
              f"fds {m['fds_baseline']} -> {m['fds_last']} (max {m['fds_max']}); "
              f"threads {m['threads_baseline']} -> {m['threads_last']}; /dev/shm maps "
              f"{m['shm_maps_baseline']} -> {m['shm_maps_last']} ({m['shm_orphaned_maps_max']} orphaned; Fast DDS's "
              f"{m['shm_fastdds_maps_baseline']} -> {m['shm_fastdds_maps_last']})")
    print(f"    /dev/shm entries {res['shm_entries']['baseline']} -> {res['shm_entries']['last']} "
          f"(hybrid_vla {res['shm_hybrid_vla']['baseline']} -> {res['shm_hybrid_vla']['last']}, "
          f"fastdds {res['shm_fastdds']['baseline']} -> {res['shm_fastdds']['last']}; all processes on the host)")
    print(f"  latency ms              {'early p50':>10} {'p90':>8} {'late p50':>10} {'p90':>8}")
    for stage in ("end_to_end", "preprocess", "prefix", "handoff", "suffix"):
        e, late = lat["early"][stage], lat["late"][stage]
        if e["n"] and late["n"]:
            print(f"    {stage:<21} {e['p50']:>10.2f} {e['p90']:>8.2f} {late['p50']:>10.2f} {late['p90']:>8.2f}")
    print(f"  node exit codes         {r['exit_codes']}; ring segments left: {r['segments_left'] or 'none'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    print_results(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    ok = results["exit_codes"] == [0, 0] and results["accounting"]["unaccounted"] == 0 and not results["segments_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
