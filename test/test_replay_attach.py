"""``hybrid-vla replay --attach`` against nodes started by the real ``ros2 launch``, run twice each time.

With the launch file's autostart (the default) the first replay starts right after ``ros2 launch``, while
the nodes are still being configured: it must wait for that autostart instead of racing it (it makes no
transition, and launch reports no failed one), count this run only, and leave both nodes active. Should it
come before launch's first request at all (launch was seen to send it seconds late on a busy machine), it
drives the node itself, launch's request is refused, and the replay, seeing that refusal, still leaves the
node active: both outcomes are accepted, the test prints which one happened. With
``autostart:=false`` it configures and activates the nodes itself and returns them to unconfigured after
each run. The second run of each reports the same counts as the first: the nodes' counters live as long as
their processes, so a replay that did not subtract them would report twice as many camera messages.

Everything runs with the real tools from the colcon install space (``ros2 launch``, ``ros2 run hybrid_vla_ros
hybrid-vla replay``, ``ros2 lifecycle get``). Both nodes are launched with ``use_sim_time:=true``, as
docs/deployment.md says for replays of recorded bags: the replay publishes the bag's time on /clock, so the output
guard keeps its age check and judges the recorded stamps by it.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import ros_tools

LOOPS = 1
CAMERA_MESSAGES = 6 * 3 * LOOPS  # the embedded bag: 6 cameras, 3 frames, played LOOPS times


def _launch(ros_env, install, model, tmp_path, ns, *extra) -> ros_tools.Launched:
    """The launch command docs/deployment.md shows for a replay into launched nodes: the bag's compressed
    cameras, both nodes on the bag's clock (``use_sim_time:=true``; the replay publishes /clock), the output
    guard's age check on as shipped."""
    return ros_tools.Launched([f"model_path:={model}", "split_layer:=2", "camera_transport:=compressed",
                               "camera_topic_suffix:=image_raw", f"namespace:={ns}", "use_sim_time:=true", *extra],
                              ros_env, tmp_path / "launch.log")


def _replay(ros_env, model, ns, out: Path, *extra: str):
    """``ros2 run hybrid_vla_ros hybrid-vla replay --attach`` with the embedded bag (and ``extra`` options);
    (process, report.json)."""
    proc = ros_tools.ros2(ros_env, "run", "hybrid_vla_ros", "hybrid-vla", "replay", "--attach", "--model-path",
                          str(model), "--namespace", f"/{ns}", "--loops", str(LOOPS), "--output", str(out), "--quiet",
                          *extra, timeout=600)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    return proc, report


