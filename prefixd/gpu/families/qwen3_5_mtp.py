"""The multi-token-prediction (MTP) head that Qwen3.5 checkpoints ship (`mtp.*`).

One MTP row at position i reads the main model's final-normed hidden row h_i and the token
t_{i+1} after it, and predicts t_{i+2}:

    e = norm_e(embed(t_{i+1}))   h = norm_h(h_i)        (zero-centred RMSNorms)
    x = fc([e | h])                                      (hidden, 2 * hidden) -> hidden
    x = decoder layer (gated full attention + MLP) at position i, K/V in the MTP's own
        KV layer of the same pages (so pages carry MTP rows like every other layer's)
    logits = lm_head(norm(x))                            (the main model's head)

The *draft carry* of a lane is h of its last row: its MTP row waits for the next token. A
snapshot holds it, so a resumed lane drafts exactly as a cold one. Drafting k > 1 tokens
chains the head on its own output rows (the published recipe for one MTP layer).
"""

from __future__ import annotations

from typing import Mapping

import torch

from prefixd.gpu.families import gdn
from prefixd.gpu.families.qwen3_5_config import FULL, HybridConfig
from prefixd.gpu.families.qwen3_5_ops import rms_norm
from prefixd.gpu.linear import project
from prefixd.gpu.families.qwen3_5_weights import plus_one, prepare_layer


def prepare_mtp(config: HybridConfig, t: Mapping[str, torch.Tensor], kv_slot: int) -> list[dict]:
    """Each MTP layer's tensors rearranged like a main full-attention layer's, plus the fc and
    norms; `kv_slot` is the first KV layer of the pool the MTP layers write."""
    if config.num_mtp_layers == 0:
        return []
    full = config.full_layers[0]  # prepare_layer reads a full-attention layer by index
    heads = []
    for j in range(config.num_mtp_layers):
        src = f"mtp.layers.{j}."
        renamed = {f"model.layers.{full}." + name[len(src):]: w for name, w in t.items()
                   if name.startswith(src)}
        layer = prepare_layer(config, renamed, full)
        layer.update(slot=kv_slot + j, fc=t["mtp.fc.weight"],
                     norm_e=plus_one(t["mtp.pre_fc_norm_embedding.weight"]),
                     norm_h=plus_one(t["mtp.pre_fc_norm_hidden.weight"]),
                     norm=plus_one(t["mtp.norm.weight"]))
        heads.append(layer)
    return heads


def mtp_hidden(model, layer: dict, hidden: torch.Tensor, next_tokens: torch.Tensor, rnd, kv) -> torch.Tensor:
    """MTP rows (rows, hidden), final-normed, float32: `hidden` (rows, hidden) are the main
    model's final-normed rows (or an earlier MTP step's), `next_tokens` (rows,) the token
    after each; `rnd` (the family's round record) gives positions, slots and attention tiles
    of those rows. Writes the rows' K/V into the MTP KV layer of the lanes' pages."""
    c: HybridConfig = model.hybrid
    eps = c.rms_norm_eps
    e = rms_norm(model.embed.index_select(0, next_tokens), layer["norm_e"], eps)
    h = rms_norm(hidden.to(model.dtype), layer["norm_h"], eps)
    x = project(torch.cat([e, h], dim=-1), layer["fc"])  # (rows, hidden)
    a = rms_norm(x, layer["ln1"], eps)
    x = x + model._full_attention(layer, a, rnd, kv)
    a = rms_norm(x, layer["ln2"], eps)
    gate, up = project(a, layer["gate_up"]).chunk(2, dim=-1)
    x = x + project((gdn.silu(gate) * up.float()).to(model.dtype), layer["down"])
    return rms_norm(x, layer["norm"], eps).float()


def check_mtp_config(config: HybridConfig) -> None:
    """Raise ValueError when the MTP head cannot run on this config."""
    if config.num_mtp_layers and FULL not in config.layer_types:
        raise ValueError("an MTP head needs a full-attention layer shape to borrow")
