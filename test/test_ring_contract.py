"""The contract between prefix and suffix in the ring's global header: dtype conversion at the view, pairs
refused at attach (never per frame), and the trajectory drift of every allowed pair on the embedded bag."""
from __future__ import annotations

import multiprocessing as mp
import uuid

import numpy as np
import pytest
import torch

from hybrid_vla_ros.model.checkpoint import load_stage
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
from hybrid_vla_ros.runtime.suffix import StaleFrame, SuffixRunner
from hybrid_vla_ros.transport.contract import CONVERSIONS, conversion_kind
from hybrid_vla_ros.transport.ring import RingConsumer, RingContractError, RingProducer, segment_name
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

CTX = mp.get_context("spawn")
WAIT_S = 60.0
D = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALLOWED = [(p, s) for p in D for s in D if p == s or (D[p], D[s]) in CONVERSIONS]
REFUSED = [(p, s) for p in D for s in D if (p, s) not in ALLOWED]


def test_conversion_table():
    assert ALLOWED == [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"),
                       ("fp16", "fp16")]
    assert conversion_kind(torch.float16, torch.float32) == conversion_kind(torch.bfloat16, torch.float32) == "exact"
    assert conversion_kind(torch.float32, torch.bfloat16) == "rounds"
    assert conversion_kind(torch.bfloat16, torch.bfloat16) == "none"
    for p, s in REFUSED + [("fp32", "float64")]:
        dst = D.get(s, torch.float64)
        with pytest.raises(RingContractError) as info:
            conversion_kind(D[p], dst)
        words = str(info.value)
        assert str(D[p]).removeprefix("torch.") in words and str(dst).removeprefix("torch.") in words
    # every fp16 and bf16 number (subnormals, zeros of both signs, inf included) survives the way to fp32
    # and back bit for bit; a NaN stays a NaN (its payload may be quieted; hidden states are finite anyway)
    for dt in (torch.float16, torch.bfloat16):
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dt)
        back = every.float().to(dt)
        nan = torch.isnan(every)
        assert torch.equal(back[~nan].view(torch.int16), every[~nan].view(torch.int16))
        assert bool(torch.isnan(back[nan]).all()) and int(nan.sum()) > 0


# ------------------------------------------------------------------------------------- between processes

def _typed_producer(name, dtype_name, conn):
    """A producer that declares ``dtype_name`` and (8, 32); publishes 3 frames of known values per "publish"."""
    dtype = D[dtype_name]
    with RingProducer(name, 4, 8 * 32 * 4, model_id=7, dtype=dtype, state_shape=(8, 32), device="cpu",
                      domain_id=77) as prod:
        conn.send("ready")
        while conn.recv() == "publish":
            for _ in range(3):
                slot = prod.acquire((8, 32), dtype)
                slot.tensor.copy_(_values(slot.seq).to(dtype))
                prod.publish(slot, stamp_ns=slot.seq, split_layer=0)
            conn.send("published")


def _values(seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seq)
    return torch.randn((8, 32), generator=g) * 10.0 ** torch.randint(-6, 5, (8, 32), generator=g)


@pytest.mark.parametrize("producer", list(D))
def test_each_consumer_dtype_converts_at_the_view_or_is_refused_at_attach(producer):
    """A producer process declaring ``producer`` dtype; a consumer of each compute dtype: an allowed pair gets
    ``compute_tensor`` == the sent values converted (bit for bit, zero-copy for the same dtype, lossless for
    the exact pairs); a refused pair fails at attach, every time, naming both dtypes, and leaves the ring as it
    was (no lock, no slot taken), as do a consumer of another model, state shape or ROS domain."""
    name = segment_name("c_" + uuid.uuid4().hex[:12])
    conn, child_conn = CTX.Pipe()
    proc = CTX.Process(target=_typed_producer, args=(name, producer, child_conn), daemon=True)
    proc.start()
    p = producer

    def publish3():
        conn.send("publish")
        assert conn.poll(WAIT_S) and conn.recv() == "published"

    try:
        assert conn.poll(WAIT_S) and conn.recv() == "ready"
        publish3()
        for s in [s for pp, s in REFUSED if pp == p]:
            for _ in range(2):
                with pytest.raises(RingContractError, match="ring contract does not fit") as info:
                    RingConsumer(name, compute_dtype=D[s])
                assert f"sends {str(D[p])[6:]} hidden states and this suffix computes in {str(D[s])[6:]}" \
                    in str(info.value)
        for kwargs, words in (({"expected_model_id": 8},
                               r"runs model 0000000000000007, this suffix model 0000000000000008"),
                              ({"expected_shape": (9, 32)}, r"shape \(8, 32\), this suffix takes \(9, 32\)"),
                              ({"expected_domain_id": 78},
                               r"the prefix runs in ROS domain 77, this suffix in ROS domain 78")):
            with pytest.raises(RingContractError, match=words):
                RingConsumer(name, **kwargs)
        first = True
        for s in [s for pp, s in ALLOWED if pp == p]:
            if not first:
                publish3()
            with RingConsumer(name, expected_model_id=7, compute_dtype=D[s], expected_shape=(8, 32),
                              expected_domain_id=77) as cons:
                assert cons.contract.dtype == D[p] and cons.contract.device_kind == "cpu"
                assert cons.contract.domain_id == 77
                assert cons.contract.state_shape == (8, 32) and cons.conversion == conversion_kind(D[p], D[s])
                if first:
                    assert cons.slot_states().count("READY") == 3, "the refused attempts took nothing"
                while (slot := cons.read(0)) is not None:
                    with slot:
                        sent = _values(slot.meta.seq).to(D[p])
                        assert slot.tensor.dtype == D[p] and torch.equal(slot.tensor, sent)  # the raw view
                        got = slot.compute_tensor
                        assert got.dtype == D[s] and torch.equal(got, sent.to(D[s]))
                        if cons.conversion in ("none", "exact"):
                            assert torch.equal(got.to(D[p]), sent)  # nothing lost
                        if cons.conversion == "none":
                            assert got.data_ptr() == slot.tensor.data_ptr()  # zero-copy
                assert cons.stats.read == 3
            first = False
    finally:
        conn.send("stop")
        proc.join(WAIT_S)


