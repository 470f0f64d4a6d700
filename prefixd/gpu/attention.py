"""Row-invariant paged attention: fixed blocks, fixed order, fixed combine.

A query row at position p attends keys 0..p of its own lane, read from the KV pool through
the lane's page table. Keys are cut into blocks of `block` rows aligned to absolute
positions (block j holds positions [j*B, (j+1)*B)). For every (row, block):

    s   = q . k                    one bmm of shape (M, D) x (D, B), M padded (linear.py)
    m   = max over the row's keys  (exact whatever the order)
    p   = exp(s - m), 0 where masked
    l_j = sum_B p,  a_j = p @ v    fixed length B, one bmm of shape (M, B) x (B, D)
    out = (sum_j a_j) / (sum_j l_j) sums over blocks by halving, zero-padded to 2^k blocks

Masked keys contribute nothing whatever their bytes hold. Pages are reused, so the rows of a
lane's pages past its last row hold whatever an earlier request left there (NaN included):
scores of masked keys are selected to -inf, never computed from, and the value rows past a
lane's last row are zeroed after the gather, since p = 0 times a stale NaN value is NaN. The
rows below it are the lane's own.

Blocks past a row's position are fully masked and add exactly 0, so a row gets the same
bits whether it is prefilled in one chunk, in pieces, decoded alone or beside other lanes
padded to more blocks. The two bmms take the pool's dtype (bf16 in bf16 mode: fp32
accumulation, bf16 outputs, as in transformers' eager bf16 attention); max, exp, sums and the
combine are fp32. K/V are read from the pool, so a row prefilled now and a row decoded later
see identical keys.

Rows of a round are grouped into tiles: all short (decode/verify) lanes share one tile,
padded to the longest; a prefill lane gets tiles of `tile_rows` rows, each seeing only the
blocks up to its last row, so memory stays O(tile_rows * context) and a tile's scores stay
cache-sized. A prefill lane's keys and values are gathered from the pool once per layer, for
its last tile, and its earlier tiles read a prefix of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from prefixd.gpu import flash, kernels
from prefixd.gpu.linear import invariant_rows

DEFAULT_BLOCK = 256
TILE_ROWS = 32  # query rows per prefill tile: its scores stay cache-sized at long context
DECODE_ROWS = 8


@dataclass(frozen=True)
class AttentionSpan:
    """One lane's rows in a round: rows [row, row + length) at positions [start, start + length)."""

    row: int
    start: int
    length: int
    page_table: tuple[int, ...]


@dataclass(frozen=True)
class AttentionTile:
    """Index tensors for one batched attention call, built once per round for every layer."""

    num_lanes: int
    rows: int  # query rows per lane (padded)
    num_blocks: int
    q_index: torch.Tensor  # (num_lanes * rows,) into q with a zero row appended
    out_index: torch.Tensor  # (num_lanes * rows,) into out with a scratch row appended
    page_index: torch.Tensor  # (num_lanes * num_blocks * block // page_size,)
    mask_from: int  # first block where some row of the tile has a masked key
    masked: torch.Tensor | None  # (num_lanes, num_blocks - mask_from, 1, rows * group, block) bool
    dead_from: torch.Tensor  # (num_lanes,) long: each lane's first key past its last row
    kv_group: int  # tiles of one group share one K/V gather: that of the group's widest tile
    index_cache: dict = field(default_factory=dict, compare=False, repr=False)  # `_head_rows`, `_key_rows`
    # (num_lanes * rows,) long: each row's position (padding rows: their lane's last row's).
    # Set for the flash kernel (flash.py), which masks from positions; then `masked` is None.
    qpos: torch.Tensor | None = None


