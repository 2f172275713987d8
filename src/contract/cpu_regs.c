/* contract: the CPU backend (host memory) and the table of every CPU kernel variant keel launches.
 *
 * keel_cpu_matmul: one registration per code path (avx2, portable) x width x group x scale dtype x epilogue for
 * quantized matrices, and per path x weight dtype x epilogue for float matrices; each serves rows 1-8 (and more
 * in passes of 8), and the runner launches it at every m of each shape. keel_cpu_relu2: one registration.
 * The avx2 path is registered only on CPUs that run it (keel never launches it elsewhere).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"

static void *cpu_alloc(size_t bytes) { return keel_xmalloc(bytes ? bytes : 1); }
static void cpu_release(void *p) { free(p); }
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static bool cpu_sync(char *why, size_t cap) {
    (void)why, (void)cap;
    return true;
}

static keel_contract_backend g_cpu = {
    .name = "cpu", .alloc = cpu_alloc, .release = cpu_release, .upload = cpu_copy, .download = cpu_copy,
    .sync = cpu_sync};

/* The AVX2 path runs only where the CPU has AVX2, FMA and F16C; the chip is named by the best path it runs. */
static bool host_has_avx2(void) {
    keel_cpu_force_portable(false);
    return strcmp(keel_cpu_isa(), "avx2") == 0;
}

const keel_contract_backend *keel_contract_cpu_backend(void) {
    snprintf(g_cpu.chip, sizeof g_cpu.chip, "cpu-%s", host_has_avx2() ? "avx2" : "portable");
    return &g_cpu;
}

static bool path_available(const keel_contract_reg *reg, char *why, size_t cap) {
    if (strcmp(reg->path, "avx2") == 0 && !host_has_avx2()) {
        snprintf(why, cap, "the avx2 path needs AVX2, FMA and F16C, which this CPU lacks");
        return false;
    }
    return true;
}

/* Runs f with the registration's code path selected, then restores the default. */
#define WITH_PATH(reg, call)                                                                                 \
    do {                                                                                                     \
        keel_cpu_force_portable(strcmp((reg)->path, "portable") == 0);                                      \
        call;                                                                                                \
        keel_cpu_force_portable(false);                                                                      \
    } while (0)

static void launch_matmul(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_cpu_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}
static void launch_relu2(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    keel_cpu_relu2((float *)a->y, a->count);
}
static void twin_width4(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_contract_twin_width4_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}
static void twin_nobias(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_contract_twin_nobias_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}
static void twin_pastend(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_contract_twin_pastend_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}
static void twin_pastend_relu2(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    keel_contract_twin_pastend_relu2((float *)a->y, a->count);
}
static void twin_epiorder(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_contract_twin_epiorder_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}
static void twin_rowleak(const keel_contract_reg *reg, const keel_contract_args *a) {
    WITH_PATH(reg, keel_contract_twin_rowleak_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi));
}

static void add_control(keel_contract_reg *r, const char *name, int gate, keel_contract_launch_fn twin) {
    KEEL_ASSERT(r->n_controls < KEEL_CONTRACT_MAX_CONTROLS);
    r->controls[r->n_controls++] = (keel_contract_control){.name = name, .gate = gate, .twin = twin};
}

static const char *sdt_tag(keel_dtype dt) {
    return dt == KEEL_DT_BF16 ? "bf16" : dt == KEEL_DT_F16 ? "f16" : "f32";
}

/* Fields every keel_cpu_matmul registration shares. */
static keel_contract_reg *add_matmul(keel_contract_table *t, const char *path, keel_contract_family fam,
                                     keel_dtype sdt, keel_epilogue epi) {
    keel_contract_reg *r = keel_contract_table_add(t);
    r->be = &g_cpu;
    r->entry = "keel_cpu_matmul";
    r->path = path;
    r->family = fam;
    r->sdt = sdt;
    r->xdt = r->ydt = KEEL_DT_F32;
    r->epi = epi;
    r->rows_min = 1;
    r->rows_max = 8;
    r->tile_rows = 8; /* a pass of up to 8 rows of x shares one decode of one weight row */
    r->tile_cols = 1;
    r->launch = launch_matmul;
    r->available = path_available;
    add_control(r, "write-past-end", 2, twin_pastend);
    return r;
}

static const int BITS[] = {2, 3, 4, 5, 6, 8};
static const int GROUPS[] = {32, 64, 128};
static const keel_dtype SDTS[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};
static const char *const PATHS[] = {"avx2", "portable"};

