"""``builtin_interfaces/msg/Time`` (``int32 sec``, ``uint32 nanosec``) to and from integer ns, for any object with
``sec`` and ``nanosec`` (no ROS import). Integers only: a float of ns since the epoch loses precision (2**53 ns is
104 days).
"""
from __future__ import annotations

import operator

NS_PER_S = 1_000_000_000
_INT32_MAX = 2**31 - 1


def stamp_to_ns(time_msg, what: str = "stamp", *, allow_negative: bool = True) -> int:
    """``sec * 1e9 + nanosec`` of a Time / Duration, exactly. Raises ValueError naming ``what`` for ``nanosec``
    outside [0, 1e9), or a negative result unless ``allow_negative``."""
    sec, nanosec = int(time_msg.sec), int(time_msg.nanosec)
    if not 0 <= nanosec < NS_PER_S:
        raise ValueError(f"{what} nanosec {nanosec} outside [0, 1e9)")
    ns = sec * NS_PER_S + nanosec
    if ns < 0 and not allow_negative:
        raise ValueError(f"{what} is negative: {sec} s {nanosec} ns")
    return ns


def header_stamp_ns(msg, what: str = "stamp") -> int:
    """``msg.header.stamp`` in ns, which must be >= 0 (see :func:`stamp_to_ns`). Raises ValueError."""
    return stamp_to_ns(msg.header.stamp, what, allow_negative=False)


def split_ns(ns: int, what: str = "stamp") -> tuple[int, int]:
    """``(sec, nanosec)`` of ``ns`` >= 0. Raises ValueError for a negative value or seconds beyond int32 (year
    2038), TypeError for a non-integer (floats lose nanoseconds)."""
    ns = operator.index(ns)
    if ns < 0:
        raise ValueError(f"{what} must be >= 0 ns, got {ns}")
    sec, nanosec = divmod(ns, NS_PER_S)
    if sec > _INT32_MAX:
        raise ValueError(f"{what} {ns} ns overflows int32 seconds")
    return sec, nanosec


def set_header_stamp(msg, ns: int) -> None:
    """Write ``ns`` (>= 0) into ``msg.header.stamp`` (sec, nanosec). Raises as :func:`split_ns`."""
    msg.header.stamp.sec, msg.header.stamp.nanosec = split_ns(ns)
