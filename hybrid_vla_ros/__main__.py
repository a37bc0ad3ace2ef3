"""``python -m hybrid_vla_ros ...``: the ``hybrid-vla`` command (see :mod:`hybrid_vla_ros.tools.cli`)."""
import sys

from .tools.cli import main

sys.exit(main())
