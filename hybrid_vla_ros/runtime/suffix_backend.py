"""How the CPU suffix computes decoder blocks [K, L): eagerly in torch, or through a compiled OpenVINO model.

``openvino`` converts blocks [K, L) at the frame shape (B, T, H) with ``openvino.convert_model`` (PyTorch frontend;
SDPA stays one ``ScaledDotProductAttention`` op), saves the IR (``model.xml`` + ``model.bin``) and compiles it for
the CPU plugin, whose oneDNN kernels and fusions (RMSNorm, rotary, SiLU x up) beat eager torch
(docs/performance.md). The model outputs only the read-out tokens' hidden states
(:func:`~hybrid_vla_ros.model.traced.read_out_tokens`), and its last block computes residual, norm and MLP for
those rows only where the block is pre-norm (:func:`~hybrid_vla_ros.model.traced.prunable`); final norm and heads
stay in torch (:func:`hybrid_vla_ros.model.modeling.plan`), so command, modes and decision logits are eager's.

A compiled model covers one K and one shape. A frame at another K runs eagerly while a build for that K runs in
the background; the new model is swapped in between frames, so a frame is never computed with a mismatched K.

Cache: ``<cache_dir>/<model id>/<backend>-k<K>-<dtype>-<B>x<T>x<H>-<key digest>/`` holds ``model.xml``,
``model.bin``, the plugin's blob cache (``ov_cache/``) and ``key.json`` (the whole :class:`ArtifactKey`), made
atomically by renaming a finished temporary folder. The key includes a digest of the weight bytes
(:func:`weights_digest`), since ``model_id`` does not hash weight values; an artifact is used only when its key
equals the wanted one field by field. Artifacts are never deleted here (each is about its blocks' weight size).

Precision: the plugin is told the stage dtype (``INFERENCE_PRECISION_HINT``), since by default it runs fp32 in
bf16 on a bf16 CPU; a bf16 suffix on a CPU without AVX512_BF16 / AMX computes in f32 from its bf16 weights.
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
from ..model.text import block_index
from ..model.traced import (BlocksToLastTokens, prunable, read_out_tokens, traceable,
                            traced_blocks)
from ..util.paths import cache_dir

#: Values of the suffix node's ``suffix_backend`` parameter.
BACKENDS = ("eager", "openvino")
#: Version of the artifact layout and of the traced module (bump when either changes: old artifacts are rebuilt).
ARTIFACT_FORMAT = 4
#: What a build found, beside ``key.json`` in an artifact: {"last_block_rows": the rows block L-1 computes after
#: attention, or null when it computes all (:func:`~hybrid_vla_ros.model.traced.prunable`)}.
BUILD_FILE = "build.json"


def default_cache_dir() -> Path:
    """``$HYBRID_VLA_CACHE``, else ``$XDG_CACHE_HOME/hybrid_vla_ros``, else ``~/.cache/hybrid_vla_ros``."""
    return cache_dir()


def weights_digest(blocks) -> str:
    """sha256 (hex) over the name, dtype, shape and bytes of every parameter and buffer of ``blocks``, in order.

    Equal only for the same values in the same dtype; one pass over the weights (about 1.5-2 GB/s with SHA-NI)."""
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

    ``model_id``: signed int64 (:func:`hybrid_vla_ros.model.checkpoint.model_id`); ``weights``: :func:`weights_digest`
    of blocks [split_layer, num_layers); ``shape``: (B, T, H); the version fields pin the code that built it."""

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
        """The artifact's folder under ``cache_dir``."""
        shape = "x".join(str(s) for s in self.shape)
        return (Path(cache_dir) / f"{self.model_id & (2**64 - 1):016x}"
                / f"{self.backend}-k{self.split_layer}-{self.dtype}-{shape}-{self.digest()[:16]}")


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


