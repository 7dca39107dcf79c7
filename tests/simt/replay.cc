/*
 * Replays launches recorded by tests/simt.py (Recording) in a binary built with ThreadSanitizer or
 * AddressSanitizer: every array argument copied into a heap allocation of exactly its size (a read
 * or write past it is AddressSanitizer's to report), the kernel run by simt.cc's checked runtime
 * (every block on a host thread of its own, unordered with the others: a race between blocks or
 * between a block's threads is ThreadSanitizer's to report), and every array compared byte for
 * byte with what the recording holds after the launch (float arrays element by element, a NaN
 * matching any NaN: which NaN a sum returns is the compiled operand order's, cuda_on_host.h).
 *
 *   replay FILE     exit 0: every launch as recorded; 1: a launch failed or differed (printed);
 *                   a sanitizer's report exits with its own code (tests/simt.py sets 66)
 */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" const char *hvd_simt_launch(const char *kernel, const unsigned grid[3], const unsigned block[3],
                                       void **args);

namespace {

struct Reader {
  FILE *in;
  template <class T>
  T take() {
    T value;
    if (fread(&value, sizeof value, 1, in) != 1) fail("the recording ends early");
    return value;
  }
  std::vector<unsigned char> bytes(size_t n) {
    std::vector<unsigned char> out(n);
    if (n && fread(out.data(), 1, n, in) != n) fail("the recording ends early");
    return out;
  }
  [[noreturn]] static void fail(const char *why) {
    fprintf(stderr, "replay: %s\n", why);
    exit(2);
  }
};

struct Argument {
  unsigned char kind = 0;            // 0 a scalar, 1 an array, 2 a null pointer
  std::vector<unsigned char> value;  // a scalar's bytes
  unsigned char *heap = nullptr;     // an array's copy, exactly its size
  size_t size = 0, offset = 0;
  unsigned char element = 0;         // 4 or 8: float or double elements, else bytes
  std::vector<unsigned char> after;
  void *pointer = nullptr;
};

/* Byte i lies in a float element that is NaN both as replayed and as recorded. */
bool both_nan(const Argument &a, size_t i) {
  if (!a.element) return false;
  const size_t at = i - i % a.element;
  if (a.element == 4) {
    float got, want;
    memcpy(&got, a.heap + at, 4);
    memcpy(&want, a.after.data() + at, 4);
    return got != got && want != want;
  }
  double got, want;
  memcpy(&got, a.heap + at, 8);
  memcpy(&want, a.after.data() + at, 8);
  return got != got && want != want;
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: replay FILE\n");
    return 2;
  }
  Reader r{fopen(argv[1], "rb")};
  if (!r.in) Reader::fail("cannot open the recording");
  char magic[8];
  if (fread(magic, 1, 8, r.in) != 8 || memcmp(magic, "HVDSIMT1", 8) != 0) Reader::fail("not a recording");
  const unsigned launches = r.take<unsigned>();
  int differed = 0;
  for (unsigned n = 0; n < launches; ++n) {
    const std::vector<unsigned char> name_bytes = r.bytes(r.take<unsigned>());
    const std::string name(name_bytes.begin(), name_bytes.end());
    unsigned grid[3], block[3];
    for (unsigned &g : grid) g = r.take<unsigned>();
    for (unsigned &b : block) b = r.take<unsigned>();
    std::vector<Argument> args(r.take<unsigned>());
    std::vector<void *> argv_(args.size());
    for (size_t k = 0; k < args.size(); ++k) {
      Argument &a = args[k];
      a.kind = r.take<unsigned char>();
      if (a.kind == 0) {
        a.value = r.bytes(r.take<unsigned>());
        argv_[k] = a.value.data();
      } else if (a.kind == 1) {
        a.size = r.take<uint64_t>();
        a.offset = r.take<uint64_t>();
        a.element = r.take<unsigned char>();
        a.heap = static_cast<unsigned char *>(malloc(a.size));
        const std::vector<unsigned char> before = r.bytes(a.size);
        if (a.size) memcpy(a.heap, before.data(), a.size);
        a.after = r.bytes(a.size);
        a.pointer = a.heap + a.offset;
        argv_[k] = &a.pointer;
      } else {
        argv_[k] = &a.pointer;
      }
    }
    const char *why = hvd_simt_launch(name.c_str(), grid, block, argv_.data());
    if (why) {
      fprintf(stderr, "launch %u (%s) failed: %s\n", n, name.c_str(), why);
      differed = 1;
    }
    for (size_t k = 0; k < args.size(); ++k) {
      const Argument &a = args[k];
      if (a.kind != 1) continue;
      for (size_t i = 0; i < a.size; ++i)
        if (a.heap[i] != a.after[i] && !both_nan(a, i)) {
          fprintf(stderr, "launch %u (%s): argument %zu differs at byte %zu of %zu (got %u, recorded %u)\n", n,
                  name.c_str(), k, i, a.size, a.heap[i], a.after[i]);
          differed = 1;
          break;
        }
      free(a.heap);
    }
  }
  fclose(r.in);
  if (!differed) printf("replay: %u launches as recorded\n", launches);
  return differed;
}
