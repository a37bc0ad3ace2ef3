"""How the CPU suffix computes decoder blocks [K, L): eagerly in torch, or through a compiled OpenVINO model.

:class:`SuffixBackend` is what :class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner` calls instead of the stage:
``backend(stage, hidden_states, command, k) -> waypoints``. ``eager`` is the stage itself. ``openvino`` converts
the stage's blocks [K, L) at the frame shape (B, T, H) once with ``openvino.convert_model`` (PyTorch frontend:
the module is traced and its aten graph mapped to OpenVINO ops; SDPA stays one ``ScaledDotProductAttention``
op), saves it (IR: ``model.xml`` + ``model.bin``) in a cache folder and compiles it for the CPU plugin, whose
GEMM and attention kernels (oneDNN, its own fused SDPA) and graph fusions (RMSNorm, rotary, SiLU x up) are what
make it faster than eager torch (figures: docs/performance.md). The compiled model gives the last tokens' hidden
states, as many as the read-out positions reach (the planning token, and MindDrive's decision and path tokens:
:func:`~hybrid_vla_ros.model.traced.read_out_tokens`); its last block runs attention for every token but its
residual, norm and MLP for those rows only, where a check at build time finds the family's block a pre-norm layer
(:func:`~hybrid_vla_ros.model.traced.prunable`); the final norm and the heads stay in torch
(:func:`hybrid_vla_ros.model.modeling.plan`), so the command, the modes and the decision logits are exactly the
eager code's.

K and live re-splits: a compiled model covers one K (the blocks [K, L) it was built from) and one input shape.
A frame at any other K runs eagerly, and a build for that K starts on a background thread (eager serves the
frames meanwhile); the new model replaces the old one between frames once it is ready. A frame is therefore
never computed with a mismatched K: the compiled path is used only when the frame's K is the one it covers.

Artifacts and the cache key: ``<cache_dir>/<model id>/<backend>-k<K>-<dtype>-<B>x<T>x<H>-<key digest>/`` holds
``model.xml``, ``model.bin``, the CPU plugin's compiled-blob cache (``ov_cache/``) and ``key.json``, written
last (atomically, by renaming a finished temporary folder) with the whole :class:`ArtifactKey`. The key holds
the checkpoint's model id, a sha256 digest of the bytes of every tensor of blocks [K, L) as the stage holds
them (dtype included: :func:`weights_digest`), K, L, the dtype, the input shape, and the versions of the
backend, torch, transformers and this artifact format. ``model_id`` alone does not hash weight values, so the
digest is what keeps an artifact of other weights with the same header from ever being used. An artifact is
used only when its ``key.json`` equals the wanted key field by field; anything else is rebuilt. The cache dir
defaults to ``$XDG_CACHE_HOME/hybrid_vla_ros`` (``~/.cache/hybrid_vla_ros``), overridable per node
(``backend_cache_dir``) or with ``HYBRID_VLA_CACHE``. Artifacts are never deleted here: remove the folder to
reclaim the space (one artifact is about the size of its blocks' weights in their dtype).

Precision: the CPU plugin is told the stage dtype's precision (``INFERENCE_PRECISION_HINT`` f32 for fp32,
bf16 for bf16 where the CPU has bf16 instructions, AVX512_BF16 or AMX), because its default would run an fp32
model in bf16 on such a CPU. Where the CPU lacks them (AVX2 only) a bf16 suffix is computed in f32 from its
bf16 weights: closer to fp32 than eager bf16, at f32 GEMM speed. ``status()['precision']`` says which.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..model.modeling import plan
from ..model.traced import (BlocksToLastTokens, prunable, read_out_tokens, traceable,
                            traced_blocks)
from ..util.paths import cache_dir

#: Values of the suffix node's ``suffix_backend`` parameter.
BACKENDS = ("eager", "openvino")
#: Version of the artifact layout and of the traced module (bump when either changes: old artifacts are rebuilt).
ARTIFACT_FORMAT = 4  # 3: the model gives the last tokens_out tokens; 4: block L-1 after attention on those only
#: What a build found, beside ``key.json`` in an artifact: {"last_block_rows": the rows block L-1 computes after
#: attention, or null when it computes all (:func:`~hybrid_vla_ros.model.traced.prunable`)}.
BUILD_FILE = "build.json"


def default_cache_dir() -> Path:
    """The default artifact folder: :func:`hybrid_vla_ros.util.paths.cache_dir` (``$HYBRID_VLA_CACHE``, else
    ``$XDG_CACHE_HOME/hybrid_vla_ros``, else ``~/.cache/hybrid_vla_ros``)."""
    return cache_dir()


def weights_digest(blocks) -> str:
    """sha256 (hex) over every parameter and buffer of ``blocks`` (an iterable of decoder blocks), in order:
    its name, dtype, shape and raw bytes. Two block ranges share a digest only when they hold the same values
    in the same dtype. Costs one pass over the weights (sha256 runs at about 1.5-2 GB/s with SHA-NI)."""
    h = hashlib.sha256()
    for i, block in enumerate(blocks):
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            t = t.detach().contiguous()
            h.update(f"{i}.{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass(frozen=True)
class ArtifactKey:
    """Everything a compiled suffix depends on; an artifact is reused only for an equal key.

    ``model_id``: :func:`hybrid_vla_ros.model.checkpoint.model_id` of the checkpoint (signed int64).
    ``weights``: :func:`weights_digest` of blocks [split_layer, num_layers) as loaded. ``dtype``: "fp32" | "bf16"
    | "fp16" (the stage's). ``shape``: the hidden states' (B, T, H). ``tokens_out``: how many last tokens the
    model gives (:func:`~hybrid_vla_ros.model.traced.read_out_tokens`). The version fields pin the code that built it
    (backend, torch, transformers, :data:`ARTIFACT_FORMAT`)."""

    backend: str
    backend_version: str
    model_id: int
    weights: str
    split_layer: int
    num_layers: int
    dtype: str
    shape: tuple
    torch_version: str
    transformers_version: str
    tokens_out: int = 1
    artifact_format: int = ARTIFACT_FORMAT

    def digest(self) -> str:
        """sha256 (hex) of the key's canonical JSON."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    def folder(self, cache_dir: str | Path) -> Path:
        """The artifact's folder under ``cache_dir`` (see the module docstring)."""
        shape = "x".join(str(s) for s in self.shape)
        return (Path(cache_dir) / f"{self.model_id & (2**64 - 1):016x}"
                / f"{self.backend}-k{self.split_layer}-{self.dtype}-{shape}-{self.digest()[:16]}")


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


class CompiledSuffix:
    """One compiled model of blocks [k, L) at one input shape (built or loaded by :func:`build_openvino`).

    ``run(hidden)``: hidden states of ``shape`` ((T, H) or (B, T, H)), any float dtype -> the last
    ``key.tokens_out`` tokens' hidden states after block L-1, shape (..., tokens_out, H), in ``dtype`` (for
    :func:`~hybrid_vla_ros.model.modeling.plan`).
    ``threads``: the CPU plugin's thread count it was compiled with (0: the plugin's default).
    ``last_block_rows``: the rows block L-1 computes after its attention (the read-out rows), or None when it
    computes every token (:func:`~hybrid_vla_ros.model.traced.prunable`).
    One inference at a time (the runner's thread)."""

    def __init__(self, key: ArtifactKey, compiled, *, dtype: torch.dtype, input_shape: tuple, folder: Path,
                 cache_hit: bool, build_s: float, precision: str, threads: int = 0,
                 last_block_rows: int | None = None):
        self.key, self.k, self.threads = key, key.split_layer, int(threads)
        self.last_block_rows = last_block_rows
        self.dtype, self.input_shape, self.folder = dtype, tuple(input_shape), folder
        self.cache_hit, self.build_s, self.precision = cache_hit, build_s, precision
        self._request = compiled.create_infer_request()

    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden if hidden.dim() == 3 else hidden.unsqueeze(0)
        if x.dtype != torch.float32:
            x = x.float()  # bf16 / fp16 -> f32 input (the cast back to the stage dtype is inside the model)
        elif not x.is_contiguous():
            x = x.contiguous()
        self._request.infer([x.numpy()], share_inputs=True)
        out = torch.from_numpy(self._request.get_output_tensor(0).data.copy())
        out = out.to(self.dtype)
        return out if hidden.dim() == 3 else out.squeeze(0)


def _openvino():
    """Import openvino (raises ImportError with the install line when it is missing)."""
    try:
        import openvino
    except ImportError as e:
        raise ImportError(f"openvino is not installed ({e}); pip install openvino==2026.4.1") from e
    return openvino


def openvino_precision(core, dtype: torch.dtype) -> str:
    """The CPU plugin's ``INFERENCE_PRECISION_HINT`` for a stage in ``dtype``: "f32" for fp32; "bf16" for bf16
    when the CPU reports BF16 in ``OPTIMIZATION_CAPABILITIES`` (AVX512_BF16 or AMX), else "f32"; "f16" for
    fp16 when it reports FP16, else "f32"."""
    caps = set(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    if dtype == torch.bfloat16 and "BF16" in caps:
        return "bf16"
    if dtype == torch.float16 and "FP16" in caps:
        return "f16"
    return "f32"


def artifact_key(stage, k: int, shape: tuple, *, model_id: int, backend: str = "openvino",
                 layers=None) -> ArtifactKey:
    """The :class:`ArtifactKey` of ``stage``'s blocks [k, L) (``layers``: those blocks, default taken from the
    stage) at hidden-state ``shape``. Raises ValueError when the stage does not hold blocks [k, L);
    ImportError when the backend is not installed."""
    import transformers

    if layers is None:
        first = stage.split_layer
        if k < first:
            raise ValueError(f"the stage holds blocks [{first}, {stage.cfg.num_layers}), not from {k}")
        layers = list(stage.layers[k - first:])
    ov = _openvino()
    dtype = next((p.dtype for b in layers for p in b.parameters()), torch.float32)
    return ArtifactKey(backend=backend, backend_version=ov.get_version(), model_id=int(model_id),
                       weights=weights_digest(layers), split_layer=int(k), num_layers=int(stage.cfg.num_layers),
                       dtype=_dtype_name(dtype), shape=tuple(int(s) for s in shape), torch_version=torch.__version__,
                       transformers_version=transformers.__version__, tokens_out=read_out_tokens(stage.cfg))


def _last_block_rows(folder: Path, tokens_out: int) -> int | None:
    """The artifact's :data:`BUILD_FILE` ``last_block_rows`` when it is ``tokens_out`` (the only value a build
    writes besides null); None when absent, unreadable or anything else. It informs (the bench's FLOP count);
    what runs is the graph in ``model.xml``."""
    try:
        rows = json.loads((folder / BUILD_FILE).read_text()).get("last_block_rows")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows == tokens_out else None


def plugin_config(precision: str, threads: int = 0, *, cache_dir: Path | None = None,
                  perf_count: bool = False) -> dict:
    """The CPU plugin's compile options of a compiled suffix: latency hint, ``INFERENCE_PRECISION_HINT``
    ``precision`` (:func:`openvino_precision`), ``INFERENCE_NUM_THREADS`` ``threads`` when > 0 (0: the plugin's
    default), ``CACHE_DIR`` (its compiled-blob cache) when given, ``PERF_COUNT`` (per-node counters) when asked."""
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision}
    if threads > 0:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    if cache_dir is not None:
        config["CACHE_DIR"] = str(cache_dir)
    if perf_count:
        config["PERF_COUNT"] = True
    return config


def _read_key(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "key.json").read_text())
    except (OSError, ValueError):
        return None


