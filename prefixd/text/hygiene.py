"""Prompt hygiene: named rewrites of a system prompt that keep consecutive turns' prefixes equal.

A client that writes a per-request value (a nonce, a timestamp) near the start of its system
prompt makes every turn's prompt differ from the last within its first tokens, so no cached
prefix can serve it. A normaliser removes such a value and nothing else; `NORMALISERS`
names each, and a front applies those it is given (`DEFAULT_NORMALISERS` unless told
otherwise) and reports which changed the prompt.

    billing_header   Claude Code's `x-anthropic-billing-header: cc_version=...; cch=<nonce>;`
                     line, at the start of a system text block (often a block of its own)
"""

from __future__ import annotations

import re
from typing import Callable

BILLING_HEADER = "billing_header"

# The header line where it begins a block, with its line break; what follows is kept as sent.
_BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)", re.IGNORECASE)


def strip_billing_header(blocks: list[str]) -> list[str]:
    """`blocks` (a system prompt's text blocks, in order) without a leading billing-header
    line in any block; a block that held only the line is left out."""
    out = []
    for text in blocks:
        kept = _BILLING_LINE.sub("", text, count=1)
        if kept or kept == text:
            out.append(kept)
    return out


Normaliser = Callable[[list[str]], list[str]]
NORMALISERS: dict[str, Normaliser] = {BILLING_HEADER: strip_billing_header}
DEFAULT_NORMALISERS: tuple[str, ...] = (BILLING_HEADER,)


def normalise_system(blocks: list[str], names: tuple[str, ...]) -> tuple[list[str], tuple[str, ...]]:
    """(the blocks after the normalisers `names`, in order; the names of those that changed
    something). A new list; `blocks` is not changed. KeyError for a name not in NORMALISERS."""
    applied = []
    for name in names:
        changed = NORMALISERS[name](blocks)
        if changed != blocks:
            applied.append(name)
        blocks = changed
    return list(blocks), tuple(applied)
