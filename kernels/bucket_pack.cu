// gpucoll_bucket_pack<Src, Dst>: copy N arrays into one flat bucket in one launch.
//
// Purpose: gradient bucketing. bucket[offset[a] + i] = Dst(C(array_a[i]) * scale) for every array
//   a of the launch, with C = float (double when either side is double): a plain copy, a copy
//   with pre-scaling (e.g. 1 / world before a float16 all-reduce), and the float32 -> bfloat16 /
//   float16 cast of wire compression, all fused.
// Launch shape: 1-D grid, one block per tile of `tile` elements of one array (grid =
//   block_start[n], see common.cuh for the work table), 256 threads per block; `tile` is a
//   multiple of 16. A launch carries at most 65,536 arrays and 2^31 - 1 blocks; the host splits
//   longer lists into several launches on the same stream.
// Determinism: every output element is written by exactly one thread with a fixed rounding
//   (nearest even); results are bit-identical from run to run and equal to the NumPy path.
#include "common.cuh"

template <typename Src, typename Dst>
__global__ void __launch_bounds__(256)
gpucoll_bucket_pack(const long long* __restrict__ table, int n_arrays, long long tile,
                    Dst* __restrict__ bucket, double scale) {
  typedef typename gpucoll::compute_type<Src, Dst>::type C;
  const long long* block_start = table + 3 * static_cast<long long>(n_arrays);
  const long long block = blockIdx.x;
  const int a = gpucoll::find_array(table, n_arrays, block);
  const Src* src = reinterpret_cast<const Src*>(table[a]);
  Dst* dst = bucket + table[n_arrays + a];
  const long long count = table[2 * static_cast<long long>(n_arrays) + a];
  gpucoll::copy_tile<Src, Dst, false>(src, dst, count, block - block_start[a],
                                      block_start[a + 1] - block_start[a], tile,
                                      gpucoll::scale_as<C>(scale));
}

#ifdef GPUCOLL_INSTANTIATE_ALL  // offline compile checks; the loader instantiates on demand
template __global__ void gpucoll_bucket_pack<float, float>(const long long*, int, long long, float*, double);
template __global__ void gpucoll_bucket_pack<float, gpucoll::bf16_t>(const long long*, int, long long, gpucoll::bf16_t*, double);
template __global__ void gpucoll_bucket_pack<float, gpucoll::f16_t>(const long long*, int, long long, gpucoll::f16_t*, double);
template __global__ void gpucoll_bucket_pack<gpucoll::bf16_t, gpucoll::bf16_t>(const long long*, int, long long, gpucoll::bf16_t*, double);
template __global__ void gpucoll_bucket_pack<gpucoll::f16_t, gpucoll::f16_t>(const long long*, int, long long, gpucoll::f16_t*, double);
template __global__ void gpucoll_bucket_pack<double, double>(const long long*, int, long long, double*, double);
#endif
