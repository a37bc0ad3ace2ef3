"""Tests for hybrid_vla_ros.vehicle.sync.CameraSynchronizer.

Real stamps: the 6 compressed camera topics of data/dgp_scene02_6cam_mcap (3 frames). DGP's cameras are
triggered together: all six share one header stamp per frame (spread 0), 1.000 s apart. The nuScenes
bag under ../shared/data beside the checkout (if present) has the real staggered rolling-shutter stamps of nuScenes
(CAM_FRONT_LEFT first, CAM_BACK_LEFT last, 42.6 ms spread).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rosbags.highlevel import AnyReader

from hybrid_vla_ros.vehicle.sync import DROP_CAUSES, CameraSynchronizer, SyncedSet

BAG = Path(__file__).resolve().parents[1] / "data" / "dgp_scene02_6cam_mcap"
NUSCENES_BAG = Path(__file__).resolve().parents[2] / "shared" / "data" / "bags" / "nuscenes_scene0061_1sample_mcap"
MS = 1_000_000
N = 6


def _camera_messages(bag: Path):
    """[(camera index, header stamp ns, message)] of the compressed camera topics, in bag order."""
    out = []
    with AnyReader([bag]) as reader:
        conns = [c for c in reader.connections if c.topic.endswith("/image_raw/compressed")]
        for conn, _, data in reader.messages(connections=conns):
            msg = reader.deserialize(data, conn.msgtype)
            cam = int(conn.topic.split("/")[3].removeprefix("camera"))
            out.append((cam, msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec, msg))
    return out


@pytest.fixture(scope="module")
def bag_messages():
    msgs = _camera_messages(BAG)
    assert len(msgs) == 3 * N
    return msgs


@pytest.fixture(scope="module")
def frame_stamps(bag_messages):
    return sorted({s for _, s, _ in bag_messages})


def _no_drops(sync):
    return all(v == 0 for v in sync.drops.values())


def test_bag_cameras_synchronize_into_three_sets(bag_messages, frame_stamps):
    sync = CameraSynchronizer(N, tolerance_ns=50 * MS)
    sets = [r for cam, stamp, msg in bag_messages if (r := sync.add(cam, stamp, msg)) is not None]
    assert len(sets) == 3 and sync.sets_emitted == 3 and _no_drops(sync)
    assert [s.stamp_ns for s in sets] == frame_stamps == [1700000000000000000, 1700000000999990000,
                                                          1700000001999942000]
    for synced in sets:
        stamp, items = synced  # unpacks as (stamp, items)
        assert isinstance(synced, SyncedSet) and len(items) == N
        # Items are the undecoded messages, in camera order, all from this frame.
        assert [m.header.frame_id for m in items] == [f"camera{i}/camera_optical_link" for i in range(N)]
        assert all(m.format == "jpeg" and m.header.stamp.sec * 10**9 + m.header.stamp.nanosec == stamp
                   for m in items)
    assert sync.last_stamps_ns == (frame_stamps[-1],) * N  # spread 0: DGP cameras share a stamp
    assert sync.queued == (0,) * N


def test_bag_stamps_with_staggered_cameras_and_shuffled_arrival(bag_messages, frame_stamps):
    # Give each camera a fixed rolling-shutter offset (like nuScenes, 0..42 ms) and shuffle arrival order
    # within each frame; sets still come out in camera order with reference = newest stamp.
    offsets = [8, 0, 16, 35, 42, 25]
    rng = random.Random(7)
    sync = CameraSynchronizer(N, tolerance_ns=50 * MS)
    sets = []
    for frame in frame_stamps:
        msgs = [(cam, stamp + offsets[cam] * MS, msg) for cam, stamp, msg in bag_messages if stamp == frame]
        rng.shuffle(msgs)
        sets += [r for cam, stamp, msg in msgs if (r := sync.add(cam, stamp, msg)) is not None]
    assert [s.stamp_ns for s in sets] == [f + 42 * MS for f in frame_stamps]
    assert all([int(m.header.frame_id[6]) for m in s.items] == list(range(N)) for s in sets)
    assert _no_drops(sync)
    # The same frames with a tolerance below the 42 ms spread never synchronize.
    sync = CameraSynchronizer(N, tolerance_ns=40 * MS)
    for frame in frame_stamps:
        for cam, stamp, msg in bag_messages:
            if stamp == frame:
                assert sync.add(cam, stamp + offsets[cam] * MS, msg) is None
    assert sync.sets_emitted == 0 and sync.drops["unsynced"] > 0


@pytest.mark.skipif(not NUSCENES_BAG.exists(), reason="shared nuScenes bag not present")
def test_nuscenes_real_staggered_stamps():
    msgs = _camera_messages(NUSCENES_BAG)
    stamps = [s for _, s, _ in msgs]
    assert max(stamps) - min(stamps) == pytest.approx(42.6 * MS, abs=0.1 * MS)
    sync = CameraSynchronizer(N, tolerance_ns=50 * MS)
    out = [r for cam, s, m in msgs if (r := sync.add(cam, s, m)) is not None]
    assert len(out) == 1 and out[0].stamp_ns == max(stamps)
    assert sync.last_stamps_ns == tuple(s for _, s, _ in sorted(msgs, key=lambda x: x[0]))
    sync = CameraSynchronizer(N, tolerance_ns=30 * MS)
    assert all(sync.add(cam, s, m) is None for cam, s, m in msgs)


def _feed(sync, frame_stamp, cams=range(N), offsets=None):
    """Add one frame; return the emitted sets."""
    out = []
    for cam in cams:
        stamp = frame_stamp + (offsets or {}).get(cam, 0)
        result = sync.add(cam, stamp, (cam, stamp))
        if result is not None:
            out.append(result)
    return out


def test_missing_camera_drops_the_frame_and_next_set_comes(frame_stamps):
    sync = CameraSynchronizer(N, tolerance_ns=20 * MS)
    f0, f1, f2 = frame_stamps
    assert len(_feed(sync, f0)) == 1
    assert _feed(sync, f1, cams=[0, 1, 2, 4, 5]) == []  # camera 3 lost this frame
    assert sync.pop_drops() == {}
    (synced,) = _feed(sync, f2)
    assert synced.stamp_ns == f2 and synced.items == [(c, f2) for c in range(N)]
    assert sync.drops["unsynced"] == 5  # the five orphaned f1 messages
    assert sync.pop_drops() == {"unsynced": 5} and sync.pop_drops() == {}
    assert sync.queued == (0,) * N


def test_dead_camera_overflows_queues_then_recovers():
    sync = CameraSynchronizer(N, tolerance_ns=20 * MS, queue_depth=4)
    base = 1_700_000_000 * 10**9
    for k in range(7):
        assert _feed(sync, base + k * 100 * MS, cams=range(5)) == []  # camera 5 silent
    # Frames 0..2 were pushed out: one queue_overflow each (camera 0 overflowed first), after which
    # their other four members could no longer be matched (unsynced).
    assert sync.drops["queue_overflow"] == 3 and sync.drops["unsynced"] == 3 * 4
    assert sync.queued == (4, 4, 4, 4, 4, 0)
    (synced,) = _feed(sync, base + 7 * 100 * MS)
    assert synced.stamp_ns == base + 700 * MS and synced.items[5] == (5, base + 700 * MS)
    # Every message of frames 0..6 was dropped exactly once, counted by cause.
    assert sync.drops["queue_overflow"] == 4 and sync.drops["queue_overflow"] + sync.drops["unsynced"] == 7 * 5
    assert sync.queued == (0,) * N


def test_backwards_and_duplicate_stamps_are_counted(frame_stamps):
    sync = CameraSynchronizer(N, tolerance_ns=20 * MS)
    f0, f1, f2 = frame_stamps
    _feed(sync, f1)
    assert sync.add(2, f0, "old") is None  # camera 2 goes back in time
    assert sync.add(2, f1, "again") is None  # same stamp as its last
    assert sync.drops["out_of_order"] == 1 and sync.drops["duplicate"] == 1
    assert sync.pop_drops() == {"out_of_order": 1, "duplicate": 1}
    (synced,) = _feed(sync, f2)
    assert synced.stamp_ns == f2
    # Duplicate inside a frame that has not completed yet: the set still comes once, with the first copy.
    sync.add(0, f2 + 100 * MS, "first")
    assert sync.add(0, f2 + 100 * MS, "second") is None
    (synced,) = _feed(sync, f2 + 100 * MS, cams=range(1, N))
    assert synced.items[0] == "first" and sync.drops["duplicate"] == 2


def test_out_of_tolerance_stamp_breaks_only_its_frame(frame_stamps):
    sync = CameraSynchronizer(N, tolerance_ns=20 * MS)
    f0, f1, f2 = frame_stamps
    assert len(_feed(sync, f0)) == 1
    assert _feed(sync, f1, offsets={4: 60 * MS}) == []  # camera 4 is 60 ms late in frame f1
    assert sync.drops["unsynced"] == 5  # the other cameras' f1 can no longer be matched
    (synced,) = _feed(sync, f2)
    assert synced.stamp_ns == f2
    assert sync.drops["unsynced"] == 6  # ... and camera 4's late message is skipped by f2's set
    assert sum(sync.drops.values()) == 6


def test_interleaved_frames_and_best_window():
    sync = CameraSynchronizer(3, tolerance_ns=10 * MS)
    t = 10**12
    assert sync.add(0, t, "a0") is None
    assert sync.add(0, t + 100 * MS, "a1") is None  # camera 0 runs a frame ahead
    assert sync.add(1, t + 3 * MS, "b0") is None
    assert sync.add(2, t + 6 * MS, "c0") == SyncedSet(t + 6 * MS, ["a0", "b0", "c0"])
    assert sync.add(2, t + 104 * MS, "c1") is None
    assert sync.add(1, t + 101 * MS, "b1") == SyncedSet(t + 104 * MS, ["a1", "b1", "c1"])
    assert sync.last_stamps_ns == (t + 100 * MS, t + 101 * MS, t + 104 * MS)
    assert _no_drops(sync)
    # Zero tolerance: only identical stamps match.
    sync = CameraSynchronizer(2, tolerance_ns=0)
    assert sync.add(0, 5, "x") is None and sync.add(1, 6, "y") is None
    assert sync.add(0, 7, "x2") is None and sync.add(1, 7, "y2") == SyncedSet(7, ["x2", "y2"])


def test_reset_allows_time_to_restart(frame_stamps):
    sync = CameraSynchronizer(N, tolerance_ns=20 * MS, jump_back_ns=10_000 * MS)  # 2 s back: not a jump here
    for f in frame_stamps:
        _feed(sync, f)
    assert _feed(sync, frame_stamps[0]) == [] and sync.drops["out_of_order"] == N  # replay loop
    sync.reset()
    assert len(_feed(sync, frame_stamps[0])) == 1
    assert sync.sets_emitted == 4


def test_validation():
    sync = CameraSynchronizer(2, tolerance_ns=MS)
    assert set(sync.drops) == set(DROP_CAUSES)
    for cam, stamp in ((2, 0), (-1, 0), (0, -5), (0, 1.5), (True, 0), ("0", 0)):
        with pytest.raises(ValueError):
            sync.add(cam, stamp, None)
    for args in ((0, 1), (2, -1), (2, 1, 0), (2.0, 1)):
        with pytest.raises(ValueError):
            CameraSynchronizer(*args)
    single = CameraSynchronizer(1, tolerance_ns=0)
    assert single.add(0, 3, "only") == SyncedSet(3, ["only"])


def test_clock_jump_back_restarts_synchronization():
    """A bag restarted (or a sensor clock reset) must not block the node until time catches up."""
    sync = CameraSynchronizer(N, tolerance_ns=10 * MS, jump_back_ns=1000 * MS)
    t0 = 1_700_000_000 * 10**9
    assert len(_feed(sync, t0)) == 1
    assert len(_feed(sync, t0 + 2000 * MS)) == 1
    # back to the start of the recording: every later frame would be out_of_order without the jump rule
    assert len(_feed(sync, t0)) == 1
    assert sync.drops["time_jump"] == 1
    assert len(_feed(sync, t0 + 100 * MS)) == 1
    # one frame stamped an hour ahead, then normal frames again: processed after one jump
    assert len(_feed(sync, t0 + 3600 * 10**9)) == 1
    assert len(_feed(sync, t0 + 200 * MS)) == 1
    assert sync.drops["time_jump"] == 2
    # a small step back (within jump_back_ns) is still a late message, not a jump
    sync.add(0, t0 + 100 * MS, "late")
    assert sync.drops["out_of_order"] == 1 and sync.drops["time_jump"] == 2


def test_one_camera_far_in_the_future_costs_only_its_own_frame():
    """Camera 1 alone stamped an hour ahead: its frame is lost, the next good frame is not (it used to be:
    camera 1's hour-ahead stamp made camera 0's next message look unmatchable before camera 1's own next
    message restarted the timeline)."""
    sync = CameraSynchronizer(N, tolerance_ns=50 * MS, jump_back_ns=1000 * MS)
    t0 = 1_700_000_000 * 10**9
    assert len(_feed(sync, t0)) == 1
    assert _feed(sync, t0 + 250 * MS, offsets={1: 3600 * 10**9}) == []
    (synced,) = _feed(sync, t0 + 500 * MS)
    assert synced.stamp_ns == t0 + 500 * MS and synced.items == [(c, t0 + 500 * MS) for c in range(N)]
    # one jump (camera 1 back from the future), its future message and the 5 partners it left alone
    assert sync.drops["time_jump"] == 1 and sync.drops["unsynced"] == 6 and sum(sync.drops.values()) == 7
    assert sync.queued == (0,) * N
    # a whole-clock jump back still restarts every camera: one jump, the next frames go through
    assert len(_feed(sync, t0 - 5000 * MS)) == 1 and sync.drops["time_jump"] == 2
    assert len(_feed(sync, t0 - 4750 * MS)) == 1 and sync.drops["time_jump"] == 2
