"""Section 9, ``decode``: a decode across the split with the prefix on the check's device and the suffix in a CPU
process pinned to the suffix cores, through the ring's decode channel (issue 40).

Per token: the prefix's step (embedding + blocks [0, K) on the device, its row copied into the ring's decode
region) and its wait for the reply (the suffix's token and both crossings); the suffix process sends back its own
per-token compute, so the crossings' share is the wait minus that. The model is a LLaMA of SmolLM2-135M's shape
(``--small``: 4 blocks of width 256) written by transformers' ``save_pretrained`` with seeded random weights (a
decode's time does not depend on the weights), split at K = L / 2; 16 greedy tokens after 64 prompt tokens, three
frames, the first a warm-up. Both sides compute in fp32 (the check's prefix dtype where the ring would convert).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import uuid
from pathlib import Path

PROMPT, NEW_TOKENS, FRAMES = 64, 16, 3
#: SmolLM2-135M's shape (its config.json), and the --small one.
SMOL_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0}
SMALL_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": True}


def run(check) -> dict:
    """The section on the check's device and cores."""
    path = write_model(check.cache / ("decode_small" if check.args.small else "decode_smol"), check.args.small)
    return decode_figures(path, str(check.device), check.suffix_cores, check.prefix_cores,
                          timeout_s=max(30.0, check.left_s()))


def write_model(path: Path, small: bool) -> Path:
    """A seeded LLaMA of :data:`SMOL_SHAPE` (or :data:`SMALL_SHAPE`) at ``path`` (written once)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(SMALL_SHAPE if small else SMOL_SHAPE))).save_pretrained(path)
    return path


def _suffix_process(path: str, k: int, segment: str, cores, conn) -> None:
    """The CPU suffix: attaches to the ring, answers every frame's decode, sends its per-token compute (ms)."""
    try:
        if cores:
            os.sched_setaffinity(0, cores)
        import torch

        from ...model.checkpoint import open_checkpoint
        from ...model.decode import DecodeSettings, SideCache, SuffixDecoding
        from ...runtime.decoding import SuffixDecodeLoop
        from ...transport.ring import RingConsumer

        torch.set_num_threads(max(1, len(cores)))
        ck = open_checkpoint(path, tokens=PROMPT)
        sm = ck.split_model()
        settings = DecodeSettings(max_new_tokens=NEW_TOKENS)
        decoding = SuffixDecoding(sm, ck.load("suffix", k), ck.load("lm_head"),
                                  SideCache(sm.text_config(), PROMPT + NEW_TOKENS - 1, k), settings)
        ring = RingConsumer(segment)
        loop = SuffixDecodeLoop(decoding, ring.decode, 60.0, torch.float32)
        conn.send({"type": "ready"})
        with torch.inference_mode():
            for _ in range(FRAMES):
                slot = ring.read(60.0)
                if slot is None:
                    raise TimeoutError("no prefill slot within 60 s")
                with slot:
                    prefill, seq = slot.compute_tensor.clone(), slot.meta.seq
                done = loop.answer(seq, prefill)
                conn.send({"type": "frame", "tokens": done.tokens, "ended": done.ended,
                           "suffix_token_ms": done.suffix_token_ms})
        ring.close()
    except BaseException as e:  # noqa: BLE001 - to the parent, which reports it in the section
        conn.send({"type": "error", "error": f"{type(e).__name__}: {e}"})


def decode_figures(path: Path, device_name: str, suffix_cores, prefix_cores=None, timeout_s: float = 300.0) -> dict:
    """The decode of the model at ``path`` with its prefix on ``device_name`` in this process (pinned to
    ``prefix_cores`` with as many torch threads meanwhile, so its threads do not take the suffix's cores); per-token
    figures (ms) of the frames after the first."""
    import torch

    old_cores, old_threads = os.sched_getaffinity(0), torch.get_num_threads()
    if prefix_cores:
        os.sched_setaffinity(0, prefix_cores)
        torch.set_num_threads(len(prefix_cores))
    try:
        return _decode_figures(path, device_name, suffix_cores, timeout_s)
    finally:
        os.sched_setaffinity(0, old_cores)
        torch.set_num_threads(old_threads)


def _decode_figures(path: Path, device_name: str, suffix_cores, timeout_s: float) -> dict:
    import torch

    from ...model.checkpoint import open_checkpoint
    from ...model.decode import PrefixDecoding, SideCache
    from ...runtime.decoding import PrefixDecodeLoop
    from ...runtime.device import resolve_device
    from ...transport.ring import RingProducer, segment_name, slot_bytes_for
    from .common import sync

    device = resolve_device(device_name)
    ck = open_checkpoint(path, tokens=PROMPT)
    sm = ck.split_model()
    k = ck.num_layers // 2
    prefix = ck.load("prefix", k, device=device)
    decoding = PrefixDecoding(sm, prefix, SideCache(sm.text_config(), PROMPT + NEW_TOKENS - 1, 0))
    inputs = tuple(t.to(device) for t in sm.example_inputs(None))
    shape = (PROMPT, int(ck.model.llm["hidden_size"]))
    segment = segment_name(f"gpucheck_dec_{os.getpid()}_{uuid.uuid4().hex[:6]}", "/")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ring = RingProducer(segment, 3, slot_bytes_for(shape, torch.float32), 1, dtype=torch.float32, state_shape=shape,
                        decode_rows=1)
    proc = ctx.Process(target=_suffix_process, args=(str(path), k, segment, list(suffix_cores), child), daemon=True)
    proc.start()
    frames = []
    try:
        _expect(parent, "ready", timeout_s)
        loop = PrefixDecodeLoop(decoding, ring.decode, 60.0)
        with torch.inference_mode():
            for _ in range(FRAMES):
                h = decoding.prefill(inputs)
                sync(device)
                slot = ring.acquire(shape, torch.float32)
                slot.tensor.copy_(h)
                seq = ring.publish(slot, stamp_ns=1, split_layer=k)
                followed = loop.follow(seq)
                answered = _expect(parent, "frame", timeout_s)
                frames.append((followed, answered))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        ring.close()
    measured = frames[1:]
    prefix_ms = [t for f, _ in measured for t in f.prefix_step_ms]
    waits = [t for f, _ in measured for t in f.reply_wait_ms[1:]]  # the replies to steps (the first: the prefill)
    suffix_ms = [t for _, a in measured for t in a["suffix_token_ms"][1:]]
    crossing = statistics.median(waits) - statistics.median(suffix_ms)
    shape = "SmolLM2-135M's shape" if ck.num_layers == SMOL_SHAPE["num_hidden_layers"] else "the --small shape"
    return {"model": f"LLaMA of {shape} ({ck.num_layers} blocks), seeded random weights",
            "device": str(device), "split_layer": k, "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS,
            "tokens_equal_on_both_sides": all(f.tokens == a["tokens"] for f, a in frames),
            "prefix_step_ms_p50": statistics.median(prefix_ms), "suffix_token_ms_p50": statistics.median(suffix_ms),
            "reply_wait_ms_p50": statistics.median(waits), "crossings_ms_p50": crossing,
            "per_token_ms_p50": statistics.median(prefix_ms) + statistics.median(waits), "status": "ok"}


def _expect(conn, kind: str, timeout_s: float) -> dict:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the suffix process sent no {kind!r} within {timeout_s:.0f} s")
    msg = conn.recv()
    if msg["type"] == "error":
        raise RuntimeError(f"the suffix process failed: {msg['error']}")
    if msg["type"] != kind:
        raise RuntimeError(f"the suffix process sent {msg['type']!r}, expected {kind!r}")
    return msg
