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
import torch

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


def _reference_file(*parts: str) -> Path:
    """A file of the published reference code; skips the test, saying why, when ../shared is not beside the
    checkout."""
    path = REFERENCE.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"the published reference code is not at {REFERENCE} (../shared beside the checkout)")
    return path


def _stub(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that relative imports below it resolve
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class _AnyMeta(type):
    """Metaclass of :func:`_anything_module`'s capitalised names: a class (it can be a base class) whose
    attributes are :class:`_Anything` (``PIPELINES.register_module()``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _Anything:
    """Stands for whatever an imported-but-unused name is: calling it with one class or function returns that
    unchanged (a decorator), any other call or attribute gives another _Anything."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or callable(args[0])):
            return args[0]
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _anything_module(monkeypatch, name: str) -> types.ModuleType:
    """A stub package ``name`` where every name exists: capitalised ones are classes (bases and registries),
    the others :class:`_Anything`. Only for modules whose names the reference file imports but the code a
    test runs never reaches (checked by the test's results against the published arithmetic)."""
    module = _stub(monkeypatch, name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _AnyMeta(attr, (), {}) if attr[:1].isupper() else _Anything()
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__
    return module


def _exec_file(monkeypatch, name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def load_pipeline(monkeypatch) -> types.ModuleType:
    """The reference's mmcv/datasets/pipelines/transforms_3d.py (ResizeCropFlipRotImage, ResizeMultiview3D,
    NormalizeMultiviewImage, ...), with the reference's own mmcv/image/geometric.py and photometric.py as
    ``mmcv.image`` (imresize, imnormalize: the arithmetic under test). Every other module it imports (datasets,
    boxes, tokenizer helpers, shapely, nuScenes devkit) is a stub where every name exists (_anything_module):
    the image transforms do not use them. Skips when ../shared/reference is not beside the checkout."""
    path = _reference_file("mmcv", "datasets", "pipelines", "transforms_3d.py")
    for name in ("mmcv", "mmcv.utils", "mmcv.parallel", "mmcv.core", "mmcv.core.voxel",
                 "mmcv.core.voxel.voxel_generator", "mmcv.core.bbox", "mmcv.core.bbox.structures",
                 "mmcv.core.bbox.structures.cam_box3d", "mmcv.core.bbox.structures.depth_box3d",
                 "mmcv.core.bbox.structures.lidar_box3d", "mmcv.datasets", "mmcv.datasets.builder",
                 "mmcv.datasets.data_utils", "mmcv.datasets.data_utils.constants",
                 "mmcv.datasets.data_utils.data_utils", "mmcv.datasets.data_utils.conversation",
                 "mmcv.datasets.pipelines", "mmcv.image.io", "mmcv.image.colorspace", "shapely", "shapely.geometry",
                 "nuscenes", "nuscenes.utils", "nuscenes.utils.geometry_utils"):
        _anything_module(monkeypatch, name)
    sys.modules["mmcv.image.io"].imread_backend = "cv2"
    image = _stub(monkeypatch, "mmcv.image")
    geometric = _exec_file(monkeypatch, "mmcv.image.geometric", REFERENCE / "mmcv" / "image" / "geometric.py")
    photometric = _exec_file(monkeypatch, "mmcv.image.photometric", REFERENCE / "mmcv" / "image" / "photometric.py")
    for name in ("impad", "impad_to_multiple", "imresize", "imrescale"):
        setattr(image, name, getattr(geometric, name))
    image.imnormalize = photometric.imnormalize
    for name in ("is_list_of", "bgr2hsv", "hsv2bgr"):
        setattr(image, name, _Anything())
    return _exec_file(monkeypatch, "mmcv.datasets.pipelines.transforms_3d", path)


def load_prompt_pipeline(monkeypatch) -> types.ModuleType:
    """The reference's transforms_3d.py as :func:`load_pipeline` loads it, but with the reference's own
    conversation templates, token constants and ``preprocess_qwen2`` / ``tokenizer_image_token_new``
    (mmcv/datasets/data_utils: what turns MindDrive's questions into input ids, the code under comparison).
    data_utils.py imports what its box helpers use (tkinter.tix, nuScenes devkit, pyquaternion): stubs, not
    reached by the prompt code."""
    pipeline = load_pipeline(monkeypatch)
    for name in ("tkinter", "tkinter.tix", "nuscenes.eval", "nuscenes.eval.common", "nuscenes.eval.common.utils",
                 "nuscenes.utils.data_classes", "pyquaternion"):
        _anything_module(monkeypatch, name)
    root = REFERENCE / "mmcv" / "datasets" / "data_utils"
    _stub(monkeypatch, "mmcv.datasets.data_utils")
    constants = _exec_file(monkeypatch, "mmcv.datasets.data_utils.constants", root / "constants.py")
    conversation = _exec_file(monkeypatch, "mmcv.datasets.data_utils.conversation", root / "conversation.py")
    data_utils = _exec_file(monkeypatch, "mmcv.datasets.data_utils.data_utils", root / "data_utils.py")
    monkeypatch.setattr(pipeline, "DEFAULT_IMAGE_TOKEN", constants.DEFAULT_IMAGE_TOKEN)
    monkeypatch.setattr(pipeline, "conversation_lib", conversation)
    for name in ("preprocess", "preprocess_llama3", "preprocess_qwen2"):
        monkeypatch.setattr(pipeline, name, getattr(data_utils, name))
    # the default conversation is module state the pipeline's __init__ sets: undone after the test
    monkeypatch.setattr(conversation, "default_conversation", conversation.default_conversation)
    return pipeline


def load_eva_vit(monkeypatch) -> types.ModuleType:
    """The reference's mmcv/models/backbones/eva_vit.py (EVAViT, Block, VisionRotaryEmbeddingFast, ...).

    Stubs: ``mmcv.models.builder`` (BACKBONES registry), ``mmcv.models.utils.attention`` (FlashAttention /
    FlashMHA, unused with ``flash_attn=False``), ``scipy.interpolate`` (imported, unused). einops is the real
    library (requirements.txt). Skips, saying why, when ../shared/reference is not beside the checkout.
    """
    path = _reference_file("mmcv", "models", "backbones", "eva_vit.py")
    pytest.importorskip("einops", reason="einops (requirements.txt, tests only) is what the reference imports")
    for name in ("mmcv", "mmcv.models", "mmcv.models.backbones", "mmcv.models.utils"):
        _stub(monkeypatch, name)
    _stub(monkeypatch, "mmcv.models.builder", BACKBONES=_Registry())
    _stub(monkeypatch, "mmcv.models.utils.attention", FlashAttention=_Unused, FlashMHA=_Unused)
    _stub(monkeypatch, "scipy")
    _stub(monkeypatch, "scipy.interpolate", interp1d=_Unused)
    return _exec_file(monkeypatch, "mmcv.models.backbones.eva_vit", path)


def load_detector(monkeypatch) -> tuple[types.ModuleType, types.ModuleType]:
    """(minddrive, distributions): the reference's mmcv/models/detectors/minddrive.py (the ``Minddrive``
    detector, whose planner methods ``distribution_forward`` / ``future_states_predict`` / ``pw_*`` a test calls
    on a small module carrying the attributes they read) and mmcv/models/utils/distributions.py (the real
    ``DistributionModule`` / ``PredictModel`` they use). Every other module minddrive.py imports (the LLaVA
    wrappers, heads, CARLA / RL / diffusion tooling, registries) is a stub where every name exists
    (_anything_module); the planner methods do not reach them. Skips when ../shared/reference is not beside the
    checkout."""
    path = _reference_file("mmcv", "models", "detectors", "minddrive.py")
    for name in ("mmcv", "mmcv.utils", "mmcv.utils.llava_llama", "mmcv.core", "mmcv.models",
                 "mmcv.models.builder", "mmcv.models.bricks", "mmcv.models.detectors",
                 "mmcv.models.detectors.mvx_two_stage", "mmcv.models.utils.grid_mask",
                 "mmcv.models.utils.positional_encoding",
                 "mmcv.models.utils.vis_utils", "mmcv.models.utils.freeze_module", "mmcv.models.utils.layers",
                 "mmcv.models.dense_heads", "mmcv.models.dense_heads.planning_head_plugin",
                 "mmcv.models.dense_heads.planning_head_plugin.metric_stp3", "mmcv.datasets",
                 "mmcv.datasets.data_utils", "mmcv.datasets.data_utils.constants",
                 "mmcv.datasets.data_utils.data_utils", "black", "zmq", "diffusers", "diffusers.schedulers",
                 "scipy", "scipy.optimize", "stable_baselines3", "stable_baselines3.common",
                 "stable_baselines3.common.distributions"):
        _anything_module(monkeypatch, name)
    utils = _anything_module(monkeypatch, "mmcv.models.utils")
    distributions = _exec_file(monkeypatch, "mmcv.models.utils.distributions",
                               REFERENCE / "mmcv" / "models" / "utils" / "distributions.py")
    utils.DistributionModule, utils.PredictModel = distributions.DistributionModule, distributions.PredictModel
    # the real `locations` (feature cell centres) and `inverse_sigmoid` the position embedding uses, from their
    # own files (whose other imports are stubs as above)
    for name in ("mmcv.utils.llava_llamav3", "mmcv.utils.llava_qwen", "mmcv.models.bricks.activation",
                 "mmcv.models.bricks.norm", "mmcv.models.bricks.registry", "mmcv.models.bricks.transformer",
                 "mmcv.models.utils.weight_init", "mmcv.models.utils.builder", "mmcv.models.backbones",
                 "mmcv.models.backbones.base_module", "mmcv.ops", "mmcv.ops.multi_scale_deform_attn"):
        _anything_module(monkeypatch, name)
    _exec_file(monkeypatch, "mmcv.utils.misc", REFERENCE / "mmcv" / "utils" / "misc.py")
    _exec_file(monkeypatch, "mmcv.models.utils.transformer",
               REFERENCE / "mmcv" / "models" / "utils" / "transformer.py")
    return _exec_file(monkeypatch, "mmcv.models.detectors.minddrive", path), distributions


class _Loss:
    """Stands for a built loss: the heads read only ``use_sigmoid`` of their class loss (the published configs:
    focal loss on sigmoids)."""

    use_sigmoid = True


class _HeadBase(torch.nn.Module):
    """Stands for mmdet's ``AnchorFreeHead``: the query heads call its constructor only for nn.Module's set-up
    (their layers are their own, built in their ``_init_layers``)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def _sdpa_flash_attention(self, q, kv, causal=False, key_padding_mask=None):
    """The published ``FlashAttention.forward`` (flash-attn's varlen kernel, CUDA fp16 only) computed with torch's
    scaled-dot-product attention in the inputs' dtype: q (B, T, H, D), kv (B, S, 2, H, D), ``key_padding_mask``
    (B, S) True = keep, scale 1 / sqrt(D) (the kernel's default). Returns ((B, T, H, D), None) as the original."""
    k, v = kv.unbind(dim=2)
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask, is_causal=causal)
    return out.transpose(1, 2), None


def load_query_heads(monkeypatch) -> tuple[types.ModuleType, types.ModuleType]:
    """(minddrive_head, minddrive_head_map): the reference's detection head ``MinddriveHead`` and map head
    ``MinddriveHeadM`` with their real transformer (mmcv/models/utils/petr_transformers.py), attention modules
    (attention.py: ``FlashMHA`` with its real projections, its flash-attn kernel call replaced by
    :func:`_sdpa_flash_attention`, the same arithmetic in fp32 on a CPU), positional encodings, ``MLN``,
    ``topk_gather``, ``memory_refresh``, ``transform_reference_points(_lane)`` and ``inverse_sigmoid``.

    Stubs: the registries (``build_transformer`` builds the real class its config names), ``AnchorFreeHead``
    (:class:`_HeadBase`), ``build_loss`` (:class:`_Loss`), ``build_bbox_coder`` (an object with the config's
    ``pc_range``), ``mmcv.models.bricks.Linear`` (= nn.Linear, as mmcv's is for these shapes), initialisers
    (the tests draw every weight themselves), and the box / NMS / assigner modules the inference path does not
    reach. Skips when ../shared/reference is not beside the checkout or einops is missing."""
    heads = _reference_file("mmcv", "models", "dense_heads", "minddrive_head.py")
    pytest.importorskip("einops", reason="einops (requirements.txt, tests only) is what the reference imports")
    root = REFERENCE / "mmcv"
    load_detector(monkeypatch)  # the real misc.py (MLN, topk_gather, ...) and transformer.py (inverse_sigmoid)
    identity_decorator = lambda *a, **k: (lambda f: f)  # noqa: E731 - auto_fp16 / force_fp32: precision casts
    utils = sys.modules["mmcv.utils"]
    utils.auto_fp16 = utils.force_fp32 = identity_decorator
    _stub(monkeypatch, "flash_attn")
    _stub(monkeypatch, "flash_attn.flash_attn_interface", flash_attn_varlen_kvpacked_func=_Unused)
    _stub(monkeypatch, "flash_attn.bert_padding", unpad_input=_Unused, pad_input=_Unused, index_first_axis=_Unused)
    attention = _exec_file(monkeypatch, "mmcv.models.utils.attention", root / "models" / "utils" / "attention.py")
    monkeypatch.setattr(attention.FlashAttention, "forward", _sdpa_flash_attention)
    petr = _exec_file(monkeypatch, "mmcv.models.utils.petr_transformers",
                      root / "models" / "utils" / "petr_transformers.py")
    positional = _exec_file(monkeypatch, "mmcv.models.utils.positional_encoding",
                            root / "models" / "utils" / "positional_encoding.py")

    def build_transformer(cfg):
        cfg = dict(cfg)
        return getattr(petr, cfg.pop("type"))(**cfg)

    models_utils = sys.modules["mmcv.models.utils"]
    models_utils.build_transformer = build_transformer
    models_utils.xavier_init = lambda *a, **k: None
    models_utils.bias_init_with_prob = lambda p: 0.0
    models_utils.NormedLinear = _Unused
    sys.modules["mmcv.models.bricks"].Linear = torch.nn.Linear
    models = sys.modules["mmcv.models"]
    models.HEADS = _Registry()
    models.build_loss = lambda cfg: _Loss()
    _stub(monkeypatch, "mmcv.models.dense_heads.anchor_free_head", AnchorFreeHead=_HeadBase)
    for name in ("mmcv.core.utils", "mmcv.core.utils.dist_utils", "mmcv.core.utils.misc", "mmcv.core.bbox",
                 "mmcv.core.bbox.util", "mmcv.core.bbox.assigners", "mmcv.core.bbox.structures",
                 "mmcv.core.bbox.structures.box_3d_mode", "mmcv.ops.iou3d_det", "mmcv.models.utils.functional",
                 "torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        _anything_module(monkeypatch, name)
    sys.modules["mmcv.core.bbox"].build_bbox_coder = lambda cfg: types.SimpleNamespace(pc_range=cfg["pc_range"])
    sys.modules["mmcv.models.utils.positional_encoding"] = positional
    detection = _exec_file(monkeypatch, "mmcv.models.dense_heads.minddrive_head", heads)
    lanes = _exec_file(monkeypatch, "mmcv.models.dense_heads.minddrive_head_map",
                       root / "models" / "dense_heads" / "minddrive_head_map.py")
    return detection, lanes


def reference_heads(monkeypatch, cfg, *, motion: bool = False, seed: int = 7):
    """(detection head ``MinddriveHead``, map head ``MinddriveHeadM``, the detector's shared encoders {query_pos,
    time_embedding, ego_pose_pe}) of the reference (:func:`load_query_heads`) at the sizes of ``cfg`` (a
    ``QueryHeadsConfig``; the published layout needs ``embed_dims`` 256), in eval mode, every weight drawn at
    random from ``seed`` (matrices N(0, 9 / fan_in), vectors N(0, 0.09); the reference points uniform in [0, 1]
    as the published initialisation draws them): the published initialisers leave some weights at zero, and large
    enough weights keep the queries' scores apart, so the memory's top-k is the same on both sides. ``motion``:
    also build the motion-prediction branch (``use_col_loss``, the published config: output only)."""
    import math

    detection, lanes = load_query_heads(monkeypatch)
    misc = sys.modules["mmcv.utils.misc"]
    e, pc_range = cfg.embed_dims, list(cfg.pc_range)
    transformer = dict(type="PETRTemporalTransformer", input_dimension=e, output_dimension=e,
                       num_layers=cfg.num_layers, embed_dims=e, num_heads=cfg.num_heads,
                       feedforward_dims=cfg.feedforward_dims, dropout=0.1, flash_attn=True)
    dream = dict(type="DREAMTransformerDecoder", num_layers=1, embed_dims=e, num_heads=cfg.num_heads, dropout=0.0,
                 feedforward_dims=cfg.memory_ffn_dims, flash_attn=True)
    loss = dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
    map_head = lanes.MinddriveHeadM(
        num_classes=cfg.map_classes, in_channels=cfg.in_channels, out_dims=cfg.out_dims, embed_dims=e,
        num_lane=cfg.num_lane, memory_len=cfg.map_memory_len, topk_proposals=cfg.map_topk,
        num_lanes_one2one=cfg.num_lanes_one2one, k_one2many=1, num_extra=cfg.num_extra, with_mask=cfg.with_mask,
        pc_range=pc_range, n_control=cfg.n_control, transformer=transformer, loss_cls=loss, train_cfg=None)
    det_head = detection.MinddriveHead(
        num_classes=cfg.num_classes, in_channels=cfg.in_channels, out_dims=cfg.out_dims, embed_dims=e,
        num_query=cfg.num_query, memory_len=cfg.memory_len, topk_proposals=cfg.topk_proposals,
        num_propagated=cfg.num_propagated, num_extra=cfg.num_extra, n_control=cfg.n_control,
        with_mask=cfg.with_mask, match_with_velo=False, use_memory=cfg.num_memory > 0,
        num_memory=max(cfg.num_memory, 1), scence_memory_len=cfg.scene_memory_len, memory_decoder_transformer=dream,
        use_col_loss=motion, motion_transformer_decoder=dream, motion_map_decoder=dream if motion else None,
        pred_traffic_light_state=True, transformer=transformer, bbox_coder=dict(pc_range=pc_range), loss_cls=loss,
        train_cfg=None)
    shared = dict(query_pos=torch.nn.Sequential(torch.nn.Linear(396, e), torch.nn.ReLU(), torch.nn.Linear(e, e)),
                  time_embedding=torch.nn.Sequential(torch.nn.Linear(e, e), torch.nn.LayerNorm(e)),
                  ego_pose_pe=misc.MLN(156, e))
    for head in (map_head, det_head):  # the detector hands each head the same three modules
        for name, module in shared.items():
            setattr(head, name, module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (map_head, det_head):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (3.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.3))
        for emb in (det_head.reference_points, det_head.pseudo_reference_points):
            emb.weight.copy_(torch.rand(emb.weight.shape, generator=gen))
        det_head.pc_range.copy_(torch.tensor(pc_range))
        map_head.pc_range.copy_(torch.tensor(pc_range))
    return det_head.eval(), map_head.eval(), shared


def published_heads_state(det_head, map_head, shared, position_encoder, rays) -> dict:
    """A detector ``state_dict`` in the published names (minddrive.py's attributes): the shared encoders at the
    top and, as the detector's ``state_dict`` has them, again under each head; both heads; the 3-D position
    embedding's MLP (``position_encoder``, an nn.Sequential Linear(3 D, 4 E), ReLU, Linear(4 E, E)) and its
    stored depths and range (``coords_d``, ``position_range``) for the ray configuration ``rays``."""
    from hybrid_vla_ros.model.camera_rays import depth_bins

    state = {f"pts_bbox_head.{k}": v for k, v in det_head.state_dict().items()}
    state.update({f"map_head.{k}": v for k, v in map_head.state_dict().items()})
    for name, module in shared.items():
        state.update({f"{name}.{k}": v for k, v in module.state_dict().items()})
    state.update({f"position_encoder.{k}": v for k, v in position_encoder.state_dict().items()})
    state["coords_d"], state["position_range"] = depth_bins(rays), torch.tensor(rays.position_range)
    return state
