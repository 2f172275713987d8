/* contract: the compiled twin of the GPU sampler and the chunked scan (src/engine/cuda/sample.cu and scan.cu built
 * again with their launchers renamed keel_contract_twin_ecu_* and the faults of twin_scan.h plantable). */
#include "twin_scan.h"

#define KEEL_SCAN_TWIN 1
namespace {
__device__ int g_scan_plant;
}
#define KEEL_SCAN_PLANTED(f) (g_scan_plant == (f))

#include "../engine/cuda/sample.cu"
#include "../engine/cuda/scan.cu"

extern "C" void keel_contract_twin_scan_arm(int fault) {
    KEEL_CUDA_CHECK(cudaMemcpyToSymbol(g_scan_plant, &fault, sizeof fault));
}
