"""The nodes' /diagnostics statuses and frame timing (ros/status.py): every field written by a node reads back
the same through the class the tools use, the wire format the tests and ``ros2 topic echo`` read stays as it was,
and a value that does not decode is a clear error."""
from __future__ import annotations

import dataclasses
import math

import pytest

from hybrid_vla_ros.ros.status import (
    FrameTiming,
    NodeStatus,
    PrefixStatus,
    RingFill,
    StageTime,
    StatusError,
    SuffixStatus,
    pipeline_status_name,
)

COMMON = dict(state="active", lifecycle_requests_refused=2, configure_error="bad model_path",
              peer_cause="owner_dead", peer="prefix pid 41", peer_message="the prefix process is gone",
              use_sim_time=True, clock_missing=True, ring_ready_slots=RingFill(3, 4), rss_mib=512.5,
              cuda_allocated_mib=100.0, cuda_reserved_mib=200.0, cuda_driver_used_mib=3000.5,
              cuda_driver_free_mib=4000.0, last_error="dropped: superseded", cpu_affinity=(0, 2),
              stages={"prefix": StageTime(12.5, 20.25, 7), "ego_wait": StageTime(0.125, 0.5, 3)},
              drops={"superseded": 3, "slot_bad_magic": 1})

PREFIX = PrefixStatus(**COMMON, frames_in=60, frames_synchronized=10, frames_out=9, ring_published=9,
                      ring_dropped_oldest=1, split_layer=4, model_id="abc123", num_layers=12, split_layer_auto=True,
                      resplits=2, decode_tokens=12, split_moves_latency=3, split_moves_memory=1,
                      split_move_reason="balanced",
                      handoff_path="produced in the slot", fast_jpeg_decode=True, ego_state_input=True,
                      ego_accel={"topic": 5, "differentiated": 4}, ego_time_jumps=1, camera_reliability="reliable",
                      camera_delay_worst=4, camera_delay_p50_ms=12.5, camera_delay_max_ms=40.0,
                      camera_delays_p50_ms=(3.5, None, 12.5), camera_delays_max_ms=(4.0, None, 40.0),
                      frames_too_old_in_a_row=2, frame_age_limit_s=1.0, cameras_silent=(3, 5), scene_inputs=True,
                      camera_infos_in=18, static_transforms_in=6, navigation_command="LEFT")

SUFFIX = SuffixStatus(**COMMON, frames_in=9, trajectories_out=8, frames_too_old_in_a_row=3, ring_attached=True,
                      ring_contract_error="dtype differs", ring_conversion="bf16 -> fp32", ring_owner_alive=True,
                      ring_read=9, odometry_in=30, odometry_propagated=2, odometry_late=1, odometry_time_jumps=1,
                      candidate_trajectories_out=8, candidates_out=40, split_layer=4, blocks_held_from=3, resplits=1,
                      resplits_on_demand=1, navigation_command="LEFT", decode_frames=3, decode_tokens=12,
                      decode_max_tokens=2, decode_tokens_last=4, suffix_backend="openvino",
                      suffix_backend_in_use="openvino", suffix_backend_k=4, suffix_backend_building=5,
                      suffix_backend_precision="bf16", suffix_backend_error="no plugin",
                      suffix_backend_cache_dir="/var/cache/hv",
                      suffix_backend_frames_compiled=6, suffix_backend_frames_eager=3,
                      suffix_linear_packing="packed 14 linear layers of blocks [K, L) (oneDNN, once)",
                      suffix_inference_precision="fp32",
                      suffix_inference_precision_reason="bf16 asked: computed in fp32, as this CPU (AVX2) has none",
                      decode_step="inductor", suffix_decode_step="building at K=5 (eager meanwhile)",
                      suffix_decode_step_k=4, suffix_decode_step_building=5,
                      suffix_decode_step_error="its build failed")


@pytest.mark.parametrize("status", [PREFIX, SUFFIX], ids=["prefix", "suffix"])
def test_every_field_round_trips_through_the_key_values(status):
    default = type(status)()
    # every field is set away from its default here: a field added to the class without a value in this test fails
    unset = [f.name for f in dataclasses.fields(status) if getattr(status, f.name) == getattr(default, f.name)]
    assert not unset, f"give these fields a non-default value in the test: {unset}"
    pairs = status.key_values()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in pairs)
    assert len({k for k, _ in pairs}) == len(pairs), "a key is written twice"
    assert type(status).from_key_values(pairs) == status
    assert type(status).from_key_values(dict(pairs)) == status  # a received DiagnosticStatus as a dict too


