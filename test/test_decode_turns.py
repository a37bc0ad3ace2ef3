"""A conversation decoded every frame (issue 40 item 6): this package's own driving model on a transformers LLM
asks a first question with the scene, answers it by a decode, is asked the next questions (``decode.turns``), each
answered by a decode, then reads its planning token placed after the last answer (ORION with its critical QA).

Referee: ORION's own way of running it (its ``simple_test_pts``): transformers' ``generate`` on the whole history as
input embeddings for each answer -- h_0 from this package's front (as every composed checkpoint's referee), then
transformers' token embeddings of the earlier answers and questions -- and transformers' forward over all of it
plus the planning turn for the read-out (the final-norm input at ``<waypoint_ego>``, then the checkpoint's own norm
and head).
"""
from __future__ import annotations

import json
import threading
import uuid

import pytest
import torch

from hf_builders import write_llama
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import SideCache, SuffixDecoding, conversation_ids, decode_in_process
from hybrid_vla_ros.split.verify import BagFrames
from hybrid_vla_ros.split.verify_decode import verify_decode
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

TOKENS = 3
#: Two questions after the first (5 and 6 tokens: more than the 4 rows a decode step carries, so a turn crosses in
#: two steps), then a planning turn of 3 tokens before the planning token.
TURNS = [[1, 40, 41, 42, 43], [1, 50, 51, 52, 53, 54]]
PLANNING_TURN = [1, 60, 61]


@pytest.fixture(scope="module")
def conversation(tmp_path_factory):
    """`init-model --preset tiny --llm DIR --set decode={...}`: the tiny model on a transformers Llama (untied LM
    head, as Vicuna's) asking two more questions and a planning turn."""
    from hybrid_vla_ros.tools.cli import main

    root = tmp_path_factory.mktemp("decode_turns")
    llama = write_llama(root / "llama")
    decode = {"max_new_tokens": TOKENS, "turns": TURNS, "after_token_ids": PLANNING_TURN}
    out = root / "qa"
    assert main(["init-model", "--preset", "tiny", "--llm", str(llama), "--set", f"decode={json.dumps(decode)}",
                 str(out)]) == 0
    return out


def test_each_answer_and_the_plan_after_them_equal_transformers_at_every_k(conversation):
    """verify-split --decode-tokens 3 at every K: three decodes of three tokens, each token transformers', every
    step's logits within 1e-5, the waypoints read after the planning turn within 1e-5 m."""
    report = verify_decode(conversation, TOKENS)
    assert report.ok, report.rows
    ck = open_checkpoint(conversation)
    assert len(report.rows) == ck.num_layers + 1 and len(report.reference_tokens) == 3 * TOKENS
    assert all(r.readout is not None and r.readout <= 1e-5 for r in report.rows)


