// Mode int4's decoder layers (llama family: no bias, no q/k norm, q's scale folded into the rope
// tables) in one call: the same ops, on the same tensors, in the same order as the Python loop
// of model.LlamaModel.forward, so every bit is the loop's. What the call saves is the
// interpreter's part of each op (argument parsing, the wrappers), about a dozen ops a layer.
//
// For each layer i, with w = weights[10 i .. 10 i + 9] and n = outs[4 i .. 4 i + 3]:
//   x = int4_mm(h, qkv; rms norm w[0]); rope_kv(x -> qk, K/V rows into the layer's pools);
//   attend(qk -> attn); h += int4_mm(attn[:-1], o);
//   g|u = int4_mm(h, gate_up; rms norm w[5]); silu_(g); act = g * u; h += int4_mm(act, down).
// With a head (a decode round, where every row's logits are wanted), the same region goes on
// with model.LlamaModel.logits' ops on every row: normed = rms_norm(h) (torch's op itself, on
// one thread), logits = int4_mm(normed, head; passes), so the team does not part and meet again
// across the Python between the two calls (and its second thread, asleep by then, is not late).
// With `finite` and `best`, the head's tiles also watch each row's logits as they store them
// (`prefixd_cpu::RowWatch`): whether all are finite, and the largest below `head_limit` at its
// lowest index, the greedy pick, so that a greedy lane's round need not read its logits again
// (cold by then: the screen and the pick were a fifth of a one-lane round's host work).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

using prefixd_cpu::Int4Weight;
using prefixd_cpu::share;

// act = silu(gate) * up into a bf16 act: each product one fp32 multiply, rounded to bf16
// nearest-even, the bits at::mul_out gives for every finite value. (A NaN's payload may differ,
// and is never read: the down product's quantizer gives a group holding one zero codes and a
// NaN scale of its own.) at::mul_out into bf16 computes into an fp32 buffer of its own and
// copies it over: three times the time of this loop on a decode round's pieces.
void mul_to_bf16(const at::Tensor& g, const at::Tensor& u, const at::Tensor& a) {
  const int64_t rows = g.size(0), cols = g.size(1);
  const float* gp = g.const_data_ptr<float>();
  const float* up = u.const_data_ptr<float>();
  at::BFloat16* ap = a.mutable_data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = gp + r * g.stride(0);
    const float* ur = up + r * u.stride(0);
    at::BFloat16* ar = ap + r * a.stride(0);
    for (int64_t i = 0; i < cols; ++i) ar[i] = at::BFloat16(gr[i] * ur[i]);
  }
}

constexpr int64_t PER_LAYER = 10;  // input norm, qkv codes and scales, o's, post norm, gate_up's, down's
constexpr int64_t OUTS = 4;        // qkv, o, gate_up, down
constexpr int64_t SHARED_ROWS = 4;  // from this many rows quantizing (and rope) are ops of their own; below, each thread quantizes all
constexpr int64_t SILU_UNIT = 32;    // columns: two AVX-512 vectors, so that a piece's elements take the
                                     // vector loop of at::silu_ exactly where the whole call's does

const float* norm_of(const at::Tensor& w, int64_t width) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == width && w.is_contiguous(),
              "layers_int4: a norm weight must be contiguous fp32 (", width, ",)");
  return w.const_data_ptr<float>();
}

