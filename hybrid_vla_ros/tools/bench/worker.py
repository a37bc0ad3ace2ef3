"""Entry point of a bench worker process: ``python -m hybrid_vla_ros.tools.bench.worker '<json spec>'``.

The spec (written by :class:`hybrid_vla_ros.tools.bench.common.Worker`) is ``{"task", "cores", "fd", "args"}``.
The worker pins itself to ``cores`` before anything imports torch or rclpy (the parent also pinned it between
fork and exec), opens the channel on descriptor ``fd``, runs ``TASKS[task](chan, **args)`` and sends
``{"type": "result", "data": <return value>}`` or ``{"type": "error", ...}``.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

#: task name -> (module, function); each function takes the channel first and keyword arguments.
TASKS = {
    "ring_producer": ("hybrid_vla_ros.tools.bench.handoff", "ring_producer_task"),
    "ring_consumer": ("hybrid_vla_ros.tools.bench.handoff", "ring_consumer_task"),
    "zc_ring_producer": ("hybrid_vla_ros.tools.bench.zero_copy", "ring_producer_task"),
    "zc_ring_consumer": ("hybrid_vla_ros.tools.bench.zero_copy", "ring_consumer_task"),
    "zc_iox_producer": ("hybrid_vla_ros.tools.bench.zero_copy", "iox_producer_task"),
    "zc_iox_consumer": ("hybrid_vla_ros.tools.bench.zero_copy", "iox_consumer_task"),
    "rclpy_publisher": ("hybrid_vla_ros.tools.bench.handoff", "rclpy_publisher_task"),
    "rclpy_subscriber": ("hybrid_vla_ros.tools.bench.handoff", "rclpy_subscriber_task"),
    "split_profile": ("hybrid_vla_ros.tools.bench.pipeline", "split_profile_task"),
    "pipeline_prefix": ("hybrid_vla_ros.tools.bench.pipeline", "prefix_task"),
    "pipeline_suffix": ("hybrid_vla_ros.tools.bench.pipeline", "suffix_task"),
    "pipeline_sequential": ("hybrid_vla_ros.tools.bench.pipeline", "sequential_task"),
    "suffix_flops": ("hybrid_vla_ros.tools.bench.suffix_flops", "flops_task"),
    "suffix_restart": ("hybrid_vla_ros.tools.bench.suffix_flops", "restart_task"),
    "peer_ours": ("hybrid_vla_ros.tools.bench.suffix_flops", "peer_ours_task"),
    "peer_llama": ("hybrid_vla_ros.tools.bench.suffix_flops", "peer_llama_task"),
    "preprocess": ("hybrid_vla_ros.tools.bench.preprocess", "preprocess_task"),
    "decode_side": ("hybrid_vla_ros.tools.bench.decode", "decode_side_task"),
    "decode_llama": ("hybrid_vla_ros.tools.bench.decode", "llama_decode_task"),
    "decode_rt_producer": ("hybrid_vla_ros.tools.bench.decode", "round_trip_producer_task"),
    "decode_rt_consumer": ("hybrid_vla_ros.tools.bench.decode", "round_trip_consumer_task"),
    "overlap_prefix": ("hybrid_vla_ros.tools.bench.decode_overlap", "overlap_prefix_task"),
    "overlap_suffix": ("hybrid_vla_ros.tools.bench.decode_overlap", "overlap_suffix_task"),
}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    if spec.get("cores"):
        os.sched_setaffinity(0, spec["cores"])  # before torch / rclpy start any thread
    from .common import Channel

    chan = Channel.from_fd(spec["fd"])
    try:
        module, name = TASKS[spec["task"]]
        data = getattr(importlib.import_module(module), name)(chan, **spec["args"])
        chan.send({"type": "result", "data": data})
    except BaseException as e:  # noqa: BLE001 - report everything, including KeyboardInterrupt, to the parent
        try:
            chan.send({"type": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        except OSError:
            pass
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
