"""The hybrid family `qwen3_5`: Gated DeltaNet layers mixed with gated full attention.

A round's rows (all lanes, concatenated) go through embeddings, norms, projections and the
MLP together (linear layers padded to an invariant M); the mixers run per lane:

- linear_attention: causal conv over the lane's conv state, then the gated delta rule,
  chunked form for a prefill chunk, step form (with a rollback record) for decode rows;
- full_attention: q/k norm, partial rotary, K/V written into the lane's pages, the
  runtime's row-invariant paged attention (`gpu.attention`), output gated by sigmoid(gate).

The chunked and step forms differ in the last bits, so `invariant_rows` is False: only rows
of a request's own prefill schedule are resumable (see docs/runtime.md, Hybrid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prefixd.gpu.attention import AttentionSpan, attend, plan_attention
from prefixd.gpu.families import gdn
from prefixd.gpu.families.qwen3_5_config import LINEAR, HybridConfig, hybrid_config, model_config
from prefixd.gpu.families.qwen3_5_gguf import register
from prefixd.gpu.families.qwen3_5_mtp import check_mtp_config, mtp_hidden, prepare_mtp
from prefixd.gpu.families.qwen3_5_ops import gated_rms_norm, rms_norm
from prefixd.gpu.families.qwen3_5_state import HybridState, LaneStatePool
from prefixd.gpu.families.qwen3_5_weights import plus_one, prepare_layer
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.linear import project
from prefixd.gpu.rope import RopeTable, apply_rope
from prefixd.scheduler.records import LaneWork


@dataclass(frozen=True)
class _Span:
    """One lane's rows [lo, hi) inside the round batch, at positions start.."""

    lane: int
    start: int
    lo: int
    hi: int
    page_table: tuple[int, ...]
    prefill: bool


@dataclass(frozen=True)
class _Round:
    """What every layer of one round reads besides its input rows."""

    spans: Sequence[_Span]
    slots: torch.Tensor  # (rows,) flat KV slot of each row
    cos: torch.Tensor  # (rows, 1, rotary_dim / 2) fp32 (rope.RopeTable.lookup)
    sin: torch.Tensor
    tiles: tuple  # attention.AttentionTile, built once per round
    lanes: torch.Tensor | None = None  # a decode program's round: each row's lane (no spans)


