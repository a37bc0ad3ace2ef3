"""vehicle/output.py: a frame's modes -> the trajectories a suffix may publish, each judged by the output guard."""
import numpy as np

from hybrid_vla_ros.vehicle.guard import GuardLimits, find_violations
from hybrid_vla_ros.vehicle.output import guarded_outputs
from hybrid_vla_ros.vehicle.trajectory import EgoState, waypoints_to_trajectory

EGO = EgoState(x=100.0, y=-20.0, z=0.5, yaw=0.3, speed=5.0, stamp_ns=1_000_000_000)
DT = 0.5
NOW = EGO.stamp_ns + 50_000_000  # 50 ms after the camera stamp


def _straight(speed: float, n: int = 6) -> np.ndarray:
    """(n, 2) waypoints in the ego frame, straight ahead at ``speed`` m/s."""
    return np.stack([speed * DT * np.arange(1, n + 1), np.zeros(n)], axis=1)


def test_the_selected_mode_and_the_candidates_that_pass_are_returned_the_others_are_named_drops():
    modes = np.stack([_straight(5.0), _straight(30.0), _straight(4.0)])  # mode 1: 30 m/s, over the 11.1 limit
    modes[2, 3] = np.nan  # mode 2 cannot be converted
    out = guarded_outputs(modes[0], modes, 0, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, candidates=True,
                          mode_names=("LEFT", "RIGHT", "STRAIGHT"))
    reference = waypoints_to_trajectory(modes[0], DT, EGO, 2.79, heading_min_segment_m=GuardLimits().min_segment_m)
    np.testing.assert_array_equal(out.selected.x, reference.x)
    np.testing.assert_array_equal(out.selected.yaw, reference.yaw)
    assert out.violations == []
    assert len(out.candidates) == 1 and out.candidates[0] is out.selected
    causes = [c for c, _ in out.drops]
    assert causes == ["candidate_guard_too_fast", "candidate_bad_waypoints"]
    assert "RIGHT" in out.drops[0][1] and "STRAIGHT" in out.drops[1][1]


def test_a_selected_mode_that_fails_the_guard_is_one_drop_and_stays_out_of_the_candidates():
    modes = np.stack([_straight(5.0), _straight(30.0)])
    out = guarded_outputs(modes[1], modes, 1, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, candidates=True)
    expected = find_violations(out.selected, EGO.stamp_ns, NOW, GuardLimits(), ego_yaw=EGO.yaw)
    assert [v.cause for v in out.violations] == [v.cause for v in expected] and expected
    assert out.drops[0][0] == f"guard_{expected[0].cause}"
    assert [c for c, _ in out.drops] == [f"guard_{expected[0].cause}", f"candidate_guard_{expected[0].cause}"]
    assert len(out.candidates) == 1  # mode 0 passes


def test_unconvertible_waypoints_build_nothing_and_an_old_stamp_is_too_old():
    bad = _straight(5.0)
    bad[0, 0] = np.inf
    out = guarded_outputs(bad, None, 0, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, candidates=True)
    assert out.selected is None and out.candidates == [] and [c for c, _ in out.drops] == ["bad_waypoints"]
    late = guarded_outputs(_straight(5.0), None, 0, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns,
                           EGO.stamp_ns + 5_000_000_000)
    assert [c for c, _ in late.drops] == ["guard_too_old"] and late.candidates == []


def test_a_model_frame_track_is_turned_per_mode_and_one_bad_unselected_mode_drops_only_itself():
    """With ``to_base_link`` (the published planners' model-frame track, model_track_to_base_link) each mode is
    turned into base_link's track before it becomes a trajectory; a mode that cannot be is that candidate's drop
    alone, and without candidates the other modes are not even looked at."""
    from hybrid_vla_ros.vehicle.trajectory import model_track_to_base_link

    origin = (1.01, 0.0)
    modes = np.stack([_straight(5.0), _straight(4.0), _straight(3.0)])
    modes[2, 3] = np.nan
    turn = lambda w: model_track_to_base_link(w, origin)  # noqa: E731
    out = guarded_outputs(modes[0], modes, 0, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, candidates=True,
                          to_base_link=turn)
    reference = waypoints_to_trajectory(turn(modes[0]), DT, EGO, 2.79,
                                        heading_min_segment_m=GuardLimits().min_segment_m)
    np.testing.assert_array_equal(out.selected.x, reference.x)
    assert len(out.candidates) == 2 and [c for c, _ in out.drops] == ["candidate_bad_waypoints"]
    alone = guarded_outputs(modes[0], modes, 0, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, to_base_link=turn)
    assert alone.selected is not None and alone.drops == []
    bad = guarded_outputs(modes[2], modes, 2, DT, EGO, 2.79, GuardLimits(), EGO.stamp_ns, NOW, to_base_link=turn)
    assert bad.selected is None and [c for c, _ in bad.drops] == ["bad_waypoints"]
