"""Shared step of the scripts that rewrite a rosbag2 folder in place (add_tf_static_from_dgp.py,
odometry_twist_to_base_link.py)."""
from __future__ import annotations

import shutil
from pathlib import Path


def replace_bag_folder(bag: Path, out: Path) -> None:
    """Make the rewritten bag folder ``out`` the bag at ``bag``: files of ``bag`` the writer did not produce
    (SOURCE.txt and the like) are copied into ``out`` first; the old folder is renamed aside, ``out`` takes its
    name, and the old one is then deleted (so a failure leaves one of the two in place). Raises OSError."""
    keep = [p for p in bag.iterdir() if p.name not in {q.name for q in out.iterdir()}]
    for p in keep:
        shutil.copy2(p, out / p.name)
    backup = bag.with_name(bag.name + ".old")
    bag.rename(backup)
    out.rename(bag)
    shutil.rmtree(backup)
