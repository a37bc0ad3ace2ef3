"""The ring ends' counters as frozen snapshots (``RingProducer.stats``, ``RingConsumer.stats``), compared field
by field (``after.read - before.read``); ``as_dict`` / ``from_dict`` are their JSON form (flat keys)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from .errors import REJECT_CAUSES


@dataclass(frozen=True)
class ProducerStats:
    """Counters of one :class:`~.producer.RingProducer` since it was created (frames).

    ``published``: frames made READY; ``dropped_oldest``: READY frames overwritten before the consumer took them;
    ``aborted``: slots given back unpublished; ``wake_errors``: wake-ups that failed unexpectedly (the frames were
    still published).
    """

    published: int = 0
    dropped_oldest: int = 0
    aborted: int = 0
    wake_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters by field name (JSON)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, int]) -> "ProducerStats":
        """The snapshot :meth:`as_dict` wrote; unknown keys are ignored, missing ones are 0."""
        return cls(**{f.name: int(values[f.name]) for f in dataclasses.fields(cls) if f.name in values})


@dataclass(frozen=True)
class ConsumerStats:
    """Counters of one :class:`~.consumer.RingConsumer` since it attached.

    ``read``: frames handed out; ``rejected``: slots refused, by every cause of :data:`~.errors.REJECT_CAUSES`;
    ``reclaimed_reading``: READING slots of a dead predecessor freed at attach; ``superseded``: READY frames freed
    unread for a newer one. :attr:`FOUND`: how ``read()`` found its frames (first look, polling the publish count,
    after a wait on the wake-up socket); ``spin_misses``: spins that reached their bound; ``spin_ms``: time spent
    spinning (ms of the consumer's core); ``spin_pauses``: see :class:`~.wake.SpinPolicy`.
    """

    read: int = 0
    rejected: Mapping[str, int] = field(default_factory=lambda: {cause: 0 for cause in REJECT_CAUSES})
    reclaimed_reading: int = 0
    superseded: int = 0
    found_ready: int = 0
    found_spinning: int = 0
    found_after_block: int = 0
    spin_misses: int = 0
    spin_ms: float = 0.0
    spin_pauses: int = 0

    #: How read() found a frame: the three counters, in the order a read tries them.
    FOUND = ("found_ready", "found_spinning", "found_after_block")

    def found_by(self, earlier: "ConsumerStats") -> str:
        """Which of :attr:`FOUND` grew since ``earlier`` (how the one frame read in between was found); ValueError
        when none did."""
        for name in self.FOUND:
            if getattr(self, name) != getattr(earlier, name):
                return name
        raise ValueError("no frame was read between the two snapshots")

    def as_dict(self) -> dict[str, float]:
        """Flat counters (JSON): each field by name, ``rejected`` as ``rejected_<cause>``."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rejected":
                out.update({f"rejected_{cause}": n for cause, n in value.items()})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, float]) -> "ConsumerStats":
        """The snapshot :meth:`as_dict` wrote; unknown keys are ignored, missing ones are 0."""
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "rejected":
                kwargs["rejected"] = {cause: int(values.get(f"rejected_{cause}", 0)) for cause in REJECT_CAUSES}
            elif f.name in values:
                kwargs[f.name] = float(values[f.name]) if f.name == "spin_ms" else int(values[f.name])
        return cls(**kwargs)