class HybridModel:
    """Weights and lane states of one hybrid model on one device (the FamilyModel of
    `qwen3_5`); K/V of its full-attention layers live in the runner's KVPool."""

    invariant_rows = False
    attention_tiles = True
    decode_programs = True  # rounds of one decode row per lane (the batched step form)
    program_rows = (1,)  # verify rows keep per-row rollback records: they run op by op
    program_prefill = False  # a prefill chunk runs the chunked form, not the step form
    mode = "invariant"

    def __init__(self, config: HybridConfig, tensors: Mapping[str, torch.Tensor], *,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.hybrid, self.device, self.dtype = config, device, dtype
        self.config = model_config(config)
        check_mtp_config(config)
        t = {name: w.to(device=device, dtype=dtype) for name, w in tensors.items()}
        self.embed = t["model.embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_embeddings else t["lm_head.weight"]
        self.final_norm = plus_one(t["model.norm.weight"])
        self.layers = [prepare_layer(config, t, i) for i in range(config.num_layers)]
        self.rope = RopeTable(self.config, device=device, rotary_dim=config.rotary_dim)
        self.mtp = prepare_mtp(config, t, kv_slot=len(config.full_layers))  # [] without MTP
        self.num_kv_layers = len(config.full_layers) + len(self.mtp)
        self.states: LaneStatePool | None = None

    def new_lane_states(self, num_lanes: int) -> None:
        """Allocate zeroed recurrent + conv state for lanes 0..num_lanes-1."""
        self.states = LaneStatePool(self.hybrid, num_lanes, device=self.device,
                                    conv_dtype=self.dtype)

    # -- facts -----------------------------------------------------------------------------

    @property
    def lane_state_bytes(self) -> int:
        return self.states.lane_state_bytes if self.states is not None else 0

    @property
    def workspace_bytes_per_row(self) -> int:
        """fp32 activations one prefill row keeps alive inside a layer (upper estimate)."""
        c = self.hybrid
        mixer = max(3 * c.conv_dim + 3 * c.lin_value_dim,
                    (4 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        return 4 * (4 * c.hidden_size + mixer + 3 * c.intermediate_size)

    def padded_rows(self, n: int) -> int:
        return n  # `project` pads small calls itself

    # -- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs, kv: KVPool) -> torch.Tensor:
        """Run a round (`gpu.model.RoundInputs`); returns final-normed hidden rows
        (num_rows, hidden) in float32. Writes KV pages, advances lane states; a decode span
        of more than one row leaves a rollback record on its lane."""
        n = inputs.num_rows
        spans = [_Span(lane, s.start, s.row, s.row + s.length, tuple(s.page_table), prefill)
                 for s, lane, prefill in zip(inputs.spans, inputs.lanes, inputs.prefill)]
        x = self.embed.index_select(0, inputs.tokens[:n])
        for rows_idx, rows in inputs.images:
            x.index_copy_(0, rows_idx, rows.to(self.dtype))
        cos, sin = self.rope.lookup(inputs.positions[:n], top=inputs.max_position)
        lanes = inputs.lane_index[:n] if inputs.lane_index is not None else None
        rnd = _Round(spans, inputs.slots, cos, sin, inputs.tiles, lanes)
        hidden = self._layers(x, rnd, kv).float()
        if lanes is not None:  # a program: each row is its lane's last
            carry = self.states.live.carry
            if carry is not None:
                carry.index_copy_(0, lanes, hidden)
            return hidden
        return self._keep_carry(hidden, spans)

    def before_program(self, lanes: Sequence[int]) -> None:
        """Host bookkeeping of a decode program's round (`forward` with `lane_index`): a
        single new row on each lane makes its older rollback record stale."""
        for lane in lanes:
            self.states.drop_trail(lane)

    @torch.inference_mode()
    def forward_works(self, works: Sequence[LaneWork], kv: KVPool) -> torch.Tensor:
        """`forward` for a list of LaneWork (tests and benches; images not supported)."""
        rnd = self._round_of(works, kv)
        ids = self._index(t for w in works for t in w.tokens)
        return self._keep_carry(self._layers(self.embed.index_select(0, ids), rnd, kv).float(), rnd.spans)

    @torch.inference_mode()
    def mtp_works(self, hidden: torch.Tensor, works: Sequence[LaneWork], kv: KVPool, step: int = 0) -> torch.Tensor:
        """MTP rows (rows, hidden) for `works` whose tokens are the tokens *after* the rows
        of `hidden` (final-normed, one per work row, at the works' positions); MTP layer
        `step` modulo their number. Writes the MTP KV layer of the works' pages."""
        if not self.mtp:
            raise RuntimeError("this checkpoint has no MTP head")
        rnd = self._round_of(works, kv)
        ids = self._index(t for w in works for t in w.tokens)
        return mtp_hidden(self, self.mtp[step % len(self.mtp)], hidden, ids, rnd, kv)

    def draft_carry(self, lane: int) -> torch.Tensor:
        """The lane's draft carry (hidden,) float32: its last row's final-normed hidden."""
        if self.states is None or self.states.live.carry is None:
            raise RuntimeError("no draft carry: no MTP head or no lane states")
        return self.states.live.carry[lane]

    def _keep_carry(self, hidden: torch.Tensor, spans: Sequence[_Span]) -> torch.Tensor:
        """Store each lane's last hidden row as its draft carry (and, for a verify, the row
        after each verify row in its rollback record); returns `hidden`."""
        carry = self.states.live.carry if self.states is not None else None
        if carry is None:
            return hidden
        for s in spans:
            carry[s.lane].copy_(hidden[s.hi - 1])
            if not s.prefill and s.hi - s.lo > 1:
                self.states.trail(s.lane).carry.copy_(hidden[s.lo:s.hi])
        return hidden

    def _round_of(self, works: Sequence[LaneWork], kv: KVPool) -> _Round:
        spans, attn_spans, lo = [], [], 0
        for w in works:
            spans.append(_Span(w.lane, w.start, lo, lo + len(w.tokens), tuple(w.page_table),
                               w.prefill))
            attn_spans.append(AttentionSpan(lo, w.start, len(w.tokens), tuple(w.page_table)))
            lo += len(w.tokens)
        page = kv.page_size
        positions = [p for w in works for p in range(w.start, w.start + len(w.tokens))]
        slots = [w.page_table[p // page] * page + p % page
                 for w in works for p in range(w.start, w.start + len(w.tokens))]
        cos, sin = self.rope.lookup(self._index(positions), top=max(positions, default=-1))
        tiles = plan_attention(attn_spans, total_rows=lo, page_size=page, device=self.device,
                               dtype=kv.dtype,
                               group=self.hybrid.num_heads // self.hybrid.num_kv_heads)
        return _Round(spans, self._index(slots), cos, sin, tuple(tiles))

    def _layers(self, x: torch.Tensor, rnd: _Round, kv: KVPool) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("forward before new_lane_states")
        eps = self.hybrid.rms_norm_eps
        for s in rnd.spans:
            if not s.prefill and s.hi - s.lo == 1:  # a newer row: older rollback records no longer apply
                self.states.drop_trail(s.lane)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer["ln1"], eps)
            if self.hybrid.layer_types[i] == LINEAR:
                x = x + self._linear_attention(layer, h, rnd)
            else:
                x = x + self._full_attention(layer, h, rnd, kv)
            h = rms_norm(x, layer["ln2"], eps)
            gate, up = project(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + project((gdn.silu(gate) * up.float()).to(self.dtype), layer["down"])
        return rms_norm(x, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (rows, vocab) of final-normed hidden rows."""
        return project(hidden.to(self.dtype), self.lm_head).float()

    def _linear_attention(self, layer: dict, h: torch.Tensor, rnd: _Round) -> torch.Tensor:
        c = self.hybrid
        proj = project(h, layer["w_in"])
        mixed, z, b, a = proj.split([c.conv_dim, c.lin_value_dim, c.lin_num_v_heads,
                                     c.lin_num_v_heads], dim=-1)
        g, beta = gdn.gates(a, b, layer["a_log"], layer["dt_bias"])
        core = torch.empty(h.shape[0], c.lin_num_v_heads, c.lin_v_dim, dtype=torch.float32,
                           device=self.device)
        if rnd.lanes is not None:  # a program: every row a single decode row of rnd.lanes[row]
            q, k, v = self._qkv(self._conv_singles(layer, rnd.lanes, mixed))
            core[:] = self._step_singles(layer, rnd.lanes, q, k, v, g, beta)
            return self._gated_out(layer, core, z, h.shape[0])
        # one-row decode lanes run batched; prefill chunks and verify rows run per lane
        singles = [s for s in rnd.spans if not s.prefill and s.hi - s.lo == 1]
        others = [s for s in rnd.spans if s.prefill or s.hi - s.lo > 1]
        conv_out = torch.empty_like(mixed)
        if singles:
            lanes, rows = self._index(s.lane for s in singles), self._index(s.lo for s in singles)
            conv_out[rows] = self._conv_singles(layer, lanes, mixed.index_select(0, rows))
        for s in others:
            conv_out[s.lo:s.hi] = self._conv_lane(layer, s, mixed[s.lo:s.hi])
        q, k, v = self._qkv(conv_out)
        if singles:
            core[rows] = self._step_singles(layer, lanes, q[rows], k[rows], v[rows], g[rows], beta[rows])
        for s in others:
            core[s.lo:s.hi] = self._recur_lane(layer, s, q[s.lo:s.hi], k[s.lo:s.hi],
                                               v[s.lo:s.hi], g[s.lo:s.hi], beta[s.lo:s.hi])
        return self._gated_out(layer, core, z, h.shape[0])

    def _gated_out(self, layer: dict, core: torch.Tensor, z: torch.Tensor, rows: int) -> torch.Tensor:
        c = self.hybrid
        out = gated_rms_norm(core, z.view(-1, c.lin_num_v_heads, c.lin_v_dim), layer["norm"],
                             c.rms_norm_eps, self.dtype)
        return project(out.view(rows, -1), layer["w_out"])

    def _step_singles(self, layer: dict, lanes: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
        """The recurrent step of one new row on each of several lanes (a lane's bits do not
        depend on how many share the call: gdn.step)."""
        rec = self.states.live.rec[layer["slot"]]
        out, new = gdn.step(q, k, v, g, beta, rec.index_select(0, lanes))
        rec.index_copy_(0, lanes, new)
        return out

    def _index(self, values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

    def _conv_singles(self, layer: dict, lanes: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """Conv of one new row on each of several lanes: (B, C) in, (B, C) out."""
        conv = self.states.live.conv[layer["slot"]]
        out, new = gdn.causal_conv(mixed.unsqueeze(1), conv.index_select(0, lanes), layer["conv"])
        conv.index_copy_(0, lanes, new)
        return out[:, 0]

    def _conv_lane(self, layer: dict, span: _Span, mixed: torch.Tensor) -> torch.Tensor:
        slot, lane = layer["slot"], span.lane
        conv_state = self.states.live.conv[slot][lane]
        if not span.prefill:  # a verify: record the conv state after every row
            trail = self.states.begin_trail(lane, mixed.shape[0]) if slot == 0 else self.states.trail(lane)
            trail.conv[slot].copy_(gdn.conv_states_after_rows(mixed, conv_state))
        elif slot == 0:
            self.states.drop_trail(span.lane)
        out, new = gdn.causal_conv(mixed, conv_state, layer["conv"])
        conv_state.copy_(new)
        return out

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv output rows into L2-normed q (scaled), k per value head, and v."""
        c, rows = self.hybrid, conv_out.shape[0]
        q, k, v = conv_out.float().split([c.lin_key_dim, c.lin_key_dim, c.lin_value_dim], dim=-1)
        rep = c.lin_num_v_heads // c.lin_num_k_heads
        q = gdn.l2_normalize(q.reshape(rows, c.lin_num_k_heads, c.lin_k_dim)) * c.lin_k_dim ** -0.5
        k = gdn.l2_normalize(k.reshape(rows, c.lin_num_k_heads, c.lin_k_dim))
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return q, k, v.reshape(rows, c.lin_num_v_heads, c.lin_v_dim)

    def _recur_lane(self, layer: dict, span: _Span, q, k, v, g, beta) -> torch.Tensor:
        """Chunked form for a prefill chunk; step form with a rollback record for verify rows."""
        slot, lane = layer["slot"], span.lane
        rec_state = self.states.live.rec[slot][lane]
        if span.prefill:
            out, new_rec = gdn.chunked(q, k, v, g, beta, rec_state)
        else:
            out, states = gdn.steps(q, k, v, g, beta, rec_state)
            new_rec = states[-1]
            self.states.trail(lane).rec[slot].copy_(states)
        rec_state.copy_(new_rec)
        return out

    def _full_attention(self, layer: dict, h: torch.Tensor, rnd: _Round, kv: KVPool) -> torch.Tensor:
        c = self.hybrid
        qkv = project(h, layer["w_qkv"], layer.get("b_qkv"))
        q_size, kv_size = 2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qg, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        qg = qg.view(-1, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(h.shape[0], -1)
        q = rms_norm(q, layer["q_norm"], c.rms_norm_eps)
        k = rms_norm(k.view(-1, c.num_kv_heads, c.head_dim), layer["k_norm"], c.rms_norm_eps)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        q, k = (apply_rope(t.float(), rnd.cos, rnd.sin).to(self.dtype) for t in (q, k))
        kv.write(layer["slot"], rnd.slots, k, v)
        out = attend(q.float() * c.head_dim ** -0.5, kv.k[layer["slot"]], kv.v[layer["slot"]],
                     rnd.tiles)  # (rows, heads * head_dim) float32
        attn = (out * gdn.sigmoid(gate)).to(self.dtype)
        return project(attn, layer["w_o"], layer.get("b_o"))

    # -- lane state ------------------------------------------------------------------------

    def capture(self, lane: int) -> HybridState:
        return self.states.capture(lane)

    def restore(self, lane: int, state: HybridState) -> int:
        return self.states.restore(lane, state)

    def reset(self, lane: int) -> None:
        self.states.reset(lane)

    def rollback(self, lane: int, num_rows: int) -> int:
        """Keep only the first `num_rows` rows of the lane's last multi-row decode."""
        return self.states.rollback(lane, num_rows)

    def rollback_copy(self, lane: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, destination) of `rollback`, for the runner's copy engine to issue."""
        return self.states.rollback_copy(lane, num_rows)


def build_qwen3_5(checkpoint, device: torch.device, dtype: torch.dtype, mode: str) -> HybridModel:
    """The family builder. Only mode "invariant" exists (as for the attention families)."""
    if mode != "invariant":
        raise ValueError(f"qwen3_5 has no mode {mode!r}; only 'invariant'")
    return HybridModel(hybrid_config(checkpoint.config), checkpoint.tensors, device=device,
                       dtype=dtype)


register()
