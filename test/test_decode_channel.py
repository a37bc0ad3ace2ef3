"""The ring's decode channel (issue 40, transport/decode_channel.py): decode steps down, chosen tokens back up,
between two real processes over the real segment, wake sockets and contract."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import uuid

import pytest
import torch

from hybrid_vla_ros.transport import segment as sg
from hybrid_vla_ros.transport.decode_channel import GO_ON, MAX_TOKENS, STOP_TOKEN, decode_region_bytes
from hybrid_vla_ros.transport.ring import RingConsumer, RingContractError, RingProducer, segment_name

CTX = mp.get_context("spawn")
T, H = 8, 16
FRAME = 7


@pytest.fixture
def name():
    seg = segment_name("d_" + uuid.uuid4().hex[:12])
    yield seg
    for entry in os.listdir(sg.SHM_DIR):
        if entry == seg or entry.startswith(seg + ".init-"):
            os.unlink(os.path.join(sg.SHM_DIR, entry))


def _answer_steps(name: str, steps: int, rows: int, attached) -> None:
    """A suffix: answers the prefill with token 0, then each step with each row's first value + 1 plus the sum of
    its rotary positions, ending the frame at the last step."""
    cons = RingConsumer(name, expected_decode=(rows, 3))
    attached.set()
    cons.decode.publish_reply(FRAME, 0, [0])
    for index in range(1, steps + 1):
        step = cons.decode.wait_step(FRAME, index, 30.0)
        if step is None:
            os._exit(3)
        tokens = [int(step.rows[r, 0].item()) + 1 + int(step.positions[:, 0, r].sum()) for r in range(len(step.rows))]
        cons.decode.publish_reply(FRAME, index, tokens, MAX_TOKENS if index == steps else GO_ON)
    cons.close()


@pytest.mark.parametrize("rows", [1, 3])
def test_steps_cross_down_and_tokens_come_back_in_order(name, rows):
    """Each step's rows and rotary positions reach the other process whole, and the reply to each step (not an
    earlier one) comes back; k > 1 rows a step, as drafted tokens would cross."""
    steps = 300
    prod = RingProducer(name, 3, 4096, 5, dtype=torch.float32, state_shape=(T, H), decode_rows=rows,
                        decode_positions=3)
    attached = CTX.Event()
    proc = CTX.Process(target=_answer_steps, args=(name, steps, rows, attached))
    proc.start()
    try:
        assert attached.wait(60)
        reply = prod.decode.wait_reply(FRAME, 0, 30.0)
        assert reply is not None and reply.tokens == (0,) and reply.end == GO_ON
        for index in range(1, steps + 1):
            k = 1 + index % rows
            values = torch.arange(k, dtype=torch.float32)[:, None] * 10 + index
            positions = torch.arange(3 * k, dtype=torch.int64).reshape(3, 1, k) + index
            prod.decode.publish_step(FRAME, index, values.expand(k, H).contiguous(), positions)
            reply = prod.decode.wait_reply(FRAME, index, 30.0)
            expected = tuple(index + 10 * r + 1 + int(positions[:, 0, r].sum()) for r in range(k))
            assert reply is not None and (reply.frame, reply.index, reply.tokens) == (FRAME, index, expected), \
                (index, reply)
        assert reply.end == MAX_TOKENS and reply.ended
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        prod.close()


def _rewrite_replies(name: str, count: int, attached) -> None:
    """Publish ``count`` replies back to back, each consistent in itself: index i, tokens (i, i, i, i), end
    STOP_TOKEN when i is odd."""
    cons = RingConsumer(name)
    attached.set()
    for i in range(1, count + 1):
        cons.decode.publish_reply(FRAME, i, [i] * 4, STOP_TOKEN if i % 2 else GO_ON)
    cons.close()


def test_a_reply_is_never_read_half_written(name):
    """The producer reads the reply header while the other process rewrites it as fast as it can: every reply it
    reads is one the suffix wrote, never a mix of two (or a field zeroed by the write under way)."""
    prod = RingProducer(name, 3, 4096, 5, dtype=torch.float32, state_shape=(T, H), decode_rows=4)
    attached = CTX.Event()
    proc = CTX.Process(target=_rewrite_replies, args=(name, 200_000, attached))
    proc.start()
    seen = torn = 0
    try:
        assert attached.wait(60)
        while proc.is_alive() or seen == 0:
            reply = prod.decode.latest_reply()
            if reply is None:
                continue
            seen += 1
            i = reply.index
            if reply.tokens != (i,) * 4 or reply.end != (STOP_TOKEN if i % 2 else GO_ON) or reply.t_publish_ns == 0:
                torn += 1
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        prod.close()
    assert seen > 1000 and torn == 0, (seen, torn)


def test_the_decode_channel_is_part_of_the_contract(name):
    """A suffix that expects a decode channel refuses a prefix without one (and the other way round), naming both;
    a ring without one has no decode region and no ``decode``."""
    prod = RingProducer(name, 3, 4096, 5, dtype=torch.float32, state_shape=(T, H))
    try:
        assert prod.decode is None
        assert prod.total_bytes == sg.GLOBAL_HEADER_BYTES + 3 * (sg.SLOT_HEADER_BYTES + 4096)
        with pytest.raises(RingContractError, match="the prefix does not decode, this suffix expects 1 rows"):
            RingConsumer(name, expected_decode=(1, 0))
        with RingConsumer(name, expected_decode=(0, 0)) as cons:
            assert cons.decode is None
    finally:
        prod.close()
    prod = RingProducer(name, 3, 4096, 5, dtype=torch.bfloat16, state_shape=(T, H), decode_rows=2,
                        decode_positions=3)
    try:
        assert prod.total_bytes == (sg.GLOBAL_HEADER_BYTES + 3 * (sg.SLOT_HEADER_BYTES + 4096)
                                    + decode_region_bytes(2, H * 2, 3))
        with pytest.raises(RingContractError, match="decodes with steps of 2 rows and 3 position rows"):
            RingConsumer(name, expected_decode=(0, 0))
        with RingConsumer(name) as cons:
            assert (cons.contract.decode_rows, cons.contract.decode_positions) == (2, 3)
            assert "decode steps of up to 2 rows with rotary positions" in cons.contract.describe()
            with pytest.raises(ValueError, match="decode steps carry rotary positions"):
                prod.decode.publish_step(FRAME, 1, torch.zeros(1, H, dtype=torch.bfloat16))
            with pytest.raises(ValueError, match=r"\(1..2, 16\) rows"):
                prod.decode.publish_step(FRAME, 1, torch.zeros(3, H, dtype=torch.bfloat16),
                                         torch.zeros(3, 1, 3, dtype=torch.int64))
    finally:
        prod.close()
    with pytest.raises(ValueError, match="declares the hidden states' dtype and shape"):
        RingProducer(name, 3, 4096, 5, decode_rows=1)


def test_a_waiting_end_gives_up_at_its_deadline(name):
    """No reply (the suffix is gone or slow): wait_reply returns None at the deadline, not before, not much later."""
    prod = RingProducer(name, 3, 4096, 5, dtype=torch.float32, state_shape=(T, H), decode_rows=1)
    try:
        with RingConsumer(name) as cons:
            prod.decode.publish_step(FRAME, 1, torch.ones(1, H))
            step = cons.decode.wait_step(FRAME, 1, 1.0)
            assert step is not None and torch.equal(step.rows, torch.ones(1, H)) and step.positions is None
            t0 = time.monotonic()
            assert prod.decode.wait_reply(FRAME, 1, 0.3) is None
            assert 0.29 <= time.monotonic() - t0 < 2.0
            assert cons.decode.wait_step(FRAME, 2, 0.05) is None  # step 1 is not step 2
    finally:
        prod.close()


def test_a_frame_whose_last_reply_was_replaced_by_the_next_frames_is_read_from_the_ended_copy(name):
    """The suffix takes the next frame as soon as it sent a frame's last reply: when its answer to frame 8's prefill
    lands before the prefix read frame 7's last reply (a prefix thread held off its core), the prefix's follower
    reads frame 7's ending reply from the channel's ended copy (its token and how it ended; the code before the
    copy waited out its reply timeout, and frame 8's suffix dropped the frame ``no_step``), and frame 8 is then
    followed from its prefill. When frame 8 ended unseen too (the copy replaced), frame 7 ends ``ended_unseen`` at
    its peer check instead of waiting out the timeout. The ring and its channel are real; the prefix's model is a
    stand-in that computes nothing (its step is where the test lets the suffix race ahead)."""
    from types import SimpleNamespace

    from hybrid_vla_ros.runtime.decoding import ENDED_UNSEEN, PrefixDecodeLoop

    prod = RingProducer(name, 3, 4096, 5, dtype=torch.float32, state_shape=(T, H), decode_rows=1)
    try:
        with RingConsumer(name) as cons:
            race = []  # the replies the suffix sends while the prefix computes its next step

            def step(tokens, placed=False):
                for reply in race:
                    cons.decode.publish_reply(*reply)
                race.clear()
                steps.append(tokens)
                return torch.ones(1, H)

            steps = []
            sm = SimpleNamespace(step_crossing=lambda out: (out, None))
            loop = PrefixDecodeLoop(SimpleNamespace(sm=sm, step=step), prod.decode, reply_timeout_s=20.0)
            # frame 7's last reply, unread, replaced by frame 8's first
            race.extend([(FRAME, 1, [42], MAX_TOKENS), (FRAME + 1, 0, [5])])
            cons.decode.publish_reply(FRAME, 0, [3])  # the suffix answers frame 7's prefill
            t0 = time.monotonic()
            seven = loop.follow(FRAME, skipped=True)
            assert seven.ended == "max_new_tokens" and seven.tokens == [3, 42] and steps == [(3,)]
            assert time.monotonic() - t0 < 1.0
            assert cons.decode.wait_step(FRAME, 1, 0.1) is not None  # step 1 of frame 7 went down
            assert cons.decode.latest_reply().frame == FRAME + 1  # the latest is frame 8's; the copy is frame 7's
            assert cons.decode.last_ended_reply().frame == FRAME
            done = {}  # frame 8's prefill reply is still the latest: its step 1 goes down at once
            follower = threading.Thread(target=lambda: done.update(f=loop.follow(FRAME + 1)))
            follower.start()
            assert cons.decode.wait_step(FRAME + 1, 1, 5.0) is not None
            cons.decode.publish_reply(FRAME + 1, 1, [6], MAX_TOKENS)
            follower.join(5.0)
            assert done["f"].ended == "max_new_tokens" and done["f"].tokens == [5, 6]
            # both frame 9's ending reply and frame 10's ending one land while the prefix computes frame 9's step
            steps.clear()
            race.extend([(FRAME + 2, 1, [7], STOP_TOKEN), (FRAME + 3, 0, [8], STOP_TOKEN)])
            cons.decode.publish_reply(FRAME + 2, 0, [1])
            t0 = time.monotonic()
            nine = loop.follow(FRAME + 2, skipped=True)
            assert nine.ended == ENDED_UNSEEN and nine.tokens == [1] and steps == [(1,)]
            assert time.monotonic() - t0 < 3.0  # its peer check, not the 20 s reply timeout
            ten = loop.follow(FRAME + 3, skipped=True)  # its ending reply at its prefill, read from the latest
            assert ten.ended == "stop_token" and ten.tokens == [8]
    finally:
        prod.close()
