/* kernels/cuda: the GPU backend's C-callable surface. Launchers are extern "C"; this header is plain C. */
#ifndef KEEL_KERNELS_CUDA_H
#define KEEL_KERNELS_CUDA_H

#include "../../core/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices (0 when there is no driver or no device); never aborts. */
int keel_cuda_device_count(void);
/* Describes device 0 ("NVIDIA H200, sm_90, 132 SMs, 139.8 GiB") into buf; false when there is none. */
bool keel_cuda_device_name(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif
