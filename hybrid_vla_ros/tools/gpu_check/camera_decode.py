"""Section 6, ``camera_decode``: 6 JPEG cameras of 1936 x 1216: nvJPEG (``torchvision.io.decode_jpeg`` on CUDA)
against the CPU path of the prefix (:func:`~hybrid_vla_ros.vehicle.image.compressed_msg_to_rgb`)."""
from __future__ import annotations

import time
from types import SimpleNamespace

from .common import CAMERA_WH, NEEDS_CUDA, pct
from .inputs import synthetic_rgb


def run(check) -> dict:
    """The section: :func:`decode_figures` of 6 cameras of :data:`~hybrid_vla_ros.tools.gpu_check.common.CAMERA_WH`
    (full size, ``--small`` too) on the check's device, ``check.sizes.reps`` decodes per path."""
    return decode_figures(str(check.device), CAMERA_WH,
                          reps=check.sizes.reps)


def _jpegs(wh: tuple[int, int], n: int = 6) -> tuple[list[bytes], str]:
    """``n`` JPEG camera frames of ``wh`` px and the encoder used (cv2, else torchvision, else PIL)."""
    import numpy as np

    images = [synthetic_rgb(wh[0], wh[1], seed=i) for i in range(n)]
    try:
        import cv2

        return [cv2.imencode(".jpg", img[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
                for img in images], "cv2"
    except ImportError:
        pass
    try:
        import torch
        from torchvision.io import encode_jpeg

        return [encode_jpeg(torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), quality=90)
                .numpy().tobytes()
                for img in images], "torchvision"
    except ImportError:
        import io

        from PIL import Image

        outs = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            outs.append(buf.getvalue())
        return outs, "PIL"


def decode_figures(device_name: str, wh: tuple[int, int], reps: int = 10) -> dict:
    """6 JPEG cameras of ``wh`` px decoded per frame, ms (median of ``reps``): the prefix's CPU path
    (``compressed_msg_to_rgb``, cv2), torchvision's CPU decoder where installed and nvJPEG
    (``torchvision.io.decode_jpeg(..., device='cuda')``, batched) on CUDA."""
    import torch

    from ...runtime.device import resolve_device

    device = resolve_device(device_name)
    jpegs, encoder = _jpegs(wh)
    out = {"cameras": len(jpegs), "width": wh[0], "height": wh[1], "encoder": encoder,
           "jpeg_bytes": sum(len(j) for j in jpegs), "paths": {}}

    def timed(fn, sync=False) -> dict:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if sync:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        return {"ms_p50": round(sorted(times)[len(times) // 2], 3), "ms": pct(times)}

    try:
        from ...vehicle.image import compressed_msg_to_rgb

        msgs = [SimpleNamespace(format="rgb8; jpeg compressed bgr8", data=j) for j in jpegs]
        out["paths"]["cpu_prefix_path"] = timed(lambda: [compressed_msg_to_rgb(m) for m in msgs])
    except ImportError as e:
        out["paths"]["cpu_prefix_path"] = {"status": f"not available: {e}"}
    try:
        from torchvision.io import decode_jpeg

        datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        out["paths"]["torchvision_cpu"] = timed(lambda: [decode_jpeg(d) for d in datas])
        if device.type == "cuda":
            out["paths"]["nvjpeg_cuda"] = timed(lambda: decode_jpeg(datas, device=str(device)), sync=True)
        else:
            out["paths"]["nvjpeg_cuda"] = {"status": NEEDS_CUDA}
    except ImportError:
        out["paths"]["torchvision_cpu"] = {"status": "torchvision is not installed"}
        out["paths"]["nvjpeg_cuda"] = {"status": "torchvision is not installed" + ("" if device.type == "cuda"
                                                                                  else f"; {NEEDS_CUDA}")}
    return out
