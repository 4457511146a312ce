"""The one prompt template of the book (MA-RLHF style), defined once.

    ###System: <system>
    ###Question: <question>
    ###Answer:

The completion starts with a space (" The zorb is blue."), so the prompt ends
on a token boundary: tokenizing the prompt alone gives a prefix of tokenizing
prompt + completion, which completion-only loss and PPO rollouts rely on.

Taught in chapter 07.
"""

from __future__ import annotations

DEFAULT_SYSTEM = "You are a helpful and harmless assistant."

SYSTEM_TAG, QUESTION_TAG, ANSWER_TAG = "###System:", "###Question:", "###Answer:"


def build_prompt(question: str, system: str = DEFAULT_SYSTEM) -> str:
    """Render one question with the template, ending in `###Answer:`."""
    return render_dialogue([(question, None)], system)


def render_dialogue(turns: list[tuple[str, str | None]], system: str = DEFAULT_SYSTEM) -> str:
    """Render (question, answer) turns; the last answer must be None (it is what the model writes).

    Multi-turn dialogues (hh-rlhf) repeat the Question/Answer pair for each earlier turn.
    """
    if not turns or turns[-1][1] is not None:
        raise ValueError("render_dialogue: the last turn must be (question, None)")
    parts = [f"{SYSTEM_TAG} {system.strip()}"]
    for question, answer in turns:
        parts.append(f"{QUESTION_TAG} {question.strip()}")
        parts.append(ANSWER_TAG if answer is None else f"{ANSWER_TAG} {answer.strip()}")
    return "\n".join(parts)


def format_completion(text: str) -> str:
    """A response as it follows the prompt: one leading space, no trailing whitespace."""
    return " " + text.strip()