// A round's layers. The threads of one OpenMP region run every op of every layer: each takes
// an op's tasks a grain (a thread's share) at a time while any are left (the product's tiles,
// attention's tasks and joins, rope's rows, the SiLU's pieces) and waits until all of them are
// done before the next op, which reads what they wrote (`prefixd_cpu::Op`). One parallel region an op cost two microseconds
// to start and join; an op's wait is well under one. No op's arithmetic changes: each task is
// the one its op runs on its own, whoever runs it, so the bits are the loop's.
void layers_int4(at::Tensor& h, at::TensorList weights, c10::IntArrayRef outs, double eps, at::Tensor& qk,
                 at::Tensor& attn, at::Tensor& act, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_pools,
                 at::TensorList v_pools, const at::Tensor& slots, const at::Tensor& spans, const at::Tensor& tables,
                 int64_t heads, const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& head_codes,
                 const std::optional<at::Tensor>& head_scales, int64_t head_n, int64_t head_passes,
                 const std::optional<at::Tensor>& normed, const std::optional<at::Tensor>& logits,
                 const std::optional<at::Tensor>& finite, const std::optional<at::Tensor>& best, int64_t head_limit) {
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(v_pools.size()) == layers && static_cast<int64_t>(weights.size()) == PER_LAYER * layers &&
                  static_cast<int64_t>(outs.size()) == OUTS * layers,
              "layers_int4: ", layers, " layers need ", PER_LAYER, " weights and ", OUTS, " output widths each");
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(), "layers_int4: h must be contiguous fp32 (R, hidden)");
  TORCH_CHECK(qk.dim() == 3 && attn.dim() == 2 && attn.size(0) == h.size(0) + 1 && attn.is_contiguous(),
              "layers_int4: attn must be contiguous and hold R + 1 rows");
  const int64_t rows = h.size(0), hidden = h.size(1);
  if (rows == 0 || layers == 0) return;
  const int64_t kv_heads = qk.size(1) - heads, dim = qk.size(2), width = heads * dim;
  TORCH_CHECK(act.dim() == 2 && act.size(0) == rows && act.is_contiguous() &&
                  (act.scalar_type() == at::kBFloat16 || act.scalar_type() == at::kFloat),
              "layers_int4: act must be contiguous bf16 or fp32 (R, intermediate)");
  const int64_t inter = act.size(1);
  const bool head = final_norm.has_value();
  std::optional<Int4Weight> head_w;
  if (head) {
    TORCH_CHECK(head_codes.has_value() && head_scales.has_value() && normed.has_value() && logits.has_value() &&
                    (head_passes == 1 || head_passes == 2),
                "layers_int4: a head needs its codes, scales, passes (1 or 2) and the normed and logits outputs");
    head_w = prefixd_cpu::int4_weight(*head_codes, *head_scales, head_n);
    TORCH_CHECK(head_w->k == hidden, "layers_int4: the head reads ", head_w->k, " inputs, the hidden size is ", hidden);
    TORCH_CHECK(final_norm->scalar_type() == at::kFloat && final_norm->dim() == 1 && final_norm->size(0) == hidden,
                "layers_int4: the final norm must be fp32 (", hidden, ",)");
    TORCH_CHECK(normed->scalar_type() == at::kFloat && normed->is_contiguous() && normed->sizes() == h.sizes(),
                "layers_int4: normed must be contiguous fp32 shaped as h");
    TORCH_CHECK(logits->scalar_type() == at::kFloat && logits->is_contiguous() && logits->dim() == 2 &&
                    logits->size(0) == rows && logits->size(1) == head_n,
                "layers_int4: logits must be contiguous fp32 (R, head_n)");
  }
  // the head's watch: each row's finite flag and best pick, as its tiles store it
  TORCH_CHECK(head || !finite.has_value(), "layers_int4: finite and best go beside a head");
  const std::optional<prefixd_cpu::RowWatch> watch =
      prefixd_cpu::row_watch(finite, best, rows, head_n, head_limit, "layers_int4");
  std::vector<Int4Weight> ws;
  std::vector<const float*> norms;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + PER_LAYER * i;
    const int64_t* n = outs.data() + OUTS * i;
    ws.push_back(prefixd_cpu::int4_weight(w[1], w[2], n[0]));
    ws.push_back(prefixd_cpu::int4_weight(w[3], w[4], n[1]));
    ws.push_back(prefixd_cpu::int4_weight(w[6], w[7], n[2]));
    ws.push_back(prefixd_cpu::int4_weight(w[8], w[9], n[3]));
    const Int4Weight* l = ws.data() + OUTS * i;
    TORCH_CHECK(l[0].k == hidden && l[0].n == (heads + 2 * kv_heads) * dim && l[1].k == width && l[1].n == hidden &&
                    l[2].k == hidden && l[2].n == 2 * inter && l[3].k == inter && l[3].n == hidden,
                "layers_int4: layer ", i, "'s products do not chain hidden ", hidden, ", attention ", width,
                " and intermediate ", inter);
    norms.push_back(norm_of(w[0], hidden));
    norms.push_back(norm_of(w[5], hidden));
    TORCH_CHECK(k_pools[i].sizes() == k_pools[0].sizes() && k_pools[i].scalar_type() == k_pools[0].scalar_type() &&
                    k_pools[i].is_contiguous() && v_pools[i].sizes() == k_pools[0].sizes() &&
                    v_pools[i].scalar_type() == k_pools[0].scalar_type() && v_pools[i].is_contiguous(),
                "layers_int4: every layer's pools must have layer 0's shape and type");
  }
  const int64_t qkv_n = ws[0].n;
  const at::Tensor qkv = at::empty({rows, qkv_n}, h.options());
  const at::Tensor gate_up = at::empty({rows, 2 * inter}, h.options());
  at::Tensor k0 = k_pools[0], v0 = v_pools[0];
  const at::Tensor q = qk.view({-1, dim});
  const auto rope = prefixd_cpu::rope_kv_plan(qkv, cos, sin, qk, k0, v0, slots, heads);
  const auto plan = prefixd_cpu::attend_plan(q, k0, v0, spans, tables, heads, heads + kv_heads, attn, "auto");
  const int threads = omp_in_parallel() ? 1 : std::max(1, at::get_num_threads());

  // SiLU and the product with the up half in pieces: rows where there are enough, else columns
  // in units of 32
  const at::Tensor gate = gate_up.narrow(1, 0, inter), up = gate_up.narrow(1, inter, inter);
  const int64_t units = (inter + SILU_UNIT - 1) / SILU_UNIT;
  const bool by_rows = rows >= 2 * threads;
  const int pieces = static_cast<int>(std::min<int64_t>(by_rows ? rows : units, 2 * threads));
  std::vector<std::array<at::Tensor, 3>> silu;  // gate, up, act
  for (int p = 0; p < pieces; ++p) {
    const auto [b, e] = share(by_rows ? rows : units, p, pieces);
    const int64_t from = by_rows ? b : b * SILU_UNIT, to = by_rows ? e : std::min(inter, e * SILU_UNIT);
    const int cut = by_rows ? 0 : 1;
    silu.push_back({gate.narrow(cut, from, to - from), up.narrow(cut, from, to - from), act.narrow(cut, from, to - from)});
  }

  // the rows' codes: one buffer the threads share (a quantizing op of its own, a task a few
  // rows), or below SHARED_ROWS one a thread, each quantizing every row as it takes its first
  // tiles of a product (which then cannot end before it has: its input stays as it read it)
  const bool shared_rows = rows >= SHARED_ROWS;
  const int64_t kmax = std::max({hidden, width, inter});
  const int64_t code_floats = (rows * kmax + 3) / 4, group_floats = rows * kmax / 32;
  const int buffers = shared_rows ? 1 : threads;  // a team is never larger than `threads`
  std::vector<float> codes(static_cast<size_t>(buffers) * (code_floats + 2 * group_floats));
  const float feps = static_cast<float>(eps);
  float* hp = h.mutable_data_ptr<float>();
  const float* attended = attn.const_data_ptr<float>();
  float* qkv_p = qkv.mutable_data_ptr<float>();
  float* gate_up_p = gate_up.mutable_data_ptr<float>();
  const bool act_bf16 = act.scalar_type() == at::kBFloat16;
  const void* act_p = act.const_data_ptr();
  // the head's: its rows' codes (head_passes a row), and the ops that run it after the layers
  const int head_q = head ? static_cast<int>(head_passes) : 0;
  const int64_t head_code_floats = (head_q * rows * hidden + 3) / 4, head_groups = head_q * rows * hidden / 32;
  std::vector<float> head_codes_buf(static_cast<size_t>(head_code_floats + 2 * head_groups));
  enum { HEAD_NORM, HEAD_QUANT, HEAD_TILES, HEAD_OPS };
  std::array<prefixd_cpu::Op, HEAD_OPS> head_ops;
  std::vector<void*> k_at, v_at;  // each layer's pools, read here: the region touches no tensor but SiLU's pieces
  for (int64_t i = 0; i < layers; ++i) {
    k_at.push_back(k_pools[i].mutable_data_ptr());
    v_at.push_back(v_pools[i].mutable_data_ptr());
  }

  // every op of every layer, in order. A grain is a thread's share: a thread that comes late
  // finds its share taken by one that came early. (Finer grains were slower on an idle machine,
  // by 3 to 9 % with a quarter of a share, and no faster beside a busy neighbour.)
  enum { QUANT_IN, QKV, ROPE, ATTEND, JOIN, QUANT_ATTN, O, QUANT_POST, GATE_UP, SILU, QUANT_ACT, DOWN, OPS };
  const auto grain = [&](int64_t total) { return static_cast<int>((total + threads - 1) / threads); };
  std::vector<prefixd_cpu::Op> ops(static_cast<size_t>(OPS * layers));
  for (int64_t i = 0; i < layers; ++i) {
    prefixd_cpu::Op* o = ops.data() + OPS * i;
    const Int4Weight* w = ws.data() + OUTS * i;
    for (const int q : {QUANT_IN, QUANT_ATTN, QUANT_POST, QUANT_ACT}) o[q].reset(shared_rows ? rows : 0, grain(rows));
    const int tiles[] = {QKV, O, GATE_UP, DOWN};
    for (int j = 0; j < 4; ++j) {
      const int64_t n = prefixd_cpu::int4_tasks(w[j], rows);
      o[tiles[j]].reset(static_cast<int>(n), grain(n));
    }
    o[ROPE].reset(shared_rows ? rows : 1, shared_rows ? grain(rows) : 1);
    o[ATTEND].reset(static_cast<int>(prefixd_cpu::attend_tasks(*plan)), 1);
    const int64_t joins = prefixd_cpu::attend_joins(*plan);
    o[JOIN].reset(static_cast<int>(joins), grain(joins));
    o[SILU].reset(pieces, 1);
  }
  if (head) {
    head_ops[HEAD_NORM].reset(1, 1);
    head_ops[HEAD_QUANT].reset(static_cast<int>(rows), grain(rows));
    const int64_t n = prefixd_cpu::int4_tasks(*head_w, head_q * rows);
    head_ops[HEAD_TILES].reset(static_cast<int>(n), grain(n));
  }

  // a thread of the team (of at most `threads`)
  const auto run = [&](int t) {
    float* mine = codes.data() + (shared_rows ? 0 : t) * (code_floats + 2 * group_floats);
    int8_t* xq = reinterpret_cast<int8_t*>(mine);
    float* d = mine + code_floats;
    float* s = d + group_floats;
    std::vector<float> row(kmax), scratch, local;
    // op's tasks, as many as this thread gets, then the wait for the rest; `first` before its first
    const auto each = [](prefixd_cpu::Op& op, const auto& first, const auto& fn) {
      if (op.total() == 0) return;
      int b, e;
      for (bool started = false; op.take(b, e); op.finish(e - b)) {
        if (!started) first();
        started = true;
        fn(b, e);
      }
      op.wait();
    };
    const auto nothing = [] {};
    // x's rows quantized, then the product's tiles into out (or added to it)
    const auto product = [&](prefixd_cpu::Op& quant, prefixd_cpu::Op& tiles, const auto* x, int64_t kx, const float* norm,
                             const Int4Weight& w, float* out, bool accumulate) {
      each(quant, nothing, [&](int b, int e) { prefixd_cpu::int4_quantize(x, b, e, kx, norm, feps, row.data(), xq, d, s); });
      const auto own = [&] {
        if (!shared_rows) prefixd_cpu::int4_quantize(x, 0, rows, kx, norm, feps, row.data(), xq, d, s);
      };
      each(tiles, own, [&](int b, int e) { prefixd_cpu::int4_tiles(w, xq, d, s, rows, kx, out, accumulate, b, e); });
    };
    for (int64_t i = 0; i < layers; ++i) {
      prefixd_cpu::Op* o = ops.data() + OPS * i;
      const Int4Weight* w = ws.data() + OUTS * i;
      void* k = k_at[i];
      void* v = v_at[i];
      product(o[QUANT_IN], o[QKV], hp, hidden, norms[2 * i], w[0], qkv_p, false);
      each(o[ROPE], nothing, [&](int b, int e) {
        prefixd_cpu::rope_kv_rows(*rope, k, v, shared_rows ? b : 0, shared_rows ? e : rows);
      });
      each(o[ATTEND], nothing, [&](int b, int e) {
        for (int j = b; j < e; ++j) prefixd_cpu::attend_task(*plan, j, k, v, scratch, local);
      });
      each(o[JOIN], nothing, [&](int b, int e) { prefixd_cpu::attend_join(*plan, b, e); });
      product(o[QUANT_ATTN], o[O], attended, width, nullptr, w[1], hp, true);  // h += o
      product(o[QUANT_POST], o[GATE_UP], hp, hidden, norms[2 * i + 1], w[2], gate_up_p, false);
      each(o[SILU], nothing, [&](int b, int e) {
        for (int p = b; p < e; ++p) {
          auto& [g, u, a] = silu[p];
          at::silu_(g);
          if (act_bf16)
            mul_to_bf16(g, u, a);
          else
            at::mul_out(a, g, u);
        }
      });
      if (act_bf16)
        product(o[QUANT_ACT], o[DOWN], static_cast<const at::BFloat16*>(act_p), inter, nullptr, w[3], hp, true);  // h += down
      else
        product(o[QUANT_ACT], o[DOWN], static_cast<const float*>(act_p), inter, nullptr, w[3], hp, true);
    }
    if (head) {
      int8_t* hq = reinterpret_cast<int8_t*>(head_codes_buf.data());
      float* hd = head_codes_buf.data() + head_code_floats;
      float* hs = hd + head_groups;
      at::Tensor out = *normed;
      each(head_ops[HEAD_NORM], nothing, [&](int, int) {
        out.copy_(at::rms_norm(h, {hidden}, *final_norm, eps));  // torch's op: the Python path's bits
      });
      const float* np = out.const_data_ptr<float>();
      each(head_ops[HEAD_QUANT], nothing,
           [&](int b, int e) { prefixd_cpu::int4_quantize_passes(np, b, e, hidden, head_q, row.data(), hq, hd, hs); });
      float* lp = logits->mutable_data_ptr<float>();
      each(head_ops[HEAD_TILES], nothing, [&](int b, int e) {
        prefixd_cpu::int4_tiles(*head_w, hq, hd, hs, head_q * rows, hidden, lp, false, b, e, head_q == 2,
                                watch ? &*watch : nullptr);
      });
    }
  };
  if (threads == 1) {
    run(0);
    return;
  }
  const at::ThreadLocalState state;
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard guard(state);  // the caller's inference mode for at::silu_ (and at::mul_out)
    run(omp_get_thread_num());
  }
}

