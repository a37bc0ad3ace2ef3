"""Camera preprocessing as a share of the prefix stage: 6 cameras of 1600x900 per frame.

Inputs, per preset:

* ``jpeg``: six ``sensor_msgs/CompressedImage``-like objects (``format`` "jpeg", ``data`` bytes), decoded by
  OpenCV to RGB, resized (INTER_AREA) to the preset's S x S input and normalised;
* ``jpeg_fast``: the same JPEGs with the prefix's ``fast_jpeg_decode`` (decoded scaled down by 2, 4 or 8
  inside libjpeg while both sides stay >= S; no reduction for S > 450 on 1600x900 cameras);
* ``rgb8``: six ``sensor_msgs/Image``-like objects (``encoding`` rgb8, 1600x900, ``step`` 4800, ``data`` an
  ``array('B')`` as rclpy delivers it), viewed in place (no copy) and resized with each filter of
  ``model.config.RESIZE_FILTERS`` (area, bilinear, bicubic, orion_crop) into the model tensor.

The JPEG rows run with each decoder (``vehicle.image.JPEG_DECODER``: OpenCV's imdecode and simplejpeg), side by
side. Every row has the one-pass limit (``limit_ms``, :func:`memory_pass_ms`: one copy of the six cameras'
rgb8 pixels, 26 MB, into buffers allocated beforehand) and ``ratio_to_limit`` = preprocess / limit.

The code path is the prefix's own: :meth:`PrefixRunner.run <hybrid_vla_ros.runtime.prefix.PrefixRunner.run>` is
called on each frame and its ``PrefixResult.preprocess_ms`` (decode + convert + resize + normalise of all
cameras, wall time) and ``prefix_ms`` (vision encoder .. block K-1 on the prefix device) are taken; decode alone
is timed with :meth:`PrefixRunner.decode`. ``share`` = preprocess / (preprocess + prefix), medians over the
frames. The worker is pinned to the prefix cores with one torch thread per core; OpenCV keeps its own default
thread pool (sized to the cores the process may use), as in the prefix node.

Frames: the six nuScenes CAM_* JPEGs of ``../shared/data/nuscenes_scene0061_mmdet3d_demo`` (1600x900; see
its SOURCE.txt: scene-0061, CC BY-NC-SA 4.0) when present, else the embedded bag's frames resized to
1600x900 with OpenCV (INTER_AREA) and re-encoded as JPEG (quality 90).
"""
from __future__ import annotations

import uuid
from array import array
from pathlib import Path
from types import SimpleNamespace

from .common import DEFAULT_BAG, NUSCENES_DIR, Worker, percentiles

WIDTH, HEIGHT = 1600, 900
NUSCENES_ORDER = ("CAM_FRONT", "CAM_FRONT_LEFT", "CAM_FRONT_RIGHT", "CAM_BACK_LEFT", "CAM_BACK_RIGHT", "CAM_BACK")


def camera_jpegs(camera_dir: str | Path | None = NUSCENES_DIR,
                 bag: str | Path = DEFAULT_BAG) -> tuple[list[bytes], str]:
    """Six 1600x900 JPEG payloads and a description of where they came from (see the module docstring)."""
    import cv2
    import numpy as np

    if camera_dir is not None and Path(camera_dir).is_dir():
        files = sorted(Path(camera_dir).glob("*.jpg"))
        ordered = [next((f for f in files if f"__{cam}__" in f.name), None) for cam in NUSCENES_ORDER]
        if all(ordered):
            data = [f.read_bytes() for f in ordered]
            shapes = {cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR).shape[:2] for d in data}
            if shapes == {(HEIGHT, WIDTH)}:
                return data, f"nuScenes scene-0061 CAM_* JPEGs from {camera_dir} (1600x900, as recorded)"
    from ...vehicle.image import compressed_msg_to_rgb
    from .pipeline import load_bag_frames

    items, _ = load_bag_frames(bag)[0]
    out = []
    for _t, msg in items[:6]:
        rgb = compressed_msg_to_rgb(msg)
        bgr = cv2.cvtColor(cv2.resize(rgb, (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2BGR)
        ok, enc = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 90])
        if not ok:
            raise RuntimeError("OpenCV could not encode a JPEG")
        out.append(enc.tobytes())
    return out, f"embedded bag {bag} frame 0, resized to 1600x900 and re-encoded (JPEG quality 90)"


