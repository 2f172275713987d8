/* contract: the twin of the GPU sampler and the chunked Mamba-2 scan (twin_scan.cu builds src/engine/cuda/sample.cu
 * and scan.cu again with their launchers renamed keel_contract_twin_ecu_* and one planted fault armed at a time). */
#ifndef KEEL_CONTRACT_TWIN_SCAN_H
#define KEEL_CONTRACT_TWIN_SCAN_H

#include "../engine/cuda/ecuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The faults, as sample.cu and scan.cu test them (KEEL_SCAN_PLANTED(n)) */
#define KEEL_SCAN_PLANT_NONE 0
#define KEEL_SCAN_PLANT_TIES 1    /* sampler: ties in logit go to the higher id (gate 3) */
#define KEEL_SCAN_PLANT_PASTEND 2 /* sampler: one int written past the token (gate 2) */
#define KEEL_SCAN_PLANT_NODSKIP 3 /* chunked scan: the D skip dropped (gate 3) */
#define KEEL_SCAN_PLANT_DECAY 4   /* chunked scan: the state's decay misses the chunk's first token (gate 3) */
#define KEEL_SCAN_PLANT_RERUN 5   /* chunked scan: every second launch moves one output by an ulp (gate 4) */

void keel_contract_twin_scan_arm(int fault);
void keel_contract_twin_ecu_sample(const float *logits, int V, float temp, int top_k, float top_p, float min_p,
                                   uint64_t seed, const int *d_pos, int *out_tok, void *scratch, void *st);
size_t keel_contract_twin_ecu_sample_scratch_bytes(int V);
void keel_contract_twin_ecu_ssm_chunked(const float *xbc, int CD, const float *proj, int ld, int dt_off, float *state,
                                        const keel_ecu_vec *dt_bias, const keel_ecu_vec *A_log, const keel_ecu_vec *D,
                                        int NH, int P, int N, int G, int m, float *y, void *st);

#ifdef __cplusplus
}
#endif

#endif
