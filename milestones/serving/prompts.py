"""Prompts as the engine takes them: text or token ids, checked before anything is queued; the model's EOS ids.

Every check here raises a ``ValueError`` (an ``InvalidParam`` naming ``prompt``) that says what to change, so a
bad prompt is refused in ``add_request`` and never reaches the requests already running.
"""

from __future__ import annotations

import operator

from transformers import AutoConfig, GenerationConfig

from .sampling_params import InvalidParam

Prompt = str | list[int]


def tokenize_prompt(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """The prompt's token ids: text encoded, ids checked against the vocabulary; never empty."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidParam("prompt", f"the prompt is not valid text: {err.reason} at character {err.start} "
                               f"({prompt[err.start:err.end]!r}); remove or replace it") from None
        token_ids = tokenizer.encode(prompt) if prompt else []
    else:
        token_ids = as_token_ids(prompt)
        if token_ids is None:
            raise InvalidParam("prompt",
                               f"a prompt must be a string or a list of token ids (integers), got {prompt!r:.80}")
    if not token_ids:
        raise InvalidParam("prompt", "the prompt is empty: give at least one character or token id")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParam("prompt", f"token ids must be in [0, {vocab_size}) for this model; got {bad[:5]}")
    return token_ids


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The prompt must leave room for one generated token, and for ``max_tokens`` of them when that is set."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidParam("prompt", f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: "
                           "shorten the prompt (it must leave room for one generated token)")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidParam("max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                           f"max_model_len ({max_model_len}): lower max_tokens to at most "
                           f"{max_model_len - num_prompt_tokens}, or pass max_tokens=None to stop at the context limit")


def as_token_ids(prompt: object) -> list[int] | None:
    """A list of Python ints from a list, tuple or 1-D array of integers (NumPy's included); None if it is not one."""
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or any(
        isinstance(t, bool) or not hasattr(t, "__index__") or getattr(t, "ndim", 0) != 0 for t in prompt
    ):
        return None
    return [operator.index(t) for t in prompt]


def eos_token_ids(path) -> set[int]:
    """Every end-of-sequence id the model declares (generation config first, as transformers does)."""
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = AutoConfig.from_pretrained(path).eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
