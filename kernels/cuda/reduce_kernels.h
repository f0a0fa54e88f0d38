/* Reduction and copy kernels for device memory, one entry per (dtype, op),
 * the same math as kernels/cpu (see element_math.h). They live in their own
 * library, libbraid_cuda (built when CMake finds nvcc, with the CUDA runtime
 * linked in), behind this C interface, so that libbraid can load it only
 * when a process works on device memory.
 *
 * Each function returns BRAID_SUCCESS or an error code with a message in
 * `error` (at most error_size bytes, NUL-terminated; may be NULL). */
#ifndef BRAID_KERNELS_CUDA_REDUCE_KERNELS_H_
#define BRAID_KERNELS_CUDA_REDUCE_KERNELS_H_

#include <braid/braid.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define BRAID_CUDA_API __attribute__((visibility("default")))
#define BRAID_CUDA_MAX_SOURCES 8
#define BRAID_CUDA_MAX_DESTINATIONS 4

struct CUstream_st; /* cudaStream_t is struct CUstream_st* */

/* dsts[d][i] = srcs[0][i] op srcs[1][i] op ... for every d: a ring step's
 * reduce-and-copy in one pass (one source and one destination is a copy).
 * Enqueued on `stream`, not waited for. Any count and alignment: 16-byte
 * loads and stores where every pointer allows them. A destination may be a
 * source exactly, not overlap one partially. AVG reduces as SUM (the
 * collective divides once, braid_cuda_divide). Results equal kernels/cpu's
 * (folding the sources left to right) except in two ways: a NaN comes out as
 * the device's canonical NaN, not with its input's payload, and float16 and
 * bfloat16 with three or more sources accumulate in float32 and round once
 * instead of after every pair. */
BRAID_CUDA_API braid_result_t braid_cuda_reduce_copy(braid_dtype_t dtype, braid_redop_t op,
                                                     const void* const* srcs, int nsrcs, void* const* dsts,
                                                     int ndsts, size_t count, struct CUstream_st* stream,
                                                     char* error, size_t error_size);

/* Loads every kernel into the current context now (the CUDA runtime loads
 * them lazily otherwise, at the first launch, which may synchronise the
 * context: a hang where a stream waits on the operation launching it). */
BRAID_CUDA_API braid_result_t braid_cuda_preload(char* error, size_t error_size);

/* out[i] = in[i] / divisor in the compute type, for floating dtypes (the AVG
 * finish, and a float16 AVG's inputs before they are summed). `out` is `in`
 * or disjoint from it. */
BRAID_CUDA_API braid_result_t braid_cuda_divide(braid_dtype_t dtype, const void* in, void* out, size_t count,
                                                int divisor, struct CUstream_st* stream, char* error,
                                                size_t error_size);

#ifdef __cplusplus
}
#endif

#endif /* BRAID_KERNELS_CUDA_REDUCE_KERNELS_H_ */
