// Mode int4's decoder layers (llama family: no bias, no q/k norm, q's scale folded into the rope
// tables) in one call: the same ops, on the same tensors, in the same order as the Python loop
// of model.LlamaModel.forward, so every bit is the loop's. What the call saves is the
// interpreter's part of each op (argument parsing, the wrappers), about a dozen ops a layer.
//
// For each layer i, with w = weights[10 i .. 10 i + 9] and n = outs[4 i .. 4 i + 3]:
//   x = int4_mm(h, qkv; rms norm w[0]); rope_kv(x -> qk, K/V rows into the layer's pools);
//   attend(qk -> attn); h += int4_mm(attn[:-1], o);
//   g|u = int4_mm(h, gate_up; rms norm w[5]); silu_(g); act = g * u; h += int4_mm(act, down).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using Int4Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::string_view,
                          const std::optional<at::Tensor>&, double, int64_t);
using RopeKv = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                    const at::Tensor&, int64_t);
using Attend = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                    int64_t, at::Tensor&, c10::string_view);

constexpr int64_t PER_LAYER = 10;  // input norm, qkv codes and scales, o's, post norm, gate_up's, down's
constexpr int64_t OUTS = 4;        // qkv, o, gate_up, down

template <typename F>
c10::TypedOperatorHandle<F> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<F>();
}

void layers_int4(at::Tensor& h, at::TensorList weights, c10::IntArrayRef outs, double eps, at::Tensor& qk,
                 at::Tensor& attn, at::Tensor& act, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_pools,
                 at::TensorList v_pools, const at::Tensor& slots, const at::Tensor& spans, const at::Tensor& tables,
                 int64_t heads) {
  static const auto mm = op<Int4Mm>("prefixd::int4_mm");
  static const auto rope_kv = op<RopeKv>("prefixd::rope_kv");
  static const auto attend = op<Attend>("prefixd::attend");
  const int64_t layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(v_pools.size()) == layers && static_cast<int64_t>(weights.size()) == PER_LAYER * layers &&
                  static_cast<int64_t>(outs.size()) == OUTS * layers,
              "layers_int4: ", layers, " layers need ", PER_LAYER, " weights and ", OUTS, " output widths each");
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(), "layers_int4: h must be contiguous fp32 (R, hidden)");
  TORCH_CHECK(qk.dim() == 3 && attn.dim() == 2 && attn.size(0) == h.size(0) + 1, "layers_int4: attn must hold R + 1 rows");
  const int64_t kv_heads = qk.size(1) - heads;
  const at::Tensor q = qk.view({-1, qk.size(2)});
  const at::Tensor attended = attn.slice(0, 0, h.size(0));
  const std::optional<at::Tensor> none;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + PER_LAYER * i;
    const int64_t* n = outs.data() + OUTS * i;
    at::Tensor k_pool = k_pools[i], v_pool = v_pools[i];
    const at::Tensor x = mm.call(h, w[1], w[2], n[0], "auto", w[0], eps, 1);
    rope_kv.call(x, cos, sin, qk, k_pool, v_pool, slots, heads);
    attend.call(q, k_pool, v_pool, spans, tables, heads, heads + kv_heads, attn, "auto");
    h.add_(mm.call(attended, w[3], w[4], n[1], "auto", none, 0.0, 1));
    std::vector<at::Tensor> gate_up = mm.call(h, w[6], w[7], n[2], "auto", w[5], eps, 1).chunk(2, -1);
    at::silu_(gate_up[0]);
    at::mul_out(act, gate_up[0], gate_up[1]);
    h.add_(mm.call(act, w[8], w[9], n[3], "auto", none, 0.0, 1));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixd, m) {
  m.def("layers_int4(Tensor(a!) h, Tensor[] weights, int[] outs, float eps, Tensor(b!) qk, Tensor(c!) attn, "
        "Tensor(d!) act, Tensor cos, Tensor sin, Tensor(e!)[] k_pools, Tensor(f!)[] v_pools, Tensor slots, "
        "Tensor spans, Tensor tables, int heads) -> ()");
}

TORCH_LIBRARY_IMPL(prefixd, CPU, m) { m.impl("layers_int4", &layers_int4); }