def compressed_items(jpegs: list[bytes]) -> list:
    """``("compressed", CompressedImage-like)`` items, camera order."""
    return [("compressed", SimpleNamespace(format="jpeg", data=d)) for d in jpegs]


def raw_items(jpegs: list[bytes]) -> list:
    """``("raw", Image-like rgb8)`` items with ``data`` as ``array('B')`` (what rclpy delivers)."""
    import cv2
    import numpy as np

    items = []
    for d in jpegs:
        rgb = cv2.cvtColor(cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        h, w = rgb.shape[:2]
        items.append(("raw", SimpleNamespace(encoding="rgb8", height=h, width=w, step=3 * w, is_bigendian=0,
                                             data=array("B", rgb.tobytes()))))
    return items


#: The cases of the preprocessing part: (input kind, JPEG decoder, resize filter). ``decoder`` None: not a JPEG.
#: The JPEG rows put the decoders side by side (vehicle.image.JPEG_DECODER), the rgb8 rows the resize filters
#: (model.config.RESIZE_FILTERS) from the same message bytes.
CASES = (("jpeg", "opencv", "area"), ("jpeg", "simplejpeg", "area"), ("jpeg_fast", "opencv", "area"),
         ("jpeg_fast", "simplejpeg", "area"), ("rgb8", None, "area"), ("rgb8", None, "bilinear"),
         ("rgb8", None, "bicubic"), ("rgb8", None, "orion_crop"))


def memory_pass_ms(items: list, repeats: int = 9) -> float:
    """The one-pass limit of a frame's camera pixels (ms, median of ``repeats``): every rgb8 image of ``items``
    (raw ``(transport, msg)`` items) copied once, read and written, into buffers allocated beforehand --
    the least any resize that reads every pixel costs on this core."""
    import time

    import numpy as np

    src = [np.frombuffer(m.data, np.uint8) for _, m in items]
    dst = [np.empty_like(a) for a in src]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for a, b in zip(src, dst):
            np.copyto(b, a)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return float(np.median(times))


def preprocess_task(chan, *, presets: list[dict], dtype: str, threads: int, camera_dir: str | None,
                    bag: str = str(DEFAULT_BAG), min_frames: int = 5, max_frames: int = 40,
                    min_seconds: float = 2.0, device: str = "cpu") -> dict:
    """Worker (pinned to the prefix cores): per preset and case (:data:`CASES`), the prefix loop (PrefixRunner.run)
    on the 6 cameras until at least ``min_frames`` frames and ``min_seconds`` s (at most ``max_frames``), after one
    warm-up frame; the one-pass limit (:func:`memory_pass_ms`) measured between the frames of each case."""
    import time

    import torch

    from ...runtime.loops import PrefixLoop, counting_context
    from ...runtime.prefix import PrefixRunner
    from ...runtime.settings import PrefixRunnerSettings
    from ...vehicle import image
    from .pipeline import _frame_inputs, bag_scene

    torch.set_num_threads(threads)
    jpegs, source = camera_jpegs(camera_dir, bag)
    items_of = {"jpeg": compressed_items(jpegs), "jpeg_fast": compressed_items(jpegs), "rgb8": raw_items(jpegs)}
    installed = image.JPEG_DECODER
    out = []
    for spec in presets:
        runner = PrefixRunner(spec["model_path"], PrefixRunnerSettings(
            spec["split_layer"], device=device, dtype=dtype, ring_name=f"bench_pre_{uuid.uuid4().hex[:10]}",
            torch_threads=threads))
        scene = bag_scene(runner.cfg, bag)  # the query heads' geometry and ego frame, from the bag's calibration
        ctx, drops = counting_context(runner)
        loop = PrefixLoop(ctx, pace=False,
                          frame_inputs=lambda stamp, items: _frame_inputs(runner.cfg, stamp, scene))

        def frame(seq: int, items: list):
            r = loop.process((seq, items))
            if r is None:
                raise RuntimeError(f"{spec['name']}: the prefix dropped a frame: {drops.last}")
            return r

        own_filter = runner.cfg.image_resize
        try:
            for kind, decoder, resize in CASES:
                if decoder == "simplejpeg" and installed != "simplejpeg":
                    chan.send({"type": "progress", "line": f"  {spec['name']} {kind} simplejpeg: skipped "
                                                          "(simplejpeg is not installed)"})
                    continue
                items = items_of[kind]
                image.JPEG_DECODER = decoder or installed
                runner.cfg.image_resize = resize  # the bench's case; the checkpoint's own filter is put back below
                runner.fast_jpeg_decode = kind == "jpeg_fast"  # PrefixRunner's scaled-down JPEG decode
                frame(0, items)  # warm-up
                pre, pfx, dec, lim, t0, i = [], [], [], [], time.monotonic(), 0
                while i < max_frames and (i < min_frames or time.monotonic() - t0 < min_seconds):
                    r = frame(i + 1, items)
                    pre.append(r.preprocess_ms)
                    pfx.append(r.prefix_ms)
                    # decode alone, right after each frame (same load on the machine); the images are freed
                    # after the clock stops, as run() frees them after its preprocess timer
                    t_a = time.perf_counter_ns()
                    images = runner.decode(items)
                    t_b = time.perf_counter_ns()
                    del images
                    dec.append((t_b - t_a) / 1e6)
                    lim.append(memory_pass_ms(items_of["rgb8"], repeats=3))
                    i += 1
                p, q, d, limit = percentiles(pre), percentiles(pfx), percentiles(dec), percentiles(lim)["p50"]
                decode_ms = d["p50"]
                out.append({"preset": spec["name"], "input": kind, "decoder": decoder, "resize": resize,
                            "split_layer": spec["split_layer"], "image_size": runner.cfg.image_size,
                            "cameras": len(items), "camera_size": [WIDTH, HEIGHT], "frames": i,
                            "preprocess_ms": p, "prefix_ms": q, "decode_ms": decode_ms,
                            "resize_normalize_ms": p["p50"] - decode_ms, "limit_ms": limit,
                            "ratio_to_limit": p["p50"] / limit if limit > 0 else None,
                            "share": p["p50"] / (p["p50"] + q["p50"])})
                chan.send({"type": "progress", "line": f"  {spec['name']} {kind} {decoder or ''} {resize}: "
                                                      f"preprocess {p['p50']:.1f} ms (decode {decode_ms:.1f}), "
                                                      f"one-pass limit {limit:.1f} ms, prefix {q['p50']:.1f} ms, "
                                                      f"share {out[-1]['share']:.2f}"})
        finally:
            runner.cfg.image_resize = own_filter
            image.JPEG_DECODER = installed
            runner.close()
    return {"results": out, "source": source}


def run_preprocess_part(plans: dict, *, dtype: str, cores=(0,), camera_dir: str | Path | None = NUSCENES_DIR,
                        bag: str | Path = DEFAULT_BAG, min_frames: int = 5, min_seconds: float = 2.0,
                        device: str = "cpu", log=print) -> dict:
    """The whole preprocessing part for prepared presets (:func:`.pipeline.prepare_preset`); its JSON section."""
    specs = [{"name": n, "model_path": p["model_path"], "split_layer": p["split_layer"]} for n, p in plans.items()]
    log(f"camera preprocessing: {', '.join(plans)}; 6 cameras 1600x900, jpeg (OpenCV and simplejpeg) and rgb8 "
        f"({', '.join(r for k, _, r in CASES if k == 'rgb8')}), cores {list(cores)}")
    with Worker("preprocess", {"presets": specs, "dtype": dtype, "threads": len(cores),
                               "camera_dir": str(camera_dir) if camera_dir else None, "bag": str(bag),
                               "min_frames": min_frames, "min_seconds": min_seconds, "device": device},
                cores=list(cores)) as w:
        data = w.result(3600, log=log)
    return {"source": data["source"], "cores": list(cores), "dtype": dtype, "device": device,
            "share_definition": "preprocess / (preprocess + prefix), medians of PrefixResult over the frames",
            "limit_definition": "one copy of the 6 cameras' rgb8 pixels into buffers allocated beforehand "
                                "(memory_pass_ms), median, measured between the frames of each case",
            "results": data["results"]}
