"""What the producer declares in the global header and the consumer checks at attach (model id, hidden-state
dtype, device kind, state shape, ROS domain, side tensors), and which dtype conversions the consumer may apply.

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

Side tensors (:class:`TensorSpec`) are judged at attach like the state shape; no conversion applies to them.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch

from ..util.ids import model_id_text
from .errors import RingContractError

__all__ = ["DTYPE_CODES", "CODE_DTYPES", "DEVICE_KINDS", "Contract", "conversion_kind", "check_contract",
           "itemsize", "dtype_name", "device_kind_of", "TensorSpec", "SIDE_DTYPES", "MAX_SIDE_NAME", "MAX_SIDE_NDIM",
           "side_differences", "side_specs"]

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

#: Dtypes a side tensor may have: the floating dtypes, and the integer / boolean ones of position ids and masks.
SIDE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
#: Longest side-tensor name (ASCII characters; the header keeps it in 32 bytes, NUL-padded).
MAX_SIDE_NAME = 31
#: Most dims of a side tensor (the header keeps four).
MAX_SIDE_NDIM = 4
_SIDE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)

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
    """'none' (same dtype: zero-copy), 'exact' or 'rounds' (the module table). Raises RingContractError, naming
    both dtypes and what to change, for a refused pair."""
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
class TensorSpec:
    """One side tensor that crosses the ring with every frame, as the producer declares it and a consumer expects.

    ``name``: an ASCII identifier of at most 31 characters, unique per ring (the key of ``WriteSlot.side`` /
    ``ReadSlot.side``). ``shape``: dims in elements (at most 4; ``()``: a scalar), e.g. ``(3, 1, T)`` multimodal
    rotary position ids. ``dtype``: one of :data:`SIDE_DTYPES`. Raises ValueError (naming the spec) for a bad
    name, an unsupported dtype, more than 4 dims, or a negative, non-integer (bool included) or >= 2**62 dim.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        name = self.name
        if not isinstance(name, str) or not _SIDE_NAME_RE.fullmatch(name) or len(name) > MAX_SIDE_NAME:
            raise ValueError(f"invalid side tensor name {name!r}: an ASCII identifier ([A-Za-z_][A-Za-z0-9_]*) of "
                             f"1 to {MAX_SIDE_NAME} characters")
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in SIDE_DTYPES:
            raise ValueError(f"side tensor {name}: unsupported dtype {self.dtype!r}; supported: "
                             f"{', '.join(dtype_name(d) for d in SIDE_DTYPES)}")
        try:
            if isinstance(self.shape, (str, bytes)) or any(isinstance(d, bool) for d in self.shape):
                raise TypeError
            dims = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise ValueError(f"side tensor {name}: shape {self.shape!r} is not a sequence of ints") from None
        if len(dims) > MAX_SIDE_NDIM:
            raise ValueError(f"side tensor {name}: shape {dims} has more than {MAX_SIDE_NDIM} dims")
        if any(d < 0 for d in dims):
            raise ValueError(f"side tensor {name}: negative dimension in shape {dims}")
        if any(d >= 1 << 62 for d in dims):
            raise ValueError(f"side tensor {name}: dimension too large in shape {dims}")
        object.__setattr__(self, "shape", dims)

    @property
    def numel(self) -> int:
        """Number of elements (the product of ``shape``; 1 for a scalar)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (bool: 1 byte per element)."""
        return self.numel * itemsize(self.dtype)

    def describe(self) -> str:
        """'position_ids int64 (3, 1, 902)': name, dtype and shape."""
        return f"{self.name} {dtype_name(self.dtype)} {self.shape}"


def side_specs(side, what: str = "side") -> tuple[TensorSpec, ...]:
    """``side`` (an iterable of :class:`TensorSpec`) as a tuple; ValueError (naming ``what``) for an item that is
    not a TensorSpec or a name twice."""
    try:
        side = tuple(side)
    except TypeError:
        raise ValueError(f"{what} must be a tuple of TensorSpec, got {side!r}") from None
    for spec in side:
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"{what} must be a tuple of TensorSpec, got an item {spec!r}")
    names = [spec.name for spec in side]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what}: side tensor names must be unique, {', '.join(dup)} given twice")
    return side


def side_differences(theirs, ours) -> list[str]:
    """Every difference between the producer's side tensors ``theirs`` and the ones a consumer expects, ``ours``
    (matched by name), one sentence each: another shape or dtype, needed but not sent, then sent but not taken (in
    the producer's order); empty when equal. Raises ValueError as :func:`side_specs`."""
    theirs, ours = side_specs(theirs, "the prefix's side"), side_specs(ours, "expected_side")
    by_name = {spec.name: spec for spec in theirs}
    wanted = {spec.name for spec in ours}
    out = []
    for want in ours:
        got = by_name.get(want.name)
        if got is None:
            out.append(f"the prefix sends no side tensor {want.name}, which this suffix needs "
                       f"({dtype_name(want.dtype)} {want.shape})")
        elif got != want:
            if got.dtype == want.dtype:
                expects = str(want.shape)
            elif got.shape == want.shape:
                expects = dtype_name(want.dtype)
            else:
                expects = f"{dtype_name(want.dtype)} {want.shape}"
            out.append(f"the prefix sends side tensor {got.describe()}, this suffix expects {expects}")
    for got in theirs:
        if got.name not in wanted:
            out.append(f"the prefix sends side tensor {got.describe()}, which this suffix does not take")
    return out


