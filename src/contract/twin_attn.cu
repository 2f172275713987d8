/* contract: the compiled twin of the engine's attention (src/engine/cuda/attn.cu built again with its launchers
 * renamed keel_contract_twin_ecu_* and its KEEL_PLANT_* hooks redefined). One fault (KEEL_ECU_ATTN_PLANT_*, ecuda.h)
 * is armed at a time through a device flag (keel_contract_twin_ecu_attn_arm); unarmed, the twin computes what the
 * kernels do. */
#define KEEL_ATTN_TWIN 1

/* no-rescale: a tile adds its keys to o without first scaling o by alpha (gate 3) */
#define KEEL_PLANT_ATTN_RESCALE(o, alpha) (g_attn_plant == KEEL_ECU_ATTN_PLANT_NORESCALE ? (o) : __fmul_rn(o, alpha))
/* row-leak: a launch of several rows scales its outputs by 1 + 2^-20, inside the gate-3 bound (gate 4) */
#define KEEL_PLANT_ATTN_OUT(v, multi)                                                                          \
    (g_attn_plant == KEEL_ECU_ATTN_PLANT_ROWLEAK && (multi) ? __fmul_rn(v, 1.0f + 0x1p-20f) : (v))
/* write-past-end: the last fp32 output (resp. cache element) written once more one element further (gate 2) */
#define KEEL_PLANT_ATTN_STORED(of, i, last, v)                                                                 \
    do {                                                                                                       \
        if (g_attn_plant == KEEL_ECU_ATTN_PLANT_PASTEND && (i) == (last)) (of)[(i) + 1] = (v);                 \
    } while (0)
#define KEEL_PLANT_KV_STORED(kc, i, last, v)                                                                   \
    do {                                                                                                       \
        if (g_attn_plant == KEEL_ECU_ATTN_PLANT_PASTEND && (last)) (kc)[(i) + 1] = (v);                        \
    } while (0)
/* bias-dropped: kv_append adds no bias (gate 3) */
#define KEEL_PLANT_KV_BIAS(b) (g_attn_plant == KEEL_ECU_ATTN_PLANT_NOBIAS ? 0.0f : (b))

#include "../engine/cuda/attn.cu"

#if !defined(KEEL_ATTN_PLANT_HOOKS)
#error "src/engine/cuda/attn.cu lost its KEEL_PLANT_* hooks: the contract's attention controls would plant nothing"
#endif
