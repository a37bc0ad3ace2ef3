"""``python -m hybrid_vla_ros.tools.bench ...``: the same as ``hybrid-vla bench ...``."""
import sys

from .cli import main

sys.exit(main())
