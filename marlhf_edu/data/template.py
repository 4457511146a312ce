"""The one prompt template of the book (MA-RLHF style), defined once.

    ###System: <system>
    ###Question: <question>
    ###Answer:

The completion starts with a space (" The zorb is blue."), so the prompt ends
on a token boundary: tokenizing the prompt alone gives a prefix of tokenizing
prompt + completion, which completion-only loss and PPO rollouts rely on.

Real instruction models bring their own chat template (SmolLM2's ChatML):
`template_for(tokenizer)` picks it when the tokenizer has one, and the book's
template otherwise; every loader renders through it (chapter 13).

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


class BookTemplate:
    """The book's template above, as an object: what the loaders use when a tokenizer has no chat template."""

    def __init__(self, system: str | None = None):
        self.system = DEFAULT_SYSTEM if system is None else system

    def dialogue(self, turns: list[tuple[str, str | None]]) -> str:
        return render_dialogue(turns, self.system)

    def completion(self, text: str) -> str:
        return format_completion(text)


class ChatTemplate:
    """A tokenizer's own chat template (SmolLM2's ChatML, Llama-2-chat's [INST], ...), for real instruction models.

    The prompt ends with the template's assistant header (`add_generation_prompt`); the completion is the bare
    answer. The tokenizer appends its EOS (`<|im_end|>` for ChatML), which is also where the template ends an
    assistant turn. `system=None` keeps the template's own default system prompt.
    """

    def __init__(self, tokenizer, system: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatTemplate: this tokenizer has no chat template; use BookTemplate")
        self.tokenizer, self.system = tokenizer, system

    def dialogue(self, turns: list[tuple[str, str | None]]) -> str:
        if not turns or turns[-1][1] is not None:
            raise ValueError("ChatTemplate.dialogue: the last turn must be (question, None)")
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        for question, answer in turns:
            messages.append({"role": "user", "content": question.strip()})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer.strip()})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def completion(self, text: str) -> str:
        return text.strip()


def template_for(tokenizer=None, system: str | None = None):
    """The tokenizer's chat template when it has one (real instruction models), the book's template otherwise
    (the toy tokenizer has none, so everything in chapters 01–12 renders exactly as before)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return ChatTemplate(tokenizer, system)
    return BookTemplate(system)
