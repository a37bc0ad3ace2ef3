#!/usr/bin/env python3
"""Run ``hybrid-vla gpu-check`` from a copy of the repository where the package is not installed and there is
no ROS (the GPU machine): ``python3 scripts/gpu_check.py --out gpu_check_out``.

It puts the repository root on ``sys.path`` and calls :func:`hybrid_vla_ros.tools.gpu_check.main`; nothing it
imports needs rclpy (see that module's docstring for what it measures and needs). The child processes it
starts (multiprocessing spawn) inherit the same path.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybrid_vla_ros.tools.gpu_check import main  # noqa: E402  (after the path set-up above)

if __name__ == "__main__":
    sys.exit(main())
