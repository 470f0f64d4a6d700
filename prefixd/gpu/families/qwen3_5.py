"""The hybrid family `qwen3_5`: Gated DeltaNet layers mixed with gated full attention.

A round's rows (all lanes, concatenated) go through embeddings, norms, projections and the
MLP together (linear layers padded to an invariant M); the mixers run per lane:

- linear_attention: causal conv over the lane's conv state, then the gated delta rule,
  chunked form for a prefill chunk, step form (with a rollback record) for decode rows;
- full_attention: q/k norm, partial rotary, K/V written into the lane's pages, causal
  attention over its pages, output gated by sigmoid(gate).

The chunked and step forms differ in the last bits, so `invariant_rows` is False: only rows
of a request's own prefill schedule are resumable (see docs/runtime.md, Hybrid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prefixd.gpu.families import gdn
from prefixd.gpu.families.qwen3_5_config import LINEAR, HybridConfig, register
from prefixd.gpu.families.qwen3_5_ops import (PagedKV, PartialRope, causal_attention,
                                              gated_rms_norm, linear, rms_norm)
from prefixd.gpu.families.qwen3_5_state import HybridState, LaneStatePool
from prefixd.scheduler.records import LaneWork


@dataclass(frozen=True)
class _Span:
    """One lane's rows inside the round batch."""

    work: LaneWork
    lo: int
    hi: int


