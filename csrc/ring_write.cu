// Fused, CUDA-graph-safe ring write: copy one fixed-shape batch of every captured tensor into
// the ring slot named by a device-side index, in one launch.
//
// The slot is read from device memory (`slot_index`), so the launch can be captured in a CUDA
// graph once and replayed with a different slot each step: the host only updates the index
// before replay. Sources are the graph's static activation buffers, passed by address.
// Every plane is `plane_vec` 16-byte vectors; tensor t lands at dst[t * plane_vec ...].
// Compiled at run time with NVRTC (cupy.RawModule); hscapture/graph.py has a torch fallback.

extern "C" __global__ void ring_write(
    const uint4* __restrict__ src0, const uint4* __restrict__ src1,
    const uint4* __restrict__ src2, const uint4* __restrict__ src3,
    const uint4* __restrict__ src4, const uint4* __restrict__ src5,
    const uint4* __restrict__ src6, const uint4* __restrict__ src7,
    int num_tensors, long long plane_vec,
    uint4* __restrict__ ring, long long slot_vec, const long long* __restrict__ slot_index)
{
    const uint4* srcs[8] = {src0, src1, src2, src3, src4, src5, src6, src7};
    uint4* dst = ring + (*slot_index) * slot_vec;
    const long long total = (long long)num_tensors * plane_vec;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int t = (int)(i / plane_vec);
        dst[i] = srcs[t][i - (long long)t * plane_vec];
    }
}
