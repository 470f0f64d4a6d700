// The kernels' parts that csrc/layers.cpp runs inside its one parallel region: each op split
// into its serial set-up (the checks and the plan) and its tasks, so that a region's threads can
// share an op's tasks and wait for each other at a barrier instead of each op starting and
// joining a team of its own. The ops (int4_mm, attend, rope_kv) are built from these same parts,
// so both give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "common.h"

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace prefixd_cpu {

// ---- the int4 product (int4_mm.cpp) --------------------------------------------------------------

struct Int4Weight {  // a packed weight, checked
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t n, k, nblocks;
  int bits;
  bool half;
};

Int4Weight int4_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t n);  // int4_mm's checks

// Rows [begin, end) of x (rows of kx values) quantized as int4_mm does (one pass, norm optional):
// row r's codes at xq + r * kx, its groups' d and s at d + r * kx / 32, s + r * kx / 32. row: kx
// floats of scratch.
void int4_quantize(const float* x, int64_t begin, int64_t end, int64_t kx, const float* norm, float eps, float* row,
                   int8_t* xq, float* d, float* s);
void int4_quantize(const at::BFloat16* x, int64_t begin, int64_t end, int64_t kx, const float* norm, float eps,
                   float* row, int8_t* xq, float* d, float* s);

// The product of `rows` quantized rows is int4_tasks(w, rows) tasks, each writing its own
// outputs: int4_tiles runs tasks [begin, end) into out (rows, w.n), or adds them to what it holds.
int64_t int4_tasks(const Int4Weight& w, int64_t rows);
void int4_tiles(const Int4Weight& w, const int8_t* xq, const float* d, const float* s, int64_t rows, int64_t kx,
                float* out, bool accumulate, int64_t begin, int64_t end);

// ---- attention (attention.cpp) --------------------------------------------------------------------

// A call's tasks in per-thread lists, and the joins of the rows whose key chunks were cut
// between tasks. It depends on the spans, tables and shapes only, so a round plans once for
// every layer: `pools` points the plan at a layer's K and V pools (of the planned shape).
struct AttendPlan;
std::shared_ptr<AttendPlan> attend_plan(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        const at::Tensor& spans, const at::Tensor& tables, int64_t heads,
                                        int64_t q_stride, at::Tensor& out, c10::string_view path);
int64_t attend_lists(const AttendPlan& plan);  // at most the thread count
int64_t attend_joins(const AttendPlan& plan);
// list i's tasks against the pools at k and v (a layer's: each thread passes the same pointers)
void attend_list(AttendPlan& plan, int64_t i, const void* k, const void* v, std::vector<float>& scratch,
                 std::vector<float>& local);
void attend_join(const AttendPlan& plan, int64_t begin, int64_t end);  // joins [begin, end), after every list

// ---- rope and the K/V write (attention.cpp) ----------------------------------------------------------

struct RopeKv;
std::shared_ptr<RopeKv> rope_kv_plan(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                     at::Tensor& qk, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                                     int64_t heads);  // rope_kv's checks
void rope_kv_rows(const RopeKv& r, void* k_pool, void* v_pool, int64_t begin, int64_t end);

// ---- a region's threads ---------------------------------------------------------------------------

// Static shares of [0, total) among n threads, as at::parallel_for cuts a range with grain 1.
inline std::pair<int64_t, int64_t> share(int64_t total, int tid, int n) {
  const int64_t each = (total + n - 1) / n;
  const int64_t begin = std::min<int64_t>(total, each * tid);
  return {begin, std::min<int64_t>(total, begin + each)};
}

// A barrier for the threads of one region: a count and a generation. A waiting thread spins a
// short while (the ops between barriers take microseconds), then sleeps on the generation (a
// futex) until the last thread wakes it, as OpenMP's own barrier does: a thread whose
// partner was descheduled must not keep a core that another process, or that partner, needs.
class Barrier {
 public:
  explicit Barrier(int n) { reset(n); }
  void reset(int n) {  // while no thread waits
    n_ = n;
    // more threads than cores (as OpenMP's throttled wait): a spinning thread holds a core that a
    // thread it waits for may need, so it sleeps almost at once
    spins_ = static_cast<unsigned>(n) > std::max(1u, std::thread::hardware_concurrency()) ? THROTTLED_SPINS : SPINS;
  }
  void wait() {
    if (n_ <= 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) wake();
      return;
    }
    for (int spins = 0; spins < spins_; ++spins) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
#ifdef PREFIXD_X86
      _mm_pause();
#endif
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (gen_.load(std::memory_order_seq_cst) == gen) sleep(gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static constexpr int SPINS = 1 << 11;  // tens of microseconds
  static constexpr int THROTTLED_SPINS = 1 << 6;
#ifdef __linux__
  int* word() { return reinterpret_cast<int*>(&gen_); }
  void sleep(int gen) { syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0); }  // returns at once if gen_ moved
  void wake() { syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0); }
#else
  void sleep(int) { std::this_thread::yield(); }
  void wake() {}
#endif
  int n_, spins_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
  std::atomic<int> sleepers_{0};
};

static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the generation itself");

}  // namespace prefixd_cpu