int keel_contract_register_cpu(keel_contract_table *t) {
    const int before = t->n;
    keel_contract_cpu_backend();
    keel_contract_reg *r = keel_contract_table_add(t);
    snprintf(r->name, sizeof r->name, "cpu/scalar/relu2");
    r->be = &g_cpu;
    r->entry = "keel_cpu_relu2";
    r->path = "scalar";
    r->family = KEEL_CF_RELU2;
    r->xdt = r->ydt = r->sdt = KEEL_DT_F32;
    r->rows_min = r->rows_max = 1;
    r->tile_rows = r->tile_cols = 1;
    r->n_shapes = 3; /* elements: one, odd, and more than a cache line's worth */
    r->shapes[0] = (keel_contract_shape){.n = 1, .k = 0, .m_lo = 1, .m_hi = 1};
    r->shapes[1] = (keel_contract_shape){.n = 7, .k = 0, .m_lo = 1, .m_hi = 1};
    r->shapes[2] = (keel_contract_shape){.n = 37, .k = 0, .m_lo = 1, .m_hi = 1};
    r->launch = launch_relu2;
    r->available = path_available;
    add_control(r, "write-past-end", 2, twin_pastend_relu2);

    for (size_t pi = 0; pi < KEEL_ARRAY_LEN(PATHS); pi++) {
        if (strcmp(PATHS[pi], "avx2") == 0 && !host_has_avx2()) continue; /* not a kernel this chip launches */
        for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
            for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++)
                for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
                    for (int e = 0; e < 2; e++) {
                        const keel_epilogue epi = e ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                        r = add_matmul(t, PATHS[pi], KEEL_CF_STREAM, SDTS[si], epi);
                        const int G = GROUPS[gi];
                        r->bits = BITS[bi];
                        r->group = G;
                        snprintf(r->name, sizeof r->name, "cpu/%s/stream/q%dg%d/%s/%s", PATHS[pi], BITS[bi], G,
                                 sdt_tag(SDTS[si]), e ? "relu2" : "none");
                        /* smallest; k of one group and odd n; two groups, n = 9; 11 rows = a pass and a part */
                        r->n_shapes = 3;
                        r->shapes[0] = (keel_contract_shape){.n = 1, .k = G, .m_lo = 1, .m_hi = 1};
                        r->shapes[1] = (keel_contract_shape){.n = 5, .k = G, .m_lo = 1, .m_hi = 8};
                        r->shapes[2] = (keel_contract_shape){.n = 9, .k = 2 * G, .m_lo = 1, .m_hi = 11};
                        add_control(r, "bias-dropped", 3, twin_nobias);
                        if (BITS[bi] > 4) add_control(r, "width-as-4", 3, twin_width4);
                        add_control(r, "row-leak", 4, twin_rowleak);
                        if (epi == KEEL_EPI_RELU2) {
                            r->n_replaces = 2;
                            /* replaces[0], the plain tile of the same variant, is filled in below */
                            snprintf(r->replaces[1], sizeof r->replaces[1], "cpu/scalar/relu2");
                            r->same_order = true;
                            add_control(r, "epilogue-order", 4, twin_epiorder);
                        }
                    }
        for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
            for (int e = 0; e < 2; e++) {
                const keel_epilogue epi = e ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                r = add_matmul(t, PATHS[pi], KEEL_CF_FLOAT, SDTS[si], epi);
                snprintf(r->name, sizeof r->name, "cpu/%s/stream/float/%s/%s", PATHS[pi], sdt_tag(SDTS[si]),
                         e ? "relu2" : "none");
                /* k = 1 (all tail), 13 (a chunk and a tail), 40 (whole chunks); odd n throughout */
                r->n_shapes = 3;
                r->shapes[0] = (keel_contract_shape){.n = 1, .k = 1, .m_lo = 1, .m_hi = 1};
                r->shapes[1] = (keel_contract_shape){.n = 5, .k = 13, .m_lo = 1, .m_hi = 8};
                r->shapes[2] = (keel_contract_shape){.n = 9, .k = 40, .m_lo = 1, .m_hi = 11};
                add_control(r, "row-leak", 4, twin_rowleak);
                if (epi == KEEL_EPI_RELU2) {
                    r->n_replaces = 2;
                    snprintf(r->replaces[1], sizeof r->replaces[1], "cpu/scalar/relu2");
                    r->same_order = true;
                    add_control(r, "epilogue-order", 4, twin_epiorder);
                }
            }
    }
    /* A fused tile replaces the plain tile of the same variant (the registration just before it), then relu2. */
    for (int i = before; i < t->n; i++) {
        keel_contract_reg *f = &t->regs[i];
        if (f->n_replaces == 2 && f->replaces[0][0] == '\0')
            snprintf(f->replaces[0], sizeof f->replaces[0], "%s", t->regs[i - 1].name);
    }
    return t->n - before;
}
