/* contract: the CUDA side of the contract (cuda_hooks.cu, twin_cuda_stream.cu) as seen from C (cuda_regs.c,
 * cuda_routed.c). Only in builds with CUDA. */
#ifndef KEEL_CONTRACT_CUDA_TWIN_H
#define KEEL_CONTRACT_CUDA_TWIN_H

#include "../kernels/cuda/cuda.h"

/* Faults the CUDA twin can arm (one at a time). */
#define KEEL_CONTRACT_PLANT_NONE 0
#define KEEL_CONTRACT_PLANT_WIDTH4 1   /* codes of 5, 6, 8 bits decoded as 4-bit: gate 3 */
#define KEEL_CONTRACT_PLANT_NOBIAS 2   /* the bias term dropped: gate 3 */
#define KEEL_CONTRACT_PLANT_PASTEND 3  /* the last output written once more one element further: gate 2 */
#define KEEL_CONTRACT_PLANT_EPIORDER 4 /* fused relu2: bias term summed before the scale term: gate 4 */
#define KEEL_CONTRACT_PLANT_ROWLEAK 5  /* odd rows get a trace of the row before: gate 4 */

#ifdef __cplusplus
extern "C" {
#endif

/* Backend hooks: device buffers from a reuse pool (cudaMalloc and cudaFree would dominate the run). */
void *keel_contract_cuda_alloc(size_t bytes);
void keel_contract_cuda_release(void *p);
void keel_contract_cuda_upload(void *dst, const void *src, size_t bytes);
void keel_contract_cuda_download(void *dst, const void *src, size_t bytes);
/* The stamp of the pooled buffer holding p: it changes whenever that buffer is handed out again or written from the
 * host, so a copy derived from its contents (the packed tile's) is current while the stamp is the same. */
unsigned long long keel_contract_cuda_stamp(const void *p);
/* Waits for the device; false with the runtime's reason when a launch or the device reported an error. */
bool keel_contract_cuda_sync(char *why, size_t cap);

/* Arms one KEEL_CONTRACT_PLANT_* fault in the twin (NONE disarms). */
void keel_contract_cuda_twin_arm(int fault);
/* Gate 1: the tile of this width and activation type has an image for this device and its launch (threads,
 * shared memory) fits the device's limits; false with a reason. */
bool keel_contract_cuda_probe(int bits, int xf16, char *why, size_t cap);

/* The twin's launchers (same contracts as keel_cuda_*). */
void keel_contract_twin_cuda_stream_matmul(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                           keel_dtype ydt, keel_epilogue epi, void *stream);
void keel_contract_twin_cuda_relu2(void *y, keel_dtype ydt, size_t count, void *stream);
void keel_contract_twin_cuda_stream_experts_up(const keel_cuda_qw *W1, const void *x, keel_dtype xdt, int m,
                                               const keel_cuda_route *items, int n_items, void *h, keel_dtype hdt,
                                               keel_epilogue epi, void *stream);
void keel_contract_twin_cuda_stream_experts_down(const keel_cuda_qw *W2, const void *h, keel_dtype hdt, int m,
                                                 const keel_cuda_route *items, const float *weights, int n_items,
                                                 void *y, keel_dtype ydt, void *stream);

/* The packed tiles' twin (twin_cuda_packed.cu): its own fault flag, its probe of the real kernels, its launchers. */
void keel_contract_cuda_twin_packed_arm(int fault);
bool keel_contract_cuda_packed_probe(int bits, int xf16, char *why, size_t cap);
void keel_contract_twin_cuda_stream_matmul_packed(const keel_cuda_pw *W, const void *x, keel_dtype xdt, int m,
                                                  void *y, keel_dtype ydt, keel_epilogue epi, void *stream);

#ifdef __cplusplus
}
#endif

#endif