def _check_run(proc, report, launched, before=None):
    """This run's report: this run's camera messages only (54 when none is lost; best-effort camera messages
    can be lost while DDS matching completes on a busy machine), and the node's counters at the start of
    this run are those at the start of the previous run plus what the previous run reported."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text + "\n" + launched.log()[-4000:]
    assert 0 < report["camera_messages_in"] <= CAMERA_MESSAGES, (report, text)
    if before is not None:
        assert report["node_counters_at_start"]["prefix_node"]["frames_in"] == \
            before["node_counters_at_start"]["prefix_node"]["frames_in"] + before["camera_messages_in"]
    assert report["frames_published"] == 3 * LOOPS
    assert 0 < report["trajectories_out"] <= report["frames_published"]
    assert report["foreign_trajectories"] == 0
    assert report["frames_through_prefix"] >= report["trajectories_out"]
    return text


def _stop(launched, ns):
    rc = launched.stop()
    assert rc == 0, launched.log()[-4000:]
    assert not launched.survivors()
    assert ros_tools.ring_segments(f"/{ns}") == []


@pytest.fixture
def cleanup():
    launches = []
    yield launches
    for launched in launches:
        if launched.alive():
            launched.stop()
        if launched.survivors():
            launched.kill()


def test_attach_to_autostarted_nodes_twice(ros_env, ros_install, tiny_checkpoint, tmp_path, cleanup):
    ns = f"hvla_attach_{uuid.uuid4().hex[:6]}"
    launched = _launch(ros_env, ros_install, tiny_checkpoint, tmp_path, ns)
    cleanup.append(launched)
    # at once, while the launch file's autostart configures the nodes
    first, report1 = _replay(ros_env, tiny_checkpoint, ns, tmp_path / "run1")
    text = _check_run(first, report1, launched)
    print("\n" + "\n".join(line for line in text.splitlines() if "found" in line or " left " in line))
    for node in ("prefix_node", "suffix_node"):
        assert ros_tools.lifecycle_state(ros_env, f"/{ns}/{node}") == "active", "left as the launch file meant"
        if f"/{ns}/{node}: found active" in text:
            continue  # waited for the autostart (the node was configuring or activating): nothing to do
        # The replay came before launch's first request (launch sent it more than --attach-wait s after the
        # replay saw the node, which a busy machine can do): launch's request was refused, the replay saw that
        # in the node's lifecycle_requests_refused and left the node active instead of undoing its transitions.
        assert f"/{ns}/{node}: left active: another lifecycle manager asked for" in text, text
        assert f"Failed to make transition 'TRANSITION_CONFIGURE' for LifecycleNode '/{ns}/{node}'" in \
            launched.log(), launched.log()
    if "done by this replay" not in text:
        assert not re.search(r"Failed to make transition", launched.log()), launched.log()

    second, report2 = _replay(ros_env, tiny_checkpoint, ns, tmp_path / "run2")
    text = _check_run(second, report2, launched, report1)
    print(f"camera messages in: {report1['camera_messages_in']}, then {report2['camera_messages_in']}")
    assert report2["split_layer"] == 2, "the attached prefix's K"
    for node in ("prefix_node", "suffix_node"):
        assert f"/{ns}/{node}: found active" in text and f"/{ns}/{node}: left active (as found)" in text, text
        assert ros_tools.lifecycle_state(ros_env, f"/{ns}/{node}") == "active"

    # a replay given another checkpoint than the nodes loaded is refused (its report would describe that
    # model's split layers), and leaves the nodes as it found them
    from hybrid_vla_ros.model.checkpoint import init_model, model_id
    from hybrid_vla_ros.util.ids import model_id_text

    other = tmp_path / "other_tiny"
    init_model("tiny", other, seed=1)
    third, _ = _replay(ros_env, other, ns, tmp_path / "run3")
    assert third.returncode == 2, third.stdout + third.stderr
    assert (f"the attached nodes run model {model_id_text(model_id(tiny_checkpoint))} (4 blocks), not --model-path "
            f"{other} (model {model_id_text(model_id(other))}, 4 blocks)") in third.stderr, third.stderr
    for node in ("prefix_node", "suffix_node"):
        assert ros_tools.lifecycle_state(ros_env, f"/{ns}/{node}") == "active"
    _stop(launched, ns)


def test_attach_to_unconfigured_nodes_twice(ros_env, ros_install, tiny_checkpoint, tmp_path, cleanup):
    ns = f"hvla_attach_{uuid.uuid4().hex[:6]}"
    launched = _launch(ros_env, ros_install, tiny_checkpoint, tmp_path, ns, "autostart:=false")
    cleanup.append(launched)
    for node in ("prefix_node", "suffix_node"):
        assert ros_tools.wait_lifecycle_state(ros_env, f"/{ns}/{node}", "unconfigured", 180, launched.alive) == \
            "unconfigured", launched.log()
    previous = None
    # the first run waits --attach-wait (10 s) without a transition for launch's lifecycle client, the second is
    # told there is no autostart to wait for (--attach-wait 0, as docs/deployment.md says)
    for run, extra in (("run1", ()), ("run2", ("--attach-wait", "0"))):
        proc, report = _replay(ros_env, tiny_checkpoint, ns, tmp_path / run, *extra)
        text = _check_run(proc, report, launched, previous)
        previous = report
        print(f"camera messages in: {report['camera_messages_in']}")
        print("\n" + "\n".join(line for line in text.splitlines() if "found" in line or "left" in line))
        for node in ("prefix_node", "suffix_node"):
            assert (f"/{ns}/{node}: found unconfigured, configure and activate done by this replay; it goes back to "
                    "unconfigured after the run") in text, text
            assert f"/{ns}/{node}: left unconfigured (as found)" in text, text
            assert ros_tools.lifecycle_state(ros_env, f"/{ns}/{node}") == "unconfigured"
        assert ros_tools.ring_segments(f"/{ns}") == [], "cleaned up again: the prefix removed its ring"
    _stop(launched, ns)
