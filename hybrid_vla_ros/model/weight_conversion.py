"""transformers' own checkpoint conversion, applied per tensor group as a stage loads.

transformers 5 keeps a mixture-of-experts block's experts as fused tensors (``mlp.experts.gate_up_proj``
(E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)), while its ``save_pretrained`` writes (and the published
checkpoints hold) one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``). transformers converts at load with the family's
``WeightConverter`` / ``WeightRenaming`` list (``conversion_mapping.get_model_conversion_mapping``;
``core_model_loading.rename_source_key``, ``MergeModulelist``, ``Concatenate``). A stage here reads only its own
blocks' tensors, so :class:`ConvertedSource` runs those same transforms on the stored tensors of the groups a
stage asks for: nothing of the conversion is written here, only which stored tensors form a group.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .sources import FLOAT_DTYPES, CheckpointError, KeyMap, TensorInfo, TensorSource

__all__ = ["ConvertedSource", "conversion_transforms", "OneBlockModel"]


def conversion_transforms(family, config, stored_names) -> tuple[list, "OneBlockModel | None"]:
    """transformers' weight transforms for a causal LM of ``family`` (:class:`~.text.TextFamily`) and ``config``,
    from a one-block meta-device model (``get_model_conversion_mapping``), and that model
    (:class:`OneBlockModel`, for converters that compare shapes with the model's); ([], None) when they change none
    of ``stored_names`` (the checkpoint's tensor names): neither merge (MoE experts) nor rename (Granite-MoE's
    ``input_linear``, EXAONE's ``transformer.h``) any."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    from .text import _one_block_config

    if family.causal_lm_class is None:
        return [], None
    with torch.device("meta"):
        shell = family.causal_lm_class(_one_block_config(config))
    transforms = list(get_model_conversion_mapping(shell))
    probe = copy.deepcopy(transforms)  # renamings keep state (a guard seen): the real pass starts fresh
    renamings = [t for t in probe if not isinstance(t, WeightConverter)]
    converters = [t for t in probe if isinstance(t, WeightConverter)]
    for name in sorted(stored_names):
        renamed, pattern = rename_source_key(name, renamings, converters)
        if pattern is not None or renamed != name:
            return transforms, OneBlockModel(shell)
    return [], None


class OneBlockModel:
    """A one-block meta-device model seen as the whole one: ``get_parameter`` of block i's parameter answers with
    block 0's (what transformers' ``Transpose(check_dims=True)`` asks a model for: the shape it expects)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        """The meta-device parameter ``name`` (any block index read as 0). Raises AttributeError if unknown."""
        return self.model.get_parameter(re.sub(r"\.layers\.\d+\.", ".layers.0.", name))


@dataclass
class _Group:
    """Stored tensors one converter turns into ``outputs`` (canonical name -> the converter's full output name)."""

    converter: object
    target: str
    members: list[tuple[str, str]] = field(default_factory=list)  # (source pattern, stored name), in load order
    outputs: dict[str, str] = field(default_factory=dict)


class ConvertedSource(TensorSource):
    """The tensors of ``raw`` (stored names: a :class:`~.sources.SafetensorsSource` without a key map) after
    ``transforms`` (:func:`conversion_transforms`), named by ``key_map`` (stored -> canonical, applied to the
    converted names); ``model``: what a converter that checks shapes compares with. A converted tensor's
    :class:`~.sources.TensorInfo` has its shape (the converter run once on meta tensors) and the stored dtype;
    reading it reads its group's stored tensors and runs the converter.

    :meth:`info` and :meth:`read` raise CheckpointError for a merged tensor whose stored tensors are uneven, differ
    in dtype or fail the converter (only a stage that needs it fails)."""

    def __init__(self, raw: TensorSource, transforms: list, key_map: KeyMap, label: str = "",
                 model: OneBlockModel | None = None):
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        super().__init__()
        self.raw, self.label, self._model = raw, label or raw.label, model
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        self._plain: dict[str, str] = {}  # canonical -> stored
        groups: dict[str, _Group] = {}
        for stored in sorted(raw.names(), key=dot_natural_key):
            renamed, pattern = rename_source_key(stored, renamings, converters)
            if pattern is None:
                canonical = key_map.canonical(renamed)
                if canonical is not None:
                    self._plain[canonical] = stored
                    self._index[canonical] = raw.info(stored)
                continue
            group = groups.setdefault(renamed, _Group(by_pattern[pattern], renamed))
            group.members.append((pattern, stored))
        self._groups: dict[str, _Group] = {}  # canonical -> its group
        #: canonical name (the group's target) -> why its stored tensors cannot be merged: raised by :meth:`info`
        #: for the stage that needs it only (a stage that does not own the block still loads)
        self._broken: dict[str, str] = {}
        for group in groups.values():
            problem = self._check_group(group)
            if problem is None:
                stored_dtype = raw.info(group.members[0][1]).dtype
                meta = {s: torch.empty(raw.info(s).shape, dtype=FLOAT_DTYPES.get(stored_dtype, torch.float32),
                                       device="meta") for _, s in group.members}
                try:
                    converted = self._convert(group, meta)
                except CheckpointError as e:
                    problem = str(e)
            if problem is not None:
                canonical = key_map.canonical(group.target)
                if canonical is not None:
                    self._broken[canonical] = problem
                    self._index[canonical] = raw.info(group.members[0][1])
                continue
            for full, t in converted.items():
                canonical = key_map.canonical(full)
                if canonical is None:
                    continue
                group.outputs[canonical] = full
                first = raw.info(group.members[0][1])
                self._groups[canonical] = group
                self._index[canonical] = TensorInfo(
                    first.file, f"{len(group.members)} stored tensors from {first.stored_name!r} on, merged by "
                                f"transformers' {type(group.converter).__name__}", stored_dtype, tuple(t.shape))

    def _check_group(self, group: _Group) -> str | None:
        """Why ``group``'s stored tensors cannot be merged (uneven counts per source pattern: an expert's tensor
        missing; several dtypes), None when they can."""
        counts: dict[str, int] = {}
        for pattern, _ in group.members:
            counts[pattern] = counts.get(pattern, 0) + 1
        if len(set(counts.values())) > 1:
            return (f"{self.label}: the stored tensors merged into {group.target!r} are uneven ("
                    + ", ".join(f"{n} of {p!r}" for p, n in counts.items()) + "): an expert's tensor is missing")
        dtypes = {self.raw.info(s).dtype for _, s in group.members}
        if len(dtypes) != 1:
            return (f"{self.label}: the tensors merged into {group.target!r} are stored in several dtypes "
                    f"{sorted(dtypes)}")
        return None

    def info(self, name: str) -> TensorInfo:
        """Where ``name`` is stored. Raises KeyError, CheckpointError for a merged tensor whose stored tensors
        cannot be merged (uneven counts, several dtypes, the converter failing)."""
        if name in self._broken:
            raise CheckpointError(self._broken[name])
        return super().info(name)

    def _convert(self, group: _Group, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The converter's outputs (full names) for the group's stored ``tensors`` (stored name -> tensor)."""
        converter = copy.deepcopy(group.converter)
        for pattern, stored in group.members:
            converter.add_tensor(group.target, stored, pattern, tensors[stored])
        try:
            out = converter.convert(group.target, model=self._model)
        except Exception as e:
            raise CheckpointError(f"{self.label}: transformers' conversion of {len(group.members)} tensors into "
                                  f"{group.target!r} failed ({type(e).__name__}: {e})") from e
        return {name: (t[0] if isinstance(t, list) else t) for name, t in out.items()}

    def check_files(self) -> None:
        self.raw.check_files()

    def read(self, names: Iterable[str], device: str | torch.device = "cpu",
             float_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """As :meth:`~.sources.TensorSource.read`; a converted tensor is built on the CPU from its group's stored
        tensors (each group read and converted once), then moved to ``device``."""
        names = list(names)
        plain = [n for n in names if n in self._plain]
        out = {}
        if plain:
            got = self.raw.read([self._plain[n] for n in plain], device, float_dtype)
            out.update({n: got[self._plain[n]] for n in plain})
        done: dict[int, dict[str, torch.Tensor]] = {}
        for name in names:
            if name in self._plain:
                continue
            group = self._groups[name]
            if id(group) not in done:
                stored = self.raw.read([s for _, s in group.members], "cpu", float_dtype)
                done[id(group)] = self._convert(group, stored)
                del stored
            out[name] = done[id(group)][group.outputs[name]].contiguous().to(device)
        return out

    def fingerprint(self, digest) -> None:
        self.raw.fingerprint(digest)

    def files(self):
        return self.raw.files()
