"""Tensor sources: where a stage's weights come from, one named tensor at a time, never by unpickling.

Stages name tensors by *canonical* names, the keys of :class:`hybrid_vla_ros.model.modeling.VLAModel`
(``embed_tokens.weight``, ``layers.{i}.*``, ``norm.weight``, ``vision.*``, ``projector.*``, ``head.*``; LLaVA:
``vision_tower.*``, ``multi_modal_projector.*``). A :class:`TensorSource` maps a canonical name to its file,
stored name, shape and dtype, and reads it onto a device: :class:`SafetensorsSource` (files renamed by a
:class:`KeyMap`), :class:`UnionSource` (several side by side, e.g. a composed checkpoint).

Layout: the safetensors format (https://huggingface.co/docs/safetensors, "Format"): 8 bytes little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``, then
the raw bytes. Headers are parsed here; only the tensors a stage owns are read. Converted checkpoints (e.g.
``.pth`` with merged LoRA adapters) are written as safetensors and read through a :class:`KeyMap`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

#: Largest safetensors JSON header accepted, bytes (a 70B checkpoint's shard headers are well under 1 MB).
MAX_HEADER_BYTES = 100 * 2**20
#: transformers' name of the shard index of a sharded checkpoint (``PreTrainedModel.save_pretrained``).
SHARD_INDEX = "model.safetensors.index.json"
#: transformers' name of an unsharded checkpoint's weights.
SINGLE_FILE = "model.safetensors"

#: safetensors dtype strings (safetensors "Format" spec) of floating-point tensors this package loads.
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
#: safetensors dtype strings of integer / boolean tensors (buffers such as position ids).
INT_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and, where it applies, the tensor."""


class MissingFileError(CheckpointError, FileNotFoundError):
    """A file the checkpoint refers to is missing; both a ValueError and a FileNotFoundError."""


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (module docstring); reads 8 + N bytes, no tensor data.

    Raises MissingFileError when the file is absent, CheckpointError when it is not a safetensors file.
    """
    return read_header_and_start(path)[0]


def read_header_and_start(path: Path) -> tuple[dict, int]:
    """(:func:`read_header`, the byte offset where tensor data starts: 8 + N)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise MissingFileError(f"{path}: file not found") from None
    with f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: implausible safetensors header size {n}")
        text = f.read(n)
    if len(text) != n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(text)} of {n} bytes)")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


@dataclass(frozen=True)
class TensorInfo:
    """Where a canonical tensor is stored; ``dtype`` is the safetensors string (``BF16``), ``start`` / ``end``
    absolute byte offsets in ``file`` (``data_offsets`` + 8 + N), -1 when unknown."""

    file: Path
    stored_name: str
    dtype: str
    shape: tuple[int, ...]
    start: int = -1
    end: int = -1

    def where(self) -> str:
        """For error messages."""
        return f"tensor {self.stored_name!r} in {self.file}"


class KeyMap:
    """Stored tensor names -> canonical names, as an ordered table of ``(regex, replacement)`` rules.

    :meth:`canonical` expands the first rule that fully matches; None (tensor unused, e.g. ``lm_head.weight``)
    when none matches or the replacement is None.
    """

    def __init__(self, rules: Iterable[tuple[str, str | None]], name: str = ""):
        #: The rules as given (pattern text, replacement), to build a map from another.
        self.rules_text = [(p, r) for p, r in rules]
        self.rules = [(re.compile(p), r) for p, r in self.rules_text]
        self.name = name

    @classmethod
    def identity(cls) -> "KeyMap":
        return cls([(r"(.*)", r"\1")], "identity")

    def canonical(self, stored: str) -> str | None:
        for pattern, replacement in self.rules:
            m = pattern.fullmatch(stored)
            if m:
                return None if replacement is None else m.expand(replacement)
        return None