class CompiledSuffix:
    """One compiled model of blocks [k, L) at one input shape (from :func:`build_openvino`); one inference at a time.

    ``run(hidden)``: (T, H) or (B, T, H), any float dtype -> (..., tokens_out, H) in ``dtype``.
    ``last_block_rows``: rows block L-1 computes after attention, None when all."""

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
    """The CPU plugin's ``INFERENCE_PRECISION_HINT`` for ``dtype``: "bf16" / "f16" where
    ``OPTIMIZATION_CAPABILITIES`` has BF16 / FP16, else "f32"."""
    caps = set(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    if dtype == torch.bfloat16 and "BF16" in caps:
        return "bf16"
    if dtype == torch.float16 and "FP16" in caps:
        return "f16"
    return "f32"


def artifact_key(stage, k: int, shape: tuple, *, model_id: int, backend: str = "openvino",
                 layers=None) -> ArtifactKey:
    """The :class:`ArtifactKey` of blocks [k, L) at ``shape``. Raises ValueError when the stage lacks them,
    ImportError without openvino."""
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
    """:data:`BUILD_FILE`'s ``last_block_rows`` when it equals ``tokens_out``, else None (informative only)."""
    try:
        rows = json.loads((folder / BUILD_FILE).read_text()).get("last_block_rows")
    except (OSError, ValueError, AttributeError):
        return None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows == tokens_out else None


def plugin_config(precision: str, threads: int = 0, *, cache_dir: Path | None = None,
                  perf_count: bool = False) -> dict:
    """The CPU plugin's compile options (latency hint; threads 0: the plugin's default)."""
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
    """Compile blocks [k, L) for hidden states of ``shape`` ((T, H) or (B, T, H)), reusing a matching artifact.

    A matching artifact the plugin cannot compile (a damaged ``model.bin``) is rebuilt once. ``layers``: the blocks,
    taken on the runner's thread when building on another. Raises ImportError (no openvino), ValueError (the
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
    """One finished build of blocks ``[k, L)``: ``seconds`` (s), ``cache_hit``, ``precision``, ``folder``."""

    k: int
    seconds: float
    cache_hit: bool
    precision: str
    folder: str


@dataclass(frozen=True)
class BackendStatus:
    """:meth:`SuffixBackend.status`. ``compiled_k`` / ``building``: None when none; ``error``: why ``requested`` is
    not in use (also at K = L); ``cache_dir``: the temporary one when the configured one cannot be written."""

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
    """The suffix's compute path: eager torch, or a compiled model built per K.

    ``log(level, message)``: level "info" | "warning" | "error" (default: print). ``background`` False builds in
    the call that first needs it. ``temporary_fallback``: build into a process temporary folder (removed at
    :meth:`close`) when ``cache_dir`` cannot be written; False: that build fails (``hybrid-vla compile-suffix``).
    An unusable backend falls back to eager with one warning; a failed build for a K logs an error and serves
    that K eagerly without retry. Raises ValueError for an unknown name.
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
        """"openvino" while a compiled model is ready, else "eager"."""
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
        """Start building for frames at ``k`` unless ready, building, failed or eager. Runner's thread only (it takes
        the blocks from the stage). One build at a time; each eager frame asks again."""
        if self._closed or not self.active or k in self.failed or k < stage.split_layer or k >= stage.cfg.num_layers:
            return
        with self._lock:
            if self.compiled_k == k or self._building is not None:
                return
            self._building = k
        # A re-split replaces the stage's ModuleList and never changes these block modules, so the build thread
        # can trace them while the runner computes (and moves) on.
        layers = list(stage.layers[k - stage.split_layer:])
        if not layers or block_index(layers[0]) != k:  # never build an artifact for the wrong blocks
            self.failed[k] = f"the stage's blocks do not start at {k} (first held {stage.split_layer})"
            self._log("error", f"suffix_backend {self.requested}: {self.failed[k]}; frames at K={k} run eagerly")
            self._building = None
            return
        if self._pool is None:
            self._build(stage, k, layers)
        else:
            self._pool.submit(self._build, stage, k, layers)

    def _build_in_cache(self, stage, k: int, layers: list) -> CompiledSuffix:
        """:func:`build_openvino` into the cache folder, or on OSError into the temporary one (see the class)."""
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
        """:meth:`SuffixStage.plan_all`, compiled when the model covers ``k``, else eagerly (and a build starts)."""
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
        """Free the compiled model, stop taking builds and remove a temporary build folder; returns at once.

        A conversion in progress finishes on its thread (the interpreter waits for it at exit) and is dropped."""
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
