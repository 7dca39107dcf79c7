/*
 * The counting build's memory traffic: kernels.cc compiled with -fsanitize=thread, whose
 * instrumentation calls the __tsan_* functions below on every load, store and atomic the kernels'
 * text makes. No ThreadSanitizer runtime is linked: here they count instead. An access to one of
 * the arrays a launch watches (hvd_simt_watch) marks the 32-byte sectors it touches as read or
 * written; a sector is counted once a launch however often it is touched, as a device's DRAM moves
 * it once and its L2 serves the rest. Accesses elsewhere (shared memory, the stack) are not
 * global memory and not counted.
 *
 *   void hvd_simt_watch(const uint64_t *lows, const uint64_t *sizes, int n)   before a launch
 *   void hvd_simt_traffic(uint64_t *read, uint64_t *written)                   after it: bytes an array
 *
 * One launch is counted at a time (the caller serialises them); its blocks may run on any thread.
 */
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace {

constexpr uint64_t kSector = 32;  // bytes: the unit a device's DRAM moves

struct Watched {
  uint64_t low, size;
  std::unique_ptr<std::atomic<uint64_t>[]> read, written;  // one bit a sector

  Watched(uint64_t low_, uint64_t size_) : low(low_), size(size_) {
    const uint64_t words = (size / kSector + 2) / 64 + 1;
    read.reset(new std::atomic<uint64_t>[words]());
    written.reset(new std::atomic<uint64_t>[words]());
  }

  static uint64_t count(const std::atomic<uint64_t> *bits, uint64_t size) {
    uint64_t sectors = 0;
    for (uint64_t w = 0; w <= (size / kSector + 2) / 64; ++w) sectors += __builtin_popcountll(bits[w].load());
    return sectors * kSector;
  }
};

std::vector<std::unique_ptr<Watched>> watched;

void touch(const volatile void *at, uint64_t n, bool write) {
  const uint64_t address = reinterpret_cast<uint64_t>(at);
  for (const auto &w : watched) {
    if (address - w->low >= w->size) continue;
    // sectors counted from the array's first byte, as where it starts a device allocation (256-byte
    // aligned): the counts do not depend on where the host put it
    const uint64_t first = (address - w->low) / kSector, last = (address + n - 1 - w->low) / kSector;
    std::atomic<uint64_t> *bits = write ? w->written.get() : w->read.get();
    for (uint64_t s = first; s <= last; ++s) bits[s / 64].fetch_or(1ull << (s % 64), std::memory_order_relaxed);
    return;
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void hvd_simt_watch(const uint64_t *lows, const uint64_t *sizes, int n) {
  watched.clear();
  for (int i = 0; i < n; ++i) watched.emplace_back(new Watched(lows[i], sizes[i]));
}

__attribute__((visibility("default"))) void hvd_simt_traffic(uint64_t *read, uint64_t *written) {
  for (size_t i = 0; i < watched.size(); ++i) {
    read[i] = Watched::count(watched[i]->read.get(), watched[i]->size);
    written[i] = Watched::count(watched[i]->written.get(), watched[i]->size);
  }
}

/* What -fsanitize=thread's instrumentation calls */
void __tsan_init() {}
void __tsan_func_entry(void *) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void **, void *) {}
void __tsan_vptr_read(void **) {}

#define HVD_ACCESS(n)                                                      \
  void __tsan_read##n(void *at) { touch(at, n, false); }                   \
  void __tsan_write##n(void *at) { touch(at, n, true); }                   \
  void __tsan_unaligned_read##n(void *at) { touch(at, n, false); }         \
  void __tsan_unaligned_write##n(void *at) { touch(at, n, true); }         \
  void __tsan_read##n##_pc(void *at, void *) { touch(at, n, false); }      \
  void __tsan_write##n##_pc(void *at, void *) { touch(at, n, true); }
HVD_ACCESS(1)
HVD_ACCESS(2)
HVD_ACCESS(4)
HVD_ACCESS(8)
HVD_ACCESS(16)
#undef HVD_ACCESS
void __tsan_read_range(void *at, unsigned long n) { touch(at, n, false); }
void __tsan_write_range(void *at, unsigned long n) { touch(at, n, true); }

/* Atomics: done (relaxed, as CUDA's are) and counted as a read and a write of their word */
#define HVD_ATOMIC(bits, type)                                                                              \
  type __tsan_atomic##bits##_load(const volatile type *at, int) {                                           \
    touch(at, sizeof(type), false);                                                                         \
    return __atomic_load_n(at, __ATOMIC_RELAXED);                                                           \
  }                                                                                                         \
  void __tsan_atomic##bits##_store(volatile type *at, type v, int) {                                        \
    touch(at, sizeof(type), true);                                                                          \
    __atomic_store_n(at, v, __ATOMIC_RELAXED);                                                              \
  }                                                                                                         \
  type __tsan_atomic##bits##_fetch_and(volatile type *at, type v, int) {                                    \
    touch(at, sizeof(type), false), touch(at, sizeof(type), true);                                          \
    return __atomic_fetch_and(at, v, __ATOMIC_RELAXED);                                                     \
  }                                                                                                         \
  type __tsan_atomic##bits##_fetch_or(volatile type *at, type v, int) {                                     \
    touch(at, sizeof(type), false), touch(at, sizeof(type), true);                                          \
    return __atomic_fetch_or(at, v, __ATOMIC_RELAXED);                                                      \
  }                                                                                                         \
  type __tsan_atomic##bits##_fetch_add(volatile type *at, type v, int) {                                    \
    touch(at, sizeof(type), false), touch(at, sizeof(type), true);                                          \
    return __atomic_fetch_add(at, v, __ATOMIC_RELAXED);                                                     \
  }                                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile type *at, type *expected, type v, int, int) {    \
    touch(at, sizeof(type), false), touch(at, sizeof(type), true);                                          \
    return __atomic_compare_exchange_n(at, expected, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED);          \
  }                                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile type *at, type *expected, type v, int, int) {  \
    touch(at, sizeof(type), false), touch(at, sizeof(type), true);                                          \
    return __atomic_compare_exchange_n(at, expected, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);         \
  }
HVD_ATOMIC(32, int)
HVD_ATOMIC(64, long long)
#undef HVD_ATOMIC
void __tsan_atomic_thread_fence(int) {}
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
