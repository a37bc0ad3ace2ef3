"""Creating a segment over what a previous producer left: its ``.init-*`` files and a dead owner's segment,
each with the wake-up directory its header names."""
from __future__ import annotations

import os
import stat
import struct

from .errors import RingNameConflict
from .layout import GLOBAL, GLOBAL_HEADER_BYTES
from .segment import GLOBAL_MAGIC, SHM_DIR, process_alive
from .wake import WAKE_DIR_PREFIX, remove_wake_dir, wake_dir_owner

__all__ = ["remove_dead_init_files", "evict_existing", "wake_dir_named_in", "remove_orphan_wake_dirs"]


def wake_dir_named_in(source) -> str | None:
    """The wake-up directory name in a segment's global header (``source``: its bytes or path), or None. Used only
    through :func:`.wake.remove_wake_dir`, which touches nothing but this uid's own wake-up directories."""
    if isinstance(source, str):
        try:
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            source = os.pread(fd, GLOBAL_HEADER_BYTES, 0)
        finally:
            os.close(fd)
    if len(source) < GLOBAL.wake_name.offset + GLOBAL.wake_name.size:
        return None
    magic, version = struct.unpack_from("<QI", source)
    if magic != GLOBAL_MAGIC or version < 2:
        return None
    return GLOBAL.wake_name.one(source).rstrip(b"\0").decode("ascii", "replace") or None


def remove_dead_init_files(name: str) -> None:
    """Remove the ``<name>.init-<pid>-<start>-<rand>`` files of dead producers (pid and start time) and the wake-up
    directories their headers name. Errors are ignored (another producer may be doing the same)."""
    prefix = name + ".init-"
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return
    for entry in entries:
        if entry.startswith(prefix):
            parts = entry[len(prefix):].split("-")
            if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
                continue  # not a file of ours
            if not process_alive(int(parts[0]), int(parts[1])):
                path = os.path.join(SHM_DIR, entry)
                old_wake = wake_dir_named_in(path)
                try:
                    os.unlink(path)
                except OSError:
                    continue
                if old_wake:
                    remove_wake_dir(old_wake)


def evict_existing(path: str, owner_pid: int, owner_start_time: int, own_wake_dir: str | None) -> int:
    """Unlink the existing segment ``path`` and the wake-up directory its header names (unless ``own_wake_dir``);
    returns its owner's pid (dead, or this process), 0 when nothing was unlinked or none is named. Raises
    RingNameConflict if a live process other than (owner_pid, owner_start_time) owns it or it is not a regular
    file of this uid."""
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return 0
    if lst.st_uid != os.getuid():
        raise RingNameConflict(f"{path} belongs to uid {lst.st_uid}")
    if not stat.S_ISREG(lst.st_mode):
        raise RingNameConflict(f"{path} is not a regular file")
    try:
        efd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    old_owner = 0
    try:
        st = os.fstat(efd)
        head = os.pread(efd, GLOBAL_HEADER_BYTES, 0)
        if len(head) >= GLOBAL.identity.size:
            magic, _ver, _hb, pid, start, _inst = GLOBAL.identity.read(head)
            is_us = pid == owner_pid and start == owner_start_time
            if magic == GLOBAL_MAGIC and not is_us and process_alive(pid, start):
                raise RingNameConflict(f"{path} is owned by live process {pid}")
            old_owner = pid if magic == GLOBAL_MAGIC else 0
        old_wake = wake_dir_named_in(head)
        try:
            cur = os.stat(path)
        except FileNotFoundError:
            return 0
        if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
            return 0
        os.unlink(path)
        if old_wake and old_wake != own_wake_dir:
            remove_wake_dir(old_wake)
        return old_owner
    finally:
        os.close(efd)


def remove_orphan_wake_dirs() -> list[str]:
    """Remove this uid's wake-up directories whose creator is dead and that no segment names any more; returns
    their names. A dead producer's segment still there keeps its directory (its consumer may be attached)."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    uid = os.getuid()
    named = set()
    for entry in entries:
        if entry.startswith(f"hybrid_vla.{uid}."):
            wake = wake_dir_named_in(os.path.join(SHM_DIR, entry))
            if wake:
                named.add(wake)
    removed = []
    for entry in entries:
        if entry.startswith(f"{WAKE_DIR_PREFIX}{uid}.") and entry not in named:
            owner = wake_dir_owner(entry)
            if owner is not None and not process_alive(*owner):
                remove_wake_dir(entry)
                removed.append(entry)
    return removed
