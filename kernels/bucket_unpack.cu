// gpucoll_bucket_unpack<Src, Dst, kCheck>: copy a flat bucket back into N arrays in one launch.
//
// Purpose: the end of a bucketed all-reduce. array_a[i] = Dst(C(bucket[offset[a] + i]) * scale)
//   with C = float (double when either side is double); the host folds averaging (1 / world) and
//   loss-scale unscaling (1 / loss_scale) into `scale`, and the cast back from bfloat16 / float16
//   happens in the same pass. With kCheck, any value written that is not finite (inf, NaN)
//   sets *found_inf = 1 (it is never cleared here; the caller zeroes it); without it found_inf
//   is never read (it may be null). The check is a template argument, not a runtime flag, so
//   that each variant gets its own register allocation: with both paths in one kernel, ptxas
//   (CUDA 13.5, sm_100) capped the kernel at 32 registers and spilled in the checking path.
// Launch shape: 1-D grid, one block per tile of `tile` elements of one array (grid =
//   block_start[n], see common.cuh for the work table), 256 threads per block; `tile` is a
//   multiple of 16. A launch carries at most 65,536 arrays and 2^31 - 1 blocks; the host splits
//   longer lists into several launches on the same stream.
// Determinism: every output element is written by exactly one thread with a fixed rounding
//   (nearest even); the flag is an OR (one block-wide vote, then a store of 1), so results and
//   flag are bit-identical from run to run and equal to the NumPy path.
#include "common.cuh"

template <typename Src, typename Dst, bool kCheck>
__global__ void __launch_bounds__(256)
gpucoll_bucket_unpack(const long long* __restrict__ table, int n_arrays, long long tile,
                      const Src* __restrict__ bucket, double scale, int* __restrict__ found_inf) {
  typedef typename gpucoll::compute_type<Src, Dst>::type C;
  const long long* block_start = table + 3 * static_cast<long long>(n_arrays);
  const long long block = blockIdx.x;
  const int a = gpucoll::find_array(table, n_arrays, block);
  Dst* dst = reinterpret_cast<Dst*>(table[a]);
  const Src* src = bucket + table[n_arrays + a];
  const long long count = table[2 * static_cast<long long>(n_arrays) + a];
  const long long k = block - block_start[a];
  const long long nblocks = block_start[a + 1] - block_start[a];
  const bool bad = gpucoll::copy_tile<Src, Dst, kCheck>(src, dst, count, k, nblocks, tile,
                                                        gpucoll::scale_as<C>(scale));
  if (kCheck && bad && threadIdx.x == 0) {
    *found_inf = 1;
  }
}

#ifdef GPUCOLL_INSTANTIATE_ALL  // offline compile checks; the loader instantiates on demand
template __global__ void gpucoll_bucket_unpack<float, float, false>(const long long*, int, long long, const float*, double, int*);
template __global__ void gpucoll_bucket_unpack<float, float, true>(const long long*, int, long long, const float*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::bf16_t, float, false>(const long long*, int, long long, const gpucoll::bf16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::bf16_t, float, true>(const long long*, int, long long, const gpucoll::bf16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::f16_t, float, false>(const long long*, int, long long, const gpucoll::f16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::f16_t, float, true>(const long long*, int, long long, const gpucoll::f16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::bf16_t, gpucoll::bf16_t, false>(const long long*, int, long long, const gpucoll::bf16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::bf16_t, gpucoll::bf16_t, true>(const long long*, int, long long, const gpucoll::bf16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::f16_t, gpucoll::f16_t, false>(const long long*, int, long long, const gpucoll::f16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<gpucoll::f16_t, gpucoll::f16_t, true>(const long long*, int, long long, const gpucoll::f16_t*, double, int*);
template __global__ void gpucoll_bucket_unpack<double, double, false>(const long long*, int, long long, const double*, double, int*);
template __global__ void gpucoll_bucket_unpack<double, double, true>(const long long*, int, long long, const double*, double, int*);
#endif
