// gpucoll kernels: shared helpers for the bucketing kernels.
//
// * dtype tags for the 16-bit floats (raw bits; conversions are written out here, so the
//   sources need no CUDA headers and compile the same under nvcc and NVRTC),
// * conversions to and from the compute type (float, or double when either side is double),
//   rounding to nearest even, subnormals kept (no flush to zero; see "PTX primitives" below),
// * the work table lookup and the per-tile copy loop shared by pack and unpack.
//
// Work table (int64, 4 * n + 1 entries, device memory), for n arrays in one launch:
//   [0, n)          array base addresses
//   [n, 2n)         element offset of each array in the bucket
//   [2n, 3n)        element count of each array
//   [3n, 4n + 1)    prefix sum of blocks per array (ceil(count / tile)); block_start[n] = grid
//   [4n + 1, ...)   block map: int32 per block, the array it copies (grid entries, two per
//                   int64, the last one's upper half unused when grid is odd)
// Block b copies one tile (`tile` elements) of the array a with
// block_start[a] <= b < block_start[a + 1]; zero-length arrays own no block.
#pragma once

namespace gpucoll {

// PTX primitives. CuPy appends -ftz=true after the caller's options on every NVRTC compile, and
// the last flag wins: a plain float multiply, __fmul_rn or a double -> float cast would then
// compile to .ftz instructions and flush float32 / bfloat16 subnormals to zero. Written in PTX
// without .ftz they keep subnormals whatever the flags (a test checks the PTX has no .ftz), and
// mul.rn is never contracted into an FMA. The bit views are PTX moves so that the optimizer
// cannot turn the integer tests on them back into (.ftz) float compares. The host build of
// these sources (the tests' kernel emulation) defines GPUCOLL_HOST_EMULATION and brings C++
// definitions of the same functions; nvcc and NVRTC never see that macro.
#ifndef GPUCOLL_HOST_EMULATION
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double mul_rn(double a, double b) {
  double r;
  asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
  return r;
}
__device__ __forceinline__ float f32_from_f64(double v) {
  float r;
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(v));
  return r;
}
__device__ __forceinline__ float f32_from_f16(unsigned short bits) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(bits));
  return r;
}
__device__ __forceinline__ unsigned short f16_from_f32(float v) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ unsigned bits_of(float v) {
  unsigned r;
  asm("mov.b32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ unsigned long long bits_of(double v) {
  unsigned long long r;
  asm("mov.b64 %0, %1;" : "=l"(r) : "d"(v));
  return r;
}
#endif

// The kernels' double `scale` argument in the compute type.
template <typename C> __device__ __forceinline__ C scale_as(double scale);
template <> __device__ __forceinline__ float scale_as<float>(double scale) {
  return f32_from_f64(scale);
}
template <> __device__ __forceinline__ double scale_as<double>(double scale) { return scale; }

struct bf16_t { unsigned short bits; };
struct f16_t { unsigned short bits; };

template <typename A, typename B> struct compute_type { typedef float type; };
template <typename B> struct compute_type<double, B> { typedef double type; };
template <typename A> struct compute_type<A, double> { typedef double type; };
template <> struct compute_type<double, double> { typedef double type; };

template <typename C, typename T> struct convert;
template <> struct convert<float, float> {
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <> struct convert<double, double> {
  static __device__ __forceinline__ double to(double v) { return v; }
  static __device__ __forceinline__ double from(double v) { return v; }
};
template <> struct convert<float, bf16_t> {
  static __device__ __forceinline__ float to(bf16_t v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
  }
  static __device__ __forceinline__ bf16_t from(float v) {
    unsigned u = bits_of(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      r.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);                             // round to nearest even
      r.bits = static_cast<unsigned short>(u >> 16);
    }
    return r;
  }
};
template <> struct convert<float, f16_t> {
  static __device__ __forceinline__ float to(f16_t v) { return f32_from_f16(v.bits); }
  static __device__ __forceinline__ f16_t from(float v) {
    f16_t r;
    r.bits = f16_from_f32(v);
    return r;
  }
};

__device__ __forceinline__ bool is_finite(float v) {
  return (bits_of(v) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool is_finite(double v) {
  return (bits_of(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}
// On the 16-bit patterns: no conversion back to float (which also cost an 8-byte spill in the
// float16 unpack with the check).
__device__ __forceinline__ bool is_finite(f16_t v) { return (v.bits & 0x7c00u) != 0x7c00u; }
__device__ __forceinline__ bool is_finite(bf16_t v) { return (v.bits & 0x7f80u) != 0x7f80u; }

template <typename T, int N> struct alignas(sizeof(T) * N) vec_t { T v[N]; };

// 16-byte vectors each thread of copy_tile loads before storing them (a -D option can set it).
#ifndef GPUCOLL_UNROLL
#define GPUCOLL_UNROLL 4
#endif
// 1: 16- and 8-byte units are loaded through the non-coherent path without L1 allocation and
// stored with the streaming (evict-first) hint, as each byte is touched once.
#ifndef GPUCOLL_CACHE_HINTS
#define GPUCOLL_CACHE_HINTS 1
#endif

// Loads and stores of one unit (a vector, or one element) of copy_run.
template <int Bytes> struct unit_io {
  template <typename V> static __device__ __forceinline__ V load(const V* p) { return *p; }
  template <typename V> static __device__ __forceinline__ void store(V* p, const V& v) { *p = v; }
};
#if GPUCOLL_CACHE_HINTS && !defined(GPUCOLL_HOST_EMULATION)
template <> struct unit_io<16> {
  template <typename V> static __device__ __forceinline__ V load(const V* p) {
    union { V v; unsigned w[4]; } u;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(u.w[0]), "=r"(u.w[1]), "=r"(u.w[2]), "=r"(u.w[3]) : "l"(p));
    return u.v;
  }
  template <typename V> static __device__ __forceinline__ void store(V* p, const V& v) {
    union { V v; unsigned w[4]; } u;
    u.v = v;
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(u.w[0]), "r"(u.w[1]), "r"(u.w[2]), "r"(u.w[3]) : "memory");
  }
};
template <> struct unit_io<8> {
  template <typename V> static __device__ __forceinline__ V load(const V* p) {
    union { V v; unsigned w[2]; } u;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
        : "=r"(u.w[0]), "=r"(u.w[1]) : "l"(p));
    return u.v;
  }
  template <typename V> static __device__ __forceinline__ void store(V* p, const V& v) {
    union { V v; unsigned w[2]; } u;
    u.v = v;
    asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};"
                 :: "l"(p), "r"(u.w[0]), "r"(u.w[1]) : "memory");
  }
};
#endif

