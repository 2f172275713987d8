/* contract: the CUDA backend's hooks (device buffers through src/kernels/cuda) and its registration table.
 * The table is empty until the CUDA stream tiles' launchers are registered here: each gets a launch function
 * taking device pointers from keel_contract_args, its edge shapes and its controls, as cpu_regs.c does.
 */
#include <stdio.h>
#include <string.h>

#include "contract.h"

#if defined(KEEL_HAVE_CUDA)
#include "../kernels/cuda/cuda.h"
#endif

/* Launch entry points the CUDA table registers (checked against launch sites in every build). */
const char *const keel_contract_cuda_entries[] = {NULL};

#if defined(KEEL_HAVE_CUDA)

static void *cuda_alloc(size_t bytes) { return keel_cuda_malloc(bytes ? bytes : 1); }
static void cuda_release(void *p) { keel_cuda_free(p); }
static void cuda_upload(void *dst, const void *src, size_t bytes) { keel_cuda_upload(dst, src, bytes); }
static void cuda_download(void *dst, const void *src, size_t bytes) { keel_cuda_download(dst, src, bytes); }
/* keel_cuda_sync aborts on a device error (KEEL_CUDA_CHECK), so returning from it means the launch reported none. */
static bool cuda_sync(char *why, size_t cap) {
    (void)why, (void)cap;
    keel_cuda_sync();
    return true;
}

static keel_contract_backend g_cuda = {.name = "cuda", .alloc = cuda_alloc, .release = cuda_release,
                                       .upload = cuda_upload, .download = cuda_download, .sync = cuda_sync};

const keel_contract_backend *keel_contract_cuda_backend(char *why, size_t cap) {
    if (keel_cuda_device_count() < 1) {
        snprintf(why, cap, "no CUDA device is visible on this host (keel_cuda_device_count() is 0)");
        return NULL;
    }
    char desc[128] = "";
    keel_cuda_device_name(desc, sizeof desc);
    const char *sm = strstr(desc, "sm_"); /* "NVIDIA H200, sm_90, 132 SMs, ..." */
    size_t len = 0;
    if (sm)
        while (sm[len] && sm[len] != ',' && len + 1 < sizeof g_cuda.chip) len++;
    if (sm)
        snprintf(g_cuda.chip, sizeof g_cuda.chip, "%.*s", (int)len, sm);
    else
        snprintf(g_cuda.chip, sizeof g_cuda.chip, "cuda");
    return &g_cuda;
}

int keel_contract_register_cuda(keel_contract_table *t) {
    (void)t;
    return 0;
}

#else

const keel_contract_backend *keel_contract_cuda_backend(char *why, size_t cap) {
    snprintf(why, cap, "this keel was built without CUDA (configure with -DKEEL_CUDA=ON on a host with nvcc)");
    return NULL;
}

int keel_contract_register_cuda(keel_contract_table *t) {
    (void)t;
    return 0;
}

#endif
