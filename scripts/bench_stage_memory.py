#!/usr/bin/env python3
"""Peak RSS of a process loading one stage of a sharded transformers checkpoint, against the stage's bytes.

What it shows: loading the suffix at K holds in memory only the suffix's own tensors (decoder blocks [K, L) and
the final norm), not the checkpoint, even when the checkpoint is many times larger.

1. writes a random LLaMA-shaped ``LlamaForCausalLM`` with transformers' own ``save_pretrained`` (sharded,
   ``--shard`` per file; default shape: width 1024, 24 blocks, MLP 2816, vocab 32000, fp32: 1.33 GB on disk)
   into a temporary directory (removed at the end unless ``--keep``);
2. for each case, in a **fresh process** (so nothing is cached in the measuring process): imports torch,
   transformers and this package, opens the checkpoint, resets the kernel's peak-RSS mark
   (``/proc/self/clear_refs`` = 5), loads the stage, and reads ``VmHWM`` / ``VmRSS`` / ``RssAnon`` /
   ``RssFile`` from ``/proc/self/status``;
3. prints, per case, the stage's tensor bytes (counted from the loaded module), the peak RSS growth over the
   process's RSS just before the load, what is still held after it, and the ratio peak / tensors; and, for
   contrast, the same process reading the whole checkpoint into its memory (``safetensors.torch.load_file``
   of every shard, each tensor copied out of the file mapping as the loader does).

The page cache is warm after the write (the shards were just written): a cold read would take longer, not
hold more. This is a benchmark that prints figures, not a test (Linux only: /proc). Usage:

    PYTHONPATH=. .venv/bin/python scripts/bench_stage_memory.py [--layers 24] [--hidden 1024] [--shard 200MB]
        [--keep DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys
import torch, transformers  # noqa: F401 - imported before the baseline, as in a node process
from hybrid_vla_ros.model.checkpoint import open_checkpoint

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

path, role, k, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ck = open_checkpoint(path)
ck.source()  # headers read (a few kB) before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status()
if role == "whole":
    from safetensors.torch import load_file
    held = {}
    for file in ck.source().files():  # every tensor of every shard into this process's memory
        held.update({name: t.clone() for name, t in load_file(str(file)).items()})
    nbytes = sum(t.numel() * t.element_size() for t in held.values())
else:
    stage = ck.load(role, k, dtype=dtype)
    nbytes = sum(t.numel() * t.element_size() for t in list(stage.parameters()) + list(stage.buffers()))
after = status()
print(json.dumps({"before": before, "after": after, "stage_bytes": nbytes}))
"""


def _write_checkpoint(path: Path, layers: int, hidden: int, mlp: int, vocab: int, shard: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), vocab_size=vocab,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(str(path), max_shard_size=shard)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _measure(path: Path, role: str, k: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), role, str(k), dtype], capture_output=True,
                         text=True, check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    doc["peak_growth"] = doc["after"]["VmHWM"] - doc["before"]["VmRSS"]
    doc["held_growth"] = doc["after"]["VmRSS"] - doc["before"]["VmRSS"]
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard", default="200MB", help="save_pretrained max_shard_size")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = p.parse_args()
    tmp = None
    if args.keep:
        path = Path(args.keep)
    else:
        tmp = tempfile.mkdtemp(prefix="bench_stage_memory_")
        path = Path(tmp) / "llama"
    try:
        disk = _write_checkpoint(path, args.layers, args.hidden, args.mlp, args.vocab, args.shard)
        shards = len(list(path.glob("model-*.safetensors")))
        L = args.layers
        cases = [("suffix", L // 2, "fp32"), ("suffix", 3 * L // 4, "fp32"), ("suffix", L // 2, "bf16"),
                 ("prefix", L // 4, "fp32"), ("whole", 0, "fp32")]
        print(f"checkpoint: LlamaForCausalLM, {L} blocks, width {args.hidden}, {disk / 1e9:.2f} GB on disk in "
              f"{shards} shards (fp32), {path}")
        print(f"{'stage':<22} {'tensors MB':>11} {'peak RSS growth MB':>19} {'held after MB':>14} "
              f"{'peak / tensors':>15}")
        rows = []
        for role, k, dtype in cases:
            m = _measure(path, role, k, dtype)
            label = "whole (load_file)" if role == "whole" else f"{role} K={k} {dtype}"
            ratio = m["peak_growth"] / m["stage_bytes"]
            print(f"{label:<22} {m['stage_bytes'] / 1e6:>11.1f} {m['peak_growth'] / 1e6:>19.1f} "
                  f"{m['held_growth'] / 1e6:>14.1f} {ratio:>15.3f}")
            rows.append({"case": label, "role": role, "k": k, "dtype": dtype, **m, "ratio": ratio})
        if args.json:
            from hybrid_vla_ros.tools.harness import write_report

            write_report({"disk_bytes": disk, "shards": shards, "rows": rows}, args.json, indent=2)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
