"""Prompt datasets and the synthetic arithmetic task sets (expressions and word problems)."""

from .prompts_dataset import SUPPORTED_FORMATS, PromptDataset, blend_prompt_records, collate_prompts, load_prompt_records
from .synthetic import evaluate_expression, make_arithmetic_records, make_word_problem_records, write_jsonl

__all__ = [
    "SUPPORTED_FORMATS",
    "PromptDataset",
    "collate_prompts",
    "load_prompt_records",
    "blend_prompt_records",
    "evaluate_expression",
    "make_arithmetic_records",
    "make_word_problem_records",
    "write_jsonl",
]