// A round's set-up and its layers in one call, from the host's lists (model.LlamaModel's
// `forward_host`): what the Python set-up builds op by op before `layers_int4` (runner._inputs,
// embed_rows, model._Round, cpu_kernels.attention_index), built here with the same values, so
// the call's bits are the same. Each lane is four numbers of `spans` (its first row, its first
// position, its rows, its pages) and its pages' ids in `pages`, in order; `rope` is
// RopeTable.scaled_table's (2: cos | sin, positions, 2: q's scaled | kv's, width). Returns the
// final hidden rows (normed, with a head; else the residual stream, unnormed), the logits (with
// a head; else an empty tensor), and with `pick_below` > 0 each row's greedy pick among the
// ids below it (-1 where any logit of the row is not finite).
std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> layers_int4_rows(
    const at::Tensor& embed, c10::IntArrayRef tokens, c10::IntArrayRef spans, c10::IntArrayRef pages,
    int64_t page_size, const at::Tensor& rope, at::TensorList weights, c10::IntArrayRef outs, double eps,
    at::TensorList k_pools, at::TensorList v_pools, int64_t heads, int64_t kv_heads, int64_t head_dim,
    at::ScalarType qk_dtype, at::ScalarType act_dtype, const std::optional<at::Tensor>& final_norm,
    const std::optional<at::Tensor>& head_codes, const std::optional<at::Tensor>& head_scales, int64_t head_n,
    int64_t head_passes, int64_t pick_below) {
  const int64_t rows = static_cast<int64_t>(tokens.size()), lanes = static_cast<int64_t>(spans.size()) / 4;
  TORCH_CHECK(static_cast<int64_t>(spans.size()) == 4 * lanes && lanes > 0 && rows > 0 && page_size > 0,
              "layers_int4_rows: four numbers a lane (first row, first position, rows, pages), and rows");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() &&
                  (embed.scalar_type() == at::kBFloat16 || embed.scalar_type() == at::kFloat),
              "layers_int4_rows: embed must be contiguous bf16 or fp32 (vocab, hidden)");
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.dim() == 4 && rope.size(0) == 2 && rope.size(2) == 2 &&
                  rope.is_contiguous(),
              "layers_int4_rows: rope must be contiguous fp32 (2, positions, 2, width)");
  TORCH_CHECK(outs.size() >= 3 && outs[2] % 2 == 0, "layers_int4_rows: the first layer's gate_up width must be even");
  const int64_t vocab = embed.size(0), hidden = embed.size(1), width = rope.size(3), covered = rope.size(1);
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);

  // the rows' positions, K/V slots and the attention index (runner._inputs, attention_index)
  int64_t most_pages = 1;
  for (int64_t s = 0; s < lanes; ++s) most_pages = std::max(most_pages, spans[4 * s + 3]);
  at::Tensor slots = at::empty({rows}, at::kLong), spans_t = at::empty({lanes, 3}, at::kLong);
  at::Tensor tables = at::zeros({lanes, most_pages}, at::kInt);
  std::vector<int64_t> positions(static_cast<size_t>(rows));
  int64_t* slot = slots.mutable_data_ptr<int64_t>();
  int64_t* span = spans_t.mutable_data_ptr<int64_t>();
  int32_t* table = tables.mutable_data_ptr<int32_t>();
  int64_t row = 0, page_at = 0;
  for (int64_t s = 0; s < lanes; ++s) {
    const int64_t first = spans[4 * s], start = spans[4 * s + 1], n = spans[4 * s + 2], np = spans[4 * s + 3];
    TORCH_CHECK(first == row && n > 0 && start >= 0 && np >= 0 && page_at + np <= static_cast<int64_t>(pages.size()) &&
                    (start + n - 1) / page_size < np && start + n <= covered,
                "layers_int4_rows: lane ", s, "'s rows do not follow the last, or its pages or rope table do not cover them");
    span[3 * s] = first, span[3 * s + 1] = start, span[3 * s + 2] = n;
    for (int64_t i = 0; i < np; ++i) table[s * most_pages + i] = static_cast<int32_t>(pages[page_at + i]);
    for (int64_t i = 0; i < n; ++i, ++row) {
      const int64_t pos = start + i;
      positions[row] = pos;
      slot[row] = pages[page_at + pos / page_size] * page_size + pos % page_size;
    }
    page_at += np;
  }
  TORCH_CHECK(row == rows, "layers_int4_rows: the lanes hold ", row, " rows, the tokens ", rows);

  // the rows' input embeddings as fp32 (embed_rows: exact), and the q-scaled rope tables (q_scaled: copies)
  at::Tensor h = at::empty({rows, hidden}, f32);
  float* hp = h.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = tokens[r];
    TORCH_CHECK(0 <= t && t < vocab, "layers_int4_rows: token ", t, " outside the vocabulary of ", vocab);
    if (embed.scalar_type() == at::kBFloat16) {
      const at::BFloat16* e = embed.const_data_ptr<at::BFloat16>() + t * hidden;
      for (int64_t i = 0; i < hidden; ++i) hp[r * hidden + i] = static_cast<float>(e[i]);
    } else {
      std::memcpy(hp + r * hidden, embed.const_data_ptr<float>() + t * hidden, hidden * sizeof(float));
    }
  }
  const int64_t all_heads = heads + kv_heads;
  at::Tensor tables_rope = at::empty({2, rows, all_heads, width}, f32);
  float* tp = tables_rope.mutable_data_ptr<float>();
  const float* rp = rope.const_data_ptr<float>();
  for (int64_t c = 0; c < 2; ++c)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < all_heads; ++k)
        std::memcpy(tp + ((c * rows + r) * all_heads + k) * width,
                    rp + ((c * covered + positions[r]) * 2 + (k < heads ? 0 : 1)) * width, width * sizeof(float));

  // the round's buffers (model._Round)
  at::Tensor qk = at::zeros({rows + 1, all_heads, head_dim}, at::TensorOptions().dtype(qk_dtype));
  at::Tensor attn = at::zeros({rows + 1, heads * head_dim}, f32);
  at::Tensor act = at::empty({rows, outs[2] / 2}, at::TensorOptions().dtype(act_dtype));

  const bool head = final_norm.has_value();
  std::optional<at::Tensor> normed, logits, finite, best;
  if (head) {
    normed = at::empty_like(h);
    logits = at::empty({rows, head_n}, f32);
    if (pick_below > 0) {
      finite = at::empty({rows}, at::kByte);
      best = at::empty({rows}, at::kLong);
    }
  }
  layers_int4(h, weights, outs, eps, qk, attn, act, tables_rope[0], tables_rope[1], k_pools, v_pools, slots, spans_t,
              tables, heads, final_norm, head_codes, head_scales, head_n, head_passes, normed, logits, finite, best,
              pick_below);
  std::vector<int64_t> picks;
  if (finite.has_value()) {
    const uint8_t* f = finite->const_data_ptr<uint8_t>();
    const uint64_t* b = reinterpret_cast<const uint64_t*>(best->const_data_ptr<int64_t>());
    for (int64_t r = 0; r < rows; ++r) picks.push_back(f[r] ? static_cast<int64_t>(0xffffffffu - (b[r] & 0xffffffffu)) : -1);
  }
  if (!head) return {h, at::empty({0}, f32), picks};
  return {*normed, *logits, picks};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixd, m) {
  m.def("layers_int4(Tensor(a!) h, Tensor[] weights, int[] outs, float eps, Tensor(b!) qk, Tensor(c!) attn, "
        "Tensor(d!) act, Tensor cos, Tensor sin, Tensor(e!)[] k_pools, Tensor(f!)[] v_pools, Tensor slots, "
        "Tensor spans, Tensor tables, int heads, Tensor? final_norm=None, Tensor? head_codes=None, "
        "Tensor? head_scales=None, int head_n=0, int head_passes=1, Tensor(g!)? normed=None, "
        "Tensor(h!)? logits=None, Tensor(i!)? finite=None, Tensor(j!)? best=None, int head_limit=0) -> ()");
}

TORCH_LIBRARY_FRAGMENT(prefixd, m) {
  m.def("layers_int4_rows(Tensor embed, int[] tokens, int[] spans, int[] pages, int page_size, Tensor rope, "
        "Tensor[] weights, int[] outs, float eps, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, int heads, "
        "int kv_heads, int head_dim, ScalarType qk_dtype, ScalarType act_dtype, Tensor? final_norm=None, "
        "Tensor? head_codes=None, Tensor? head_scales=None, int head_n=0, int head_passes=1, int pick_below=0) "
        "-> (Tensor, Tensor, int[])");
}

TORCH_LIBRARY_IMPL(prefixd, CPU, m) {
  m.impl("layers_int4", &layers_int4);
  m.impl("layers_int4_rows", &layers_int4_rows);
}
