"""Orion's and MindDrive's published prompts as token ids, made with the LLM's own tokenizer at conversion time.

Orion's closed-loop agent runs one conversation a frame (its agent config's test pipeline:
``LoadAnnoatationCriticalVQATest`` with ``load_type=["critical_qa"]``, ``desc_qa=False`` and ``use_gen_token``: the
critical-QA turns are dropped and the planning turn alone remains), in Vicuna v1's conversation template
(``conv_vicuna_v1``: its system prompt, ``USER`` / ``ASSISTANT``, separators " " and "</s>"), tokenized by LLaVA's
``tokenizer_image_token`` (each piece around ``<image>`` with the tokenizer's own BOS, which only the first keeps).
Source: the public copies of Orion's pipeline and agent config (xiaomi-mlab/Orion's code as carried in
wzh506/CoT4AD: mmcv/datasets/pipelines/transforms_3d.py, adzoo/orion/configs/orion_stage3_agent.py); the planning
hidden state is read at ``<waypoint_ego>`` (Orion's ``llava_llama.py``), followed by the template's "</s>".

With its critical QA on (its chain-of-thought config ``orion_stage3_cot.py``: ``desc_qa=True``), Orion asks three
questions before the planning turn, each its own conversation (``preprocess_v1`` with ``only_one_system_prompt``:
the system prompt only in the first, each tokenized with its own BOS), and answers each by ``generate`` on the whole
history (its ``simple_test_pts``: ``do_sample``, temperature 0.1, top-p 0.75, up to 320 new tokens, the answer
appended to the history with its ``</s>``); the planning state is then read at ``<waypoint_ego>`` of the planning
turn. The pipeline draws the first two questions at random from its templates; here the first of each is asked,
every frame (:func:`orion_qa_prompt`).

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

from dataclasses import dataclass, field
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
#: Orion's critical-QA questions (desc_qa on), the first of each of its pipeline's templates, and its decode.
ORION_QA_QUESTIONS = ("What can you tell about the current driving conditions from the images?",
                      "Where are the critical objects in the scene and what impact do they have on the ego vehicle?",
                      "Please describe your driving behavior and explain the reasons.")
ORION_QA_DECODE = {"max_new_tokens": 320, "temperature": 0.1, "top_p": 0.75}
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
    #: With its critical QA (:func:`orion_qa_prompt`): the ``decode`` mapping of the config (the later questions as
    #: turns, the planning turn placed after the last answer); {} for the closed-loop conversation.
    decode: dict = field(default_factory=dict)


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


def _vicuna_turn(question: str, answer: str = "", system: bool = False) -> str:
    """One turn of ``conv_vicuna_v1`` as Orion's ``preprocess_v1`` writes it (the system prompt only in the first;
    an empty answer leaves "ASSISTANT:" open)."""
    head = (VICUNA_SYSTEM if system else "") + VICUNA_SEP + f"{VICUNA_USER}: {question}{VICUNA_SEP}{VICUNA_ASSISTANT}:"
    return head + (f" {answer}{VICUNA_SEP2}" if answer else "")


def orion_qa_prompt(config_dir: str | Path) -> OrionPrompt:
    """Orion's conversation with its critical QA (module docstring) from the tokenizer in ``config_dir``: the
    first question's turn around the scene tokens (``prompt_token_ids``, ``after_token_ids``: up to its open
    "ASSISTANT:"), and ``decode``: the other questions' turns as ``turns``, the planning turn up to (not including)
    ``<waypoint_ego>`` as ``after_token_ids`` (the read-out token follows it), the stop token ``</s>`` and Orion's
    sampling (:data:`ORION_QA_DECODE`). Raises ValueError as :func:`orion_prompt`, or for a tokenizer without an
    end-of-sequence token."""
    config_dir = Path(config_dir)
    tok = _load_tokenizer(config_dir)
    tok.add_tokens([WAYPOINT_TOKEN], special_tokens=True)
    if tok.eos_token_id is None:
        raise ValueError(f"{config_dir}: the tokenizer has no end-of-sequence token to end Orion's answers")
    first, *others = ORION_QA_QUESTIONS
    head, tail = _vicuna_turn(f"{IMAGE}\n{DRIVING}{first}", system=True).split(IMAGE)
    before, after = tok(head).input_ids, tok(tail).input_ids
    bos = tok.bos_token_id
    if bos is not None and before[:1] == [bos] and after[:1] == [bos]:  # only the first piece keeps its BOS
        after = after[1:]
    turns = [list(tok(_vicuna_turn(q)).input_ids) for q in others]
    planning = list(tok(_vicuna_turn(ORION_QUESTION, ORION_ANSWER)).input_ids)
    waypoint = tok(WAYPOINT_TOKEN, add_special_tokens=False).input_ids
    if len(waypoint) != 1 or planning.count(waypoint[0]) != 1:
        raise ValueError(f"{config_dir}: the tokenizer splits {WAYPOINT_TOKEN} into {len(waypoint)} ids")
    decode = {**ORION_QA_DECODE, "stop_token_ids": [int(tok.eos_token_id)], "turns": turns,
              "after_token_ids": planning[:planning.index(waypoint[0])]}
    return OrionPrompt(prompt_token_ids=list(before), after_token_ids=list(after), waypoint_token_id=waypoint[0],
                       vocab_size=len(tok), tokenizer=f"{type(tok).__name__} from {config_dir}", decode=decode)
