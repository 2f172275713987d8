/* contract: registrations of the CUDA engine's own kernels (src/engine/cuda/kernels.cu), beside the stream tiles'
 * table (cuda_regs.c). Plain C. */
#ifndef KEEL_CONTRACT_ENGINE_REGS_CUDA_H
#define KEEL_CONTRACT_ENGINE_REGS_CUDA_H

#include "contract.h"

/* The engine's launch entry points (src/engine/cuda/ecuda.h) this table covers, NULL-terminated, in every build. */
extern const char *const keel_contract_cuda_engine_entries[];

/* Appends the engine kernels' registrations (on the CUDA backend) and returns how many; 0 without CUDA or a device.
 * Called where the CUDA table is built (after keel_contract_register_cuda). */
int keel_contract_register_cuda_engine(keel_contract_table *t);

/* The GPU sampler, the chunked Mamba-2 scan and the router's group filter (engine_regs_scan.c): their launch entry
 * points (NULL-terminated, every build) and their registrations on the CUDA backend (0 without CUDA or a device). */
extern const char *const keel_contract_cuda_scan_entries[];
int keel_contract_register_cuda_scan(keel_contract_table *t);

/* The graph-ready attention's launch entry points (src/engine/cuda/attn.cu), NULL-terminated, in every build. */
extern const char *const keel_contract_cuda_attn_entries[];
/* Appends the attention kernels' registrations (engine_regs_attn.c) and returns how many; 0 without CUDA or a device. */
int keel_contract_register_cuda_attn(keel_contract_table *t);

#endif
