// Host emulation of the CUDA built-ins that kernels/*.cu use, so that the kernels compile with a
// host C++ compiler and run on the CPU (tests/test_kernels_host.py, marker kernel_host).
//
// * __global__ / __device__ / __forceinline__ / __launch_bounds__ are plain C++,
// * threadIdx / blockIdx / blockDim / gridDim are globals that the launcher sets,
// * a block's threads are fibers (ucontext) of one OS thread, run one after another;
//   __syncthreads_or suspends a thread until every thread of its block has reached the barrier,
//   then returns the OR of their predicates to each: a real per-block barrier. A block whose
//   threads do not all reach it (divergent barrier, undefined in CUDA) is reported as an error,
// * the PTX primitives of kernels/common.cuh (mul.rn, cvt to and from f16, cvt f64 -> f32, bit
//   moves) are C++ with the same IEEE results: one rounding to nearest even, subnormals kept.
//
// This file is never part of a GPU build: only the host test build includes it (it defines
// GPUCOLL_HOST_EMULATION, which kernels/common.cuh tests); nvcc and NVRTC refuse it outright.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)
#error "cuda_host.h emulates CUDA on the host; GPU builds compile kernels/*.cu without it"
#endif

#define GPUCOLL_HOST_EMULATION 1

#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

namespace gpucoll {

inline unsigned bits_of(float v) {
  unsigned u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
inline unsigned long long bits_of(double v) {
  unsigned long long u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// IEEE multiply and narrowing: one rounding to nearest even with subnormals (SSE / NEON
// arithmetic, built without -ffast-math, so no flush to zero and no contraction).
inline float mul_rn(float a, float b) { return a * b; }
inline double mul_rn(double a, double b) { return a * b; }
inline float f32_from_f64(double v) { return static_cast<float>(v); }

// cvt.f32.f16: exact.
inline float f32_from_f16(unsigned short h) {
  const unsigned sign = static_cast<unsigned>(h & 0x8000u) << 16;
  const unsigned exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return __uint_as_float(sign | bits_of(magnitude));
  }
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Shift right by `shift` bits, rounding to nearest even on the bits shifted out.
inline unsigned shift_rne(unsigned value, unsigned shift) {
  const unsigned kept = value >> shift, rest = value & ((1u << shift) - 1u);
  const unsigned half = 1u << (shift - 1u);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// cvt.rn.f16.f32: round to nearest even, overflow to inf, float subnormals to +-0 or the
// smallest half subnormal, NaN stays NaN (quiet).
inline unsigned short f16_from_f32(float v) {
  const unsigned u = bits_of(v);
  const unsigned sign = (u >> 16) & 0x8000u, magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: quiet, top payload bits kept
    return static_cast<unsigned short>(sign | 0x7e00u | ((magnitude >> 13) & 0x1ffu));
  }
  if (magnitude >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // >= 65520
  if (magnitude >= 0x38800000u) {                                                    // >= 2^-14
    const unsigned rebased = magnitude - (112u << 23);  // exponent bias 127 -> 15
    return static_cast<unsigned short>(sign | shift_rne(rebased, 13));
  }
  if (magnitude <= 0x33000000u) return static_cast<unsigned short>(sign);  // <= 2^-25: +-0
  const unsigned exponent = magnitude >> 23;                                // 102 .. 112
  const unsigned significand = (magnitude & 0x7fffffu) | 0x800000u;
  return static_cast<unsigned short>(sign | shift_rne(significand, 126u - exponent));
}

}  // namespace gpucoll

// ------------------------------------------------------------------------------------ launcher
namespace gpucoll_host {

enum FiberState { kReady, kAtBarrier, kDone };

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  FiberState state = kDone;
  int predicate = 0;
};

struct Launcher {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  unsigned current = 0;
  int barrier_result = 0;
  void (*body)(void*) = nullptr;
  void* argument = nullptr;
};

inline Launcher launcher;

inline void fiber_main() {
  launcher.body(launcher.argument);
  launcher.fibers[launcher.current].state = kDone;
}  // returns to launcher.scheduler through uc_link

// Run `body(argument)` as a grid of `grid` blocks of `threads` threads. Returns "" or what
// went wrong (a divergent barrier).
inline std::string launch(unsigned long long grid, unsigned threads, void (*body)(void*),
                          void* argument) {
  constexpr size_t kStack = 64 * 1024;
  Launcher& l = launcher;
  l.body = body;
  l.argument = argument;
  if (l.fibers.size() < threads) l.fibers.resize(threads);
  gridDim.x = static_cast<unsigned>(grid);
  blockDim.x = threads;
  for (unsigned long long block = 0; block < grid; ++block) {
    blockIdx.x = static_cast<unsigned>(block);
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& fiber = l.fibers[t];
      if (fiber.stack.empty()) fiber.stack.resize(kStack);
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber.stack.data();
      fiber.context.uc_stack.ss_size = fiber.stack.size();
      fiber.context.uc_link = &l.scheduler;
      makecontext(&fiber.context, fiber_main, 0);
      fiber.state = kReady;
    }
    for (;;) {
      for (unsigned t = 0; t < threads; ++t) {
        if (l.fibers[t].state != kReady) continue;
        l.current = t;
        threadIdx.x = t;
        swapcontext(&l.scheduler, &l.fibers[t].context);
      }
      unsigned waiting = 0;
      int any = 0;
      for (unsigned t = 0; t < threads; ++t) {
        if (l.fibers[t].state == kAtBarrier) {
          ++waiting;
          any |= l.fibers[t].predicate != 0;
        }
      }
      if (waiting == 0) break;  // every thread of the block returned
      if (waiting != threads) {
        return "block " + std::to_string(block) + ": " + std::to_string(waiting) + " of " +
               std::to_string(threads) + " threads reached __syncthreads_or (divergent barrier)";
      }
      l.barrier_result = any;
      for (unsigned t = 0; t < threads; ++t) l.fibers[t].state = kReady;
    }
  }
  return "";
}

}  // namespace gpucoll_host

inline int __syncthreads_or(int predicate) {
  gpucoll_host::Launcher& l = gpucoll_host::launcher;
  gpucoll_host::Fiber& fiber = l.fibers[l.current];
  fiber.predicate = predicate;
  fiber.state = gpucoll_host::kAtBarrier;
  swapcontext(&fiber.context, &l.scheduler);  // back when every thread has arrived
  return l.barrier_result;
}
