"""The ring's exceptions (all :class:`RingError`) and the causes of a rejected slot."""
from __future__ import annotations

__all__ = ["RingError", "RingNameConflict", "RingConsumerConflict", "RingContractError", "SlotRejected",
           "REJECT_CAUSES"]

#: Causes of :class:`SlotRejected`, counted as ``rejected_<cause>``. ``bad_*``: not a valid slot header of this
#: layout (``bad_dtype`` also: not the declared dtype); ``*_mismatch``: a valid header the consumer does not take
#: (``dtype_mismatch``: an undeclared-dtype producer sent a dtype the consumer cannot convert).
REJECT_CAUSES = ("bad_magic", "bad_version", "bad_shape", "bad_dtype", "split_mismatch", "model_mismatch",
                 "dtype_mismatch")


class RingError(RuntimeError):
    """Base class of the ring's errors (bad use, incompatible or inconsistent segment)."""


class RingNameConflict(RingError):
    """A live producer (another process, same pid and start time) already owns the segment name."""


class RingConsumerConflict(RingError):
    """Another consumer holds the ring's single-consumer lock: a second suffix for one prefix.

    ``holder_pid``: the pid the holder wrote into the header at attach (0: not yet, or gone).
    """

    def __init__(self, name: str, holder_pid: int):
        who = f"process {holder_pid}" if holder_pid > 0 else "another process"
        super().__init__(f"another consumer ({who}) is attached to {name}: one prefix feeds one suffix")
        self.holder_pid = holder_pid


class RingContractError(RingError):
    """The producer's contract (:mod:`.contract`) does not fit this consumer; raised at attach, before any frame
    is taken, naming both sides."""


class SlotRejected(RingError):
    """A READY slot's header failed validation; the slot was released and the cause counted.

    ``cause``: one of :data:`REJECT_CAUSES`; ``meta``: the parsed FrameMeta (``*_mismatch``), else None.
    """

    def __init__(self, cause: str, meta=None, detail: str = ""):
        super().__init__(f"slot rejected: {cause}" + (f" ({detail})" if detail else ""))
        self.cause = cause
        self.meta = meta
