"""Shared-memory ring that hands hidden states from the prefix process to the suffix process: the public API.

Exactly one :class:`RingProducer` (which creates and finally unlinks the segment) and one :class:`RingConsumer`
(which attaches and never unlinks) use one POSIX shared-memory segment ``/dev/shm/<name>`` (mode 0600) of a
global header and ``n_slots`` slots. The producer writes each frame straight into a slot (it can compute its
last result there, or copy device-to-host into it); the consumer gets a zero-copy ``torch`` view of the slot.
Linux only. Where each part lives:

* :mod:`.segment`: names and paths, the global header layout, owner identity, mapping, the mutex;
* :mod:`.contract`: what the producer declares (model id, dtype, device kind, state shape, side tensors:
  :class:`TensorSpec`) and which dtype conversions the consumer may apply at the view
  (:class:`RingContractError` at attach otherwise);
* :mod:`.slots`: the slot header, its states FREE -> WRITING -> READY -> READING -> FREE, and the publish
  protocol (READY is the last store) with its memory-ordering argument;
* :mod:`.wake`: the wake-up socket in a 0700 directory, and the bounded spin before it;
* :mod:`.ring_end`: what both ends share (the global header's fields, the mapping and mutex, close);
  :mod:`.producer` / :mod:`.consumer`: the two ends (:mod:`.leftovers`: what a dead producer left);
  :mod:`.pinned`: page-locking the segment for a CUDA device-to-host copy.

Side tensors: a producer created with ``side=(TensorSpec(...), ...)`` carries them with every frame after the
hidden states (``WriteSlot.side`` to fill, ``ReadSlot.side`` to read: name -> zero-copy view); a consumer
created with ``expected_side`` refuses a producer whose side tensors differ.

Slot states change only under the segment mutex. The producer takes a FREE slot, else overwrites the oldest
READY one (counted as ``dropped_oldest``), never a READING one. The consumer takes the oldest READY slot
(``delivery="fifo"``) or the newest, freeing the older ones as ``superseded`` (``"newest"``). A publish sends
one byte to the consumer's socket; the consumer looks for READY slots before it sleeps on it, so a frame
published before read() is never missed, and drains stale wake-ups.

Lifecycle: a SIGKILLed producer leaves its segment behind; the next producer finds the owner (pid + start time)
dead and replaces it, and a consumer still attached to the old one then sees ``producer_gone`` and re-attaches.
A consumer that dies while holding a slot leaves it READING; the next consumer resets it to FREE at attach.
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