def test_a_check_longer_than_the_llm_positions_is_refused(conversation):
    """--decode-tokens N runs N tokens in every answer: beyond the LLM's positions it is refused, as init-model
    refuses such a decode config."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        verify_decode(conversation, 200)


def test_a_question_left_out_changes_the_answers_and_the_plan(conversation):
    """The same frame decoded without the turns (one long answer) gives other tokens after the first answer and
    other waypoints: the check above sees the questions, it does not pass whatever is asked."""
    ck = open_checkpoint(conversation)
    sm, cfg = ck.split_model(), ck.cfg
    spec = cfg.decode_spec
    k = 1
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames())
        bound = SuffixDecoding.bound(cfg.num_tokens, spec.settings, len(cfg.decode_placed_token_ids), spec.turns)
        config, head = sm.text_config(), ck.load("lm_head")

        def run(turns):
            return decode_in_process(sm, ck.load("prefix", k), ck.load("suffix", k), head, SideCache(config, bound, 0),
                                     SideCache(config, bound, k), inputs, spec.settings,
                                     placed=cfg.decode_placed_token_ids, turns=turns)

        asked, unasked = run(spec.turns), run(())
        ref_tokens, _, _, _ = sm.decode_referee(torch.float32, inputs, TOKENS, cache_len=bound)
        want = sm.decode_readout_referee(torch.float32, inputs, conversation_ids(asked.decodes(), spec.turns), 3)
    assert asked.tokens == ref_tokens and asked.turn_starts == [TOKENS, 2 * TOKENS]
    assert asked.decode_ends == ["max_new_tokens"] * 3
    assert unasked.tokens[:TOKENS] == ref_tokens[:TOKENS]  # the first answer is asked the same way
    assert len(unasked.tokens) == TOKENS  # no turn: the frame ends after one decode
    assert (asked.plan.modes - want).abs().max() <= 1e-5
    assert (unasked.plan.modes - want).abs().max() > 1e-3


def _pixels(cfg, items):
    return preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean, cfg.image_std)


def test_the_runners_ask_each_question_over_the_ring_like_transformers(conversation, frames):
    """The prefix and suffix runners on a real ring (the next frame's prefill overlapping the decode): every
    frame's answers are the referee's on that frame's camera images, the turns cross as ``turn`` replies (each
    question in two steps), the prefix counts the answers' tokens and the questions' apart, and the trajectory is
    the head after the planning turn within 1e-5 m."""
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    k, ns = 1, f"/dt_{uuid.uuid4().hex[:8]}"
    prefix = PrefixRunner(str(conversation), PrefixRunnerSettings(k, device="cpu", namespace=ns, decode_overlap=True))
    suffix = SuffixRunner(str(conversation), SuffixRunnerSettings(k, namespace=ns, backend="eager"))
    followed = {}
    prefix.on_decode = followed.__setitem__
    chosen = frames[:2]
    try:
        suffix.wait_attached(10)
        worker = threading.Thread(target=lambda: [prefix.run(items, stamp) for stamp, items in chosen])
        worker.start()
        got = [suffix.poll(20.0) for _ in chosen]
        worker.join(60)
        assert prefix.follower.wait_idle(10)
    finally:
        suffix.close()
        prefix.close()
    assert all(r is not None for r in got), got
    ck = open_checkpoint(conversation)
    sm, cfg = ck.split_model(), ck.cfg
    spec = cfg.decode_spec
    bound = SuffixDecoding.bound(cfg.num_tokens, spec.settings, len(cfg.decode_placed_token_ids), spec.turns)
    for result, (stamp, items) in zip(got, chosen):
        assert result.meta.stamp_ns == stamp
        with torch.inference_mode():
            inputs = (_pixels(cfg, items), None, None)
            tokens, _, _, _ = sm.decode_referee(torch.float32, inputs, TOKENS, cache_len=bound)
            decodes = [tokens[i:i + TOKENS] for i in range(0, len(tokens), TOKENS)]
            want = sm.decode_readout_referee(torch.float32, inputs, conversation_ids(decodes, spec.turns), 3)
        assert result.decode.tokens == tokens and result.decode.ended == "max_new_tokens"
        # no tokenizer files beside this Llama: the reasoning text is the conversation's ids, questions included
        conversation = conversation_ids(decodes, spec.turns)
        assert result.decode.text == "token ids: " + " ".join(map(str, conversation))
        lane_follow = want[3 if len(want) > 1 else 0]
        assert abs(result.waypoints - lane_follow.double().numpy()).max() <= 1e-5
        done = followed[result.meta.seq]
        assert done.tokens == tokens and done.turn_tokens == sum(map(len, TURNS))
        assert done.placed == len(cfg.decode_placed_token_ids)


def test_the_plan_counts_every_decode_and_turn_the_config_declares(conversation):
    """`plan` without --decode-tokens takes the frame's decode from the checkpoint config: three decodes of 3 tokens,
    each question's and the planning turn's steps (4 rows a step), and KV caches bounded as the runners allocate
    them (the prefix two: the decoding frame's and the next prefill's)."""
    from hybrid_vla_ros.split.planner import PREFIX_KV_CACHES, frame_decode, plan_for_checkpoint

    cfg = open_checkpoint(conversation).cfg
    spec = cfg.decode_spec
    steps, kv_tokens = frame_decode(cfg)
    # prefill -> token 1; a step after each chosen token but the last (8); each question 2 steps instead of 1
    # ([last, q1..q3], [q4..]); the planning turn 2 steps ([last, p1, p2, p3], [<waypoint>]): 13 steps, + 1 token
    assert steps - 1 == 8 + 1 + 1 + 2
    bound = SuffixDecoding.bound(cfg.num_tokens, spec.settings, len(cfg.decode_placed_token_ids), spec.turns)
    # every chosen token is run (each later one leads a turn or the planning turn), every turn and placed token too
    assert kv_tokens == bound == cfg.num_tokens + 3 * TOKENS + sum(map(len, TURNS)) + len(PLANNING_TURN) + 1
    plan = plan_for_checkpoint(conversation, None, None, "fp32")
    text = open_checkpoint(conversation).split_model().text_config()
    per_layer = 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * bound * 4
    for r in plan.rows:
        assert r.decode_tokens == steps
        assert r.gpu_kv_bytes == PREFIX_KV_CACHES * r.k * per_layer and r.cpu_kv_bytes == (3 - r.k) * per_layer
    assert plan_for_checkpoint(conversation, None, None, "fp32", decode_tokens=0).rows[1].gpu_kv_bytes == 0
