"""The bytes one decode token reads, and the machine's read bandwidth: the memory bound of decode.

    from bench.token_bytes import runner_account, gguf_account, read_bandwidth

A one-lane decode round reads every layer's weights once, the output head once, one row of the
embedding and every K/V row of its context, and little else (activations stay in cache). The
account is taken from the tensors a loaded model actually holds (their dtypes and packing:
`Int4Weight` codes and scales, bf16 or fp32 tensors) and from the KV pool's bytes per row, or,
for llama.cpp, from the GGUF file's tensors (their quantization types) and its f16 K/V cache.
`read_bandwidth` is a streaming read (a sum) over a buffer far larger than the caches, on the
given thread count; `StreamRead` is one such read at a time, to take turns with the engines
(a machine's bandwidth may move by half within a minute). bytes / bandwidth is the least time
a token can take: its inverse is the bound a decode rate is measured against.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

KINDS = ("qkv", "o", "gate_up", "down", "norms and biases", "head", "embedding row")
_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm", "qkv_bias")


@dataclass(frozen=True)
class TokenBytes:
    """What one decode token reads: weights by kind (bytes), and the K/V bytes of one context row."""

    weights: dict[str, int]
    kv_bytes_per_row: int
    what: str  # the formats, in words: "int4 codes + bf16 scales; K/V bf16"

    def kv_bytes(self, context: int) -> int:
        return self.kv_bytes_per_row * context

    def total(self, context: int) -> int:
        return sum(self.weights.values()) + self.kv_bytes(context)


def _nbytes(weight: object) -> int:
    if weight is None:
        return 0
    return int(weight.nbytes)  # torch.Tensor and linear's Int4Weight and Int8Weight all say their bytes


def _format(weight: object) -> str:
    if isinstance(weight, torch.Tensor):
        return str(weight.dtype).removeprefix("torch.")
    if getattr(weight, "residual", False):
        return "two 4-bit layers"
    return "8-bit" if int(weight.codes.shape[2]) == 8 else "4-bit"  # the kernel's layouts (cpu_kernels)


def runner_account(runner) -> TokenBytes:
    """The account of a `ModelRunner` over a llama-style family (`LlamaModel`: model.layers).

    ValueError for a family whose weights are laid out otherwise (the hybrid family)."""
    model = runner.model
    layers = getattr(model, "layers", None)
    if not layers or not dataclasses.is_dataclass(layers[0]):
        raise ValueError(f"no bytes account for {type(model).__name__}")
    weights: dict[str, int] = defaultdict(int)
    for layer in layers:
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            weights["norms and biases" if f.name in _NORMS else f.name] += _nbytes(value)
    weights["norms and biases"] += _nbytes(model.final_norm)
    weights["head"] = _nbytes(model.lm_head)
    weights["embedding row"] = model.embed.shape[1] * model.embed.element_size()
    kv = runner.kv
    what = (f"projections {_format(layers[0].qkv)}, head {_format(model.lm_head)}, "
            f"K/V {'8-bit codes + fp32 scale a 32' if kv.codes8 else str(kv.dtype).removeprefix('torch.')}")
    return TokenBytes({k: weights[k] for k in KINDS}, kv.bytes_per_page // kv.page_size, what)


_GGUF_KIND = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o", "ffn_gate": "gate_up",
              "ffn_up": "gate_up", "ffn_down": "down"}


def gguf_account(path: str, kv_itemsize: int = 2) -> TokenBytes:
    """The account of llama.cpp on the GGUF at `path`: its tensors as stored (llama.cpp computes on
    the quantized blocks), the head `output.weight` or, tied, `token_embd.weight`; K/V in f16."""
    from pathlib import Path

    from prefixd.gpu.loading.gguf_loader import read_gguf_header

    gf, config, _ = read_gguf_header(Path(path))
    try:
        weights: dict[str, int] = defaultdict(int)
        types: dict[str, str] = {}
        for name, tensor in gf.tensors.items():
            nbytes = tensor.num_bytes
            part = name.split(".")[-2] if name.startswith("blk.") else name.removesuffix(".weight")
            if part in _GGUF_KIND:
                weights[_GGUF_KIND[part]] += nbytes
                types.setdefault("projections", _type_name(tensor))
            elif part == "token_embd":
                rows = config.vocab_size
                weights["embedding row"] = nbytes // rows
                types["embedding"] = _type_name(tensor)
                if "output.weight" not in gf.tensors:
                    weights["head"] = nbytes
            elif part == "output":
                weights["head"] = nbytes
                types["head"] = _type_name(tensor)
            else:
                weights["norms and biases"] += nbytes
    finally:
        gf.close()
    head = types.get("head", types.get("embedding", "?"))
    kv_row = config.num_layers * 2 * config.num_kv_heads * config.head_dim * kv_itemsize
    what = f"projections {types.get('projections', '?')}, head {head}, K/V f{8 * kv_itemsize}"
    return TokenBytes({k: weights[k] for k in KINDS}, kv_row, what)


def _type_name(tensor) -> str:
    return getattr(tensor.qtype, "name", str(tensor.qtype))


class StreamRead:
    """Streaming reads of one fp32 buffer of `buffer_bytes` (far larger than the caches) on
    `threads` torch threads: `read()` times one sum and gives bytes a second."""

    def __init__(self, threads: int, buffer_bytes: int = 1 << 28) -> None:
        self.threads = threads
        self.buffer_bytes = buffer_bytes
        self._buf = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        self.read()  # pages touched, threads started

    def read(self) -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            start = time.perf_counter()
            self._buf.sum()
            return self.buffer_bytes / (time.perf_counter() - start)
        finally:
            torch.set_num_threads(before)


def read_bandwidth(threads: int, buffer_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes a second a streaming read reaches: the median of `repeats` `StreamRead` reads."""
    stream = StreamRead(threads, buffer_bytes)
    return statistics.median(stream.read() for _ in range(repeats))


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


