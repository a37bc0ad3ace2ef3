"""What the producer promises and the consumer checks at attach: model id, dtype of the hidden states, device
kind and state shape (kept in the ring's global header, :mod:`.segment`), and which dtype conversions the
consumer may apply at the view.

Conversions from the producer's dtype to the consumer's compute dtype (``torch.Tensor.to``, round to nearest
even; IEEE 754-2008 binary16 / binary32 and Google's bfloat16, i.e. binary32's upper 16 bits; "exact" is for
numbers: a NaN stays a NaN, its payload may not, and the prefix never publishes one):

============== ============== ======== ==========================================================================
producer       consumer       kind     why
============== ============== ======== ==========================================================================
any X          X              none     the zero-copy view itself
float16        float32        exact    every binary16 number (subnormals, inf included) is a binary32 number
bfloat16       float32        exact    a bfloat16 number is a binary32 number with the low 16 significand bits 0
float32        bfloat16       rounds   24 -> 8 significant bits (relative error <= 2**-9); same exponent range
float16        bfloat16       refused  rounds twice (fp16 prefix, then 11 -> 8 bits): 1.2 cm at 3 s on the embedded
                                       bag at K = L, over the 1 cm budget; float16 -> float32 is exact instead
float32/bf16   float16        refused  binary16 holds at most 65504: larger hidden states would become inf
anything else  -              refused  (integer or float64 hidden states are not what a suffix computes on)
============== ============== ======== ==========================================================================

The trajectory drift of each allowed pair is measured in docs/design.md ("The dtype contract") and bounded
(<= 1 cm at 3 s) by test/test_ring_contract.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import RingContractError

__all__ = ["DTYPE_CODES", "CODE_DTYPES", "DEVICE_KINDS", "Contract", "conversion_kind", "check_contract",
           "itemsize", "dtype_name", "device_kind_of"]

#: Wire code of each dtype the ring carries (0: not declared).
DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.uint8: 5, torch.int8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in DTYPE_CODES}
#: Wire code of the producer's device kind (where the hidden states were computed).
DEVICE_KINDS = {"undeclared": 0, "cpu": 1, "cuda": 2, "other": 3}
_KIND_NAMES = {code: name for name, code in DEVICE_KINDS.items()}

_EXACT, _ROUNDS = "exact", "rounds"
#: (producer dtype, consumer compute dtype) -> conversion kind, for the pairs that differ and are allowed.
CONVERSIONS = {
    (torch.float16, torch.float32): _EXACT,
    (torch.bfloat16, torch.float32): _EXACT,
    (torch.float32, torch.bfloat16): _ROUNDS,
}


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype | None) -> str:
    """'float32', 'bfloat16', ... ('undeclared' for None)."""
    return "undeclared" if dtype is None else str(dtype).removeprefix("torch.")


def device_kind_of(device) -> str:
    """'cpu', 'cuda' or 'other' for a torch.device / device string."""
    kind = torch.device(device).type
    return kind if kind in ("cpu", "cuda") else "other"


def conversion_kind(src: torch.dtype, dst: torch.dtype) -> str:
    """'none' (same dtype: zero-copy), 'exact' or 'rounds' (see the module table).

    Raises RingContractError, naming both dtypes and what to change, for a pair that is refused."""
    if src == dst:
        return "none"
    kind = CONVERSIONS.get((src, dst))
    if kind is not None:
        return kind
    if dst == torch.float16 and src in (torch.float32, torch.bfloat16):
        why = (f"float16 holds at most 65504 and 11 significant bits, so {dtype_name(src)} hidden states "
               "could become inf")
    elif (src, dst) == (torch.float16, torch.bfloat16):
        why = "float16 hidden states would be rounded a second time (11 -> 8 significant bits)"
    else:
        why = "no conversion is defined for this pair"
    ok = sorted(dtype_name(d) for s, d in CONVERSIONS if s == src) + [dtype_name(src)]
    raise RingContractError(
        f"the prefix sends {dtype_name(src)} hidden states and this suffix computes in {dtype_name(dst)}: not "
        f"supported ({why}); set the suffix dtype to one of {', '.join(sorted(set(ok)))}")


@dataclass(frozen=True)
class Contract:
    """The producer's declaration in the global header.

    ``model_id``: int64 model identity. ``dtype``: torch dtype of every frame, or None when undeclared (each
    frame's slot header then says). ``device_kind``: 'cpu', 'cuda', 'other' or 'undeclared'. ``state_shape``:
    the shape of every frame, or None when undeclared. ``layout_version``: the segment layout (u32).
    """

    model_id: int
    dtype: torch.dtype | None
    device_kind: str
    state_shape: tuple[int, ...] | None
    layout_version: int

    @classmethod
    def from_wire(cls, model_id: int, dtype_code: int, device_code: int, ndim: int, dims, version: int):
        """From the header fields; unknown codes raise RingContractError."""
        if dtype_code and dtype_code not in CODE_DTYPES:
            raise RingContractError(f"the producer declared an unknown dtype code {dtype_code}")
        shape = tuple(int(d) for d in dims[:ndim]) if 0 <= ndim <= len(dims) else None
        return cls(int(model_id), CODE_DTYPES.get(dtype_code), _KIND_NAMES.get(device_code, f"code {device_code}"),
                   shape, int(version))

    def describe(self) -> str:
        """One line for logs: 'model 123, float16 hidden states (105, 128) from cuda, layout 2'."""
        shape = "any shape" if self.state_shape is None else str(self.state_shape)
        return (f"model {self.model_id}, {dtype_name(self.dtype)} hidden states {shape} from {self.device_kind}, "
                f"layout {self.layout_version}")


def check_contract(contract: Contract, *, expected_model_id: int | None = None,
                   compute_dtype: torch.dtype | None = None, expected_shape=None) -> str:
    """Judge a producer's contract against a consumer's expectations (None: no expectation).

    Returns the conversion kind the consumer will apply at the view ('none', 'exact', 'rounds', or 'per
    frame' when the producer declared no dtype). Raises RingContractError with every problem in one message:
    another model id, a state shape other than ``expected_shape``, a dtype pair :func:`conversion_kind`
    refuses.
    """
    problems, kind = [], "per frame"
    if expected_model_id is not None and contract.model_id != expected_model_id:
        problems.append(f"the prefix runs model {contract.model_id}, this suffix model {expected_model_id} "
                        "(another checkpoint: use the same model_path on both)")
    if expected_shape is not None and contract.state_shape is not None \
            and tuple(contract.state_shape) != tuple(expected_shape):
        problems.append(f"the prefix sends hidden states of shape {contract.state_shape}, this suffix takes "
                        f"{tuple(expected_shape)}")
    if compute_dtype is not None and contract.dtype is not None:
        try:
            kind = conversion_kind(contract.dtype, compute_dtype)
        except RingContractError as e:
            problems.append(str(e))
    elif contract.dtype is not None:
        kind = "none"
    if problems:
        raise RingContractError("ring contract does not fit: " + "; ".join(problems)
                                + f" [producer: {contract.describe()}]")
    return kind
