"""Open-loop figures of a run (:mod:`hybrid_vla_ros.vehicle.open_loop`): in ``hybrid-vla replay``'s report, and
``hybrid-vla evaluate BAG`` on any bag that holds Autoware trajectories. The logged drive comes from the bag's
``/ground_truth/trajectory`` when it has one (a replay's output bag, or a bag autoware_planning_data_analyzer's
``add_gt_trajectory_to_bag.py`` made: each trajectory is compared with the ground truth stamped nearest to it,
within the analyzer's 0.1 s sync tolerance, so a looped replay's jumps back are never interpolated across), else
from its odometry or ``--odometry-bag``'s.

Messages are read with rosbags (no ROS needed), with the Autoware message types registered from their installed
``.msg`` files (:func:`~hybrid_vla_ros.tools.output_bag.typestore`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np

from ..util.bags import BagMessage, read_bag
from ..vehicle.open_loop import (HORIZONS_S, FrameErrors, HorizonErrors, LoggedPath, PlannedPath, frame_errors,
                                 summarize)

__all__ = ["ODOMETRY_TOPIC", "TRAJECTORY_TOPIC", "GROUND_TRUTH_TOPIC", "logged_path", "ground_truth_paths",
           "loop_path", "replay_open_loop", "ground_truth_open_loop", "describe_path", "describe_ground_truth",
           "open_loop_report", "print_open_loop", "add_arguments", "run_evaluate"]

#: Autoware's ego odometry, and the output topic of the launch file and of a replay (namespace hybrid_vla).
ODOMETRY_TOPIC = "/localization/kinematic_state"
TRAJECTORY_TOPIC = "/planning/hybrid_vla/trajectory"
#: autoware_planning_data_analyzer's ground-truth topic (its ``add_gt_trajectory_to_bag.py``).
GROUND_TRUTH_TOPIC = "/ground_truth/trajectory"
#: A trajectory takes the ground truth stamped within this of it (the analyzer's ``sync_tolerance_ms``: 100).
SYNC_TOLERANCE_NS = 100_000_000


def logged_path(messages: list[BagMessage], topic: str = ODOMETRY_TOPIC) -> tuple[LoggedPath | None, list[str]]:
    """The logged path from the Odometry (or pose) messages on ``topic`` among ``messages``
    (:meth:`LoggedPath.from_odometry`); a message that does not deserialize is dropped and named."""
    from .output_bag import typestore

    store, decoded, dropped = typestore(), [], []
    for i, m in enumerate(x for x in messages if x.topic == topic):
        try:
            decoded.append(store.deserialize_cdr(m.raw, m.msgtype))
        except Exception as err:  # noqa: BLE001  (rosbags raises several types for bad CDR)
            dropped.append(f"odometry {i}: does not deserialize ({type(err).__name__}: {err})")
    path, bad = LoggedPath.from_odometry(decoded)
    return path, dropped + bad


def ground_truth_paths(messages: list[BagMessage], topic: str = GROUND_TRUTH_TOPIC) -> tuple[list[LoggedPath],
                                                                                          list[str]]:
    """Each ground-truth Trajectory on ``topic`` (header stamp, poses at ``time_from_start``) as a short
    :class:`LoggedPath`, sorted by stamp; one that does not read or has fewer than 2 points is named in the list
    of those left out."""
    from .output_bag import typestore

    store, paths, left = typestore(), [], []
    for i, m in enumerate(x for x in messages if x.topic == topic):
        try:
            gt = PlannedPath.from_message(store.deserialize_cdr(m.raw, m.msgtype))
            # the ground truth reaches as far past its log as the log does (logged_future): not again
            paths.append(LoggedPath(gt.stamp_ns + np.rint(gt.t_s * 1e9).astype(np.int64), gt.xy, gt.yaw,
                                    gt.frame_id, reach_after_s=0.0))
        except Exception as err:  # noqa: BLE001  (bad CDR or a path of one point: counted, not fatal)
            left.append(f"ground truth {i}: {type(err).__name__}: {err}")
    return sorted(paths, key=lambda p: int(p.stamps_ns[0])), left


def ground_truth_open_loop(planned: dict[int, PlannedPath], truths: list[LoggedPath],
                           horizons_s=HORIZONS_S) -> tuple[list[FrameErrors], dict[str, int]]:
    """Each trajectory compared with the ground truth stamped nearest to it within :data:`SYNC_TOLERANCE_NS`
    (:func:`ground_truth_paths`); one with none that near is counted as not compared."""
    starts = np.array([int(p.stamps_ns[0]) for p in truths], dtype=np.int64)
    frames, not_compared = [], {}
    for stamp in sorted(planned):
        i = int(np.argmin(np.abs(starts - stamp))) if starts.size else -1
        if i < 0 or abs(int(starts[i]) - stamp) > SYNC_TOLERANCE_NS:
            key = "no ground truth stamped within 0.1 s"
            not_compared[key] = not_compared.get(key, 0) + 1
            continue
        try:
            frames.append(frame_errors(planned[stamp], truths[i], horizons_s))
        except ValueError as err:
            not_compared[str(err)] = not_compared.get(str(err), 0) + 1
    return frames, not_compared


def loop_path(path: LoggedPath, stamp_ns: int, loop_ns: int, loops: int, first_stamp_ns: int) -> LoggedPath:
    """``path`` as played in the loop of a replay's frame stamped ``stamp_ns``: loop ``n`` (``(stamp_ns -
    first_stamp_ns) // loop_ns``, clipped to ``[0, loops)``; 0 when ``loop_ns`` is 0) has its stamps shifted by
    ``n * loop_ns``."""
    loop = min(max((stamp_ns - first_stamp_ns) // loop_ns, 0), loops - 1) if loop_ns > 0 else 0
    return path.shifted(loop * loop_ns)


def replay_open_loop(planned: dict[int, PlannedPath], path: LoggedPath | None, loop_ns: int, loops: int,
                     first_stamp_ns: int, horizons_s=HORIZONS_S) -> tuple[list[FrameErrors], dict[str, int]]:
    """Each trajectory of a replay compared with the logged path of its own loop: the replay shifts loop ``n``'s
    stamps by ``n * loop_ns``, so a trajectory stamped ``s`` belongs to loop ``(s - first_stamp_ns) // loop_ns``
    (clipped to ``[0, loops)``; ``first_stamp_ns`` the bag's first camera header stamp) and is compared with the
    path shifted as far. Returns the frames compared (by stamp) and the count of those not compared by reason."""
    frames, not_compared = [], {}
    if path is None:
        return [], {"the bag has no usable odometry": len(planned)} if planned else {}
    for stamp in sorted(planned):
        try:
            frames.append(frame_errors(planned[stamp], loop_path(path, stamp, loop_ns, loops, first_stamp_ns),
                                       horizons_s))
        except ValueError as err:
            not_compared[str(err)] = not_compared.get(str(err), 0) + 1
    return frames, not_compared


def _figures(errors: HorizonErrors | None) -> dict:
    """:class:`HorizonErrors` as JSON: each figure rounded to 4 decimals (every one None for None)."""
    if errors is None:
        return {f.name: None for f in fields(HorizonErrors)}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(errors).items()}


def describe_path(path: LoggedPath | None, dropped: list[str]) -> dict | None:
    """The report's ``logged_path`` for a drive from odometry: what it is, its frame, samples, span (s) and the
    messages left out; None without one."""
    if path is None:
        return None
    span = round(float(path.stamps_ns[-1] - path.stamps_ns[0]) / 1e9, 3)
    return {"source": "odometry", "what": f"{len(path.stamps_ns)} odometry samples over {span} s",
            "frame_id": path.frame_id, "samples": int(len(path.stamps_ns)), "span_s": span, "dropped": dropped}


def describe_ground_truth(truths: list[LoggedPath], left: list[str]) -> dict | None:
    """The report's ``logged_path`` for a drive from ground-truth trajectories (:func:`ground_truth_paths`)."""
    if not truths:
        return None
    return {"source": GROUND_TRUTH_TOPIC, "what": f"{len(truths)} ground-truth trajectories on {GROUND_TRUTH_TOPIC}",
            "frame_id": truths[0].frame_id, "samples": len(truths),
            "span_s": round(float(truths[-1].stamps_ns[0] - truths[0].stamps_ns[0]) / 1e9, 3), "dropped": left}


def open_loop_report(frames: list[FrameErrors], not_compared: dict[str, int], logged: dict | None,
                     horizons_s=HORIZONS_S) -> dict:
    """The ``open_loop`` section of a report: the summary per horizon (:func:`summarize`: frames, left out by
    reason and the mean figures, None where no frame reached it), per frame its stamp and figures per horizon, what
    was left out and why, and ``logged_path`` (:func:`describe_path` / :func:`describe_ground_truth`; None: no
    logged drive)."""
    summary = summarize(frames, not_compared, horizons_s)
    return {
        "definitions": "autoware_planning_data_analyzer open_loop (docs/open_loop.md)",
        "horizons": {name: {"frames": h.frames, "left_out": h.left_out, **_figures(h.mean)}
                     for name, h in summary.horizons.items()},
        "frames_compared": summary.frames,
        "not_compared": summary.not_compared,
        "logged_path": logged,
        "frames": [{"stamp_ns": f.stamp_ns, "left_out": f.left_out,
                    "horizons": {n: _figures(h) for n, h in f.horizons.items()}} for f in frames],
    }


def print_open_loop(section: dict, indent: str = "", out=None) -> None:
    """The open-loop lines of :func:`open_loop_report`'s ``section`` (each after ``indent``): ADE / FDE / AHE and
    the mean lateral / longitudinal deviation per horizon reached, then what was left out."""
    out = out or sys.stdout
    lp = section["logged_path"]
    if lp is None:
        print(f"{indent}open loop: the bag has no usable odometry; no driving figures", file=out)
        return
    print(f"{indent}open loop ({section['frames_compared']} trajectories against the logged drive: {lp['what']}, "
          f"frame {lp['frame_id']}):", file=out)
    for name, h in section["horizons"].items():
        if h["frames"]:
            print(f"{indent}  {name:>5}: ADE {h['ade_m']:.3f} m  FDE {h['fde_m']:.3f} m  AHE {h['ahe_rad']:.3f} rad  "
                  f"lateral {h['lateral_mean_m']:.3f} m  longitudinal {h['longitudinal_mean_m']:.3f} m  "
                  f"({h['frames']} frames)", file=out)
        else:
            why = ", ".join(f"{n} {r}" for r, n in h["left_out"].items()) or "no frames"
            print(f"{indent}  {name:>5}: none ({why})", file=out)
    for reason, n in section["not_compared"].items():
        print(f"{indent}  {n} trajectories not compared: {reason}", file=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``hybrid-vla evaluate``'s options."""
    p.add_argument("bag", help="a rosbag2 folder with the published trajectories (e.g. a replay's output bag)")
    p.add_argument("--odometry-bag", default=None,
                   help="the bag with the logged drive (default: the bag itself); for a looped replay give its output "
                        "bag alone, whose ground truth follows each loop")
    p.add_argument("--trajectory-topic", default=None,
                   help=f"the Trajectory topic (default: {TRAJECTORY_TOPIC}, or the bag's only Trajectory topic "
                        f"other than {GROUND_TRUTH_TOPIC})")
    p.add_argument("--odometry-topic", default=None,
                   help="the logged drive's topic: nav_msgs/Odometry, or a geometry_msgs PoseStamped / "
                        f"PoseWithCovarianceStamped pose topic (default: {GROUND_TRUTH_TOPIC} when the bag has it, "
                        f"else {ODOMETRY_TOPIC})")
    p.add_argument("--horizons", type=float, nargs="+", default=list(HORIZONS_S),
                   help="horizons in s (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the figures here (the replay report's open_loop section)")


#: The message types a logged drive is read from (:meth:`LoggedPath.from_odometry`).
POSE_TYPES = ("nav_msgs/msg/Odometry", "geometry_msgs/msg/PoseWithCovarianceStamped", "geometry_msgs/msg/PoseStamped")
TRAJECTORY_TYPE = "autoware_planning_msgs/msg/Trajectory"


def _read(path: str) -> list[BagMessage]:
    """:func:`read_bag`, every error as ValueError naming the bag (rosbags raises several types)."""
    try:
        return read_bag(path)
    except Exception as err:  # re-raised as one readable error
        raise ValueError(f"cannot read the bag {path}: {err}") from err


def _topic_problem(messages: list[BagMessage], topic: str, types: tuple[str, ...], bag: str, what: str) -> str:
    """Why ``topic`` of ``bag`` cannot give ``what`` (no message on it, or another type than ``types``); ""."""
    found = {m.msgtype for m in messages if m.topic == topic}
    if not found:
        return f"no message on {topic} in {bag}"
    if not found <= set(types):
        return f"{topic} in {bag} is {', '.join(sorted(found))}, not {what} ({' / '.join(types)})"
    return ""


def run_evaluate(args: argparse.Namespace) -> int:
    """``hybrid-vla evaluate``: 0 when at least one trajectory was compared, 1 when none was, 2 for bad options, a
    bag that cannot be read, or topics without the messages they need."""
    from ..util.paths import output_file_problem
    from .output_bag import typestore

    def fail(text: str) -> int:
        print(f"hybrid-vla evaluate: {text}", file=sys.stderr)
        return 2

    if any(not (math.isfinite(h) and h > 0) for h in args.horizons):
        return fail(f"--horizons must be > 0 s, got {args.horizons}")
    if args.json and (problem := output_file_problem(args.json)):
        return fail(f"--json: {problem}")
    try:
        messages = _read(args.bag)
        source, source_name = ((messages, args.bag) if args.odometry_bag is None
                               else (_read(args.odometry_bag), args.odometry_bag))
    except ValueError as err:
        return fail(str(err))
    topics = sorted({m.topic for m in messages if m.msgtype == TRAJECTORY_TYPE} - {GROUND_TRUTH_TOPIC})
    if args.trajectory_topic is None:
        args.trajectory_topic = topics[0] if len(topics) == 1 else TRAJECTORY_TOPIC
    if problem := _topic_problem(messages, args.trajectory_topic, (TRAJECTORY_TYPE,), args.bag, "a trajectory"):
        return fail(f"{problem} (its Trajectory topics: {', '.join(topics) or 'none'})")
    store, planned, bad = typestore(), {}, {}
    for m in messages:
        if m.topic != args.trajectory_topic:
            continue
        try:
            plan = PlannedPath.from_message(store.deserialize_cdr(m.raw, m.msgtype))
            planned[plan.stamp_ns] = plan
        except Exception as err:  # noqa: BLE001  (a bad message is counted, not fatal)
            key = f"unreadable trajectory ({type(err).__name__}: {err})"
            bad[key] = bad.get(key, 0) + 1
    # the logged drive: the source bag's ground truth (loop by loop in a replay's output bag) unless a topic is named
    truths, left = ground_truth_paths(source) if args.odometry_topic is None else ([], [])
    if truths:
        frames, not_compared = ground_truth_open_loop(planned, truths, tuple(args.horizons))
        logged = describe_ground_truth(truths, left)
    else:
        topic = args.odometry_topic or ODOMETRY_TOPIC
        if problem := _topic_problem(source, topic, POSE_TYPES, source_name, "an odometry or pose topic"):
            return fail(f"{problem}: the logged drive comes from --odometry-topic (default {ODOMETRY_TOPIC}) of "
                        "--odometry-bag (default: the bag itself)")
        path, dropped = logged_path(source, topic)
        if path is None:
            return fail(f"{topic} in {source_name} gives no logged drive (2 usable messages needed): "
                        + "; ".join(dropped[:3]))
        frames, not_compared = replay_open_loop(planned, path, 0, 1, 0, tuple(args.horizons))
        logged = describe_path(path, dropped)
        late = sum(1 for stamp in planned if stamp > path.stamps_ns[-1] + path.reach_after_s * 1e9)
        if late:
            print(f"note: {late} of {len(planned)} trajectories are stamped after the logged drive ends (a looped "
                  "replay's later loops?); a replay's output bag alone compares every loop with its own log "
                  f"({GROUND_TRUTH_TOPIC})")
    for reason, n in bad.items():
        not_compared[reason] = not_compared.get(reason, 0) + n
    section = open_loop_report(frames, not_compared, logged, tuple(args.horizons))
    print_open_loop(section)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(section, indent=2) + "\n")
        except OSError as err:
            return fail(f"cannot write --json {args.json}: {err}")
    return 0 if frames else 1