def build_openvino(stage, k: int, shape: tuple, *, model_id: int, cache_dir: str | Path, threads: int = 0,
                   layers=None, key: ArtifactKey | None = None) -> CompiledSuffix:
    """Compile ``stage``'s blocks [k, L) for hidden states of ``shape`` ((T, H) or (B, T, H)) with OpenVINO,
    reusing the artifact in ``cache_dir`` when its key matches (see the module docstring), else converting
    the module and saving the artifact first; a matching artifact the plugin cannot compile (a damaged
    ``model.bin``) is converted and saved again once.

    ``threads``: the CPU plugin's ``INFERENCE_NUM_THREADS`` (0: its default, every core this process may use).
    ``layers``: blocks [k, L) (default: from the stage; pass a list taken on the runner's thread when building
    on another one). Returns a :class:`CompiledSuffix`. Raises ImportError (openvino missing), ValueError (the
    stage lacks blocks [k, L)), and what conversion or compilation raises."""
    ov = _openvino()
    t0 = time.perf_counter()
    first = stage.split_layer
    if layers is None:
        if k < first:
            raise ValueError(f"the stage holds blocks [{first}, {stage.cfg.num_layers}), not from {k}")
        layers = list(stage.layers[k - first:])
    shape3 = tuple(shape) if len(shape) == 3 else (1, *shape)
    if key is None:
        key = artifact_key(stage, k, shape3, model_id=model_id, layers=layers)
    dtype = next((p.dtype for b in layers for p in b.parameters()), torch.float32)
    folder = key.folder(cache_dir)
    core = ov.Core()
    weight_dtype = torch.float32 if openvino_precision(core, dtype) == "f32" else dtype

    def convert_and_save(replace: bool) -> None:
        folder.parent.mkdir(parents=True, exist_ok=True)  # a cache that cannot be written fails before converting
        # Weights in the precision the CPU plugin computes in: bf16 weights on a CPU without bf16 instructions
        # go in as f32 (their values exactly), so no FC decompresses them on every call.
        blocks = traced_blocks(stage.cfg, layers, weight_dtype)
        prune = bool(blocks) and prunable(blocks[-1], shape3, key.tokens_out, stage.rotary_emb)
        module = BlocksToLastTokens(blocks, stage.rotary_emb, weight_dtype, key.tokens_out, prune_last=prune).eval()
        example = torch.zeros(shape3, dtype=torch.float32)
        with torch.no_grad():
            model = ov.convert_model(module, example_input=example, input=[(list(shape3), ov.Type.f32)])
        tmp = folder.parent / f".{folder.name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        try:
            ov.save_model(model, str(tmp / "model.xml"), compress_to_fp16=False)
            (tmp / BUILD_FILE).write_text(json.dumps({"last_block_rows": key.tokens_out if prune else None}) + "\n")
            (tmp / "key.json").write_text(json.dumps(key.to_json(), indent=1, sort_keys=True) + "\n")
            if not replace and _read_key(folder) == key.to_json() and (folder / "model.xml").is_file():
                shutil.rmtree(tmp, ignore_errors=True)  # another build of the same key finished first: use it
            else:
                if folder.exists():  # a stale, unreadable or damaged artifact under the same name: replace it
                    shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    cache_hit = _read_key(folder) == key.to_json() and (folder / "model.xml").is_file()
    if not cache_hit:
        convert_and_save(replace=False)
    precision = openvino_precision(core, dtype)
    config = plugin_config(precision, threads, cache_dir=folder / "ov_cache")
    # Compiled from the saved IR, also right after a build (as a restart compiles it, not the converted model in
    # memory: the same graph ran 1.5-4 % faster read back; smol, 4 blocks: bf16 13.2 -> 12.7 ms, fp32 23.2 ->
    # 22.8 ms, docs/performance.md). With CACHE_DIR the plugin imports its blob without building the model first.
    try:
        compiled = core.compile_model(str(folder / "model.xml"), "CPU", config)
    except Exception:
        if not cache_hit:
            raise
        # A damaged artifact under a matching key.json (model.bin missing or cut short, say): built again once.
        cache_hit = False
        convert_and_save(replace=True)
        compiled = core.compile_model(str(folder / "model.xml"), "CPU", config)
    return CompiledSuffix(key, compiled, dtype=dtype, input_shape=shape3, folder=folder, cache_hit=cache_hit,
                          build_s=time.perf_counter() - t0, precision=precision, threads=threads,
                          last_block_rows=_last_block_rows(folder, key.tokens_out))


