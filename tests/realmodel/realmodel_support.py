"""Shared by the real-model tier's conftest and tests (a plain module: the tests folders are not packages)."""

from __future__ import annotations

import numpy as np
import pytest

from minienv.model.hub import cached_path

NAME = "smollm2-135m-instruct"

#: varied conversations: a plain question, a system prompt, several turns, code, non-Latin text and digits
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Translate to English: 今日はいい天気ですね。Привет! 2024-12-04, 3.14159 🙂"}],
]
GREEDY_TOKENS = 24


def model_file():
    path = cached_path(NAME, verify=False)
    if path is None:
        pytest.skip(f"{NAME} is not in the model cache: run `python -m minienv download {NAME}` (or set "
                    "MINIENV_MODELS_DIR to a cache that has it)")
    return path



def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref|: the error relative to the logits' scale."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