// 1: a block finds its array in the table's block map, one load; 0: by a binary search of
// block_start, about log2(n) loads one after another (10 for 1,000 arrays), which every block
// of the launch waits for before it copies anything (a -D option can set it).
#ifndef GPUCOLL_BLOCK_MAP
#define GPUCOLL_BLOCK_MAP 1
#endif

// Index of the array that owns block `block` (largest a with block_start[a] <= block).
__device__ __forceinline__ int find_array(const long long* __restrict__ table, int n,
                                          long long block) {
#if GPUCOLL_BLOCK_MAP
  return reinterpret_cast<const int*>(table + 4 * static_cast<long long>(n) + 1)[block];
#else
  const long long* block_start = table + 3 * static_cast<long long>(n);
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (block_start[mid] <= block) lo = mid; else hi = mid;
  }
  return lo;
#endif
}

// out[i] = Out(C(in[i]) * scale) for the `n` units (vectors of N elements, or N = 1) of a
// block's run, thread t taking units t, t + blockDim.x, ...: GPUCOLL_UNROLL units loaded before
// any is stored, so that many loads are in flight per thread (one at a time, the copy loop
// reached 62 % of a device copy's bandwidth on an H200). With kCheck, returns whether any value
// this thread wrote is not finite.
template <typename C, typename In, typename Out, int N, bool kCheck>
__device__ __forceinline__ bool copy_run(const vec_t<In, N>* __restrict__ in,
                                         vec_t<Out, N>* __restrict__ out, long long n, C scale) {
  typedef unit_io<static_cast<int>(sizeof(vec_t<In, N>))> InIO;
  typedef unit_io<static_cast<int>(sizeof(vec_t<Out, N>))> OutIO;
  bool bad = false;
  const long long stride = blockDim.x;
  long long i = threadIdx.x;
  for (; i + (GPUCOLL_UNROLL - 1) * stride < n; i += GPUCOLL_UNROLL * stride) {
    vec_t<In, N> a[GPUCOLL_UNROLL];
#pragma unroll
    for (int u = 0; u < GPUCOLL_UNROLL; ++u) a[u] = InIO::load(in + i + u * stride);
#pragma unroll
    for (int u = 0; u < GPUCOLL_UNROLL; ++u) {
      vec_t<Out, N> b;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        b.v[j] = convert<C, Out>::from(mul_rn(convert<C, In>::to(a[u].v[j]), scale));
        if (kCheck) bad |= !is_finite(b.v[j]);
      }
      OutIO::store(out + i + u * stride, b);
    }
  }
  for (; i < n; i += stride) {
    const vec_t<In, N> a = InIO::load(in + i);
    vec_t<Out, N> b;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      b.v[j] = convert<C, Out>::from(mul_rn(convert<C, In>::to(a.v[j]), scale));
      if (kCheck) bad |= !is_finite(b.v[j]);
    }
    OutIO::store(out + i, b);
  }
  return bad;
}

