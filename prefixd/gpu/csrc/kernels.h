// The kernels' parts that csrc/layers.cpp runs inside its one parallel region: each op split
// into its serial set-up (the checks and the plan) and its tasks, so that a region's threads can
// share an op's tasks and wait for them to be done (`Op`) instead of each op starting and
// joining a team of its own. The ops (int4_mm, attend, rope_kv) are built from these same parts,
// so both give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
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

// The same with `passes` codes a row (int4_mm's `passes`: 2 for the head): row r's first at
// xq + passes * r * kx, its groups' d and s at passes * r * kx / 32.
void int4_quantize_passes(const float* x, int64_t begin, int64_t end, int64_t kx, int passes, float* row, int8_t* xq,
                          float* d, float* s);

// The product of `rows` quantized rows is int4_tasks(w, rows) tasks, each writing its own
// outputs: int4_tiles runs tasks [begin, end) into out (rows, w.n), or adds them to what it holds.
// With `paired`, rows 2m and 2m + 1 are row m's two passes and out is (rows / 2, w.n).
int64_t int4_tasks(const Int4Weight& w, int64_t rows);

// What the tiles learn of each out row's final outputs as they store them (while they are in the
// first-level cache), for the head's call: `finite` (set by the caller) is cleared where any
// output is an inf or a NaN; `best` (0 from the caller) rises to the key of the largest output
// below `limit` at its lowest index (the value's order key above the index's complement:
// int4_mm.cpp's `watch_result`). Tiles of one row on several threads raise it atomically: the
// largest key wins whatever their order, so the result is the row's own.
struct RowWatch {
  uint8_t* finite;
  uint64_t* best;
  int64_t limit;
};

// The watch of `rows` out rows of `n` outputs held in `finite` and `best`, checked (uint8 (rows,)
// and int64 (rows,), 0 <= limit <= n) and set to their starting values; none where neither is
// given. `who` names the caller in its errors.
std::optional<RowWatch> row_watch(const std::optional<at::Tensor>& finite, const std::optional<at::Tensor>& best,
                                  int64_t rows, int64_t n, int64_t limit, const char* who);

void int4_tiles(const Int4Weight& w, const int8_t* xq, const float* d, const float* s, int64_t rows, int64_t kx,
                float* out, bool accumulate, int64_t begin, int64_t end, bool paired = false,
                const RowWatch* watch = nullptr);

// ---- attention (attention.cpp) --------------------------------------------------------------------

// A call's tasks (the largest first; `attend` itself runs them in per-thread lists) and the
// joins of the rows whose key chunks were cut between tasks. It depends on the spans, tables
// and shapes only, so a round plans once for every layer: `attend_task` takes a layer's K and V
// pools (of the planned shape) as pointers.
struct AttendPlan;
std::shared_ptr<AttendPlan> attend_plan(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        const at::Tensor& spans, const at::Tensor& tables, int64_t heads,
                                        int64_t q_stride, at::Tensor& out, c10::string_view path);
int64_t attend_tasks(const AttendPlan& plan);
int64_t attend_joins(const AttendPlan& plan);
// task i (the largest first) against the pools at k and v (a layer's: each thread passes the same pointers)
void attend_task(AttendPlan& plan, int64_t i, const void* k, const void* v, std::vector<float>& scratch,
                 std::vector<float>& local);
void attend_join(const AttendPlan& plan, int64_t begin, int64_t end);  // joins [begin, end), after every task

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

// One op of a region: its tasks [0, total) taken a grain at a time by whichever thread asks
// next, and the count of those done, which every thread waits on before the op after it. A
// thread that comes late (its core's other work held it up: a busy neighbour, the daemon's
// front) finds its grain taken by a thread that came early, and the op perhaps done. A waiting
// thread spins a short while (the ops take microseconds), then sleeps on the count (a futex)
// until the thread that finishes the last task wakes it: it must not keep a core that the
// thread it waits for may need.
class Op {
 public:
  void reset(int total, int grain) {  // before the region
    total_ = total;
    grain_ = std::max(1, grain);
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    sleepers_.store(0, std::memory_order_relaxed);
  }
  int total() const { return total_; }
  // the next grain of tasks [begin, end), or false when none is left
  bool take(int& begin, int& end) {
    if (next_.load(std::memory_order_relaxed) >= total_) return false;
    begin = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (begin >= total_) return false;
    end = std::min(total_, begin + grain_);
    return true;
  }
  void finish(int count) {  // after running a grain's `count` tasks
    if (done_.fetch_add(count, std::memory_order_seq_cst) + count == total_ &&
        sleepers_.load(std::memory_order_seq_cst) > 0)
      wake();
  }
  void wait() {  // until every task is done; what they wrote is then visible
    for (int spins = 0; spins < SPINS; ++spins) {
      if (done_.load(std::memory_order_acquire) == total_) return;
#ifdef PREFIXD_X86
      _mm_pause();
#endif
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    for (int now; (now = done_.load(std::memory_order_seq_cst)) != total_;) sleep(now);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  static constexpr int SPINS = 1 << 11;  // tens of microseconds
#ifdef __linux__
  int* word() { return reinterpret_cast<int*>(&done_); }
  void sleep(int now) { syscall(SYS_futex, word(), FUTEX_WAIT_PRIVATE, now, nullptr, nullptr, 0); }  // returns at once if the count moved
  void wake() { syscall(SYS_futex, word(), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0); }
#else
  void sleep(int) { std::this_thread::yield(); }
  void wake() {}
#endif
  int total_ = 0, grain_ = 1;
  alignas(64) std::atomic<int> next_{0};
  alignas(64) std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
};

static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the count itself");

}  // namespace prefixd_cpu
