"""The ring's exceptions: bad use or an unusable segment (RingError), a name owned by a live producer, a
producer/consumer pair whose contract does not fit, and one rejected slot."""
from __future__ import annotations

__all__ = ["RingError", "RingNameConflict", "RingConsumerConflict", "RingContractError", "SlotRejected",
           "REJECT_CAUSES"]

#: Causes of :class:`SlotRejected`, each counted as ``rejected_<cause>`` by the consumer.
#: ``bad_*``: the header is not a valid slot header of this layout (``bad_dtype`` also: a dtype other than the
#: one the producer declared in the global header); ``*_mismatch``: a valid header the consumer does not take
#: (``dtype_mismatch``: an undeclared-dtype producer sent a dtype the consumer cannot convert).
REJECT_CAUSES = ("bad_magic", "bad_version", "bad_shape", "bad_dtype", "split_mismatch", "model_mismatch",
                 "dtype_mismatch")


class RingError(RuntimeError):
    """Base class of the ring's errors (bad use, incompatible or inconsistent segment)."""


class RingNameConflict(RingError):
    """A live producer (another process, same pid and start time) already owns the segment name."""


class RingConsumerConflict(RingError):
    """Another consumer holds the ring (its single-consumer lock): a second suffix for one prefix.

    ``holder_pid``: the pid the holder wrote into the header at attach (0 when it had not yet, or is gone).
    """

    def __init__(self, name: str, holder_pid: int):
        who = f"process {holder_pid}" if holder_pid > 0 else "another process"
        super().__init__(f"another consumer ({who}) is attached to {name}: one prefix feeds one suffix")
        self.holder_pid = holder_pid


class RingContractError(RingError):
    """The producer's declared contract (model id, dtype, device kind, state shape, layout version in the
    global header) does not fit what this consumer computes with; raised at attach, before any frame is
    taken, with a message that names both sides (see :mod:`hybrid_vla_ros.transport.contract`)."""


class SlotRejected(RingError):
    """A READY slot's header failed validation; the slot was released and the cause counted.

    ``cause`` is one of :data:`REJECT_CAUSES`; ``meta`` is the parsed FrameMeta for the ``*_mismatch`` causes
    and ``None`` when the header could not be parsed.
    """

    def __init__(self, cause: str, meta=None, detail: str = ""):
        super().__init__(f"slot rejected: {cause}" + (f" ({detail})" if detail else ""))
        self.cause = cause
        self.meta = meta
