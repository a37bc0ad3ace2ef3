"""Orion's and MindDrive's published prompts as token ids, made with the LLM's own tokenizer at conversion time.

Orion's closed-loop agent runs one conversation a frame (its agent config's test pipeline:
``LoadAnnoatationCriticalVQATest`` with ``load_type=["critical_qa"]``, ``desc_qa=False`` and ``use_gen_token``: the
critical-QA turns are dropped and the planning turn alone remains), in Vicuna v1's conversation template
(``conv_vicuna_v1``: its system prompt, ``USER`` / ``ASSISTANT``, separators " " and "</s>"), tokenized by LLaVA's
``tokenizer_image_token`` (each piece around ``<image>`` with the tokenizer's own BOS, which only the first keeps).
Source: the public copies of Orion's pipeline and agent config (xiaomi-mlab/Orion's code as carried in
wzh506/CoT4AD: mmcv/datasets/pipelines/transforms_3d.py, adzoo/orion/configs/orion_stage3_agent.py); the planning
hidden state is read at ``<waypoint_ego>`` (Orion's ``llava_llama.py``), followed by the template's "</s>".

MindDrive runs its LLM twice a frame, each pass on its own conversation (its ``inference_only_pipeline``, as its
closed-loop agent runs it in the 0.5B and 3B configs: ``LoadAnnoatationMixCriticalVQATest`` with ``single``,
``is_decoupling``, ``use_meta_action`` and not ``desc_qa``, ``conv_template="llava_qwen2"``,
``preprocess_qwen2(training_mode=False)``; ../shared/reference/minddrive, Apache-2.0):

- the decision pass (adapter ``decision_expert``): the speed decision is the LM head's logits of the speed tokens at
  position -2, the token before the answer's meta-action, so the sampled meta-action never counts;
- the action pass (adapter ``action_expert``): the planners read the final hidden states at ``<waypoint_ego>`` and
  ``<path_waypoint_ego>``.

The turns are framed exactly as the published ``preprocess_qwen2`` frames them (LLaMA-3's system header inside
Qwen2's markers, kept as published), the text around ``<image>`` tokenized piecewise without special tokens
(``tokenizer_image_token_new``); ``<image>`` becomes the scene tokens. Tokens are added in the published order
(``add_special_token``), so the ids match.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: MindDrive's speed meta-actions in the order of its decision read-out (its SPEED_MAPPING, index = speed mode).
SPEED_TOKENS = ("<maintain_moderate_speed>", "<stop>", "<maintain_slow_speed>", "<speed_up>", "<slow_down>",
                "<maintain_fast_speed>", "<slow_down_rapidly>")
#: Its path meta-actions, added after the speed ones.
PATH_TOKENS = ("<lanefollow>", "<straight>", "<turn_left>", "<change_lane_left>", "<turn_right>",
               "<change_lane_right>")
WAYPOINT_TOKEN = "<waypoint_ego>"
PATH_WAYPOINT_TOKEN = "<path_waypoint_ego>"
IMAGE = "<image>"
#: The Qwen2 conversation template's system prompt, turn markers and separators (``conv_llava_qwen_2``).
SYSTEM = "You are a helpful assistant."
USER, ASSISTANT, SEP, SEP2 = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_start|>", "<|im_end|>\n"
#: The words before each question (the published ``prompt``).
DRIVING = "You are driving a car."
DECISION_QUESTION = "What actions should the car be taking?"
ACTION_QUESTION = ("Based on the above information, please provide a safe, executable, and reasonable planning "
                   "trajectory for the ego car.")
ACTION_ANSWER = f"Here is the planning trajectory {WAYPOINT_TOKEN} {PATH_WAYPOINT_TOKEN}"
#: The decision answer's meta-action: the published pipeline draws one at random; the read-out is the token
#: before it, which it cannot change (causal attention), so any one gives the same decision.
DECISION_ANSWER = f"The car should be {SPEED_TOKENS[0]}"
#: Vicuna v1's conversation template (``conv_vicuna_v1``), Orion's LLM's.
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")
VICUNA_USER, VICUNA_ASSISTANT, VICUNA_SEP, VICUNA_SEP2 = "USER", "ASSISTANT", " ", "</s>"
#: Orion's closed-loop planning turn (desc_qa off: no critical-QA turns before it).
ORION_QUESTION = "Please provide the planning trajectory for the ego car without reasons."
ORION_ANSWER = f"Here is the planning trajectory {WAYPOINT_TOKEN}"
#: Files whose presence says a directory holds a tokenizer's vocabulary (transformers' fast and slow formats; a
#: ``tokenizer_config.json`` alone is not one: transformers would build an empty tokenizer from it).
TOKENIZER_MARKERS = ("tokenizer.json", "vocab.json", "tokenizer.model")


@dataclass(frozen=True)
class MindDrivePrompts:
    """MindDrive's two prompts as :class:`~hybrid_vla_ros.model.config.VLAConfig` holds them.

    prompt_token_ids: the tokens before the scene tokens, shared by both passes. pass_prompt_token_ids: [decision,
    action]: each pass's tokens after the scene tokens, to the end of its answer. speed_token_ids: in speed-mode
    order. vocab_size: after the published additions (the embedding rows). tokenizer: class and directory."""

    prompt_token_ids: list[int]
    pass_prompt_token_ids: list[list[int]]
    speed_token_ids: list[int]
    waypoint_token_id: int
    path_token_id: int
    vocab_size: int
    tokenizer: str


def has_tokenizer(config_dir: str | Path) -> bool:
    """True when ``config_dir`` holds tokenizer files (else no tokenizer is looked for: nothing is downloaded)."""
    return any((Path(config_dir) / name).is_file() for name in TOKENIZER_MARKERS)


def minddrive_prompts(config_dir: str | Path) -> MindDrivePrompts:
    """Tokenize the two prompts with the tokenizer in ``config_dir`` (local files only). Raises ValueError when no
    tokenizer loads from there, or a token the read-out needs is not one id."""
    config_dir = Path(config_dir)
    tok = _load_tokenizer(config_dir)
    tok.add_tokens(list(SPEED_TOKENS + PATH_TOKENS), special_tokens=True)
    tok.add_tokens([WAYPOINT_TOKEN], special_tokens=True)
    tok.add_tokens([PATH_WAYPOINT_TOKEN], special_tokens=True)

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    def one(token: str) -> int:
        got = ids(token)
        if len(got) != 1:
            raise ValueError(f"{config_dir}: the tokenizer splits {token} into {len(got)} ids")
        return got[0]

    before: list[int] = []
    passes = []
    for question, answer in ((DECISION_QUESTION, DECISION_ANSWER), (ACTION_QUESTION, ACTION_ANSWER)):
        turn = (SEP + f"<|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}" + SEP2 + USER
                + f"{IMAGE}\n{DRIVING}{question}" + SEP2 + ASSISTANT)
        head, tail = turn.split(IMAGE)
        before, after = ids(head), ids(tail)
        passes.append(after + ids(answer))
    return MindDrivePrompts(prompt_token_ids=before, pass_prompt_token_ids=passes,
                            speed_token_ids=[one(t) for t in SPEED_TOKENS], waypoint_token_id=one(WAYPOINT_TOKEN),
                            path_token_id=one(PATH_WAYPOINT_TOKEN), vocab_size=len(tok),
                            tokenizer=f"{type(tok).__name__} from {config_dir}")


@dataclass(frozen=True)
class OrionPrompt:
    """Orion's closed-loop conversation as :class:`~hybrid_vla_ros.model.config.VLAConfig` holds it (one pass):
    ``prompt_token_ids`` before the scene tokens (BOS, system prompt, "USER: "), ``after_token_ids`` after them to the
    end of the answer (its one ``pass_prompt_token_ids``), ``waypoint_token_id``, ``vocab_size`` after Orion's
    addition and the ``tokenizer`` (class and directory)."""

    prompt_token_ids: list[int]
    after_token_ids: list[int]
    waypoint_token_id: int
    vocab_size: int
    tokenizer: str
    speed_token_ids: tuple = ()  # Orion reads no decision tokens


def _load_tokenizer(config_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(config_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_dir}: its tokenizer does not load ({type(e).__name__}: {e})") from None


def orion_prompt(config_dir: str | Path) -> OrionPrompt:
    """Tokenize Orion's closed-loop conversation (module docstring) with the tokenizer in ``config_dir`` (local
    files only), ``<waypoint_ego>`` added as Orion adds it. Raises ValueError when no tokenizer loads from there or
    ``<waypoint_ego>`` is not one id."""
    config_dir = Path(config_dir)
    tok = _load_tokenizer(config_dir)
    tok.add_tokens([WAYPOINT_TOKEN], special_tokens=True)
    turn = (f"{VICUNA_SYSTEM}{VICUNA_SEP}{VICUNA_USER}: {IMAGE}\n{DRIVING}{ORION_QUESTION}{VICUNA_SEP}"
            f"{VICUNA_ASSISTANT}: {ORION_ANSWER}{VICUNA_SEP2}")
    head, tail = turn.split(IMAGE)
    before, after = tok(head).input_ids, tok(tail).input_ids
    bos = tok.bos_token_id
    if bos is not None and before[:1] == [bos]:  # each piece carries the BOS: only the first keeps it
        after = after[1:] if after[:1] == [bos] else after
    waypoint = tok(WAYPOINT_TOKEN, add_special_tokens=False).input_ids
    if len(waypoint) != 1:
        raise ValueError(f"{config_dir}: the tokenizer splits {WAYPOINT_TOKEN} into {len(waypoint)} ids")
    return OrionPrompt(prompt_token_ids=list(before), after_token_ids=list(after), waypoint_token_id=waypoint[0],
                       vocab_size=len(tok), tokenizer=f"{type(tok).__name__} from {config_dir}")