def _prefix_process(model, dtype, ns, frames, published, done):
    runner = PrefixRunner(model, PrefixRunnerSettings(2, device="cpu", dtype=dtype, namespace=ns))
    try:
        for stamp, items in frames:
            runner.run(items, stamp)
        published.set()
        done.wait(WAIT_S)
    finally:
        runner.close()


def test_a_suffix_of_a_refused_dtype_reports_it_at_attach_not_per_frame(tiny_checkpoint, frames):
    """An fp32 prefix process and an fp16 suffix: the suffix never takes a frame (no per-frame error, no
    internal error), says why in ``contract_error``; a bf16 suffix then takes the frames the prefix left."""
    ns = f"/ct_{uuid.uuid4().hex[:6]}"
    published, done = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_prefix_process, args=(str(tiny_checkpoint), "fp32", ns, frames[:2], published, done),
                       daemon=True)
    proc.start()
    try:
        assert published.wait(WAIT_S)
        bad = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, dtype="fp16", namespace=ns,
                                                                     inference_precision="dtype"))
        try:
            for _ in range(3):
                assert bad.poll(0.05) is None and not bad.attached
            assert "sends float32 hidden states and this suffix computes in float16" in bad.contract_error
            assert bad.attach_error == bad.contract_error
        finally:
            bad.close()
        good = SuffixRunner(str(tiny_checkpoint),
                            SuffixRunnerSettings(2, dtype="bf16", namespace=ns, delivery="fifo",
                                                 inference_precision="dtype"))
        try:
            for seq in (1, 2):  # both frames are still there (stale for a suffix that attaches after them)
                with pytest.raises(StaleFrame, match=f"frame seq {seq} "):
                    good.poll(WAIT_S)
            assert good.attached and good.contract_error == "" and good.ring.conversion == "rounds"
        finally:
            good.close()
    finally:
        done.set()
        proc.join(WAIT_S)


# ------------------------------------------------------------------------------------- trajectory drift

def test_drift_of_every_allowed_pair_is_within_1cm_at_3s(tiny_checkpoint, frames):
    """Each allowed (prefix dtype, suffix dtype) through the real ring at K = 0, 2 and L on the bag's frames:
    the 3 s waypoint is within 1 cm of the fp32 monolithic model's and of the same-dtype pipeline's."""
    full = load_stage(tiny_checkpoint, "full")
    cfg = full.cfg
    i3 = round(3.0 / cfg.waypoint_dt_s) - 1
    with torch.inference_mode():
        reference = [full(preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean,
                                     cfg.image_std)).double().numpy() for _, items in frames]
    got = {}
    for k in (0, 2, cfg.num_layers):
        for p in D:
            ns = f"/dr_{uuid.uuid4().hex[:6]}"
            prefix = PrefixRunner(str(tiny_checkpoint),
                                  PrefixRunnerSettings(k, device="cpu", dtype=p, namespace=ns))
            try:
                for s in [s for pp, s in ALLOWED if pp == p]:
                    suffix = SuffixRunner(str(tiny_checkpoint),
                                          SuffixRunnerSettings(k, dtype=s, namespace=ns, delivery="fifo",
                                                                               inference_precision="dtype"))
                    try:
                        suffix.poll(0)  # attach first: frames published before it are stale
                        out = []
                        for stamp, items in frames:
                            prefix.run(items, stamp)
                            r = suffix.poll(WAIT_S)
                            assert r is not None and r.meta.stamp_ns == stamp
                            out.append(r.waypoints)
                        got[(k, p, s)] = out
                    finally:
                        suffix.close()
            finally:
                prefix.close()
    lines, worst = [], 0.0
    for (k, p, s), wps in got.items():
        vs_ref = max(float(np.linalg.norm(w[i3] - r[i3])) for w, r in zip(wps, reference))
        vs_same = max(float(np.linalg.norm(w[i3] - q[i3])) for w, q in zip(wps, got[(k, p, p)]))
        worst = max(worst, vs_ref, vs_same)
        lines.append(f"K={k} {p}->{s}: {vs_ref * 100:.3f} cm from fp32, {vs_same * 100:.3f} cm from {p}->{p}")
        assert vs_ref <= 0.01 and vs_same <= 0.01, lines[-1]
        if (p, s) == ("fp32", "fp32"):
            assert vs_ref <= 1e-5
    print("\n" + "\n".join(lines) + f"\nworst {worst * 100:.3f} cm")
