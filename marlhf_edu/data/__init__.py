"""Data formats: the prompt template, converters to trl's formats, loaders.

Taught in chapter 07 (`chapters/07_data_and_sft.md`).
"""

from __future__ import annotations

from marlhf_edu.data.formats import (LoadReport, PKU_MARGINS, alpaca_to_sft, generic_to_preference,
                                     hh_rlhf_to_preference, hh_rlhf_to_sft, load_preferences, load_sft,
                                     pku_saferlhf_to_preference, pku_saferlhf_to_sft)
from marlhf_edu.data.template import (BookTemplate, ChatTemplate, DEFAULT_SYSTEM, build_prompt, format_completion,
                                      render_dialogue, template_for)
from marlhf_edu.errors import BadRowError, DataFileError

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
