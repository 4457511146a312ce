"""Data formats: the prompt template, converters to trl's formats, loaders.

Taught in chapter 07 (`chapters/07_data_and_sft.md`).
"""

from marlhf_edu.data.formats import (
    BadRowError,
    DataFileError,
    LoadReport,
    alpaca_to_sft,
    generic_to_preference,
    hh_rlhf_to_preference,
    hh_rlhf_to_sft,
    load_preferences,
    load_sft,
    pku_saferlhf_to_preference,
    pku_saferlhf_to_sft,
    PKU_MARGINS,
)
from marlhf_edu.data.template import (DEFAULT_SYSTEM, BookTemplate, ChatTemplate, build_prompt, format_completion,
                                     render_dialogue, template_for)

__all__ = [
    "DEFAULT_SYSTEM",
    "build_prompt",
    "format_completion",
    "render_dialogue",
    "BookTemplate",
    "ChatTemplate",
    "template_for",
    "BadRowError",
    "DataFileError",
    "LoadReport",
    "PKU_MARGINS",
    "generic_to_preference",
    "hh_rlhf_to_preference",
    "hh_rlhf_to_sft",
    "pku_saferlhf_to_preference",
    "pku_saferlhf_to_sft",
    "alpaca_to_sft",
    "load_preferences",
    "load_sft",
]
