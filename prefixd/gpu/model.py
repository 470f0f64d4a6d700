"""The llama-style decoder (families llama, qwen2, qwen3) over the paged KV pool.

Per layer, every row of the round in one batch::

    x = rms(h) -> qkv (one fused GEMM, + bias: qwen2) -> q/k rms per head (qwen3) -> rope
      -> K, V into the pool -> blocked attention per tile -> o_proj -> h += .
    x = rms(h) -> gate|up (one fused GEMM) -> silu(gate) * up -> down -> h += .

The residual stream, norms, rope, attention and the SiLU product are fp32; GEMM inputs and
weights are in the compute dtype (bf16 by default) and their outputs come back as fp32.
Mode "int4" keeps the four projections of every layer as 4-bit group-32 codes and the lm_head
as 8-bit ones, read with two 8-bit codes of each activation (linear.py), each packed from the
file's own values where the loader has them (`Checkpoint.exact`); the embedding stays in the
compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from prefixd.gpu import cpu_kernels, fused, kernels
from prefixd.gpu.attention import AttentionSpan, AttentionTile, attend_into
from prefixd.gpu.config import ModelConfig
from prefixd.gpu.kv_pool import KVPool
from prefixd.gpu.linear import Int4Weight, Int8Weight, Weight, fuse, invariant_rows, linear, matmul, quantize_int4, quantize_int8
from prefixd.gpu.rope import RopeTable, rotate, rotation_tables

if TYPE_CHECKING:
    from prefixd.scheduler.records import LaneWork


@dataclass(frozen=True)
class RoundInputs:
    """Everything a family's forward reads about one round, built once by the runner.

    Rows are the round's lanes concatenated; `tokens`/`positions` may carry padding rows
    past `num_rows` (token 0, position 0) that are computed and ignored.
    """

    tokens: torch.Tensor  # (padded_rows,) long
    positions: torch.Tensor  # (padded_rows,) long
    num_rows: int
    slots: torch.Tensor  # (num_rows,) long: page * page_size + offset of each real row
    spans: tuple[AttentionSpan, ...]  # one per lane, in plan order
    lanes: tuple[int, ...]  # lane id of each span
    prefill: tuple[bool, ...]  # per span: a prefill chunk (True) or decode/verify rows
    tiles: tuple[AttentionTile, ...]
    images: tuple[tuple[torch.Tensor, torch.Tensor], ...] = field(default=())  # (row idx, rows f32)
    max_position: int | None = None  # a bound on `positions` known to the host (no device read)
    # a decode program's rows (gpu/programs.py): the lane of each row, every row one lane's
    # single decode row, padding rows a scratch lane (families with lane state read it)
    lane_index: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight.

    On CPU torch's fused rms_norm gives the composite's bits in one op (tests/gpu/test_ops.py);
    on CUDA the mean runs in kernels.py's fixed order.
    """
    if not x.is_cuda:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return x * torch.rsqrt(kernels.mean_last(x.pow(2)) + eps) * weight


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight
    down: Weight


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KeyError(f"checkpoint has no tensor {name!r}")
    return tensors.pop(name)


MODES = ("invariant", "int4")


def check_mode(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError unless `mode` runs on this device and dtype ("int4": CPU, bf16 only)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not available (have: {', '.join(MODES)})")
    if mode != "int4":
        return
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"mode 'int4' runs on the CPU in bf16 only (got {device.type}, {dtype})")
    ok, why = cpu_kernels.available()
    if not ok:
        raise ValueError(f"mode 'int4' needs prefixd's CPU kernel: {why}")


