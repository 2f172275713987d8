/* contract: the CUDA engine registrations' cases (buffers of each kernel kind, their inputs) and float64 references
 * with their bounds, shared by engine_regs_cuda.c (launches, gates, table) and engine_refs_cuda.c (the definitions).
 * Plain C; CUDA builds only. */
#ifndef KEEL_CONTRACT_ENGINE_CASES_CUDA_H
#define KEEL_CONTRACT_ENGINE_CASES_CUDA_H

#include "contract.h"

#define U 0x1p-24
#define GUARD KEEL_CONTRACT_GUARD
#define MAXB 14
/* The quantized fp32 matvec's roundings on one output: a 32-code unit's sums as four sequential partials of 8 and a
 * two-level tree (10), its scale and bias terms (2), the lane's units in order (one per 1024 codes), the warp's
 * five-level tree (5). */
#define QMV_HOPS(k) (17 + ((k) + 1023) / 1024)
#define BF16_UNIT 0x1p-8 /* bf16 keeps 8 significant bits: rounding to nearest errs by at most 2^-8 |v| */

enum { K_EMBED, K_RMSNORM, K_ADDNORM, K_ADDBIAS, K_MATVEC_F, K_MATVEC_Q, K_CONV, K_SSM, K_GATENORM, K_ROUTE,
       K_ARGMAX, K_ROUTED_UP, K_ROUTED_DOWN, K_COMBINE, K_UNION, K_ROUTER, K_MAMBA, K_RWIN, K_NORMMV, K_N };
enum { R_IN, R_OUT, R_STATE, R_SCRATCH };

typedef struct buf {
    keel_dtype dt;
    size_t n, row; /* elements; elements per row when row-wise (0: one block for every row) */
    int role;
    void *h;       /* host values */
    keel_contract_gbuf g; /* its guarded backend copy */
} buf;

typedef struct ecase {
    int kind, m, n, k; /* n, k: the shape's widths (meaning per kind) */
    int nb;
    buf b[MAXB];
} ecase;

/* Per kind: the Mamba geometry used at every shape, the router's and the routed matvec's counts. */
enum { S_P = 16, S_N = 48, S_G = 2, C_K = 4, R_K1 = 6, R_K2 = 4, X_E = 4, X_K = 2 };

/* Appends a buffer of n elements of dt (row: elements per row when row-wise, 0 otherwise) to c. */
void keel_contract_ecase_add(ecase *c, keel_dtype dt, size_t n, size_t row, int role);
void keel_contract_ecase_free(ecase *c);
double keel_contract_ecase_get(const buf *b, size_t i);
void keel_contract_ecase_set(buf *b, size_t i, double v);
/* The buffers of c's kind, in the order the launch and the reference read them. */
void keel_contract_ecase_layout(ecase *c);
/* Inputs: dist 0 normal, 1 large magnitude; integers, codes and routing logits on grids with ties. */
void keel_contract_ecase_generate(ecase *c, uint64_t seed, int dist);
/* Elements of every output and state buffer, together. */
size_t keel_contract_ecase_n_out(const ecase *c);
/* The float64 reference and bound of every output and state element (buffer order) from c's inputs. */
void keel_contract_ecase_reference(const ecase *c, double *ref, double *bnd);

#endif
