"""Shared-memory ring that hands hidden states from the prefix process to the suffix process: the public API.

One :class:`RingProducer` (creates and finally unlinks the segment) and one :class:`RingConsumer` (attaches, never
unlinks) share one POSIX shared-memory segment ``/dev/shm/<name>`` (mode 0600): a global header and ``n_slots``
slots. The producer writes each frame straight into a slot; the consumer gets a zero-copy ``torch`` view of it.
Side tensors (:class:`TensorSpec`) cross with every frame after the hidden states. Linux only.

Slot states change only under the segment mutex. The producer takes a FREE slot, else overwrites the oldest READY
one (``dropped_oldest``), never a READING one. The consumer takes the oldest READY slot (``delivery="fifo"``) or
the newest, freeing the older ones as ``superseded`` (``"newest"``); a frame published before read() is never
missed.

Lifecycle: a SIGKILLed producer leaves its segment behind; the next producer finds the owner (pid + start time)
dead and replaces it, and a consumer still attached to the old one sees ``producer_gone`` and re-attaches. A slot
left READING by a dead consumer is reset to FREE by the next consumer at attach.

Parts: :mod:`.segment` (names, global header, owner identity, mutex), :mod:`.contract` (what the producer
declares, allowed dtype conversions), :mod:`.slots` (slot header, states, publish protocol), :mod:`.wake`
(wake-up socket, spin), :mod:`.ring_end`, :mod:`.producer`, :mod:`.consumer` (the ends), :mod:`.leftovers` (what a
dead producer left), :mod:`.pinned` (page-locking the segment for CUDA copies).
"""
from __future__ import annotations

from .consumer import DELIVERY_POLICIES, ReadSlot, RingConsumer
from .contract import Contract, TensorSpec, conversion_kind, side_differences
from .errors import REJECT_CAUSES, RingConsumerConflict, RingContractError, RingError, RingNameConflict, SlotRejected
from .producer import ConsumerPresence, RingProducer, WriteSlot, slot_bytes_for
from .segment import ros_domain_id, segment_name, segment_path
from .slots import NO_TIMINGS, FrameMeta, SlotTimings
from .stats import ConsumerStats, ProducerStats
from .wake import SpinPolicy

__all__ = [
    "RingError", "RingNameConflict", "RingConsumerConflict", "RingContractError", "SlotRejected", "FrameMeta",
    "SlotTimings", "NO_TIMINGS", "ProducerStats", "ConsumerStats",
    "WriteSlot", "ReadSlot", "RingProducer", "RingConsumer", "ConsumerPresence", "segment_name", "ros_domain_id",
    "slot_bytes_for", "segment_path", "REJECT_CAUSES", "DELIVERY_POLICIES", "SpinPolicy", "Contract",
    "conversion_kind", "TensorSpec", "side_differences",
]