def test_the_wire_format_is_what_the_tests_and_ros2_topic_echo_read():
    values = dict(PREFIX.key_values())
    assert values["frames_out"] == "9" and values["split_layer"] == "4" and values["split_layer_auto"] == "True"
    assert values["ring_ready_slots"] == "3/4" and values["cameras_silent"] == "3,5"
    assert values["cpu_affinity"] == "[0, 2]" and values["rss_mib"] == "512.5"
    assert values["drop_superseded"] == "3" and values["ego_accel_topic"] == "5"
    assert values["prefix_p50_ms"] == "12.500" and values["prefix_p90_ms"] == "20.250" and values["prefix_n"] == "7"
    assert pipeline_status_name("/vla/prefix_node") == "/vla/prefix_node: pipeline"


def test_an_unconfigured_node_writes_empty_values_that_read_back_as_none():
    status = SuffixStatus(state="unconfigured")
    values = dict(status.key_values())
    assert values["split_layer"] == "" and values["suffix_backend_k"] == "" and values["rss_mib"] == ""
    back = SuffixStatus.from_key_values(values)
    assert back.split_layer is None and back.rss_mib is None and back == status


def test_unknown_keys_are_ignored_and_missing_ones_keep_their_default():
    back = PrefixStatus.from_key_values({"frames_out": "4", "a_newer_key": "x", "drop_bad_stamp": "2"})
    assert back.frames_out == 4 and back.drops == {"bad_stamp": 2} and back.frames_in == 0 and back.stages == {}


@pytest.mark.parametrize("key, text", [("frames_out", "many"), ("split_layer_auto", "yes"), ("cpu_affinity", "{}"),
                                       ("drop_superseded", "1.5"), ("ring_ready_slots", "3"), ("rss_mib", "big")])
def test_a_value_that_does_not_decode_names_its_key(key, text):
    with pytest.raises(StatusError, match=key):
        PrefixStatus.from_key_values({key: text})


def test_since_counts_the_counters_of_one_run_and_keeps_the_rest():
    before = dataclasses.replace(PREFIX, frames_out=4, drops={"superseded": 1}, ego_accel={"topic": 5})
    run = PREFIX.since(before)
    assert run.frames_out == 5 and run.drops == {"superseded": 2, "slot_bad_magic": 1}
    assert run.ego_accel == {"differentiated": 4}  # topic: no new frames
    assert run.split_layer == PREFIX.split_layer and run.cpu_affinity == PREFIX.cpu_affinity  # not counters
    restarted = dataclasses.replace(PREFIX, frames_out=2)
    assert restarted.since(PREFIX).frames_out == 0  # a restart reset the counter: nothing negative
    assert PREFIX.since(None) == PREFIX
    with pytest.raises(TypeError):
        PREFIX.since(SUFFIX)
    assert "frames_out" in PREFIX.counters() and "split_layer" not in PREFIX.counters()
    assert PREFIX.counters()["drop_superseded"] == 3


def test_the_stage_keys_do_not_swallow_other_fields_ending_alike():
    # camera_delay_p50_ms ends like a stage time: it stays a field, not a stage 'camera_delay'
    back = PrefixStatus.from_key_values(PREFIX.key_values())
    assert "camera_delay" not in back.stages and back.camera_delay_p50_ms == 12.5


def test_both_statuses_share_the_common_fields():
    common = {f.name for f in dataclasses.fields(NodeStatus)}
    assert common <= {f.name for f in dataclasses.fields(PrefixStatus)}
    assert common <= {f.name for f in dataclasses.fields(SuffixStatus)}


def test_frame_timing_round_trips_and_keeps_nan_for_an_untimed_stage():
    t = FrameTiming(ego_wait_ms=4.0, preprocess_ms=1.5, prefix_ms=2.25, handoff_ms=0.125, suffix_ms=3.0,
                    odometry_wait_ms=0.5,
                    t_prefix_start_ns=10, t_write_start_ns=20, t_ready_ns=30, t_suffix_end_ns=40, t_publish_ns=50,
                    decode_tokens=16, prefix_token_ms=0.75, suffix_token_ms=2.5, decode_round_trip_ms=0.0625)
    assert FrameTiming.from_key_values(t.key_values()) == t
    assert dict(t.key_values())["decode_tokens"] == "16"
    assert dict(t.key_values())["preprocess_ms"] == "1.5000" and dict(t.key_values())["t_ready_ns"] == "30"
    assert list(t.stage_ms()) == list(FrameTiming.STAGES)
    untimed = FrameTiming.from_key_values(FrameTiming(suffix_ms=3.0).key_values())
    assert math.isnan(untimed.preprocess_ms) and untimed.suffix_ms == 3.0
    with pytest.raises(StatusError, match="t_ready_ns"):
        FrameTiming.from_key_values({"t_ready_ns": "soon"})


