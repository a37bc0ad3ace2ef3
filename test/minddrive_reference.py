"""MindDrive's published model code (../shared/reference/minddrive, Apache-2.0; see its SOURCE.txt) loaded by path
as the referee of the tests, never by the package.

Importing its ``mmcv`` tree as a package pulls in training and CARLA code that cannot be installed here, so each
module file a test needs is loaded on its own with small stub modules for what it imports but does not use on a
CPU: the registries (a ``register_module`` that returns the class unchanged), the flash-attention wrappers (the
modules are built with ``flash_attn=False``, their plain-PyTorch path) and scipy (imported, unused). What a stub
stands for is named where it is made; the reference's own arithmetic is never replaced.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "minddrive"


class _Registry:
    """Stands for mmcv's registries: ``register_module()`` leaves the class as it is."""

    def register_module(self, *args, **kwargs):
        if args and isinstance(args[0], type):
            return args[0]
        return lambda cls: cls


class _Unused:
    """Stands for a class the reference imports but does not reach on the path a test runs (flash attention:
    the tests build the modules with ``flash_attn=False``)."""

    def __init__(self, *args, **kwargs):
        raise AssertionError("the reference reached a stubbed class; build it with flash_attn=False")


def _stub(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that relative imports below it resolve
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def load_eva_vit(monkeypatch) -> types.ModuleType:
    """The reference's mmcv/models/backbones/eva_vit.py (EVAViT, Block, VisionRotaryEmbeddingFast, ...).

    Stubs: ``mmcv.models.builder`` (BACKBONES registry), ``mmcv.models.utils.attention`` (FlashAttention /
    FlashMHA, unused with ``flash_attn=False``), ``scipy.interpolate`` (imported, unused). einops is the real
    library (requirements.txt). Skips, saying why, when ../shared/reference is not beside the checkout.
    """
    path = REFERENCE / "mmcv" / "models" / "backbones" / "eva_vit.py"
    if not path.is_file():
        pytest.skip(f"the published reference code is not at {REFERENCE} (../shared beside the checkout)")
    pytest.importorskip("einops", reason="einops (requirements.txt, tests only) is what the reference imports")
    for name in ("mmcv", "mmcv.models", "mmcv.models.backbones", "mmcv.models.utils"):
        _stub(monkeypatch, name)
    _stub(monkeypatch, "mmcv.models.builder", BACKBONES=_Registry())
    _stub(monkeypatch, "mmcv.models.utils.attention", FlashAttention=_Unused, FlashMHA=_Unused)
    _stub(monkeypatch, "scipy")
    _stub(monkeypatch, "scipy.interpolate", interp1d=_Unused)
    name = "mmcv.models.backbones.eva_vit"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
