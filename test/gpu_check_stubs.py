"""Stand-ins for test_gpu_check.py that a spawned process imports by name (test/ is on its sys.path)."""
from __future__ import annotations

import time


def memory_rows_that_never_answer(*_args) -> list[dict]:
    """A memory worker that hangs, as one killed for memory leaves ``Pool.apply`` waiting."""
    time.sleep(600)
    return []
