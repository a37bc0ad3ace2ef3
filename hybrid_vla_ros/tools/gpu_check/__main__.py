"""``python -m hybrid_vla_ros.tools.gpu_check ...``: the same as ``hybrid-vla gpu-check ...``."""
import sys

from . import main

sys.exit(main())
