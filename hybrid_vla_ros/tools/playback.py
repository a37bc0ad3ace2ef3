"""Playing a bag for ``hybrid-vla replay``: a publisher per played topic, each message at its recorded time
(scaled by ``--rate``), looped with its stamps shifted by a loop length, the bag's clock advanced before each
message, camera frames timed as their last image goes out, odometry kept for the pictures."""
from __future__ import annotations

import importlib
import sys
import time

import numpy as np

from ..ros.graph import wait_for_reliable_subscriptions, wait_for_subscribers
from .replay_report import drops_by_cause
from .replay_recorder import PlayedOdometry

ODOMETRY_TOPIC = "/localization/kinematic_state"
TF_STATIC_TOPIC = "/tf_static"  # published before playback, transient local, for a model with the query heads
ACCELERATION_TOPIC = "/localization/acceleration"  # played when the bag has it (the embedded bag does not) and
# the checkpoint takes the ego state


def message_class(msgtype: str):
    """'sensor_msgs/msg/Image' -> the rclpy message class. Raises ImportError / AttributeError."""
    pkg, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


def publishers_for(node, play, cameras: set[str], odometry_readers: int = 1, camera_info_read: bool = False) -> dict:
    """A publisher on ``node`` per topic of the messages ``play`` (topic -> (publisher, message class)), returned
    once the nodes subscribe (10 s at most; the odometry by ``odometry_readers`` subscribers, CameraInfo only
    waited for when ``camera_info_read``: a prefix with the query heads) and each camera topic (``cameras``, the
    topics played as they are published) has a reliable subscription (10 s at most, see below). Warns on stderr
    of other publishers on the same topics: their frames would mix with these."""
    publishers = {}
    for m in play:
        if m.topic not in publishers:
            cls = message_class(m.msgtype)
            publishers[m.topic] = (node.create_publisher(cls, m.topic, 10), cls)
    wait_for_subscribers([pub for pub, _ in publishers.values()
                          if not pub.topic_name.endswith("camera_info") or camera_info_read],
                         10.0, {ODOMETRY_TOPIC: odometry_readers})
    # These publishers are reliable: a prefix with camera_reliability auto re-subscribes its cameras reliable
    # about a second after it hears them. A frame sent during that switch could be lost, and a replay sends each
    # frame once: wait for it (10 s; a prefix configured best_effort stays so, and the replay goes on).
    cameras = [pub.topic_name for pub, _ in publishers.values() if pub.topic_name in cameras]
    if cameras and not wait_for_reliable_subscriptions(node, cameras, 10.0):
        print("note: a camera topic has no reliable subscription after 10 s (camera_reliability best_effort?): "
              "large images can be lost under load", file=sys.stderr)
    foreign = sorted(t for t, (pub, _) in publishers.items() if node.count_publishers(t) > 1)
    if foreign:
        print(f"warning: other publishers on {', '.join(foreign)}: their frames mix with this replay's",
              file=sys.stderr)
    return publishers


def missing_calibration(messages, info_topics: list[str]) -> list[str]:
    """What a bag lacks of the calibration the published query heads read: each of ``info_topics`` (CameraInfo)
    without a message, and ``/tf_static`` when it has none; [] when it has both."""
    topics = {m.topic for m in messages}
    return [t for t in info_topics if t not in topics] + ([] if TF_STATIC_TOPIC in topics else [TF_STATIC_TOPIC])


