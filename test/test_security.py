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


#: The one place a pickle may ever be read: the converter of published .pth checkpoints (issue #14), with
#: torch's weights-only unpickler on a memory map, exactly this call. (file, the stripped line)
ALLOWED = {("hybrid_vla_ros/model/published.py",
            'obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")')}


def _offenders(files: dict[str, str]) -> tuple[list[str], set]:
    """(offending lines, allowed sites found) of ``{relative path: source text}``."""
    offenders, allowed = [], set()
    for rel, text in files.items():
        for lineno, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if (rel, code.strip()) in ALLOWED:
                allowed.add((rel, code.strip()))
                continue
            for pattern, why in FORBIDDEN.items():
                if re.search(pattern, code):
                    offenders.append(f"{rel}:{lineno}: {why}")
    return offenders, allowed


def test_package_source_has_no_unsafe_deserialisation_or_eval():
    files = {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in PACKAGE.rglob("*.py")}
    offenders, allowed = _offenders(files)
    assert not offenders, "\n".join(offenders)
    assert allowed == ALLOWED, "the allowed converter site moved: update ALLOWED, never widen it"
    assert sum(t.count("torch.load(") for t in files.values()) == 1


def test_the_allow_list_admits_only_that_exact_call_in_that_file():
    site_file, site = next(iter(ALLOWED))
    assert _offenders({site_file: site})[0] == []
    assert _offenders({"hybrid_vla_ros/model/checkpoint.py": site})[0]  # the same call elsewhere
    assert _offenders({site_file: site.replace("weights_only=True", "weights_only=False")})[0]
    assert _offenders({site_file: site.replace(", mmap=True", "")})[0]
    assert _offenders({site_file: "state = torch.load(other)"})[0]


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