class HybridModel:
    """Weights, KV pages and lane states of one hybrid model on one device."""

    invariant_rows = False

    def __init__(self, config: HybridConfig, tensors: Mapping[str, torch.Tensor], *,
                 device: torch.device, dtype: torch.dtype, num_lanes: int, num_pages: int,
                 page_size: int = 16) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        t = {name: w.to(device=device, dtype=dtype) for name, w in tensors.items()}
        self.embed = t["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_embeddings else t["lm_head.weight"]
        self.final_norm = self._plus_one(t["model.norm.weight"])
        self.layers = [self._layer(t, i) for i in range(config.num_layers)]
        self.rope = PartialRope(config.rotary_dim, config.rope_theta, device)
        self.kv = PagedKV(len(config.full_layers), num_pages, page_size, config.num_kv_heads,
                          config.head_dim, device=device, dtype=dtype)
        self.states = LaneStatePool(config, num_lanes, device=device, conv_dtype=dtype)

    # -- weights ---------------------------------------------------------------------------

    def _plus_one(self, w: torch.Tensor) -> torch.Tensor:
        return 1.0 + w.float()

    def _layer(self, t: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | int]:
        c, p = self.config, f"model.layers.{i}."
        layer: dict[str, torch.Tensor | int] = {
            "ln1": self._plus_one(t[p + "input_layernorm.weight"]),
            "ln2": self._plus_one(t[p + "post_attention_layernorm.weight"]),
            "gate_up": torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]),
            "down": t[p + "mlp.down_proj.weight"],
        }
        if c.layer_types[i] == LINEAR:
            a = p + "linear_attn."
            layer["slot"] = c.linear_layers.index(i)
            layer["w_in"] = torch.cat([t[a + "in_proj_qkv.weight"], t[a + "in_proj_z.weight"],
                                       t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"]])
            layer["conv"] = t[a + "conv1d.weight"].float().squeeze(1).contiguous()  # (C, K)
            layer["a_log"] = t[a + "A_log"].float()
            layer["dt_bias"] = t[a + "dt_bias"].float()
            layer["norm"] = t[a + "norm.weight"]
            layer["w_out"] = t[a + "out_proj.weight"]
        else:
            a = p + "self_attn."
            layer["slot"] = c.full_layers.index(i)
            layer["w_qkv"] = torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"],
                                        t[a + "v_proj.weight"]])
            if c.attention_bias:
                layer["b_qkv"] = torch.cat([t[a + "q_proj.bias"], t[a + "k_proj.bias"],
                                            t[a + "v_proj.bias"]])
                layer["b_o"] = t[a + "o_proj.bias"]
            layer["q_norm"] = self._plus_one(t[a + "q_norm.weight"])
            layer["k_norm"] = self._plus_one(t[a + "k_norm.weight"])
            layer["w_o"] = t[a + "o_proj.weight"]
        return layer

    # -- facts -----------------------------------------------------------------------------

    @property
    def lane_state_bytes(self) -> int:
        return self.states.lane_state_bytes

    @property
    def kv_bytes_per_page(self) -> int:
        return self.kv.bytes_per_page

    # -- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, works: Sequence[LaneWork]) -> torch.Tensor:
        """Run every lane's rows through the model; returns final-normed hidden rows
        (sum of rows, hidden) in work order. Writes KV pages, advances lane states; a
        decode work of more than one row leaves a rollback record on its lane."""
        spans, lo = [], 0
        for work in works:
            spans.append(_Span(work, lo, lo + len(work.tokens)))
            lo += len(work.tokens)
        x = self._embed(spans)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["ln1"], self.config.rms_norm_eps)
            if self.config.layer_types[i] == LINEAR:
                x = x + self._linear_attention(layer, h, spans)
            else:
                x = x + self._full_attention(layer, h, spans)
            h = rms_norm(x, layer["ln2"], self.config.rms_norm_eps)
            gate, up = linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + linear((gdn.silu(gate) * up.float()).to(self.dtype), layer["down"])
        return rms_norm(x, self.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (rows, vocab) of final-normed hidden rows."""
        return linear(hidden, self.lm_head).float()

    def _embed(self, spans: Sequence[_Span]) -> torch.Tensor:
        ids = [tok for s in spans for tok in s.work.tokens]
        x = self.embed[torch.tensor(ids, dtype=torch.long, device=self.device)]
        for s in spans:
            for image in s.work.images:
                x = self._place_image(x, s, image)
        return x

    def _place_image(self, x: torch.Tensor, span: _Span, image) -> torch.Tensor:
        rows = torch.as_tensor(image.rows, dtype=torch.float32).to(self.device, self.dtype)
        at, start = image.identity.at, span.work.start
        lo, hi = max(at, start), min(at + rows.shape[0], start + (span.hi - span.lo))
        if lo < hi:
            x[span.lo + lo - start:span.lo + hi - start] = rows[lo - at:hi - at]
        return x

    def _linear_attention(self, layer: dict, h: torch.Tensor, spans: Sequence[_Span]) -> torch.Tensor:
        c = self.config
        proj = linear(h, layer["w_in"])
        mixed, z, b, a = proj.split([c.conv_dim, c.lin_value_dim, c.lin_num_v_heads,
                                     c.lin_num_v_heads], dim=-1)
        g, beta = gdn.gates(a, b, layer["a_log"], layer["dt_bias"])
        core = torch.empty(h.shape[0], c.lin_num_v_heads, c.lin_v_dim, dtype=torch.float32,
                           device=self.device)
        for s in spans:
            core[s.lo:s.hi] = self._gdn_lane(layer, s, mixed[s.lo:s.hi], g[s.lo:s.hi],
                                             beta[s.lo:s.hi])
        out = gated_rms_norm(core, z.view(-1, c.lin_num_v_heads, c.lin_v_dim), layer["norm"],
                             c.rms_norm_eps, self.dtype)
        return linear(out.view(h.shape[0], -1), layer["w_out"])

    def _gdn_lane(self, layer: dict, span: _Span, mixed: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> torch.Tensor:
        c, slot, lane = self.config, layer["slot"], span.work.lane
        conv_state = self.states.live.conv[slot][lane]
        rec_state = self.states.live.rec[slot][lane]
        rows = mixed.shape[0]
        trail = None
        if not span.work.prefill and rows > 1:
            trail = self.states.begin_trail(lane, rows) if slot == 0 else self.states.trail(lane)
            trail.conv[slot].copy_(gdn.conv_states_after_rows(mixed, conv_state))
        conv_out, new_conv = gdn.causal_conv(mixed, conv_state, layer["conv"])
        q, k, v = conv_out.float().split([c.lin_key_dim, c.lin_key_dim, c.lin_value_dim], dim=-1)
        rep = c.lin_num_v_heads // c.lin_num_k_heads
        q = gdn.l2_normalize(q.reshape(rows, c.lin_num_k_heads, c.lin_k_dim)) * c.lin_k_dim ** -0.5
        k = gdn.l2_normalize(k.reshape(rows, c.lin_num_k_heads, c.lin_k_dim))
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        v = v.reshape(rows, c.lin_num_v_heads, c.lin_v_dim)
        if span.work.prefill:
            if slot == 0:
                self.states.drop_trail(lane)
            out, new_rec = gdn.chunked(q, k, v, g, beta, rec_state)
        else:
            out, states = gdn.steps(q, k, v, g, beta, rec_state)
            new_rec = states[-1]
            if trail is not None:
                trail.rec[slot].copy_(states)
        conv_state.copy_(new_conv)
        rec_state.copy_(new_rec)
        return out

    def _full_attention(self, layer: dict, h: torch.Tensor, spans: Sequence[_Span]) -> torch.Tensor:
        c = self.config
        qkv = linear(h, layer["w_qkv"], layer.get("b_qkv"))
        q_size, kv_size = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qg, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        qg = qg.view(-1, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(h.shape[0], -1)
        q = rms_norm(q, layer["q_norm"], c.rms_norm_eps)
        k = rms_norm(k.view(-1, c.num_kv_heads, c.head_dim), layer["k_norm"], c.rms_norm_eps)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        out = torch.empty(h.shape[0], c.num_heads, c.head_dim, dtype=torch.float32, device=self.device)
        for s in spans:
            out[s.lo:s.hi] = self._attend_lane(layer["slot"], s, q[s.lo:s.hi], k[s.lo:s.hi],
                                               v[s.lo:s.hi])
        attn = (out.view(h.shape[0], -1) * gdn.sigmoid(gate)).to(self.dtype)
        return linear(attn, layer["w_o"], layer.get("b_o"))

    def _attend_lane(self, slot: int, span: _Span, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
        work, rows = span.work, q.shape[0]
        pos = torch.arange(work.start, work.start + rows, device=self.device)
        cos, sin = self.rope.cos_sin(pos, self.dtype)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        self.kv.write(slot, work.page_table, work.start, k, v)
        keys, values = self.kv.read(slot, work.page_table, work.start + rows)
        scale = self.config.head_dim ** -0.5
        if work.prefill:
            return causal_attention(q, keys, values, work.start, scale)
        # decode rows one by one: a verified row gets the bits of the same row decoded alone
        return torch.cat([causal_attention(q[j:j + 1], keys[:work.start + j + 1],
                                           values[:work.start + j + 1], work.start + j, scale)
                          for j in range(rows)])

    # -- lane state ------------------------------------------------------------------------

    def capture(self, lane: int) -> HybridState:
        return self.states.capture(lane)

    def restore(self, lane: int, state: HybridState) -> int:
        return self.states.restore(lane, state)

    def reset_lane(self, lane: int) -> None:
        self.states.reset(lane)

    def rollback(self, lane: int, num_rows: int) -> int:
        """Keep only the first `num_rows` rows of the lane's last multi-row decode."""
        return self.states.rollback(lane, num_rows)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        return self.kv.copy_pages(src, dst)


register()
