"""Security properties: weights never unpickled, no eval of inputs, private shared memory."""
import os
import re
import stat
import uuid
from pathlib import Path

import pytest
import torch

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, load_stage, model_id
from hybrid_vla_ros.transport.ring import RingProducer, segment_name

PACKAGE = Path(__file__).resolve().parent.parent / "hybrid_vla_ros"
FORBIDDEN = {
    r"\btorch\.load\(": "torch.load unpickles: weights come only from safetensors",
    r"\bpickle\.loads?\(": "pickle executes code from the file",
    r"(?<![\w.])eval\(": "eval of anything that came from outside",
    r"(?<![\w.])exec\(": "exec of anything that came from outside",
    r"\byaml\.load\(": "yaml.load can build arbitrary objects: use yaml.safe_load",
    r"\byaml\.unsafe_load\(": "yaml.unsafe_load builds arbitrary objects",
    r"weights_only\s*=\s*False": "torch.load(weights_only=False) unpickles",
}


def test_package_source_has_no_unsafe_deserialisation_or_eval():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {why}")
    assert not offenders, "\n".join(offenders)


def test_a_pickled_checkpoint_is_refused_not_loaded(tmp_path, tiny_checkpoint):
    """A directory holding only PyTorch pickle weights is not a checkpoint for us: no unpickling happens."""
    ck = tmp_path / "pickled"
    ck.mkdir()
    (ck / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"payload": Payload()}, ck / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=WEIGHTS_FILE):
        load_stage(ck, "full")
    assert not marker.exists()


def test_corrupt_safetensors_header_is_rejected(tmp_path, tiny_checkpoint):
    ck = tmp_path / "corrupt"
    ck.mkdir()
    (ck / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    (ck / WEIGHTS_FILE).write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="implausible"):
        model_id(ck)
    with pytest.raises(Exception):
        load_stage(ck, "suffix", 1)


def test_ring_segment_is_private_and_scoped_by_user_and_namespace():
    ns = f"/sec_{uuid.uuid4().hex[:6]}"
    name = segment_name("prefix_states", ns)
    assert f".{os.getuid()}." in name and ns.strip("/") in name
    old = os.umask(0)
    try:
        with RingProducer(name, 3, 1024, 1) as ring:
            mode = stat.S_IMODE(os.stat(ring.path).st_mode)
    finally:
        os.umask(old)
    assert mode == 0o600
    for bad in ("../x", "a/b", "", "x" * 200):
        with pytest.raises(ValueError):
            segment_name(bad, ns)