def block_size(page_size: int) -> int:
    """Smallest multiple of the page size that is at least DEFAULT_BLOCK."""
    return page_size * -(-DEFAULT_BLOCK // page_size)


def _padded_rows(length: int, group: int, dtype: torch.dtype) -> int:
    """Query rows per lane of a tile: `length`, padded so that rows * group reaches the
    minimum row count of an fp32 product. bf16 products are not padded: torch's CPU bf16 bmm,
    on the one thread kernels.bmm runs it on, gives a row the same bits at every M from 1 and
    every batch count at attention's shapes (bench/probe_cpu.py), and on CUDA kernels.bmm is
    one fixed configuration for every M."""
    if dtype == torch.bfloat16:
        return length
    rows = length
    while rows * group < invariant_rows(rows * group, dtype):
        rows += 1
    return rows


def _tile(pieces: Sequence[tuple[AttentionSpan, int, int]], *, total_rows: int, group: int,
          page_size: int, block: int, device: torch.device, dtype: torch.dtype,
          kv_group: int, for_flash: bool = False) -> AttentionTile:
    """One tile over (span, first, count): rows [first, first + count) of each span; for the
    flash kernel (`for_flash`) with positions and no mask."""
    rows = max(c for _, _, c in pieces) if for_flash else _padded_rows(max(c for _, _, c in pieces), group, dtype)
    ends = [s.start + f + c for s, f, c in pieces]
    num_blocks = -(-max(ends) // block)
    pages_per_lane = num_blocks * block // page_size
    q_index, out_index, qpos, page_index = [], [], [], []
    for (span, first, count), end in zip(pieces, ends):
        real = list(range(span.row + first, span.row + first + count))
        q_index += real + [total_rows] * (rows - count)
        out_index += real + [total_rows] * (rows - count)
        positions = list(range(span.start + first, end))
        qpos += positions + [end - 1] * (rows - count)
        table = list(span.page_table[:pages_per_lane])
        if len(table) * page_size < end:
            raise ValueError(f"page table of {len(span.page_table)} pages cannot hold row {end - 1}")
        page_index += table + [table[0]] * (pages_per_lane - len(table))
    nl = len(pieces)
    # Blocks before mask_from are unmasked for every row: the mask covers only the rest.
    mask_from = min(qpos) // block
    qp = torch.tensor(qpos, dtype=torch.long, device=device).view(nl, rows)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    masked = None if for_flash else tile_mask(qp, num_blocks, mask_from, block, group)
    return AttentionTile(nl, rows, num_blocks, as_long(q_index), as_long(out_index), as_long(page_index),
                         mask_from, masked, as_long(ends), kv_group, qpos=qp.view(-1) if for_flash else None)


def tile_mask(qpos: torch.Tensor, num_blocks: int, mask_from: int, block: int, group: int) -> torch.Tensor:
    """`AttentionTile.masked` for query positions qpos (lanes, rows): (lanes, num_blocks -
    mask_from, 1, rows * group, block) bool, True where the key lies past the row's position."""
    nl, rows = qpos.shape
    kpos = torch.arange(mask_from * block, num_blocks * block, device=qpos.device).view(1, 1, 1, -1)
    masked = (kpos > qpos.view(nl, rows, 1, 1)).expand(nl, rows, group, (num_blocks - mask_from) * block)
    masked = masked.reshape(nl, rows * group, num_blocks - mask_from, block).permute(0, 2, 1, 3)
    return masked.unsqueeze(2).contiguous()


def plan_attention(spans: Sequence[AttentionSpan], *, total_rows: int, group: int, page_size: int,
                   device: torch.device, dtype: torch.dtype, tile_rows: int = TILE_ROWS,
                   decode_rows: int = DECODE_ROWS) -> list[AttentionTile]:
    """Tiles covering every row of every span; `total_rows` is the round's row count and
    `dtype` the KV pool's (it sets the padding of the matmuls' row count). Where attention runs
    the flash kernel (`kernels.triton_path`), a prefill lane is one tile of all its rows (the
    kernel keeps no scores) and tiles carry positions instead of masks."""
    block = block_size(page_size)
    for_flash = kernels.triton_path(device)
    short = [(s, 0, s.length) for s in spans if 0 < s.length <= decode_rows]
    tiles = []
    if short:
        tiles.append(_tile(short, total_rows=total_rows, group=group, page_size=page_size,
                           block=block, device=device, dtype=dtype, kv_group=0, for_flash=for_flash))
    for kv_group, s in enumerate(spans, start=1):
        if s.length <= decode_rows:
            continue
        if for_flash:
            tiles.append(_tile([(s, 0, s.length)], total_rows=total_rows, group=group, page_size=page_size,
                               block=block, device=device, dtype=dtype, kv_group=kv_group, for_flash=True))
            continue
        # the widest tile first: the group's gather is made for it, the others read a prefix
        for first in reversed(range(0, s.length, tile_rows)):
            count = min(tile_rows, s.length - first)
            tiles.append(_tile([(s, first, count)], total_rows=total_rows, group=group,
                               page_size=page_size, block=block, device=device, dtype=dtype,
                               kv_group=kv_group))
    return tiles


def _key_rows(tile: AttentionTile, block: int, page_size: int, kv_heads: int) -> torch.Tensor:
    """Rows of the pool viewed as (pages * P * kv_heads, D), in the tile's (lane, block,
    kv head, key) order: one gather gives the bmm's layout. Keys at or past a lane's
    `dead_from` read the lane's position 0 instead (a row of its own, finite): their scores
    are masked and their probability is exactly 0, so they add the zeros a zeroed row would,
    and no stale (possibly non-finite) row of a reused page is ever read. Built on the first
    layer, cached."""
    key = ("keys", block, page_size, kv_heads)
    if key not in tile.index_cache:
        device = tile.page_index.device
        nl, nb, per_block = tile.num_lanes, tile.num_blocks, block // page_size
        offsets = torch.arange(page_size, device=device)
        pages = tile.page_index.view(nl, nb * per_block)
        slots = (pages.view(nl, nb, per_block, 1) * page_size + offsets).view(nl, nb, block)
        ends = tile.dead_from.view(nl, 1, 1)
        positions = torch.arange(nb * block, device=device).view(1, nb, block)
        first = (pages[:, 0] * page_size).view(nl, 1, 1)
        slots = torch.where(positions >= ends, first, slots).view(nl, nb, 1, block)
        heads = torch.arange(kv_heads, device=device).view(1, 1, kv_heads, 1)
        tile.index_cache[key] = (slots * kv_heads + heads).reshape(-1)
    return tile.index_cache[key]


def _kv_rows(tile: AttentionTile, block: int, page_size: int, kv_heads: int, v_offset: int) -> torch.Tensor:
    """`_key_rows`, then the same rows `v_offset` rows further on: one index for K and V of a
    layer whose values sit at a fixed row offset after its keys in one storage. Cached."""
    key = ("kv", block, page_size, kv_heads, v_offset)
    if key not in tile.index_cache:
        rows = _key_rows(tile, block, page_size, kv_heads)
        tile.index_cache[key] = torch.cat([rows, rows + v_offset])
    return tile.index_cache[key]


def _value_offset(k_pool: torch.Tensor, v_pool: torch.Tensor) -> int | None:
    """Rows of D from k_pool's first element to v_pool's, when both are contiguous views of
    one storage with the values after the keys (the KV pool's layers); else None."""
    d = k_pool.shape[-1]
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape == v_pool.shape):
        return None
    if k_pool.untyped_storage().data_ptr() != v_pool.untyped_storage().data_ptr():
        return None
    delta = v_pool.storage_offset() - k_pool.storage_offset()
    if delta < k_pool.numel() or delta % d:
        return None
    return delta // d


def _gather(k_pool: torch.Tensor, v_pool: torch.Tensor, tile: AttentionTile,
            block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (lanes, blocks, kv_heads, block, D) of a tile's lanes, pool dtype: one
    gather of both when they share a storage (the KV pool), else one each. Keys and values
    past a lane's last row are its position 0's (`_key_rows`)."""
    _, page_size, kvh, d = k_pool.shape
    shape = (tile.num_lanes, tile.num_blocks, kvh, block, d)
    offset = _value_offset(k_pool, v_pool)
    if offset is None:
        rows = _key_rows(tile, block, page_size, kvh)
        return (k_pool.view(-1, d).index_select(0, rows).view(shape),
                v_pool.view(-1, d).index_select(0, rows).view(shape))
    rows = _kv_rows(tile, block, page_size, kvh, offset)
    flat = k_pool.as_strided((offset + k_pool.numel() // d, d), (d, 1))  # keys ... values of the layer
    kv = flat.index_select(0, rows).view(2, *shape)
    return kv[0], kv[1]


def _head_rows(tile: AttentionTile, heads: int, kv_heads: int, q_stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rows, out_rows): q's rows among the round's (rows + 1) * q_stride head vectors (a
    round row holds q_stride heads, its q heads first), in the tile's (lane, block, kv head,
    row, group) order (every block reads the same q), and the output's among (rows + 1) * heads
    in (lane, kv head, row, group) order. Built on the first layer, then cached."""
    key = (heads, kv_heads, q_stride)
    if key not in tile.index_cache:
        nl, rows, group = tile.num_lanes, tile.rows, heads // kv_heads
        head = (torch.arange(kv_heads, device=tile.q_index.device) * group).view(kv_heads, 1, 1)
        head = head + torch.arange(group, device=tile.q_index.device).view(1, 1, group)  # (kvh, 1, group)
        q_rows = tile.q_index.view(nl, 1, 1, rows, 1) * q_stride + head.unsqueeze(0)  # (nl, 1, kvh, rows, group)
        q_rows = q_rows.expand(nl, tile.num_blocks, kv_heads, rows, group).reshape(-1)
        out_rows = (tile.out_index.view(nl, 1, rows, 1) * heads + head).reshape(-1)
        tile.index_cache[key] = (q_rows, out_rows)
    return tile.index_cache[key]


def attend_tile(q_ext: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: AttentionTile,
                out: torch.Tensor, q_stride: int) -> None:
    """Attention of one tile's rows, written into their rows of out (R + 1, heads * D) fp32.

    q_ext is pre-scaled, in the pool's dtype, ((R + 1) * q_stride, D): q_stride head vectors
    per round row, its `heads` q heads first, and a last round row of zeros; k and v are the
    tile's gathered blocks, (lanes, blocks, kv_heads, block, D), or a wider gather of the same
    lane (its leading blocks are this tile's). Batched matmuls run over (lane, block, kv head),
    each of fixed shape. Padding rows read the zero row and write the scratch row R.
    """
    nl, rows, nb = tile.num_lanes, tile.rows, tile.num_blocks
    _, gathered_blocks, kvh, block, d = k.shape
    heads = out.shape[1] // d
    m_rows = rows * (heads // kvh)
    q_rows, out_rows = _head_rows(tile, heads, kvh, q_stride)
    if gathered_blocks != nb:
        k, v = k[:, :nb], v[:, :nb]  # a view: contiguous, as one lane's leading blocks
    q = q_ext.index_select(0, q_rows).view(-1, m_rows, d)  # (nl * nb * kvh, m_rows, D)
    s = kernels.bmm(q, k.reshape(-1, block, d).transpose(1, 2)).view(nl, nb, kvh, m_rows, block)
    s[:, tile.mask_from:].masked_fill_(tile.masked, float("-inf"))
    # amax in the pool dtype is exact; float(s) - m over flat views (a broadcast over a
    # 5-d mixed-dtype tensor is many times slower, for the same bits)
    m = s.amax(dim=(1, 4), keepdim=True).float()  # every row sees position 0: m is finite
    p = s.float().view(nl, nb, kvh * m_rows, block).sub_(m.view(nl, 1, kvh * m_rows, 1))
    p = p.exp_().view(nl, nb, kvh, m_rows, block)  # 0 where masked
    l = kernels.sum_dim(p, -1)  # (nl, nb, kvh, m_rows)
    a = kernels.bmm(p.view(-1, m_rows, block).to(v.dtype), v.reshape(-1, block, d))
    # a (fp32 by promotion) and l side by side: one sum over blocks for both
    al = _sum_blocks(torch.cat([a.view(nl, nb, kvh, m_rows, d), l.unsqueeze(-1)], dim=-1))
    o = al[..., :d] / al[..., d:]  # (nl, kvh, m_rows, D)
    out.view(-1, d).index_copy_(0, out_rows, o.reshape(-1, d))


def _sum_blocks(x: torch.Tensor) -> torch.Tensor:
    """x summed over its block dim (1) by halving: blocks zero-padded to a power of two, then
    x[:h] + x[h:] until one is left. A row's trailing all-masked blocks and the padding are
    exact zeros that meet only zeros or pass a value through unchanged, so the sum's bits
    depend only on the row's own blocks, whatever the tile's block count (element-wise adds:
    the same on every device)."""
    n = x.shape[1]
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, size - n])  # zero blocks at the end
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           tiles: Sequence[AttentionTile]) -> torch.Tensor:
    """(R, heads * D) fp32 attention of pre-scaled fp32 q (R, heads, D) over the pool.

    The two matmuls run in the pool's dtype (fp32 accumulation; bf16 outputs in bf16 mode);
    softmax statistics, block sums and the combine are fp32.

    Rows no tile covers come back as zeros.
    """
    r, heads, d = q.shape
    q_ext = q.new_zeros((r + 1, heads, d), dtype=k_pool.dtype)  # a zero row for padding rows
    q_ext[:r] = q
    out = q.new_zeros(r + 1, heads * d)
    attend_into(q_ext.view(-1, d), heads, k_pool, v_pool, tiles, out)
    return out[:r]


def attend_into(q_ext: torch.Tensor, q_stride: int, k_pool: torch.Tensor, v_pool: torch.Tensor,
                tiles: Sequence[AttentionTile], out: torch.Tensor) -> None:
    """`attend` into buffers a caller keeps for a whole round (every layer writes the same rows):
    q_ext ((R + 1) * q_stride, D) in the pool's dtype, its last round row zero (`attend_tile`),
    and out (R + 1, heads * D) fp32, whose rows no tile covers keep what they hold."""
    block = tiles[0].masked.shape[-1] if tiles and tiles[0].masked is not None else 0
    gathered: tuple[int, torch.Tensor, torch.Tensor] | None = None
    for tile in tiles:  # a group's widest tile comes first
        if tile.masked is None:  # planned for the flash kernel
            flash.attend_tile(q_ext, q_stride, k_pool, v_pool, tile, out)
            continue
        if gathered is None or gathered[0] != tile.kv_group:
            gathered = (tile.kv_group, *_gather(k_pool, v_pool, tile, block))
        attend_tile(q_ext, gathered[1], gathered[2], tile, out, q_stride)