@dataclass(frozen=True)
class Contract:
    """The producer's declaration in the global header (None: undeclared).

    ``model_id``: int64. ``dtype``: of every frame (None: each slot header says). ``device_kind``: 'cpu', 'cuda',
    'other' or 'undeclared'. ``state_shape``: of every frame. ``layout_version``: u32. ``domain_id``: the
    producer's ROS domain. ``side``: the :class:`TensorSpec` every frame carries, in the producer's order.
    """

    model_id: int
    dtype: torch.dtype | None
    device_kind: str
    state_shape: tuple[int, ...] | None
    layout_version: int
    domain_id: int | None = None
    side: tuple[TensorSpec, ...] = ()
    #: Rows a decode step carries (0: the producer does not decode) and rotary position rows with each step.
    decode_rows: int = 0
    decode_positions: int = 0

    @classmethod
    def from_wire(cls, model_id: int, dtype_code: int, device_code: int, ndim: int, dims, version: int,
                  domain_id: int = -1, side: tuple[TensorSpec, ...] = (), decode: tuple[int, int] = (0, 0)):
        """From the header fields (``domain_id`` -1: undeclared; ``side`` already parsed; ``decode``: rows,
        position rows); RingContractError for an unknown dtype code."""
        if dtype_code and dtype_code not in CODE_DTYPES:
            raise RingContractError(f"the producer declared an unknown dtype code {dtype_code}")
        shape = tuple(int(d) for d in dims[:ndim]) if 0 <= ndim <= len(dims) else None
        return cls(int(model_id), CODE_DTYPES.get(dtype_code), _KIND_NAMES.get(device_code, f"code {device_code}"),
                   shape, int(version), None if domain_id < 0 else int(domain_id), tuple(side), int(decode[0]),
                   int(decode[1]))

    def describe(self) -> str:
        """One line for logs: 'model 1f2e3d4c5b6a7988, float16 hidden states (105, 128) from cuda in ROS domain
        0, layout 4', then any side tensors: ', side position_ids int64 (3, 1, 902), ...'."""
        shape = "any shape" if self.state_shape is None else str(self.state_shape)
        domain = "" if self.domain_id is None else f" in ROS domain {self.domain_id}"
        side = f", side {', '.join(spec.describe() for spec in self.side)}" if self.side else ""
        decode = (f", decode steps of up to {self.decode_rows} rows" + (" with rotary positions"
                                                                       if self.decode_positions else "")
                  if self.decode_rows else "")
        return (f"model {model_id_text(self.model_id)}, {dtype_name(self.dtype)} hidden states {shape} from "
                f"{self.device_kind}{domain}, layout {self.layout_version}{side}{decode}")



def check_contract(contract: Contract, *, expected_model_id: int | None = None,
                   compute_dtype: torch.dtype | None = None, expected_shape=None,
                   expected_domain_id: int | None = None, expected_side=None,
                   expected_decode: tuple[int, int] | None = None) -> str:
    """Judge a producer's contract against a consumer's expectations (None: none; ``expected_side`` ``()``: no
    side tensors). Returns the conversion kind ('none', 'exact', 'rounds', or 'per frame' without a declared dtype).
    Raises RingContractError with every problem in one message: another ROS domain (or none when one is expected),
    model id or state shape, a dtype pair :func:`conversion_kind` refuses, each :func:`side_differences`, a decode
    channel other than ``expected_decode`` (rows, position rows).
    ValueError for a malformed ``expected_side``.
    """
    problems, kind = [], "per frame"
    if expected_domain_id is not None and contract.domain_id != expected_domain_id:
        theirs = "no ROS domain" if contract.domain_id is None else f"ROS domain {contract.domain_id}"
        problems.append(f"the prefix runs in {theirs}, this suffix in ROS domain {expected_domain_id} (its "
                        "cameras are not this pipeline's: start both nodes with the same ROS_DOMAIN_ID)")
    if expected_model_id is not None and contract.model_id != expected_model_id:
        problems.append(f"the prefix runs model {model_id_text(contract.model_id)}, this suffix model "
                        f"{model_id_text(expected_model_id)} (another checkpoint: use the same model_path on both)")
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
    if expected_side is not None:
        problems.extend(side_differences(contract.side, expected_side))
    if expected_decode is not None and (contract.decode_rows, contract.decode_positions) != tuple(expected_decode):
        theirs = (f"decodes with steps of {contract.decode_rows} rows and {contract.decode_positions} position rows"
                  if contract.decode_rows else "does not decode")
        problems.append(f"the prefix {theirs}, this suffix expects {expected_decode[0]} rows and "
                        f"{expected_decode[1]} position rows (0: no decode; the same checkpoint and decode "
                        "settings on both)")
    if problems:
        raise RingContractError("ring contract does not fit: " + "; ".join(problems)
                                + f" [producer: {contract.describe()}]")
    return kind