def test_the_replay_report_sets_end_to_end_against_the_stage_sum():
    """replay_report.pipeline_overhead on two frames written out by hand: e2e from the last camera message to the
    trajectory, minus the stages the suffix timed (an untimed stage, NaN, counts 0), split into the time before the
    prefix started and after the suffix ended; a trajectory without a timing, or of another replay, is left out."""
    from hybrid_vla_ros.tools.replay_report import pipeline_overhead

    ms = 1_000_000
    frames = {1_000 * ms: 10.000, 2_000 * ms: 11.000}  # camera stamp (ns) -> last camera message sent (s)
    t1 = FrameTiming(preprocess_ms=20.0, prefix_ms=100.0, handoff_ms=0.5, suffix_ms=80.0, odometry_wait_ms=math.nan,
                     t_prefix_start_ns=10_004 * ms, t_suffix_end_ns=10_205 * ms)
    t2 = FrameTiming(preprocess_ms=22.0, prefix_ms=101.0, handoff_ms=0.5, suffix_ms=82.0, odometry_wait_ms=1.5,
                     t_prefix_start_ns=11_010 * ms, t_suffix_end_ns=11_220 * ms)
    trajectories = {1_000 * ms: 10.2075, 2_000 * ms: 11.2230, 9_000 * ms: 20.0, 3_000 * ms: 12.0}
    o = pipeline_overhead(trajectories, {1_000 * ms: t1, 2_000 * ms: t2, 9_000 * ms: t1}, frames, 50.0)
    # frame 1: e2e 207.5, stages 200.5, overhead 7.0, before 4, after 2.5; frame 2: 223, 207, 16, 10, 3
    assert o["n"] == 2
    assert o["e2e_p50_ms"] == pytest.approx(215.25) and o["stage_sum_p50_ms"] == pytest.approx(203.75)
    assert o["overhead_p50_ms"] == pytest.approx(11.5)
    assert o["allowed_ms"] == pytest.approx(0.05 * 203.75 + 2, abs=1e-3)
    assert o["before_prefix_p50_ms"] == pytest.approx(7.0) and o["after_suffix_p50_ms"] == pytest.approx(2.75)
    assert o["met"] is True  # 11.5 <= 12.19
    assert pipeline_overhead({}, {}, frames, 50.0)["met"] is None


def test_a_prefix_paced_to_a_slow_suffix_is_not_a_stall_for_two_of_its_cycles():
    """The stall ERROR (inputs arrive, nothing comes out for STALL_S = 3 s) would fire every cycle for a prefix
    paced to a suffix slower than 3 s (it publishes once per suffix cycle): the prefix's threshold is two of the
    attached suffix's announced cycles when that is longer, and STALL_S without an attached suffix or a schedule."""
    from types import SimpleNamespace

    from hybrid_vla_ros.ros.prefix_node import PrefixNode
    from hybrid_vla_ros.runtime.prefix import PrefixRunner

    def node(attached, taken, next_read):  # the runner's own suffix_cycle_s over a stand-in ring header
        ring = SimpleNamespace(consumer_attached=lambda: attached, consumer_schedule=lambda: (taken, next_read))
        runner = SimpleNamespace(ring=ring)
        runner.suffix_cycle_s = lambda: PrefixRunner.suffix_cycle_s(runner)
        return SimpleNamespace(runner=runner, STALL_S=PrefixNode.STALL_S)

    t = 10**12
    assert PrefixNode.stall_s(node(True, t, t + 8_500_000_000)) == 17.0  # minddrive-0.5b wholly on one core
    assert PrefixNode.stall_s(node(True, t, t + 200_000_000)) == PrefixNode.STALL_S  # a fast suffix
    assert PrefixNode.stall_s(node(False, t, t + 8_500_000_000)) == PrefixNode.STALL_S  # a dead one's figures
    assert PrefixNode.stall_s(node(True, 0, 0)) == PrefixNode.STALL_S  # nothing announced yet
    assert PrefixNode.stall_s(SimpleNamespace(runner=None, STALL_S=3.0)) == 3.0  # unconfigured