def render_account(accounts: dict[str, TokenBytes], rates: dict[str, dict[str, float]],
                   contexts: dict[str, int], bandwidth: float | dict[str, float]) -> str:
    """A markdown table: each engine's bytes a one-lane decode token reads (MB) by kind and at each
    context, its measured decode rate, the GB/s that rate moves and the fraction of `bandwidth`
    (one for every row, or one a row label).

    contexts: decode row label (a key of rates[engine]) -> the mean context its tokens read."""
    from bench.common import markdown_table

    engines = list(accounts)
    rows: list[list[object]] = [[f"{kind} (MB)", *(_mb(accounts[e].weights[kind]) for e in engines)]
                                for kind in KINDS]
    rows.append(["weights, all (MB)", *(_mb(sum(accounts[e].weights.values())) for e in engines)])
    for label, ctx in contexts.items():
        bw = bandwidth[label] if isinstance(bandwidth, dict) else bandwidth
        where = label.removeprefix("decode 1 lane ")
        rows.append([f"K/V {where} (MB)", *(_mb(accounts[e].kv_bytes(ctx)) for e in engines)])
        rows.append([f"total {where} (MB)", *(_mb(accounts[e].total(ctx)) for e in engines)])
        rows.append([f"bound {where} (tok/s)", *(f"{bw / accounts[e].total(ctx):,.1f}" for e in engines)])
        measured = [rates.get(e, {}).get(label) for e in engines]
        rows.append([f"measured {where} (tok/s)", *("n/a" if r is None else f"{r:,.1f}" for r in measured)])
        rows.append([f"moved {where} (GB/s)", *("n/a" if r is None else f"{r * accounts[e].total(ctx) / 1e9:.2f}"
                                                for e, r in zip(engines, measured))])
        rows.append([f"fraction of bound {where}", *("n/a" if r is None else f"{r * accounts[e].total(ctx) / bw:.2f}"
                                                    for e, r in zip(engines, measured))])
    lines = [markdown_table(["bytes a 1-lane decode token reads", *engines], rows), ""]
    lines += [f"- {e}: {accounts[e].what}" for e in engines]
    return "\n".join(lines)