class LlamaModel:
    """FamilyModel for llama / qwen2 / qwen3 (attention only: every row is invariant).

    Takes ownership of `tensors`: projections are fused and the originals dropped from it.
    """

    invariant_rows = True
    lane_state_bytes = 0

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], *,
                 device: torch.device, dtype: torch.dtype, mode: str = "invariant",
                 exact: Callable[[str], torch.Tensor | None] | None = None) -> None:
        check_mode(mode, device, dtype)
        self.config = config
        self.device = device
        self.dtype = dtype
        self.mode = mode
        # int4 attends with prefixd's CPU kernel (cpu_kernels.attend): no tiles to plan
        self.attention_tiles = mode != "int4"
        self.decode_programs = self.attention_tiles  # decode rounds as fixed programs (programs.py)
        self.num_kv_layers = config.num_layers
        f32 = lambda t: t.to(device=device, dtype=torch.float32)  # noqa: E731
        lin = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
        # int4 requantizes each weight it packs from the file's own values where the loader has
        # them (`exact`: fp32, one tensor at a time), not from their rounding to the compute dtype
        self._exact = exact if mode == "int4" and exact is not None else (lambda name: None)
        self.embed = lin(_take(tensors, "model.embed_tokens.weight"))
        head_name = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
        head = self.embed if config.tie_embeddings else lin(_take(tensors, "lm_head.weight"))
        tensors.pop("lm_head.weight", None)
        if mode == "int4":  # 8-bit codes: a GGUF Q8_0 head's own (linear.int8_codes), two codes an input
            source = self._exact(head_name)
            self.lm_head: Weight = quantize_int8(head if source is None else source, passes=2)
        else:
            self.lm_head = head
        self.final_norm = f32(_take(tensors, "model.norm.weight"))
        self.layers = [self._layer(tensors, i, f32, lin) for i in range(config.num_layers)]
        del self._exact  # it holds the file open: not kept past the load
        self.rope = RopeTable(config, device=device)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        # int4 without a q/k norm or a qkv bias: a round's layers in one call of the CPU kernels,
        # its weights and output widths listed once (False: the Python loop, op by op; the tests
        # compare the two)
        self.one_call = mode == "int4" and not config.qk_norm and not config.attention_bias and all(
            isinstance(w, Int4Weight) for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        # ... and its set-up in that call too, from the lanes' lists (`forward_host`), where the
        # rope tables are q-scaled (a power-of-two scale) and attention is the CPU kernels'
        self.host_set_up = self.device.type == "cpu" and not self.attention_tiles and math.frexp(self.scale)[0] == 0.5
        self._one_call_weights: tuple[list[torch.Tensor], list[int]] = ([], [])
        for layer in self.layers if self.one_call else ():
            for norm, w in ((layer.input_norm, layer.qkv), (None, layer.o), (layer.post_norm, layer.gate_up),
                            (None, layer.down)):
                self._one_call_weights[0].extend([w.codes, w.scales] if norm is None else [norm, w.codes, w.scales])
                self._one_call_weights[1].append(w.shape[0])

    def _layer(self, t: dict[str, torch.Tensor], i: int, f32, lin) -> _Layer:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        pack = quantize_int4 if self.mode == "int4" else lin
        weight = lambda name: self._weight(t, name)  # noqa: E731
        qkv = fuse([weight(a + f"{n}_proj.weight") for n in "qkv"])
        bias = None
        if self.config.attention_bias:
            bias = f32(torch.cat([_take(t, a + f"{n}_proj.bias").float() for n in "qkv"]))
        qn = f32(_take(t, a + "q_norm.weight")) if self.config.qk_norm else None
        kn = f32(_take(t, a + "k_norm.weight")) if self.config.qk_norm else None
        gate_up = fuse([weight(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        return _Layer(
            input_norm=f32(_take(t, p + "input_layernorm.weight")), qkv=pack(qkv), qkv_bias=bias,
            q_norm=qn, k_norm=kn, o=pack(weight(a + "o_proj.weight")),
            post_norm=f32(_take(t, p + "post_attention_layernorm.weight")),
            gate_up=pack(gate_up), down=pack(weight(p + "mlp.down_proj.weight")))

    def _weight(self, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """A projection to pack: the file's own values (int4, where the loader has them) or the
        loaded tensor in the compute dtype."""
        loaded = _take(tensors, name)
        source = self._exact(name)
        return loaded.to(device=self.device, dtype=self.dtype) if source is None else source.to(self.device)

    # FamilyModel: lane state (none for attention-only families)
    def new_lane_states(self, num_lanes: int) -> None:
        return None

    def capture(self, lane: int) -> "EmptyState":
        return EmptyState()

    def restore(self, lane: int, state: object) -> int:
        return 0

    def reset(self, lane: int) -> None:
        return None

    @property
    def workspace_bytes_per_row(self) -> int:
        """fp32 activations one prefill row keeps alive inside a layer (upper estimate)."""
        c = self.config
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        return 4 * (4 * c.hidden_size + 2 * qkv + 3 * c.intermediate_size)

    def padded_rows(self, n: int) -> int:
        """int4: n (its one kernel is invariant at every M); else the compute dtype's minimum."""
        return n if self.mode == "int4" else invariant_rows(n, self.dtype)

    def embed_rows(self, inputs: RoundInputs) -> torch.Tensor:
        """(padded_rows, hidden) fp32 input embeddings; image rows replace their tokens'."""
        h = self.embed.index_select(0, inputs.tokens)
        for rows_idx, rows in inputs.images:
            h.index_copy_(0, rows_idx, rows.to(self.dtype))
        return h.float()

    def forward(self, inputs: RoundInputs, kv: KVPool) -> torch.Tensor:
        """Run every layer; writes K/V of the real rows; returns final-normed fp32 hidden."""
        return self._forward(inputs, kv, head=False)[0]

    def forward_logits(self, inputs: RoundInputs, kv: KVPool, pick_below: int = 0) -> tuple[
            torch.Tensor, torch.Tensor | None, list[int] | None]:
        """`forward`, and every row's logits where mode int4's one call takes the head too (the
        runner asks when it wants every row's, as in a decode round), else None; the bits of
        `logits(forward(...))`. Beside those logits, with `pick_below` > 0, what the call saw of
        each row as it stored it (`cpu_kernels.head_picks`): the greedy pick among ids below
        `pick_below`, or -1 where a logit of the row is not finite; else None."""
        return self._forward(inputs, kv, head=True, pick_below=pick_below)

    @property
    def host_rounds(self) -> bool:
        """Whether `forward_host` runs a round (mode int4's one call, its set-up in the call)."""
        return self.one_call and self.host_set_up

    def forward_host(self, lanes: Sequence[LaneWork], kv: KVPool, head: bool, pick_below: int = 0) -> tuple[
            torch.Tensor, torch.Tensor | None, list[int] | None]:
        """`forward` (head False) or `forward_logits` (head True) of a round of `lanes` with no
        image rows, where `host_rounds`: the round's set-up is built in the one call from the
        lanes' own lists (`cpu_kernels.layers_int4_rows`), not op by op from `RoundInputs`,
        with the same values, so the same bits."""
        c = self.config
        tokens: list[int] = []
        spans: list[int] = []
        pages: list[int] = []
        top = 0
        for w in lanes:
            spans += (len(tokens), w.start, len(w.tokens), len(w.page_table))
            pages += w.page_table
            tokens += w.tokens
            top = max(top, w.start + len(w.tokens) - 1)
        rope = self.rope.scaled_table(c.num_heads, c.num_kv_heads, self.scale, top)
        w = self.lm_head
        takes_head = head and isinstance(w, Int8Weight)
        hidden, logits, picks = cpu_kernels.layers_int4_rows(
            self.embed, tokens, spans, pages, kv.page_size, rope, *self._one_call_weights, c.rms_norm_eps, kv.k, kv.v,
            c.num_heads, c.num_kv_heads, c.head_dim, self.dtype if kv.codes8 else kv.dtype, self.dtype,
            head=(self.final_norm, w.codes, w.scales, w.shape[0], w.passes, pick_below) if takes_head else ())
        if not takes_head:
            return rms_norm(hidden, self.final_norm, c.rms_norm_eps), None, None
        return hidden, logits, picks if pick_below > 0 else None

    def _forward(self, inputs: RoundInputs, kv: KVPool, head: bool, pick_below: int = 0) -> tuple[
            torch.Tensor, torch.Tensor | None, list[int] | None]:
        c = self.config
        h = self.embed_rows(inputs)  # (rows, hidden) fp32, a fresh tensor: updated in place
        rnd = _Round(self, inputs, self.dtype if kv.codes8 else kv.dtype, h.shape[0])  # q and k: bf16 beside 8-bit pages
        if rnd.fused:
            return self._forward_fused(h, rnd, kv), None, None
        if self.one_call and rnd.cpu_index is not None and rnd.scaled is not None:
            # int4: the loop below as one call of the CPU kernels (the same ops, the same bits)
            args = (h, *self._one_call_weights, c.rms_norm_eps, rnd.qk, rnd.attn, rnd.act, rnd.scaled, kv.k, kv.v,
                    rnd.slots, rnd.cpu_index, c.num_heads)
            w = self.lm_head
            if head and isinstance(w, Int8Weight) and h.shape[0] == inputs.num_rows:
                rows = h.shape[0]
                normed, logits = torch.empty_like(h), h.new_empty((rows, w.shape[0]))
                watch = (torch.empty(rows, dtype=torch.uint8), torch.empty(rows, dtype=torch.long),
                         pick_below) if pick_below > 0 else ()
                cpu_kernels.layers_int4(*args, head=(self.final_norm, w.codes, w.scales, w.shape[0], w.passes,
                                                     normed, logits, *watch))
                return normed, logits, cpu_kernels.head_picks(*watch[:2]) if watch else None
            cpu_kernels.layers_int4(*args)
            return rms_norm(h, self.final_norm, c.rms_norm_eps), None, None
        for i, layer in enumerate(self.layers):
            h += self._attention(i, layer, self._normed_product(h, layer.input_norm, layer.qkv), rnd, kv)
            gate, up = self._normed_product(h, layer.post_norm, layer.gate_up).float().chunk(2, dim=-1)
            torch.nn.functional.silu(gate, inplace=True)
            h += matmul(torch.mul(gate, up, out=rnd.act), layer.down)  # fp32 += compute dtype: exact
        return rms_norm(h, self.final_norm, c.rms_norm_eps), None, None

    def _forward_fused(self, h: torch.Tensor, rnd: "_Round", kv: KVPool) -> torch.Tensor:
        """`forward` through fused.py's kernels (the CUDA path): each residual add rides the
        next norm's kernel, rope and the K/V write are one kernel, SiLU times up one more."""
        eps = self.config.rms_norm_eps
        pending = None  # the last product, not yet added to h
        for i, layer in enumerate(self.layers):
            x = fused.rms_norm(h, layer.input_norm, eps, residual=pending, out_dtype=self.dtype)
            o = self._attention(i, layer, matmul(x, layer.qkv), rnd, kv)
            x = fused.rms_norm(h, layer.post_norm, eps, residual=o, out_dtype=self.dtype)
            pending = matmul(fused.silu_mul(matmul(x, layer.gate_up), rnd.act), layer.down)
        return fused.rms_norm(h, self.final_norm, eps, residual=pending)

    def _normed_product(self, h: torch.Tensor, norm: torch.Tensor, weight: Weight) -> torch.Tensor:
        """rms_norm(h) @ weight.T in the product's dtype; int4 normalizes inside its kernel."""
        if self.mode == "int4":
            return matmul(h, weight, norm=(norm, self.config.rms_norm_eps))
        return matmul(rms_norm(h, norm, self.config.rms_norm_eps), weight)

    def _attention(self, i: int, layer: _Layer, qkv: torch.Tensor, rnd: "_Round", kv: KVPool) -> torch.Tensor:
        """o_proj of the layer's attention, in the compute dtype, from the qkv projection's output
        (the compute dtype: rope reads it as fp32 by promotion)."""
        c = self.config
        heads = c.num_heads
        if rnd.fused and layer.q_norm is None:  # bias, rope, q's scale and the K/V write: one kernel
            fused.rope_write(qkv, layer.qkv_bias, rnd.positions, self.rope.cos, self.rope.sin, self.scale, rnd.qk,
                             kv.k[i], kv.v[i], rnd.slots, heads=heads, kv_heads=c.num_kv_heads)
        else:
            if layer.qkv_bias is not None:
                qkv = qkv.float() + layer.qkv_bias
            if rnd.cpu_index is not None and layer.q_norm is None and rnd.scaled is not None:
                # int4: rope and the K/V write in one call of the CPU kernels, the bits of _rope_and_write
                cpu_kernels.rope_kv(qkv, rnd.scaled, rnd.qk, kv.k[i], kv.v[i], rnd.slots, heads)
            else:
                self._rope_and_write(i, layer, qkv, rnd, kv)
        if rnd.cpu_index is not None:  # int4: prefixd's CPU attention, reading the pool in place
            cpu_kernels.attend(rnd.qk.view(-1, c.head_dim), kv.k[i], kv.v[i], *rnd.cpu_index, heads,
                               heads + c.num_kv_heads, rnd.attn)
        else:
            attend_into(rnd.qk.view(-1, c.head_dim), heads + c.num_kv_heads, kv.k[i], kv.v[i], rnd.tiles, rnd.attn)
        return matmul(rnd.attn[:-1], layer.o)

    def _rope_and_write(self, i: int, layer: _Layer, qkv: torch.Tensor, rnd: "_Round", kv: KVPool) -> None:
        """Rotated (q-scaled) q and k heads into `rnd.qk`, the K/V rows into the pool."""
        c = self.config
        heads = c.num_heads
        qk_dim = (heads + c.num_kv_heads) * c.head_dim
        qk = qkv[:, :qk_dim].unflatten(-1, (heads + c.num_kv_heads, c.head_dim))  # (rows, H + KV, hd)
        v = qkv[:, qk_dim:].unflatten(-1, (c.num_kv_heads, c.head_dim))
        out = rnd.qk[:-1]  # (rows, H + KV, hd) in the pool's dtype: scaled q heads, then k heads
        if layer.q_norm is not None:
            qk = qk.float()
            q = rotate(rms_norm(qk[:, :heads], layer.q_norm, c.rms_norm_eps), rnd.cos, rnd.sin)
            torch.mul(q, self.scale, out=out[:, :heads])
            out[:, heads:] = rotate(rms_norm(qk[:, heads:], layer.k_norm, c.rms_norm_eps), rnd.cos, rnd.sin)
        else:
            rope_qk_into(qk, out, heads, self.scale, (rnd.cos, rnd.sin), rnd.scaled)
        if rnd.cpu_index is not None:  # int4's attention takes q and k as rope_kv leaves them
            out.copy_(cpu_kernels.flush_tiny(out))
        n = rnd.num_rows
        kv.write(i, rnd.slots, out[:n, heads:], v[:n])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, vocab) fp32 logits of final-normed hidden rows (n, hidden)."""
        n = hidden.shape[0]
        return linear(kernels.pad_rows(hidden, self.padded_rows(n)), self.lm_head)[:n]


def rope_qk_into(qk: torch.Tensor, out: torch.Tensor, heads: int, scale: float,
                 tables: tuple[torch.Tensor, torch.Tensor],
                 scaled: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """out[:, :heads] = rotate(q) * scale and out[:, heads:] = rotate(k), in out's dtype, with
    the bits of rotating and scaling in fp32 first. qk (rows, heads + kv_heads, head_dim) in the
    compute dtype or fp32 (read as fp32 by promotion); tables: `rotation_tables`' (cos, sin);
    scaled: the same with q's heads times a power-of-two scale (`scale_q_tables`), or None: then the
    rotation is materialized in fp32 and q scaled from it."""
    if scaled is not None:  # q and k heads in one pass, the scale in q's tables
        torch.add(qk * scaled[0], _swap_halves(qk) * scaled[1], out=out)
        return
    rotated = rotate(qk, *tables)
    torch.mul(rotated[:, :heads], scale, out=out[:, :heads])
    out[:, heads:] = rotated[:, heads:]


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """x2 | x1 of each head of x (rows, heads, head_dim): what `rotate` multiplies by sin."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)


class _Round:
    """What every layer of one round shares: rope tables, row indices and the buffers a layer
    writes before the next one does (each is read within its layer).

    `qk` ((rows + 1), H + KV, head_dim), the pool's dtype: a layer's pre-scaled q heads and its
    k heads, the last row zero (padding rows of attention read it); `attn` (rows + 1, H *
    head_dim) fp32: attention's output, the last row a scratch row; `act` (rows, intermediate),
    the compute dtype: silu(gate) * up, the down projection's input.

    With a power-of-two attention scale (head_dim 4^k), q's scale is folded into its rope
    tables (`scaled`: cos and sin, (rows, H + KV, head_dim)): multiplying by a power of
    two is exact, so (x cos + x' sin) * s has the bits of x (cos s) + x' (sin s).
    """

    def __init__(self, model: "LlamaModel", inputs: RoundInputs, pool_dtype: torch.dtype, rows: int) -> None:
        c = model.config
        device = inputs.tokens.device
        self.num_rows, self.slots, self.tiles = inputs.num_rows, inputs.slots, inputs.tiles
        self.positions = inputs.positions
        self._top, self._qk_norm = inputs.max_position, c.qk_norm
        # the CUDA path's kernels (fused.py; never mode int4, the CPU's, whose pool holds 8-bit
        # pages); the rope tables below cover the positions
        self.fused = model.attention_tiles and kernels.triton_path(device)
        self.cpu_index = cpu_kernels.attention_index(inputs.spans) if not model.attention_tiles else None
        self.scaled = None
        self._rope, self._tables = model.rope, None
        if self.fused and not c.qk_norm:  # fused.rope_write reads the tables by position
            top = inputs.max_position
            model.rope.cover(int(inputs.positions.max()) if top is None else top)
        elif not c.qk_norm and math.frexp(model.scale)[0] == 0.5:
            self.scaled = model.rope.q_scaled(inputs.positions, c.num_heads, c.num_kv_heads, model.scale,
                                              top=inputs.max_position)
        heads = c.num_heads + c.num_kv_heads
        self.qk = torch.zeros(rows + 1, heads, c.head_dim, dtype=pool_dtype, device=device)
        self.attn = torch.zeros(rows + 1, c.num_heads * c.head_dim, dtype=torch.float32, device=device)
        self.act = torch.empty(rows, c.intermediate_size, dtype=model.dtype, device=device)

    @property
    def cos(self) -> torch.Tensor | None:
        """`rotation_tables`' cos for the round's rows (None where fused.rope_write reads the
        table by position); built on first use: mode int4's one call reads `scaled` only."""
        tables = self._rotation_tables()
        return None if tables is None else tables[0]

    @property
    def sin(self) -> torch.Tensor | None:
        tables = self._rotation_tables()
        return None if tables is None else tables[1]

    def _rotation_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.fused and not self._qk_norm:
            return None
        if self._tables is None:
            self._tables = rotation_tables(*self._rope.lookup(self.positions, top=self._top))
        return self._tables


def scale_q_tables(table: torch.Tensor, heads: int, kv_heads: int, scale: float) -> torch.Tensor:
    """A (rows, 1, head_dim) rope table as (rows, heads + kv_heads, head_dim), q's heads times scale."""
    rows, _, d = table.shape
    return torch.cat([(table * scale).expand(rows, heads, d), table.expand(rows, kv_heads, d)], dim=1)


class EmptyState:
    """The lane state of an attention-only family: nothing."""

    nbytes = 0


def build_llama(checkpoint, device: torch.device, dtype: torch.dtype, mode: str) -> LlamaModel:
    return LlamaModel(checkpoint.config, checkpoint.tensors, device=device, dtype=dtype, mode=mode,
                      exact=getattr(checkpoint, "exact", None))

