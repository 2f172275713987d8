/* engine/cuda: the launcher names and fault hooks shared by sample.cu and scan.cu: keel_ecu_* with no faults, or,
 * when src/contract/twin_scan.cu builds both again (defining KEEL_SCAN_TWIN 1 and KEEL_SCAN_PLANTED first),
 * keel_contract_twin_ecu_* with the planted fault tested by KEEL_SCAN_PLANTED. */
#ifndef KEEL_ENGINE_CUDA_SCAN_FN_H
#define KEEL_ENGINE_CUDA_SCAN_FN_H

#ifndef KEEL_SCAN_TWIN
#define KEEL_SCAN_TWIN 0
#endif
#ifndef KEEL_SCN_FN
#if KEEL_SCAN_TWIN
#define KEEL_SCN_FN(name) keel_contract_twin_ecu_##name
#else
#define KEEL_SCN_FN(name) keel_ecu_##name
#endif
#endif
#ifndef KEEL_SCAN_PLANTED
#define KEEL_SCAN_PLANTED(f) ((void)(f), false)
#endif

#endif
