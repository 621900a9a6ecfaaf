// Work units of one FFI call shared between the calling thread and XLA's intra-op pool.
//
// Included by the CPU kernels (cpu_moe_rows.cc, cpu_paged_attention.cc,
// cpu_dense_panels.cc); the build (kernels/cpu_build.py) hashes this header into each
// kernel's cache key.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// CPUs this process may run on (its affinity mask; the hardware's count where unknown).
inline int64_t UsableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

// Pool tasks a call starts beside its own thread: one per other CPU at most. XLA's pool
// has a thread per CPU and the calling thread runs units too, so one task more
// time-slices: a third thread on two CPUs made the dense kernel's LM head call (8 rows,
// [128, 4096]) 1.3-1.9x slower (scripts/bench_dense_panels.py).
template <typename Pool>
int64_t MaxHelpers(Pool& pool) {
  static const int64_t cpus = UsableCpus();
  return std::min<int64_t>(pool.num_threads(), cpus - 1);
}

// Runs run_unit(u) once for every u in [0, units) and returns when all have run. Units
// are claimed from one atomic counter by this thread and by up to MaxHelpers(pool)
// pool tasks alike, so a unit runs once whoever runs it. A task that starts after the
// last unit was claimed finds none left; it still holds its copy of run_unit, so
// run_unit must own (e.g. by a shared_ptr) whatever it reads.
template <typename RunUnit>
void ShareUnits(xla::ffi::ThreadPool& pool, int64_t units, RunUnit run_unit) {
  auto next_unit = std::make_shared<std::atomic<int64_t>>(0);
  auto done = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [next_unit, done, units, run_unit]() {
    for (int64_t u; (u = next_unit->fetch_add(1)) < units;) {
      run_unit(u);
      done->fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(MaxHelpers(pool), units - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (done->load(std::memory_order_acquire) < units) std::this_thread::yield();
}

// As ShareUnits, but units are claimed `chunk` consecutive ones at a time, and each runs
// as run_unit(u, next): next is the unit this thread runs after u (u + 1 in the same
// chunk), or -1, so that u can prefetch what next reads. Pool: any type with
// num_threads() and Schedule(function) (xla::ffi::ThreadPool).
template <typename Pool, typename RunUnit>
void ShareUnitChunks(Pool& pool, int64_t units, int64_t chunk, RunUnit run_unit) {
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (units + chunk - 1) / chunk;
  auto next_chunk = std::make_shared<std::atomic<int64_t>>(0);
  auto done = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [next_chunk, done, units, chunk, chunks, run_unit]() {
    for (int64_t c; (c = next_chunk->fetch_add(1)) < chunks;) {
      const int64_t end = std::min(units, (c + 1) * chunk);
      for (int64_t u = c * chunk; u < end; ++u) run_unit(u, u + 1 < end ? u + 1 : -1);
      done->fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(MaxHelpers(pool), chunks - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (done->load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace jaxserve
