// Work units of one FFI call shared between the calling thread and XLA's intra-op pool.
//
// Included by the CPU kernels (cpu_moe_rows.cc, cpu_paged_attention.cc); the build
// (kernels/cpu_build.py) hashes this header into each kernel's cache key.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs run_unit(u) once for every u in [0, units) and returns when all have run. Units
// are claimed from one atomic counter by this thread and by up to pool.num_threads()
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
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), units - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (done->load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace jaxserve
