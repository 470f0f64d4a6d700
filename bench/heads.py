"""Bench-only output-head variants of a runner mode, to compare head formats in one run.

    "int4"             the mode as it is (its head: 8-bit codes of the file's own values)
    "int4+head=bf16"   the mode with its lm_head replaced after loading: bf16 (the compute dtype),
    "int4+head=4x2"    two 4-bit layers (linear.quantize_int4_residual; the head of revisions 2-6),
    "int4+head=4"      one 4-bit layer (linear.quantize_int4)
    "int4+head=8"      one 8-bit layer (linear.quantize_int8), where linear has it
    "int4+head=8x1"    the mode's own 8-bit head read with one 8-bit code of each activation, not
                       two (`Int8Weight.passes`): the head of revision 7

A variant is not a mode: the daemon never runs one, and the disk tier never sees its rows. The
replacement head is made from the model's embedding as loaded, in the compute dtype (the head is
tied on the default model), or, untied, from the head itself where it is still a tensor; so
"int4+head=8" is not "int4": the mode packs its head from the file's values.
"""

from __future__ import annotations

HEADS = ("bf16", "4x2", "4", "8", "8x1")


def split_mode(spec: str) -> tuple[str, str | None]:
    """(runner mode, head variant or None) of a bench mode spec; ValueError on an unknown head."""
    mode, _, head = spec.partition("+head=")
    if head and head not in HEADS:
        raise ValueError(f"head variant {head!r}: one of {', '.join(HEADS)}")
    return mode, head or None


def apply_head(model, head: str | None) -> None:
    """Replace `model.lm_head` (a LlamaModel's) by the variant `head`; None leaves it."""
    if head is None:
        return
    import dataclasses

    import torch

    from prefixd.gpu import linear

    if head == "8x1":
        if not isinstance(model.lm_head, linear.Int8Weight):
            raise ValueError("head variant 8x1 is mode int4's own 8-bit head, read in one pass")
        model.lm_head = dataclasses.replace(model.lm_head, passes=1)
        return

    source = model.lm_head if isinstance(model.lm_head, torch.Tensor) else None
    if source is None:
        if not model.config.tie_embeddings:
            raise ValueError("an untied head already packed has no source to make a variant from")
        source = model.embed
    if head == "bf16":
        model.lm_head = source.to(torch.bfloat16)
    elif head == "4x2":
        model.lm_head = linear.quantize_int4_residual(source)
    elif head == "4":
        model.lm_head = linear.quantize_int4(source)
    else:
        quantize = getattr(linear, "quantize_int8", None)
        if quantize is None:
            raise ValueError("this tree's linear.py has no 8-bit weights")
        model.lm_head = quantize(source)
