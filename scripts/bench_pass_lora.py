#!/usr/bin/env python3
"""MindDrive's two LLM passes on one base: shared base + a low-rank delta per pass vs two merged copies.

MindDrive (issue #14) runs its Qwen2 LLM twice a frame with two LoRA adapters (``decision_expert``,
``action_expert``; r = 16, alpha = 16 on q/k/v/o). Two ways to run both passes through one decoder block:

* ``delta``: one block, its q/k/v/o :class:`hybrid_vla_ros.model.modeling.PassLoRALinear` (base weights
  shared; per pass ``x @ A_p^T @ B_p^T`` added), the two passes as a batch of 2 -- what converted MindDrive
  checkpoints run;
* ``merged``: two blocks whose q/k/v/o are each pass's merged ``W + alpha / r * B A`` (MLP and norms shared:
  LoRA does not touch them), each pass through its own block (batch 1).

It prints, per block: the bytes of the weights each option holds (counted from the modules: fp32 and fp16,
the prefix's and the suffix's dtype) and the median time of one block over both passes on this CPU at
minddrive-0.5b widths (Qwen2-0.5B: width 896, 14 heads, 2 KV heads, MLP 4864; T = 523 tokens, the
minddrive-0.5b preset's sequence), after a warm-up. Random weights; the figures are what the arithmetic and
memory traffic cost, which does not depend on the values. A benchmark that prints figures, not a test::

    PYTHONPATH=. .venv/bin/python scripts/bench_pass_lora.py [--repeats 7] [--threads N] [--preset minddrive-0.5b]
        [--tokens T] [--json OUT]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _bytes(modules, dtype: torch.dtype) -> int:
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * torch.empty((), dtype=dtype).element_size()
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="minddrive-0.5b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=None, help="T (default: the preset's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from hybrid_vla_ros.model.config import preset
    from hybrid_vla_ros.tools.harness import write_report
    from hybrid_vla_ros.model import text
    from hybrid_vla_ros.model.modeling import PASS_LORA_TARGETS, _blocks, llm_config, llm_family

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg_delta = preset(args.preset, llm_passes=2, pass_lora_rank=args.rank)
    cfg_plain = preset(args.preset, llm_passes=2)
    llm = llm_config(cfg_plain)
    T = args.tokens or cfg_plain.num_tokens
    H = cfg_plain.hidden_size
    torch.manual_seed(0)
    delta = _blocks(cfg_delta, llm_config(cfg_delta), 0, 1)[0].eval()
    with torch.no_grad():
        for name in PASS_LORA_TARGETS:
            lin = getattr(delta.self_attn, name)
            lin.lora_A.normal_(0, lin.in_features ** -0.5)
            lin.lora_B.normal_(0, 0.01)
    merged = [_blocks(cfg_plain, llm, 0, 1)[0].eval() for _ in range(2)]
    with torch.no_grad():
        for p, block in enumerate(merged):
            block.mlp = delta.mlp  # shared with the base: LoRA adapts attention only
            block.input_layernorm = delta.input_layernorm
            block.post_attention_layernorm = delta.post_attention_layernorm
            for name in PASS_LORA_TARGETS:
                src, dst = getattr(delta.self_attn, name), getattr(block.self_attn, name)
                dst.weight.copy_(src.weight + src.lora_B[p] @ src.lora_A[p])
                if dst.bias is not None:
                    dst.bias.copy_(src.bias)
    rotary = text.make_rotary(llm_family(cfg_plain), llm)
    x = torch.randn(2, T, H)
    pos = torch.arange(T).unsqueeze(0)
    cos_sin = rotary(x, pos)

    def run_delta():
        return delta(x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)

    def run_merged():
        return torch.cat([merged[p](x[p:p + 1], attention_mask=None, position_ids=pos,
                                    position_embeddings=cos_sin) for p in range(2)])

    with torch.inference_mode():
        a, b = run_delta(), run_merged()
        agree = float((a - b).abs().max())
        fns = {"delta": run_delta, "merged": run_merged}
        ts = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(args.repeats):  # interleaved, so a load change on a shared machine hits both alike
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                ts[name].append((time.perf_counter() - t0) * 1e3)
        times = {name: statistics.median(v) for name, v in ts.items()}
    L = cfg_plain.num_layers
    res = {"preset": args.preset, "tokens": T, "hidden": H, "rank": args.rank, "blocks": L,
           "threads": torch.get_num_threads(), "max_abs_diff_delta_vs_merged": agree, "ms_per_block": times,
           "bytes_per_block": {}}
    for dt_name, dt in (("fp32", torch.float32), ("fp16", torch.float16)):
        res["bytes_per_block"][dt_name] = {"delta": _bytes([delta], dt), "merged": _bytes(merged, dt)}
    print(f"{args.preset}: width {H}, T = {T}, r = {args.rank}, 2 passes, {res['threads']} CPU threads; "
          f"delta vs merged outputs agree to {agree:.2e}")
    print("option  | weights/block fp32 | fp16     | x {L} blocks fp16 | ms/block (both passes, fp32 CPU)".format(L=L))
    for name in ("delta", "merged"):
        b32, b16 = res["bytes_per_block"]["fp32"][name], res["bytes_per_block"]["fp16"][name]
        print(f"{name:7s} | {b32 / 1e6:15.2f} MB | {b16 / 1e6:6.2f} MB | {b16 * L / 1e6:14.1f} MB | "
              f"{times[name]:.2f}")
    if args.json:
        write_report(res, args.json, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
