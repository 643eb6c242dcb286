// fp8 quantization of bf16 rows in one launch: hscapture.fp8.quantize_into's codes, scales and
// non-finite counts, bit for bit, for a [tensors, rows, hidden] block of a CUDA ring slot.
//
// One thread block per (row, tensor). Per row: amax = the largest |x| over its finite values;
// scale = amax / 448 (an IEEE float division), 1 where that is 0; each finite x is stored as the
// e4m3fn code of x / scale (IEEE division, then PyTorch's float -> float8_e4m3fn rounding: nearest,
// ties to even, 480 and above NaN), each NaN or inf as 0x7F, and counted. The rounding is spelled
// out below rather than taken from cuda_fp8.h, whose conversion may round twice.
// Compiled at run time with NVRTC (cupy.RawModule); hscapture/consumer/device_fp8.py falls back to
// hscapture.fp8.quantize_into (about ten torch kernels) where it cannot.

#define THREADS 256

// cupy compiles with -ftz=true (single-precision denormals flushed to zero, which PyTorch does not
// do), so no single-precision operation here meets a denormal that could change a result: the
// maximum is taken on bit patterns, and the two divisions are done in double precision (never
// flushed) and rounded to float by hand. A quotient of two floats rounded to double and then to
// float is the float quotient correctly rounded (53 >= 2 x 24 + 2 bits), as PyTorch computes it.

__device__ __forceinline__ double exact_double(unsigned int bits) {   // a float, denormals included
    const unsigned int magnitude = bits & 0x7FFFFFFFu;
    const double value = (magnitude >> 23) ? (double)__uint_as_float(magnitude)
                                           : ldexp((double)magnitude, -149);   // a denormal: mantissa x 2^-149
    return (bits >> 31) ? -value : value;
}

__device__ __forceinline__ unsigned int float_bits_rn(double d) {     // finite d, |d| < 2^128: round to float
    const unsigned long long b = (unsigned long long)__double_as_longlong(d);
    const unsigned int sign = (unsigned int)(b >> 32) & 0x80000000u;
    const int e = (int)((b >> 52) & 0x7FF) - 1023;
    if (e < -151) return sign;                                           // below half the least denormal: zero
    const unsigned long long m = (b & 0xFFFFFFFFFFFFFull) | (1ull << 52);
    const int shift = e >= -126 ? 29 : 29 + (-126 - e);                 // keep 24 bits, fewer for a denormal
    unsigned long long keep = m >> shift;
    const unsigned long long rest = m & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    if (rest > half || (rest == half && (keep & 1))) ++keep;             // to nearest, ties to even
    const unsigned int magnitude = e >= -126 ? (unsigned int)((e + 126) << 23) + (unsigned int)keep
                                             : (unsigned int)keep;       // a carry moves up the exponent
    return sign | magnitude;
}

__device__ __forceinline__ unsigned char e4m3fn_code(unsigned int bits) {  // PyTorch's float -> e4m3fn
    const unsigned int sign = bits & 0x80000000u;
    bits ^= sign;
    unsigned char code;
    if (bits >= (1087u << 20)) {             // |f| >= 480 (or NaN): NaN
        code = 0x7Fu;
    } else if (bits < (121u << 23)) {        // |f| < 2^-6: a denormal code, rounded by a float add (a
        const unsigned int magic = 141u << 23;   // flushed float denormal gives code 0, as it would anyway)
        code = (unsigned char)(__float_as_uint(__fadd_rn(__uint_as_float(bits), __uint_as_float(magic))) - magic);
    } else {                                  // normal: rebias the exponent, round the mantissa to 3 bits
        const unsigned int odd = (bits >> 20) & 1u;
        bits += (unsigned int)(7 - 127) * (1u << 23) + 0x7FFFFu + odd;
        code = (unsigned char)(bits >> 20);
    }
    return code | (unsigned char)(sign >> 24);
}

extern "C" __global__ void quantize_bf16_rows(
    const unsigned short* __restrict__ rows, long long tensor_stride, int hidden,
    unsigned char* __restrict__ codes, float* __restrict__ scales, int* __restrict__ nonfinite, int out_rows)
{
    const int row = blockIdx.x, tensor = blockIdx.y;
    const unsigned short* x = rows + tensor * tensor_stride + (long long)row * hidden;
    const long long out = (long long)tensor * out_rows + row;
    unsigned int amax = 0;                    // the largest finite magnitude, as float bits
    int bad = 0;
    for (int i = threadIdx.x; i < hidden; i += THREADS) {
        const unsigned int magnitude = ((unsigned int)x[i] << 16) & 0x7FFFFFFFu;
        if (magnitude < 0x7F800000u) amax = max(amax, magnitude); else ++bad;
    }
    for (int offset = 16; offset; offset >>= 1) {
        amax = max(amax, __shfl_down_sync(0xffffffffu, amax, offset));
        bad += __shfl_down_sync(0xffffffffu, bad, offset);
    }
    __shared__ unsigned int warp_amax[THREADS / 32];
    __shared__ int warp_bad[THREADS / 32];
    __shared__ double row_scale;
    if ((threadIdx.x & 31) == 0) {
        warp_amax[threadIdx.x >> 5] = amax;
        warp_bad[threadIdx.x >> 5] = bad;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) {
            amax = max(amax, warp_amax[w]);
            bad += warp_bad[w];
        }
        unsigned int scale = float_bits_rn(exact_double(amax) / 448.0);
        if (scale == 0) scale = 0x3F800000u;  // a zero (or all but zero) row: scale 1
        row_scale = exact_double(scale);
        scales[out] = __uint_as_float(scale);
        nonfinite[out] = bad;
    }
    __syncthreads();
    const double scale = row_scale;
    unsigned char* y = codes + out * hidden;
    for (int i = threadIdx.x; i < hidden; i += THREADS) {
        const unsigned int bits = (unsigned int)x[i] << 16;
        y[i] = (bits & 0x7F800000u) != 0x7F800000u ? e4m3fn_code(float_bits_rn(exact_double(bits) / scale))
                                                  : (unsigned char)0x7Fu;
    }
}