def publish_calibration(node, messages, info_topics: list[str], publishers: dict, statuses,
                        timeout_s: float = 10.0):
    """Before playback, for a model with the published query heads: the bag's ``/tf_static`` on a reliable,
    transient-local publisher (as tf2's static broadcaster; returned, keep it while the replay runs) and the first
    CameraInfo of each camera of ``info_topics`` on its publisher from ``publishers`` (topic -> (publisher,
    class)), so the prefix has the calibration when the first frame comes (on a vehicle CameraInfo flows with every
    image; here the bag's first CameraInfo of a camera may follow its image). ``statuses()``: the prefix's latest
    status (ros.status.PrefixStatus or None); waits up to ``timeout_s`` until it reports them received. Returns
    (the /tf_static publisher or None when the bag has none, whether the prefix reported them in time)."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from rclpy.serialization import deserialize_message
    from tf2_msgs.msg import TFMessage

    tf_static = [m for m in messages if m.topic == TF_STATIC_TOPIC]
    tf_pub = None
    transforms = 0
    if tf_static:
        qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
        tf_pub = node.create_publisher(TFMessage, TF_STATIC_TOPIC, qos)
        merged = TFMessage()
        for m in tf_static:  # one latched message with every transform, as a static broadcaster keeps them
            merged.transforms.extend(deserialize_message(m.raw, TFMessage).transforms)
        transforms = len(merged.transforms)
        tf_pub.publish(merged)
    infos = 0
    for topic in info_topics:
        first = next((m for m in messages if m.topic == topic), None)
        if first is not None and topic in publishers:
            pub, cls = publishers[topic]
            pub.publish(deserialize_message(first.raw, cls))
            infos += 1
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = statuses()
        if status is not None and status.camera_infos_in >= infos and status.static_transforms_in >= transforms:
            return tf_pub, True
        time.sleep(0.1)
    return tf_pub, False


def play_bag(args, play, publishers, rec, ns: str, cameras: list[str], on_frame=None, clock=None,
             baseline=None) -> dict:
    """Publish the bag at its recorded rate, ``args.loops`` times. Returns frame stamps and counts, and
    ``loop_ns``: how far (ns) each loop's stamps are shifted past the previous loop's.

    ``cameras``: the camera topics as played, in model camera order. A frame is timed from the instant the call
    publishing its last image begins (CLOCK_MONOTONIC: a node may hold that image before the call returns); the
    first camera's images are kept for the plots.

    ``clock`` (tools.sim_clock.BagClock): the bag's clock, run with the playback from its first message and
    advanced to each message's receive time (loop offset included) before the message goes out.

    Records the odometry played and the first camera's messages into ``rec`` (for the plots). The
    progress bar counts frames and shows trajectories and drops (from the nodes' latest /diagnostics).
    Ctrl-C stops playback early; the result then says ``interrupted: True``. ``on_frame(index)`` runs
    before the first message of each frame (index 0-based over all loops). ``baseline``: the nodes'
    statuses before playback (replay_recorder.Statuses), subtracted from the drops the progress bar shows.
    """
    from rclpy.serialization import deserialize_message
    from tqdm import tqdm

    t0 = play[0].t_ns
    span = play[-1].t_ns - t0
    first_camera, cameras = cameras[0], set(cameras)
    camera_times = sorted({m.t_ns for m in play if m.topic in cameras})
    gaps = np.diff(camera_times)
    gaps = gaps[gaps > args.sync_tolerance_ms * 1e6]  # between frames, not between the cameras of one frame
    period = int(np.median(gaps)) if gaps.size else 100_000_000
    loop_len = span + period
    frames: dict[int, float] = {}  # frame stamp (ns, its first camera message) -> wall time its last image went out
    frames_per_loop = gaps.size + 1 if camera_times else 0
    bar = tqdm(total=args.loops * frames_per_loop, unit="frame", disable=args.quiet, dynamic_ncols=True, desc="replay",
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]")
    counts = {"messages": 0}
    wall0 = time.monotonic()
    if clock is not None:
        clock.run(t0, wall0, args.rate)
    interrupted = False
    try:
        play_loops(args, play, publishers, rec, deserialize_message, bar, frames, wall0, t0, loop_len,
                   cameras, first_camera, ns, counts, on_frame, clock, baseline)
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    return {"frames": frames, "messages": counts["messages"], "wall_s": time.monotonic() - wall0,
            "interrupted": interrupted, "loop_ns": loop_len}


def play_loops(args, play, publishers, rec, deserialize_message, bar, frames, wall0, t0, loop_len,
               cameras, first_camera, ns, counts, on_frame=None, clock=None, baseline=None) -> None:
    from ..vehicle.trajectory import ego_state_from_odometry

    last_frame = None
    for loop in range(args.loops):
        offset = loop * loop_len
        for m in play:
            due = wall0 + (m.t_ns - t0 + offset) / 1e9 / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pub, cls = publishers[m.topic]
            msg = deserialize_message(m.raw, cls)
            stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec + offset
            if offset:  # the first loop plays the stamps as recorded, invalid ones (nanosec >= 1e9) included
                msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp, 1_000_000_000)
            new_frame = m.topic in cameras and (
                last_frame is None or abs(stamp - last_frame) > args.sync_tolerance_ms * 1e6)
            if new_frame:
                if on_frame is not None:
                    on_frame(counts.get("frames", 0))  # (a disabled tqdm bar does not count)
                counts["frames"] = counts.get("frames", 0) + 1
            if clock is not None:
                clock.advance_to(m.t_ns + offset)  # the bag's clock first: no message from a node's future
            # the instant the publish call begins: a subscriber can hold the message before the call returns
            sent = time.monotonic()
            pub.publish(msg)
            counts["messages"] += 1
            if m.topic in cameras:
                if new_frame:
                    last_frame = stamp
                    bar.update(1)
                frames[last_frame] = sent
                if m.topic == first_camera:
                    with rec.lock:
                        rec.first_camera[stamp] = m
            elif m.topic == ODOMETRY_TOPIC:
                try:
                    ego = ego_state_from_odometry(msg)
                except ValueError:
                    ego = None  # the suffix node drops it too (bad_odometry)
                with rec.lock:
                    rec.played_odometry.append(PlayedOdometry(loop, m.t_ns + offset, msg))
                    if ego is not None:
                        rec.odometry.append(ego)
            with rec.lock:
                done = len(rec.trajectories)
            now = rec.statuses(ns)
            drops = sum(drops_by_cause(
                *(None if st is None else st.since(getattr(baseline, side, None))
                  for side, st in (("prefix", now.prefix), ("suffix", now.suffix)))).values())
            bar.set_postfix({"trajectories": done, "drops": drops}, refresh=False)
