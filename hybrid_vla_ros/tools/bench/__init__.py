"""``hybrid-vla bench``: side-by-side measurements of the split pipeline's costs, written as JSON, PNG plots and
Markdown tables. Every figure is a ratio of quantities measured in the same run on the same machine; nothing
here is a pass/fail timing test.

Parts (each in its own module, run by :mod:`hybrid_vla_ros.tools.bench.cli`):

* :mod:`.handoff` -- the prefix hidden states between two processes: the shared-memory ring against an rclpy
  topic carrying the same bytes (Fast DDS default, ``FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA``, the project's
  shared-memory profile) and against one in-process memcpy (the floor).
* :mod:`.pipeline` -- the cross-frame asynchronous pipeline (prefix and suffix in two pinned processes) on the
  embedded bag's frames: frame rate against the rate its own stage times allow, end-to-end latency against the
  sum of its stage times, and the same frames run one stage after the other.
* :mod:`.suffix_flops` -- achieved FLOP/s of the CPU suffix against the GEMM peak torch reaches on the same
  pinned cores and dtype.
* :mod:`.preprocess` -- decode + convert + resize of 6 cameras of 1600x900 as a share of the prefix stage.

Worker processes (:mod:`.worker`) are pinned to their cores before torch or rclpy is imported, so every thread
they ever start stays on those cores.
"""