// Copy tile `k` (of `nblocks`) of `count` elements: out[i] = Out(C(in[i]) * scale).
// 16-byte vector accesses when `in` and `out` reach 16-byte (resp. VEC-element) alignment at the
// same element (checked here, per array, from the addresses); scalar head and tail otherwise.
// With kCheck, returns (block-wide) whether any value written is not finite.
template <typename In, typename Out, bool kCheck>
__device__ __forceinline__ bool copy_tile(const In* __restrict__ in, Out* __restrict__ out,
                                          long long count, long long k, long long nblocks,
                                          long long tile,
                                          typename compute_type<In, Out>::type scale) {
  typedef typename compute_type<In, Out>::type C;
  constexpr int kWide = sizeof(In) > sizeof(Out) ? sizeof(In) : sizeof(Out);
  constexpr int VEC = 16 / kWide;
  const unsigned long long in_addr = reinterpret_cast<unsigned long long>(in);
  const unsigned long long out_addr = reinterpret_cast<unsigned long long>(out);

  long long head = 0;
  bool vector = false;
  if (VEC > 1 && in_addr % sizeof(In) == 0 && out_addr % sizeof(Out) == 0) {
    const unsigned long long in_bytes = VEC * sizeof(In), out_bytes = VEC * sizeof(Out);
    const long long h = static_cast<long long>(((in_bytes - in_addr % in_bytes) % in_bytes) /
                                               sizeof(In));
    if (h < count && (out_addr + h * sizeof(Out)) % out_bytes == 0) {
      vector = true;
      head = h;
    }
  }
  long long begin = k == 0 ? 0 : min(head + k * tile, count);
  long long end = k == nblocks - 1 ? count : min(head + (k + 1) * tile, count);

  typedef vec_t<In, 1> In1;
  typedef vec_t<Out, 1> Out1;
  bool bad = false;
  long long scalar_to = end, tail_from = end;
  if (vector) {
    const long long vbegin = max(begin, head);
    const long long nvec = (end - vbegin) / VEC;
    scalar_to = vbegin;                   // head (first tile only)
    tail_from = vbegin + nvec * VEC;      // tail (last tile only)
    bad |= copy_run<C, In, Out, VEC, kCheck>(
        reinterpret_cast<const vec_t<In, VEC>*>(in + vbegin),
        reinterpret_cast<vec_t<Out, VEC>*>(out + vbegin), nvec, scale);
  }
  bad |= copy_run<C, In, Out, 1, kCheck>(reinterpret_cast<const In1*>(in + begin),
                                          reinterpret_cast<Out1*>(out + begin),
                                          scalar_to - begin, scale);
  bad |= copy_run<C, In, Out, 1, kCheck>(reinterpret_cast<const In1*>(in + tail_from),
                                          reinterpret_cast<Out1*>(out + tail_from),
                                          end - tail_from, scale);
  if (kCheck) return __syncthreads_or(bad) != 0;
  return false;
}

}  // namespace gpucoll
