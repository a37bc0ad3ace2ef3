"""hybrid_vla_ros: split VLA inference between a GPU prefix node and a CPU suffix node.

Sub-packages, lowest layer first (a module imports only from its own layer or the ones below;
``test/test_layers.py`` walks every import to keep it so):

* ``util``      paths of the package's files, bags, statistics, stamps, core lists (no torch, no ROS)
* ``model``     checkpoint config, the VLA as decoder blocks, its stages at a split layer K, loaders
* ``transport`` the shared-memory ring that carries the prefix hidden states between processes
* ``vehicle``   camera images, camera sync, ego state, trajectory construction, the output guard
* ``split``     the memory / latency plan per K, the profiler, moving K at run time
* ``runtime``   the prefix and suffix runners (one per process), devices, CPU affinity
* ``ros``       the thin rclpy lifecycle nodes, their parameters and schemas, message conversion
* ``tools``     the ``hybrid-vla`` command: replay, plots, bench

Everything below ``ros`` imports nothing from ROS (no rclpy, no message packages).
"""

from .util.numerics import request_reproducible_mkl

__version__ = "0.1.0"

# oneMKL in its reproducible mode (MKL_CBWR=AUTO unless set): a split compares bit for bit with the unsplit model
# in every run, on every host (util/numerics.py says why and what it costs)
request_reproducible_mkl()
