// DASH_HD marks functions that the kernels and the CPU module dash_attn._sched (built without CUDA) both compile.
#pragma once

#if defined(__CUDACC__)
#define DASH_HD __host__ __device__
#else
#define DASH_HD
#endif