class TensorSource:
    """Canonical name -> tensor; subclasses fill ``self._index`` (name -> :class:`TensorInfo`)."""

    label = "checkpoint"

    def __init__(self):
        self._index: dict[str, TensorInfo] = {}

    def names(self) -> set[str]:
        """Canonical names this source holds."""
        return set(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        """Where ``name`` is stored. Raises KeyError."""
        return self._index[name]

    def check_files(self) -> None:
        """Check, from file sizes only, that every tensor's byte range lies in its file and fits dtype and shape.

        Raises MissingFileError (a file gone), CheckpointError naming the first tensor that does not fit."""
        sizes: dict[Path, int] = {}
        for name in sorted(self._index, key=lambda n: (str(self._index[n].file), self._index[n].start)):
            info = self._index[name]
            if info.file not in sizes:
                try:
                    sizes[info.file] = info.file.stat().st_size
                except FileNotFoundError:
                    raise MissingFileError(f"{info.file}: shard not found (it holds {info.where()})") from None
            if info.start < 0:
                continue  # no byte range known (read through safetensors' own reader)
            dtype = FLOAT_DTYPES.get(info.dtype) or INT_DTYPES.get(info.dtype)
            numel = 1
            for d in info.shape:
                numel *= d
            width = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
            if info.end > sizes[info.file]:
                raise CheckpointError(f"{info.where()}: its bytes [{info.start}, {info.end}) run past the end of "
                                      f"the file ({sizes[info.file]} bytes): a truncated or corrupt shard")
            if width is not None and info.end - info.start != numel * width:
                raise CheckpointError(f"{info.where()}: {info.end - info.start} bytes for {info.dtype} "
                                      f"{list(info.shape)}: a corrupt header")

    def read(self, names: Iterable[str], device: str | torch.device = "cpu",
             float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Read ``names`` onto ``device`` as ``{name: tensor}``, floating-point ones in ``float_dtype`` if given.

        Each tensor is one ``readinto`` into process memory, never a memory-map view (a shard re-saved in place
        would SIGBUS a running node); a conversion holds one stored tensor at a time, on the CPU, so the device
        never holds a stored-dtype copy. CUDA uploads are non-blocking on the *current* stream
        (:class:`DeviceUploader`): a caller on a side stream records an event before another stream uses them.

        Raises KeyError for a name the source lacks, MissingFileError for a missing file, CheckpointError when a
        file lacks a tensor its index promised or is shorter than its header says.
        """
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._index[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        device = torch.device(device)
        upload = None if device.type == "cpu" else DeviceUploader(device)
        little = sys.byteorder == "little"  # safetensors stores little-endian
        try:
            for file, wanted in by_file.items():
                if not file.is_file():
                    raise MissingFileError(f"{file}: shard not found (it holds {self._index[wanted[0]].where()})")
                if little and all(self._index[n].start >= 0 for n in wanted):
                    items = self._read_ranges(file, wanted, float_dtype)
                else:
                    items = self._read_with_safe_open(file, wanted, float_dtype)
                for name, t in items:
                    out[name] = t if upload is None else upload(t)
        finally:
            if upload is not None:
                upload.close()
        return out

    def _read_ranges(self, file: Path, wanted: list[str], float_dtype):
        """Yield (name, CPU tensor in its final dtype), one read each."""
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            scratch = None
            for name in wanted:
                info = self._index[name]
                stored = FLOAT_DTYPES.get(info.dtype)
                if float_dtype is None or stored is None or stored == float_dtype:
                    yield name, _read_range(f, size, info)
                    continue
                if scratch is None or scratch.numel() < info.end - info.start:
                    scratch = None  # free the smaller one first
                    scratch = torch.empty(max(self._index[n].end - self._index[n].start for n in wanted),
                                          dtype=torch.uint8)
                yield name, _read_range(f, size, info, scratch).to(float_dtype)
            del scratch

    def _read_with_safe_open(self, file: Path, wanted: list[str], float_dtype):
        """As :meth:`_read_ranges`, through ``safetensors.safe_open``, each a copy."""
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                for name in wanted:
                    if self._index[name].stored_name not in present:
                        raise CheckpointError(f"{file} does not hold tensor {self._index[name].stored_name!r}, "
                                              f"which {self.label} names")
                for name in wanted:
                    t = f.get_tensor(self._index[name].stored_name)
                    if float_dtype is not None and t.is_floating_point():
                        t = t.to(float_dtype)
                    yield name, t.clone()  # not a view of the memory map
                    del t
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (a bare Exception subclass)
            raise CheckpointError(f"{file}: cannot read safetensors data ({type(e).__name__}: {e})") from e

    def fingerprint(self, digest) -> None:
        """Feed what identifies this source (every file's header) into the hashlib ``digest``."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        """The files this source reads, sorted."""
        return sorted({i.file for i in self._index.values()})


class DeviceUploader:
    """Host tensors -> ``device`` (CUDA) through two alternating page-locked staging buffers.

    ``uploader(t)`` returns a new device tensor whose copy is queued non-blocking on the current stream (complete
    once the stream reaches it), so the next file read overlaps this DMA; a buffer is reused only after its last
    copy's event. Without page-locked memory it falls back to synchronous ``t.to(device)``. :meth:`close` waits
    for the last copies and frees the buffers. Device allocation errors (OutOfMemoryError) propagate.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list = [None, None]
        self._turn = 0
        self.pinned = self.device.type == "cuda"

    def _staging(self, nbytes: int) -> torch.Tensor | None:
        i = self._turn
        self._turn ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # the DMA out of this buffer is done
            self._events[i] = None
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            self._buffers[i] = None
            try:
                self._buffers[i] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                self.pinned = False
                return None
        return self._buffers[i], i

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return t.to(self.device)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        got = self._staging(nbytes)
        if got is None:
            return t.to(self.device)
        buf, i = got
        host = buf[:nbytes]
        host.copy_(t.reshape(-1).view(torch.uint8))
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.reshape(-1).view(torch.uint8).copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event
        return out

    def close(self) -> None:
        for e in self._events:
            if e is not None:
                e.synchronize()
        self._events = [None, None]
        self._buffers = [None, None]


def _read_range(f, file_size: int, info: TensorInfo, into: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor's bytes from the open file ``f`` as a CPU tensor, new or a view of the uint8 scratch ``into``."""
    dtype = FLOAT_DTYPES.get(info.dtype) or INT_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointError(f"{info.where()}: stored as {info.dtype}, which this package does not read")
    n = info.end - info.start
    numel = 1
    for s in info.shape:
        numel *= s
    if n != numel * torch.empty((), dtype=dtype).element_size() or info.start < 0 or info.end > file_size:
        raise CheckpointError(f"{info.where()}: data_offsets do not fit its dtype / shape {info.dtype} "
                              f"{list(info.shape)} or the file ({file_size} bytes): a truncated or corrupt file")
    buf = torch.empty(n, dtype=torch.uint8) if into is None else into[:n]
    f.seek(info.start)
    if n and f.readinto(buf.numpy()) != n:
        raise CheckpointError(f"{info.where()}: the file ends inside the tensor's data (truncated)")
    return buf.view(dtype).reshape(info.shape)


class SafetensorsSource(TensorSource):
    """Tensors of one or more safetensors files, renamed by a :class:`KeyMap` (default identity).

    ``index``: optional ``{stored name: file}`` (a shard index's ``weight_map``), checked against the shard
    headers; without one the headers are the index. Raises MissingFileError (a shard missing), CheckpointError
    (a shard lacks an indexed tensor, or two stored names map to one canonical name).
    """

    def __init__(self, files: list[Path], key_map: KeyMap | None = None, *, index: dict[str, Path] | None = None,
                 label: str = "the checkpoint", index_file: Path | None = None):
        super().__init__()
        self.label = label
        self.key_map = key_map or KeyMap.identity()
        self.index_file = index_file
        self._headers: dict[Path, dict] = {}
        self._starts: dict[Path, int] = {}
        files = [Path(f) for f in files]
        if index is None:
            index = {}
            for file in files:
                for stored in self._header(file):
                    if stored != "__metadata__":
                        index[stored] = file
        for stored, file in sorted(index.items()):
            canonical = self.key_map.canonical(stored)
            if canonical is None:
                continue
            header = self._header(file, stored)
            entry = header.get(stored)
            if entry is None:
                raise CheckpointError(f"{index_file or file} names tensor {stored!r} in {file}, but that file does "
                                      "not hold it")
            if canonical in self._index:
                raise CheckpointError(f"{label}: tensors {self._index[canonical].stored_name!r} and {stored!r} both "
                                      f"map to {canonical!r}")
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(v) for v in entry["data_offsets"])
            start = self._starts[file]
            self._index[canonical] = TensorInfo(file, stored, str(entry["dtype"]), shape, start + begin, start + end)
        self._all_files = sorted(set(files) | set(index.values()))

    def _header(self, file: Path, for_tensor: str | None = None) -> dict:
        if file not in self._headers:
            try:
                self._headers[file], self._starts[file] = read_header_and_start(file)
            except MissingFileError:
                raise MissingFileError(
                    f"{file}: shard not found"
                    + (f" ({self.index_file} names it for tensor {for_tensor!r})"
                       if self.index_file else "")) from None
        return self._headers[file]

    def fingerprint(self, digest) -> None:
        # Headers in file-name order, keys sorted (safetensors writes metadata in hash order).
        for file in self._all_files:
            digest.update(json.dumps(self._header(file), sort_keys=True).encode())


class UnionSource(TensorSource):
    """Several sources side by side; a canonical name present in two of them is an error (CheckpointError)."""

    def __init__(self, sources: list[TensorSource], label: str = "the composed checkpoint"):
        super().__init__()
        self.label = label
        self.sources = list(sources)
        self._owner: dict[str, TensorSource] = {}
        for source in self.sources:
            for name in source.names():
                if name in self._index:
                    raise CheckpointError(f"{label}: {self._index[name].where()} and {source.info(name).where()} "
                                          f"both provide {name!r}")
                self._index[name] = source.info(name)
                self._owner[name] = source

    def check_files(self) -> None:
        for source in self.sources:
            source.check_files()

    def read(self, names: Iterable[str], device: str | torch.device = "cpu",
             float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """As :meth:`TensorSource.read`, each name read by the source that holds it (a converting source
        included)."""
        by_source: dict[int, list[str]] = {}
        for name in names:
            by_source.setdefault(id(self._owner[name]), []).append(name)
        out: dict[str, torch.Tensor] = {}
        for source in self.sources:
            if id(source) in by_source:
                out.update(source.read(by_source[id(source)], device, float_dtype))
        return out

    def fingerprint(self, digest) -> None:
        for source in self.sources:
            source.fingerprint(digest)


def hf_safetensors_files(directory: Path) -> tuple[list[Path], dict[str, Path] | None, Path | None]:
    """``(files, index, index_file)`` of a transformers directory; ``index`` (name -> shard) None if unsharded.

    Raises MissingFileError when neither weights file exists (naming pickle files found instead),
    CheckpointError for an unreadable index.
    """
    directory = Path(directory)
    index_file = directory / SHARD_INDEX
    if index_file.is_file():
        try:
            doc = json.loads(index_file.read_text())
            weight_map = doc["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_file}: not a shard index ({e})") from None
        index = {str(k): directory / str(v) for k, v in weight_map.items()}
        return sorted(set(index.values())), index, index_file
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single], None, None
    raise MissingFileError(f"{directory}: no {SINGLE_FILE} or {SHARD_INDEX}" + pickle_hint(directory))


#: File endings of PyTorch pickle checkpoints, which this package never opens.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickle_hint(path: Path) -> str:
    """How to convert the pickle checkpoints at or in ``path``; "" when there are none."""
    path = Path(path)
    found = [path] if path.is_file() else (sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
                                           if path.is_dir() else [])
    if not found or (path.is_file() and path.suffix not in PICKLE_SUFFIXES):
        return ""
    names = ", ".join(p.name for p in found[:3])
    return (f"; found PyTorch pickle weights ({names}), which this package never loads: unpickling runs code "
            "from the file. Convert them once, where you trust the file, to safetensors: for a transformers "
            "model, `AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)` (transformers 5 always "
            "writes safetensors; with transformers 4 pass safe_serialization=True); for a bare state dict, "
            "load it with torch's loader and weights_only=True and write it with "
            "`safetensors.torch.save_file(state_dict, 'model.safetensors')`")


def digest_files(digest, *files: Path) -> None:
    """Feed the bytes of small text files (config.json, a shard index) into ``digest``, names first."""
    for file in files:
        digest.update(Path(file).name.encode())
        digest.update(Path(file).read_bytes())


def new_digest():
    """The hash that :func:`hybrid_vla_ros.model.checkpoint.model_id` uses (sha256)."""
    return hashlib.sha256()