@dataclass(frozen=True)
class BackendBuild:
    """One finished build of the compiled suffix: for blocks ``[k, L)``, ``seconds`` it took (s), whether the
    artifact came from the cache (``cache_hit``), its ``precision`` and the ``folder`` it lives in."""

    k: int
    seconds: float
    cache_hit: bool
    precision: str
    folder: str


@dataclass(frozen=True)
class BackendStatus:
    """:meth:`SuffixBackend.status`: the backend asked for (``requested``) and the one computing frames now
    (``in_use``: it or "eager"), the K the ready compiled model covers (``compiled_k``) and the K being built in the
    background (``building``), both None when there is none; the compiled model's ``precision`` ("" without one);
    ``error``: why the asked-for backend is not in use ("" when it is; also at K = L, where there are no blocks to
    compile); ``cache_dir`` (the temporary folder builds go to when the configured one cannot be written); frames
    computed by each path (``frames_compiled``, ``frames_eager``); the ``last_build`` (None before the first)."""

    requested: str
    in_use: str
    compiled_k: int | None
    building: int | None
    precision: str
    error: str
    cache_dir: str
    frames_compiled: int
    frames_eager: int
    last_build: BackendBuild | None


class SuffixBackend:
    """The suffix's compute path: eager torch, or a compiled model built per K (see the module docstring).

    Args:
        name: "eager" or "openvino" (:data:`BACKENDS`).
        stage: the runner's :class:`~hybrid_vla_ros.model.modeling.SuffixStage` (moved in place by re-splits).
        model_id: the checkpoint's model id (part of the cache key).
        cache_dir: artifact folder (None: :func:`default_cache_dir`).
        threads: CPU plugin threads (0: as many as the process may use).
        log: ``log(level, message)`` with level "info" | "warning" | "error" (default: print).
        background: build on a background thread (eager serves meanwhile); False builds inside the call that
            first needs it (tests, the bench).
        temporary_fallback: when ``cache_dir`` cannot be written (OSError), build into a temporary folder of the
            process, removed at :meth:`close` (the node); False: that build fails (``hybrid-vla compile-suffix``,
            whose builds must be kept).

    A backend that cannot be used (openvino not importable) falls back to eager at construction with one
    warning line naming the reason; one whose build fails for a K logs an error line, serves that K eagerly
    and does not retry it. ``status()`` says what is in use. Raises ValueError for an unknown name.
    """

    def __init__(self, name: str, stage, *, model_id: int, cache_dir: str | Path | None = None, threads: int = 0,
                 log=None, background: bool = True, temporary_fallback: bool = True):
        if name not in BACKENDS:
            raise ValueError(f"unknown suffix backend {name!r}; use one of {', '.join(BACKENDS)}")
        self.requested = name
        self.model_id = int(model_id)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.threads = int(threads)
        self.background = background
        self._log = log or (lambda level, msg: print(f"[{level}] {msg}", flush=True))
        self.shape = tuple(stage.cfg.prefix_state_shape)
        self.error = ""  # why the compiled path is not in use ("" when it is, or when eager was asked for)
        self.failed: dict[int, str] = {}  # K -> why its build failed (not retried)
        self.builds: list[BackendBuild] = []  # one record per finished build
        self.frames_compiled = 0
        self.frames_eager = 0
        self._compiled: CompiledSuffix | None = None
        self._building: int | None = None  # K of the build in progress
        self._closed = False
        self._lock = threading.Lock()
        self._pool = None
        self._temp_cache: Path | None = None  # where builds go when cache_dir cannot be written
        self._temporary_fallback = temporary_fallback
        self._num_layers = stage.cfg.num_layers
        self._last_k: int | None = None  # the K of the last frame
        self.active = name != "eager"
        why_not = traceable(stage) if self.active else ""
        if why_not:
            self.active, self.error = False, why_not
            self._log("warning", f"suffix_backend {name} cannot be used, falling back to eager: {self.error}")
            return
        if self.active:
            try:
                _openvino()
            except ImportError as e:
                self.active = False
                self.error = str(e)
                self._log("warning", f"suffix_backend {name} cannot be used, falling back to eager: {e}")
                return
            if background:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="suffix_backend_build")

    # ------------------------------------------------------------------------------------------ state
    @property
    def in_use(self) -> str:
        """"openvino" while a compiled model is ready (it serves frames at its K), else "eager"."""
        return self.requested if self._compiled is not None else "eager"

    @property
    def compiled_k(self) -> int | None:
        """The K the ready compiled model covers, None when there is none."""
        c = self._compiled
        return None if c is None else c.k

    def status(self) -> BackendStatus:
        """The backend's state now, for logs and /diagnostics (:class:`BackendStatus`)."""
        with self._lock:  # one view of the compiled model, the build and the error (the build thread swaps them)
            c, building, error = self._compiled, self._building, self.error
        error = error or (f"K = L = {self._last_k}: no decoder blocks after the split to compile (the final "
                               "norm and head run eagerly)" if self.active and self._last_k == self._num_layers
                               else "")
        return BackendStatus(requested=self.requested, in_use=self.requested if c is not None else "eager",
                             compiled_k=c.k if c is not None else None,
                             building=building, precision=c.precision if c else "", error=error,
                             cache_dir=str(self._temp_cache or self.cache_dir), frames_compiled=self.frames_compiled,
                             frames_eager=self.frames_eager, last_build=self.builds[-1] if self.builds else None)

    # ------------------------------------------------------------------------------------------ builds
    def prepare(self, stage, k: int) -> None:
        """Start building the compiled model for frames at ``k`` (blocks [k, L) must be held by ``stage``);
        nothing when it is ready, building, has failed, or the backend is eager. One build at a time: a K asked
        for while another builds is asked for again by its next frame (each eagerly computed frame calls this).
        Call it on the runner's thread only: it takes the blocks from the stage, which re-splits move there."""
        if self._closed or not self.active or k in self.failed or k < stage.split_layer or k >= stage.cfg.num_layers:
            return
        with self._lock:
            if self.compiled_k == k or self._building is not None:
                return
            self._building = k
        # A re-split replaces the stage's ModuleList and never changes these block modules, so the build thread
        # can trace them while the runner computes (and moves) on.
        layers = list(stage.layers[k - stage.split_layer:])
        if not layers or layers[0].self_attn.layer_idx != k:  # never build an artifact for the wrong blocks
            self.failed[k] = f"the stage's blocks do not start at {k} (first held {stage.split_layer})"
            self._log("error", f"suffix_backend {self.requested}: {self.failed[k]}; frames at K={k} run eagerly")
            self._building = None
            return
        if self._pool is None:
            self._build(stage, k, layers)
        else:
            self._pool.submit(self._build, stage, k, layers)

    def _build_in_cache(self, stage, k: int, layers: list) -> CompiledSuffix:
        """:func:`build_openvino` into the cache folder; when that folder cannot be written (an OSError: read-only,
        not a folder, no permission), into a temporary folder of this process instead (made once, with a warning;
        removed at :meth:`close`), so the compiled suffix still serves, only not kept for a restart. Without
        ``temporary_fallback`` (or once closed) the OSError is raised: the build fails."""
        temp = self._temp_cache
        if temp is None:
            try:
                return build_openvino(stage, k, self.shape, model_id=self.model_id, cache_dir=self.cache_dir,
                                      threads=self.threads, layers=layers)
            except OSError as e:
                import tempfile

                with self._lock:
                    if self._closed or not self._temporary_fallback:
                        raise
                    temp = self._temp_cache = Path(tempfile.mkdtemp(prefix="hybrid_vla_suffix_"))
                self._log("warning", f"suffix_backend {self.requested}: the cache folder {self.cache_dir} cannot be "
                                     f"written ({type(e).__name__}: {e}); compiled suffixes go to "
                                     f"{self._temp_cache} for this run and are removed at cleanup (set "
                                     "backend_cache_dir to a writable folder to keep them)")
        return build_openvino(stage, k, self.shape, model_id=self.model_id, cache_dir=temp, threads=self.threads,
                              layers=layers)

    def _build(self, stage, k: int, layers: list) -> None:
        try:
            compiled = self._build_in_cache(stage, k, layers)
        except Exception as e:  # noqa: BLE001 - logged, this K serves eagerly from now on
            self.failed[k] = f"{type(e).__name__}: {e}"
            self.error = f"build for K={k} failed: {self.failed[k]}"
            self._log("error", f"suffix_backend {self.requested}: {self.error}; frames at K={k} run eagerly")
            compiled = None
        else:
            self.builds.append(BackendBuild(k=k, seconds=compiled.build_s, cache_hit=compiled.cache_hit,
                                            precision=compiled.precision, folder=str(compiled.folder)))
            self._log("info", f"suffix_backend {self.requested} ready for K={k} (blocks [{k}, "
                              f"{stage.cfg.num_layers}), precision {compiled.precision}) in {compiled.build_s:.1f} s "
                              f"({'cached artifact' if compiled.cache_hit else 'converted and saved'} at "
                              f"{compiled.folder})")
        with self._lock:
            if compiled is not None and not self._closed:
                self._compiled = compiled  # swapped in for the next frame at k
                self.error = ""
            self._building = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no build is in progress (True) or ``timeout`` s passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._building is not None:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # ------------------------------------------------------------------------------------------ frames
    def plan_all(self, stage, hidden_states: torch.Tensor, command: int, k: int | None = None):
        """:meth:`SuffixStage.plan_all` through the compiled model when it covers ``k`` (the frame's K),
        else eagerly (and a build for ``k`` starts). Same arguments, result and errors as the stage's."""
        k = stage.split_layer if k is None else k
        self._last_k = k
        if not isinstance(hidden_states, torch.Tensor):  # a SplitState with side tensors: the eager stage only
            self.frames_eager += 1
            return stage.plan_all(hidden_states, command, k)
        c = self._compiled
        if c is not None and c.k < stage.split_layer:  # its blocks were freed by a move up: free its copy too
            with self._lock:
                if self._compiled is c:
                    self._compiled = None
            c = None
        if c is not None and c.k == k and k >= stage.split_layer and tuple(hidden_states.shape) == self.shape:
            self.frames_compiled += 1
            return plan(stage, c.run(hidden_states), command)
        self.frames_eager += 1
        out = stage.plan_all(hidden_states, command, k)  # validates shape and K first
        self.prepare(stage, k)
        return out

    def __call__(self, stage, hidden_states: torch.Tensor, command: int, k: int | None = None) -> torch.Tensor:
        """Waypoints (N, 2) float32 m of the command's mode; see :meth:`plan_all`."""
        return self.plan_all(stage, hidden_states, command, k).waypoints

    def close(self) -> None:
        """Free the compiled model and stop taking builds; returns at once. A conversion in progress cannot be
        interrupted: it finishes on its thread (the interpreter waits for it at exit) and its model is dropped.
        A temporary build folder (a cache folder that could not be written) is removed."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._compiled = None
        if self._temp_cache is not None:  # builds of a cache folder that could not be written: not kept
            if self._building is None:
                shutil.rmtree(self._temp_cache, ignore_errors=True)
            else:  # a conversion is still writing there: removed when the interpreter exits
                import atexit

                atexit.register(shutil.rmtree, self._temp_cache, ignore_errors=True)
            self._temp_cache = None
