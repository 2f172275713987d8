/* contract: the compiled twin of the CUDA engine's kernels (src/engine/cuda/kernels.cu built again with its
 * planted faults compiled in and its launchers renamed keel_contract_twin_ecu_*). */
#define KEEL_ECU_TWIN 1
#include "../engine/cuda/kernels.cu"
