"""``hybrid-vla replay --decode-step inductor``: what the replay does with the suffix node's decode-step fields on
/diagnostics (``decode_step``, ``suffix_decode_step_k`` / ``_building`` / ``_error``), read through the replay's
own recorder from real ``diagnostic_msgs`` messages. The nodes' statuses are written here for the states a live
node passes through (a re-split while another K builds, a build that fails); the states themselves come from
``DecodeStepBuilder.status()``, checked in test_compiled_step.py, and a whole replay that waits for a build is in
test_decode_drives.py."""
import threading
import time
import types

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

from hybrid_vla_ros.ros.status import SuffixStatus, pipeline_status_name
from hybrid_vla_ros.tools.replay import ReplaySession
from hybrid_vla_ros.tools.replay_recorder import Recorder

NS = "/decode_wait"


def _message(st: SuffixStatus) -> DiagnosticArray:
    status = DiagnosticStatus(name=pipeline_status_name(f"{NS}/suffix_node"))
    status.values = [KeyValue(key=k, value=v) for k, v in st.key_values()]
    return DiagnosticArray(status=[status])


def _run(capsys, first: SuffixStatus, later=(), timeout_s=5.0):
    """The replay's decision on ``first`` (its baseline), the node then publishing each of ``later`` 0.2 s apart:
    (whether it waited, what it printed)."""
    rec = Recorder()
    rec.on_diagnostics(_message(first))
    session = types.SimpleNamespace(baseline=rec.statuses(NS), rec=rec, ns=NS)
    session._suffix_while = types.MethodType(ReplaySession._suffix_while, session)

    def publish():
        for st in later:
            time.sleep(0.2)
            rec.on_diagnostics(_message(st))

    feeder = threading.Thread(target=publish)
    feeder.start()
    waited = ReplaySession._wait_for_decode_step(session, timeout_s)
    feeder.join()
    out = capsys.readouterr()
    return waited, out.out + out.err


def _suffix(**fields) -> SuffixStatus:
    return SuffixStatus(decode_step="inductor", split_layer=1, **fields)


def test_a_step_built_for_the_node_k_is_ready_even_while_another_k_builds(capsys):
    waited, text = _run(capsys, _suffix(suffix_decode_step_k=1, suffix_decode_step_building=2,
                                              suffix_decode_step="inductor at K=1"))
    assert not waited and "compiled decode step ready: inductor at K=1" in text


def test_it_waits_for_the_build_of_the_node_k_and_says_when_it_is_ready(capsys):
    building = _suffix(suffix_decode_step_building=1, suffix_decode_step="building at K=1 (eager meanwhile)")
    ready = _suffix(suffix_decode_step_k=1, suffix_decode_step="inductor at K=1")
    waited, text = _run(capsys, building, [building, ready])
    assert waited and "waiting for the compiled decode step (K=1, TorchInductor)" in text
    assert "compiled decode step ready after" in text


def test_a_build_of_another_k_is_not_waited_for(capsys):
    """The node moved to K = 1 while K = 2 builds: K = 1's step builds at its next frame, nothing to wait for."""
    waited, text = _run(capsys, _suffix(suffix_decode_step_building=2,
                                              suffix_decode_step="eager at K=1 (building at K=2 first)"))
    assert not waited and "builds at the next frame (eager at K=1 (building at K=2 first))" in text


def test_a_refused_or_failed_step_is_said_and_never_waited_for(capsys):
    why = "its decode steps take multimodal positions"
    waited, text = _run(capsys, _suffix(suffix_decode_step_error=why,
                                           suffix_decode_step=f"eager (not compiled: {why})"))
    assert not waited and f"warning: the compiled decode step is not in use; the suffix node's decode step: eager " \
                          f"(not compiled: {why})" in text
    building = _suffix(suffix_decode_step_building=1, suffix_decode_step="building at K=1 (eager meanwhile)")
    failed = _suffix(suffix_decode_step_error="the build failed: RuntimeError: x",
                     suffix_decode_step="eager at K=1 (the build failed: RuntimeError: x)")
    waited, text = _run(capsys, building, [failed])
    assert waited and "not in use; the suffix node's decode step: eager at K=1 (the build failed" in text


def test_a_build_past_the_timeout_is_said_and_eager_asked_is_left_alone(capsys):
    building = _suffix(suffix_decode_step_building=1, suffix_decode_step="building at K=1 (eager meanwhile)")
    waited, text = _run(capsys, building, [building], timeout_s=0.5)
    assert waited and "was not ready after" in text
    waited, text = _run(capsys, SuffixStatus(decode_step="eager", split_layer=1, suffix_decode_step="eager"))
    assert not waited and text == ""
