// Element-wise reduction and scaling kernels for host memory, one entry per
// (dtype, op). float16 and bfloat16 are computed in float32 and rounded to
// nearest even. Runtime CPU dispatch lives behind these functions.
#pragma once

#include <braid/braid.h>

#include <cstddef>
#include <cstdint>

namespace braid::kernels {

// Whether `op` is defined for `dtype` (AVG only for floating types, the
// bitwise ops only for integer types).
bool redop_supported(braid_dtype_t dtype, braid_redop_t op);
bool is_floating(braid_dtype_t dtype);

// dst[i] = a[i] op b[i]; dst may alias a or b (exactly, not partially).
// AVG reduces as SUM: the collective divides once at the end.
void reduce(braid_dtype_t dtype, braid_redop_t op, void* dst, const void* a, const void* b, size_t count);

// The instruction set the kernels run with on this CPU: "avx512_bf16"
// (AVX-512 with its bfloat16 conversion), "avx512", "avx2" (with F16C) or
// "default" (SSE2 on x86-64), after any BRAID_CPU_ISA cap.
const char* active_isa();

// Whether `cap` is a value BRAID_CPU_ISA takes: "default", "avx2", "avx512"
// or "avx512_bf16" (the most the kernels use; no cap below what the CPU
// offers).
bool valid_isa_cap(const char* cap);

// out[i] = in[i] / divisor, for floating dtypes (the AVG finish, and a
// float16 AVG's inputs before they are summed). `out` is `in` or disjoint.
void divide(braid_dtype_t dtype, const void* in, void* out, size_t count, int divisor);

// Scalar conversions, exposed for tests and for tools that build references.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bfloat16_to_float(uint16_t b);
uint16_t float_to_bfloat16(float f);

}  // namespace braid::kernels
