// The gpucoll kernels (kernels/*.cu, unchanged) built for the host through cuda_host.h, with a C
// entry point for ctypes. Built and loaded by tests/test_kernels_host.py.
#include "cuda_host.h"

#include "../../kernels/bucket_pack.cu"
#include "../../kernels/bucket_unpack.cu"

#include <cstdio>

namespace {

struct Arguments {
  const long long* table;
  int n_arrays;
  long long tile;
  void* bucket;
  double scale;
  int check;
  int* found_inf;
};

template <typename Src, typename Dst>
void pack_body(void* raw) {
  const Arguments& a = *static_cast<const Arguments*>(raw);
  gpucoll_bucket_pack<Src, Dst>(a.table, a.n_arrays, a.tile, static_cast<Dst*>(a.bucket), a.scale);
}

template <typename Src, typename Dst>
void unpack_body(void* raw) {
  const Arguments& a = *static_cast<const Arguments*>(raw);
  const Src* bucket = static_cast<const Src*>(a.bucket);
  if (a.check) {
    gpucoll_bucket_unpack<Src, Dst, true>(a.table, a.n_arrays, a.tile, bucket, a.scale, a.found_inf);
  } else {
    gpucoll_bucket_unpack<Src, Dst, false>(a.table, a.n_arrays, a.tile, bucket, a.scale, nullptr);
  }
}

typedef void (*Body)(void*);

// (kernel, src type, dst type) -> the instantiation the GPU loader would compile.
Body find_body(const std::string& kernel, const std::string& src, const std::string& dst) {
  using gpucoll::bf16_t;
  using gpucoll::f16_t;
  const std::string key = kernel + ":" + src + ":" + dst;
#define GPUCOLL_BODY(name, S, D, s, d) \
  if (key == #name ":" s ":" d) return name##_body<S, D>;
  GPUCOLL_BODY(pack, float, float, "float32", "float32")
  GPUCOLL_BODY(pack, float, bf16_t, "float32", "bfloat16")
  GPUCOLL_BODY(pack, float, f16_t, "float32", "float16")
  GPUCOLL_BODY(pack, bf16_t, bf16_t, "bfloat16", "bfloat16")
  GPUCOLL_BODY(pack, f16_t, f16_t, "float16", "float16")
  GPUCOLL_BODY(pack, double, double, "float64", "float64")
  GPUCOLL_BODY(unpack, float, float, "float32", "float32")
  GPUCOLL_BODY(unpack, bf16_t, float, "bfloat16", "float32")
  GPUCOLL_BODY(unpack, f16_t, float, "float16", "float32")
  GPUCOLL_BODY(unpack, bf16_t, bf16_t, "bfloat16", "bfloat16")
  GPUCOLL_BODY(unpack, f16_t, f16_t, "float16", "float16")
  GPUCOLL_BODY(unpack, double, double, "float64", "float64")
#undef GPUCOLL_BODY
  return nullptr;
}

// A barrier self-test: every thread writes its slot, meets the barrier, then reads its
// neighbour's slot (visible only if the barrier really waited for every thread).
struct BarrierTest {
  int* slots;
  int* seen;
  int* votes;
  int voter;
};

void barrier_body(void* raw) {
  BarrierTest& b = *static_cast<BarrierTest*>(raw);
  const unsigned t = threadIdx.x, n = blockDim.x, base = blockIdx.x * n;
  b.slots[base + t] = static_cast<int>(base + t) + 1;
  if (b.voter < 0 && t == 0) return;  // thread 0 skips the barrier: must be reported
  const int vote = __syncthreads_or(static_cast<int>(t) == b.voter);
  b.seen[base + t] = b.slots[base + (t + 1) % n];
  b.votes[base + t] = vote;
}

int report(char* error, int error_size, const std::string& message) {
  if (error_size > 0) std::snprintf(error, static_cast<size_t>(error_size), "%s", message.c_str());
  return message.empty() ? 0 : 1;
}

}  // namespace

extern "C" {

// One launch of gpucoll_bucket_<kernel><src, dst>: grid blocks of `threads` threads.
// Returns 0, or 1 with the reason in `error`.
int gpucoll_host_launch(const char* kernel, const char* src, const char* dst,
                        unsigned long long grid, unsigned threads, const long long* table,
                        int n_arrays, long long tile, void* bucket, double scale, int check,
                        int* found_inf, char* error, int error_size) {
  Body body = find_body(kernel, src, dst);
  if (body == nullptr) {
    return report(error, error_size,
                  std::string("no instantiation ") + kernel + "<" + src + ", " + dst + ">");
  }
  Arguments arguments{table, n_arrays, tile, bucket, scale, check, found_inf};
  return report(error, error_size, gpucoll_host::launch(grid, threads, body, &arguments));
}

int gpucoll_host_barrier_test(unsigned grid, unsigned threads, int voter, int* slots, int* seen,
                              int* votes, char* error, int error_size) {
  BarrierTest test{slots, seen, votes, voter};
  return report(error, error_size, gpucoll_host::launch(grid, threads, barrier_body, &test));
}

}  // extern "C"
