"""How a model id is written for people: one spelling for logs, /diagnostics, reports and ``init-model``."""
from __future__ import annotations

__all__ = ["model_id_text"]


def model_id_text(ident: int) -> str:
    """A model id (a signed int64: the hash of a checkpoint's config and tensor layout, ``model.checkpoint.model_id``)
    as 16 lowercase hex digits of its two's-complement bits, e.g. ``-1`` -> ``ffffffffffffffff``."""
    return f"{int(ident) & (2**64 - 1):016x}"
