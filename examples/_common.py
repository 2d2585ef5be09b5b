"""Helpers shared by the example scripts (not part of any milestone).

Importing this module also makes ``milestones`` importable when a script is run
from a checkout that was not installed with ``pip install -e .``: it puts the
repository root on ``sys.path`` if, and only if, the import would fail otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("milestones") is None:  # a plain checkout: use the package next to examples/
    sys.path.insert(0, str(REPO_ROOT))


# Real English prose for benchmark prompts (written for this project; public domain).
# Slices of its tokens at varying offsets give prompts of any wanted length.
SAMPLE_TEXT = """\
The lighthouse keeper rose every morning before the gulls, climbed the hundred and
twelve steps of the tower, and wiped the salt from the great lens with a soft cloth
that his mother had sewn for the purpose forty years before. Nobody had asked him to
keep doing it. The light had been electric for a generation, the shipping lanes had
moved further out to sea, and the harbour below was used mostly by children in small
boats with patched sails. Still, he said, a light that is looked after burns a little
brighter, and a man who looks after something sleeps a little better. In the evenings
he wrote down the weather in a ledger: the direction of the wind, the colour of the
water, the number of ships he had seen, which was usually none, and the number of
stars, which he counted in patches and multiplied, the way his teacher had shown him.

A machine that answers questions works, in the end, much like that keeper's ledger.
It reads what it has been given one word at a time, keeps a careful record of
everything it has read so far, and uses that record to decide what ought to come
next. The record is the expensive part. Each new word must be compared with every
word before it, so a long conversation costs far more than a short one, and a
thousand conversations at once cost more still. Engineers who build such machines
spend most of their days on bookkeeping: where to keep the record, how much room to
set aside for it, when to throw part of it away, and how to share the pages that two
conversations happen to have in common. The arithmetic itself is simple; arranging it
so that nothing waits and nothing is wasted is the whole craft.

In the spring the keeper planted beans along the south wall of the cottage, where the
stones held the warmth of the afternoon, and in the autumn he gave most of them away
to the families in the village, because one man cannot eat a wall of beans, however
much he likes them. The children who sailed in the harbour would sometimes climb the
hill to ask him how the light worked. He would explain the lens, and the way it gathers
a small flame into a beam that can be seen twenty miles away, and then he would tell
them that the real trick was not the lens at all but the patience of turning up every
day, in good weather and bad, to make sure that the beam was there when it was needed.
Most of them nodded politely and asked whether they could see the top of the tower.
He always said yes.
"""

DEFAULT_CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about a cat watching the rain.",
    "Explain in two sentences why the sky is blue.",
]


def text_token_ids(tokenizer, min_tokens: int) -> list[int]:
    """The tokens of SAMPLE_TEXT, repeated as often as needed to hold at least ``min_tokens``."""
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    return ids * max(1, -(-min_tokens // len(ids)))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a flag's default in --help, unless its help text already explains it (or it has none)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
