/* contract: the CUDA backend (device buffers from a pool, src/contract/cuda_hooks.cu) and the table of every CUDA
 * kernel keel launches (src/kernels/cuda/cuda.h):
 *   keel_cuda_stream_matmul: width {2,3,4,5,6,8} x group {32,64,128} x scale dtype {BF16,F16,F32} x activation
 *     {BF16,F16} x output {F32,BF16} x epilogue {none,relu2}; each serves m = 1..8 and is run at every m;
 *   keel_cuda_stream_matmul_rows (up to 256 rows in 8-row groups): every width, group 64, BF16 scales, both
 *     activations, both outputs, both epilogues, run at m = 1..20 (three groups, the last partial) on a split k;
 *   keel_cuda_stream_matmul_packed: width x group x BF16 scales x activation {BF16,F16} x (F32 and BF16 plain, F32
 *     fused relu2), each held to the ring tile's bits (gate 4), on a packed copy of the case's matrix made
 *     once per case (packed_of), with shapes that walk k in quarters and halves (gates 1-3, their roundings in the bound);
 *     controls from its own twin (twin_cuda_packed.cu);
 *   keel_cuda_relu2: F32 and BF16;
 *   keel_cuda_stream_experts_up (fused relu2, and plain) and keel_cuda_stream_experts_down: every width and group,
 *     BF16 scales, both activations and outputs, with what they replace (cuda_routed.c runs their gates).
 * Controls come from one twin of stream.cu (twin_cuda_stream.cu) with one fault armed per launch.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"

#if defined(KEEL_HAVE_CUDA)
#include "cuda_twin.h"
#endif

/* Launch entry points the CUDA table registers (checked against launch sites in every build). */
const char *const keel_contract_cuda_entries[] = {"keel_cuda_stream_matmul", "keel_cuda_relu2",
                                                  "keel_cuda_stream_experts_up", "keel_cuda_stream_experts_down",
                                                  "keel_cuda_stream_matmul_rows", "keel_cuda_stream_matmul_packed",
                                                  NULL};

#if defined(KEEL_HAVE_CUDA)

/* The twin's many-row launcher (twin_cuda_stream.cu; same contract as keel_cuda_stream_matmul_rows). */
void keel_contract_twin_cuda_stream_matmul_rows(const keel_cuda_qw *W, const void *x, keel_dtype xdt, int m, void *y,
                                                keel_dtype ydt, keel_epilogue epi, void *stream);
static const char ROWS_ENTRY[] = "keel_cuda_stream_matmul_rows";

static bool cuda_sync(char *why, size_t cap) { return keel_contract_cuda_sync(why, cap); }

static keel_contract_backend g_cuda = {.name = "cuda", .alloc = keel_contract_cuda_alloc,
                                       .release = keel_contract_cuda_release, .upload = keel_contract_cuda_upload,
                                       .download = keel_contract_cuda_download, .sync = cuda_sync};

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

/* ---- launches ---------------------------------------------------------------------------------------- */

/* The registration's matrix as the launchers take it; routed: experts stacked, n rows each. */
static keel_cuda_qw qw_of(const keel_contract_reg *reg, const keel_contract_args *a) {
    const int E = reg->experts > 0 ? reg->experts : 1, n = a->W.n / E;
    return (keel_cuda_qw){.w = a->W.w, .scales = a->W.scales, .biases = a->W.biases, .n = n, .k = a->W.k,
                          .bits = a->W.bits, .group = a->W.group, .sdt = a->W.sdt,
                          .expert_words = E > 1 ? (int64_t)n * (int64_t)keel_quant_row_words(a->W.k, a->W.bits) : 0,
                          .expert_groups = E > 1 ? (int64_t)n * (a->W.k / a->W.group) : 0,
                          .items = KEEL_CONTRACT_ITEMS_OF(reg)};
}

static void launch_stream(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_qw w = qw_of(reg, a);
    keel_cuda_stream_matmul(&w, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
}
static void launch_rows(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_qw w = qw_of(reg, a);
    keel_cuda_stream_matmul_rows(&w, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
}
static void launch_relu2(const keel_contract_reg *reg, const keel_contract_args *a) {
    keel_cuda_relu2(a->y, reg->ydt, a->count, NULL);
}
static void launch_up(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_qw w = qw_of(reg, a);
    keel_cuda_stream_experts_up(&w, a->x, reg->xdt, a->m, (const keel_cuda_route *)a->items, a->n_items, a->y,
                                reg->ydt, reg->epi, NULL);
}
static void launch_down(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_qw w = qw_of(reg, a);
    keel_cuda_stream_experts_down(&w, a->x, reg->xdt, a->m, (const keel_cuda_route *)a->items, a->weights,
                                  a->n_items, a->y, reg->ydt, NULL);
}

/* The twin with one fault armed, launched as the kernel would be. */
static void twin_launch(int fault, const keel_contract_reg *reg, const keel_contract_args *a) {
    keel_contract_cuda_twin_arm(fault);
    const keel_cuda_qw w = qw_of(reg, a);
    switch (reg->family) {
    case KEEL_CF_STREAM:
        if (!strcmp(reg->entry, ROWS_ENTRY))
            keel_contract_twin_cuda_stream_matmul_rows(&w, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
        else
            keel_contract_twin_cuda_stream_matmul(&w, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
        break;
    case KEEL_CF_RELU2: keel_contract_twin_cuda_relu2(a->y, reg->ydt, a->count, NULL); break;
    case KEEL_CF_ROUTED_UP:
        keel_contract_twin_cuda_stream_experts_up(&w, a->x, reg->xdt, a->m, (const keel_cuda_route *)a->items,
                                                  a->n_items, a->y, reg->ydt, reg->epi, NULL);
        break;
    case KEEL_CF_ROUTED_DOWN:
        keel_contract_twin_cuda_stream_experts_down(&w, a->x, reg->xdt, a->m, (const keel_cuda_route *)a->items,
                                                    a->weights, a->n_items, a->y, reg->ydt, NULL);
        break;
    default: KEEL_ASSERTF(false, "no CUDA twin for family %d", (int)reg->family);
    }
    keel_contract_cuda_twin_arm(KEEL_CONTRACT_PLANT_NONE);
}
static void twin_width4(const keel_contract_reg *r, const keel_contract_args *a) { twin_launch(KEEL_CONTRACT_PLANT_WIDTH4, r, a); }
static void twin_nobias(const keel_contract_reg *r, const keel_contract_args *a) { twin_launch(KEEL_CONTRACT_PLANT_NOBIAS, r, a); }
static void twin_pastend(const keel_contract_reg *r, const keel_contract_args *a) { twin_launch(KEEL_CONTRACT_PLANT_PASTEND, r, a); }
static void twin_epiorder(const keel_contract_reg *r, const keel_contract_args *a) { twin_launch(KEEL_CONTRACT_PLANT_EPIORDER, r, a); }
static void twin_rowleak(const keel_contract_reg *r, const keel_contract_args *a) { twin_launch(KEEL_CONTRACT_PLANT_ROWLEAK, r, a); }

/* The packed copy of the matrix the last packed launch ran on, kept while its source buffers' stamps and its shape
 * stay the same (a generated case launches the same matrix for every m, gate and control). */
static struct {
    keel_cuda_pw pw;
    const void *w, *scales, *biases;
    unsigned long long stamp[3];
} g_pk;

static const keel_cuda_pw *packed_of(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_qw w = qw_of(reg, a);
    const unsigned long long st[3] = {keel_contract_cuda_stamp(w.w), keel_contract_cuda_stamp(w.scales),
                                      keel_contract_cuda_stamp(w.biases)};
    if (g_pk.pw.w && g_pk.w == w.w && g_pk.scales == w.scales && g_pk.biases == w.biases && g_pk.pw.n == w.n &&
        g_pk.pw.k == w.k && g_pk.pw.bits == w.bits && g_pk.pw.group == w.group && g_pk.pw.sdt == w.sdt &&
        !memcmp(g_pk.stamp, st, sizeof st))
        return &g_pk.pw;
    keel_cuda_free((void *)g_pk.pw.w);
    char why[256] = "";
    KEEL_ASSERTF(keel_cuda_pack_upload_qw(&w, &g_pk.pw, why, sizeof why), "%s: %s", reg->name, why);
    g_pk.w = w.w, g_pk.scales = w.scales, g_pk.biases = w.biases;
    memcpy(g_pk.stamp, st, sizeof st);
    return &g_pk.pw;
}

/* The packed tile on the packed copy of the registration's matrix: the kernel or its twin with one fault armed. */
static void packed_run(bool twin, int fault, const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_pw *pw = packed_of(reg, a);
    if (twin) {
        keel_contract_cuda_twin_packed_arm(fault);
        keel_contract_twin_cuda_stream_matmul_packed(pw, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
        keel_contract_cuda_twin_packed_arm(KEEL_CONTRACT_PLANT_NONE);
    } else {
        keel_cuda_stream_matmul_packed(pw, a->x, reg->xdt, a->m, a->y, reg->ydt, reg->epi, NULL);
    }
}
static void launch_packed(const keel_contract_reg *r, const keel_contract_args *a) { packed_run(false, 0, r, a); }
static void pk_width4(const keel_contract_reg *r, const keel_contract_args *a) { packed_run(true, KEEL_CONTRACT_PLANT_WIDTH4, r, a); }
static void pk_nobias(const keel_contract_reg *r, const keel_contract_args *a) { packed_run(true, KEEL_CONTRACT_PLANT_NOBIAS, r, a); }
static void pk_pastend(const keel_contract_reg *r, const keel_contract_args *a) { packed_run(true, KEEL_CONTRACT_PLANT_PASTEND, r, a); }
static void pk_rowleak(const keel_contract_reg *r, const keel_contract_args *a) { packed_run(true, KEEL_CONTRACT_PLANT_ROWLEAK, r, a); }

/* Gate 1 of the packed tile: an image for this device that fits its limits; gate 4 holds it to the ring tile bit for
 * bit on its last shape, which must then not k-split in the ring tile here; its halves and quarters shapes must split
 * so here. */
static bool packed_available(const keel_contract_reg *reg, char *why, size_t cap) {
    if (!keel_contract_cuda_packed_probe(reg->bits, reg->xdt == KEEL_DT_F16, why, cap)) return false;
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    if (keel_cuda_stream_splits(s->n, s->k, 0) != 1) {
        snprintf(why, cap, "its gate-4 shape n=%d k=%d splits in the ring tile on this device", s->n, s->k);
        return false;
    }
    const keel_contract_shape *h = &reg->shapes[reg->n_shapes - 2];
    if (keel_cuda_packed_splits(h->n, h->k) != 2) {
        snprintf(why, cap, "its halves shape n=%d k=%d does not split on this device", h->n, h->k);
        return false;
    }
    const keel_contract_shape *qs = &reg->shapes[reg->n_shapes - 4];
    if (keel_cuda_packed_splits(qs->n, qs->k) != 4) {
        snprintf(why, cap, "its quarters shape n=%d k=%d does not split in four on this device", qs->n, qs->k);
        return false;
    }
    return true;
}
static int packed_splits(int n, int k, int items) { return (void)items, keel_cuda_packed_splits(n, k); }

/* Gate 1: the tile has an image for this device and fits its limits; a registration that claims a k-split shape
 * must really split here (else its coverage claim is false on this chip). */
static bool tile_available(const keel_contract_reg *reg, char *why, size_t cap) {
    if (!keel_contract_cuda_probe(reg->bits, reg->xdt == KEEL_DT_F16, why, cap)) return false;
    const keel_contract_shape *s = &reg->shapes[reg->n_shapes - 1];
    if (keel_cuda_stream_splits(s->n, s->k, KEEL_CONTRACT_ITEMS_OF(reg)) < 2) {
        snprintf(why, cap, "its k-split shape n=%d k=%d does not split on this device", s->n, s->k);
        return false;
    }
    return true;
}

/* ---- the table --------------------------------------------------------------------------------------- */

static void add_control(keel_contract_reg *r, const char *name, int gate, keel_contract_launch_fn twin) {
    KEEL_ASSERT(r->n_controls < KEEL_CONTRACT_MAX_CONTROLS);
    r->controls[r->n_controls++] = (keel_contract_control){.name = name, .gate = gate, .twin = twin};
}

static const char *dt_tag(keel_dtype dt) { return dt == KEEL_DT_BF16 ? "bf16" : dt == KEEL_DT_F16 ? "f16" : "f32"; }

static void stream_name(char *out, size_t cap, const char *family, int bits, int group, keel_dtype sdt,
                        keel_dtype xdt, keel_dtype ydt, keel_epilogue epi) {
    snprintf(out, cap, "cuda/mma/%s/q%dg%d/%s/x%s-y%s/%s", family, bits, group, dt_tag(sdt), dt_tag(xdt),
             dt_tag(ydt), epi == KEEL_EPI_RELU2 ? "relu2" : "none");
}

static const int BITS[] = {2, 3, 4, 5, 6, 8};
static const int GROUPS[] = {32, 64, 128};
static const keel_dtype SDTS[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32};
static const keel_dtype XDTS[] = {KEEL_DT_BF16, KEEL_DT_F16};
static const keel_dtype YDTS[] = {KEEL_DT_F32, KEEL_DT_BF16};
#define KSPLIT_K 2176 /* 17 groups of 128: the k-split shape (a multiple of every group) */
#define EXPERTS 4     /* routed registrations: experts stacked in W, two per token */

/* Fields every tile registration (plain or routed) shares; the controls every tile gets. */
static keel_contract_reg *add_tile(keel_contract_table *t, keel_contract_family fam, int bits, int G, keel_dtype sdt,
                                   keel_dtype xdt, keel_dtype ydt, keel_epilogue epi) {
    keel_contract_reg *r = keel_contract_table_add(t);
    r->be = &g_cuda;
    r->path = "mma";
    r->family = fam;
    r->bits = bits, r->group = G, r->sdt = sdt, r->xdt = xdt, r->ydt = ydt, r->epi = epi;
    r->rows_min = 1;
    r->rows_max = KEEL_CUDA_STREAM_MAX_ROWS;
    r->tile_rows = 64; /* a block: 4 warps x 16 rows of W (the mma m side) */
    r->tile_cols = KEEL_CUDA_STREAM_MAX_ROWS; /* the 8 activation rows (the mma n side) */
    r->arith = KEEL_CA_MMA;
    r->splits = keel_cuda_stream_splits;
    r->available = tile_available;
    /* smallest; k of one group, odd n; n past a 64-row block, two groups; the k-split shape */
    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 1, .k = G, .m_lo = 1, .m_hi = 1};
    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 5, .k = G, .m_lo = 1, .m_hi = 8};
    if (fam == KEEL_CF_STREAM) r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 67, .k = 2 * G, .m_lo = 1, .m_hi = 8};
    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 9, .k = KSPLIT_K, .m_lo = 1, .m_hi = 8};
    add_control(r, "write-past-end", 2, twin_pastend);
    add_control(r, "bias-dropped", 3, twin_nobias);
    if (bits > 4) add_control(r, "width-as-4", 3, twin_width4);
    /* fp32 outputs only: a leak that bf16 rounding shows is larger than the gate-3 slack, so it goes red at gate 3
     * (seen on the H200); the fp32 twin of every bf16 registration carries this control */
    if (ydt == KEEL_DT_F32) add_control(r, "row-leak", 4, twin_rowleak);
    /* fused relu2 against a sequence compared bit for bit (fp32 output): its order is what gate 4 pins */
    if (epi == KEEL_EPI_RELU2 && ydt == KEEL_DT_F32) add_control(r, "epilogue-order", 4, twin_epiorder);
    return r;
}

int keel_contract_register_cuda(keel_contract_table *t) {
    const int before = t->n;
    for (size_t yi = 0; yi < KEEL_ARRAY_LEN(YDTS); yi++) {
        keel_contract_reg *r = keel_contract_table_add(t);
        snprintf(r->name, sizeof r->name, "cuda/elementwise/relu2/%s", dt_tag(YDTS[yi]));
        r->be = &g_cuda;
        r->entry = "keel_cuda_relu2";
        r->path = "elementwise";
        r->family = KEEL_CF_RELU2;
        r->xdt = r->ydt = r->sdt = YDTS[yi];
        r->rows_min = r->rows_max = 1;
        r->tile_rows = 256, r->tile_cols = 1; /* a block of 256 threads, grid-stride */
        r->n_shapes = 3;
        r->shapes[0] = (keel_contract_shape){.n = 1, .m_lo = 1, .m_hi = 1};
        r->shapes[1] = (keel_contract_shape){.n = 7, .m_lo = 1, .m_hi = 1};
        r->shapes[2] = (keel_contract_shape){.n = 300, .m_lo = 1, .m_hi = 1}; /* more than one block */
        r->launch = launch_relu2;
        add_control(r, "write-past-end", 2, twin_pastend);
    }
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++)
            for (size_t si = 0; si < KEEL_ARRAY_LEN(SDTS); si++)
                for (size_t xi = 0; xi < KEEL_ARRAY_LEN(XDTS); xi++)
                    for (size_t yi = 0; yi < KEEL_ARRAY_LEN(YDTS); yi++)
                        for (int e = 0; e < 2; e++) {
                            const keel_epilogue epi = e ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                            keel_contract_reg *r = add_tile(t, KEEL_CF_STREAM, BITS[bi], GROUPS[gi], SDTS[si], XDTS[xi],
                                                            YDTS[yi], epi);
                            r->entry = "keel_cuda_stream_matmul";
                            r->launch = launch_stream;
                            stream_name(r->name, sizeof r->name, "stream", r->bits, r->group, r->sdt, r->xdt, r->ydt,
                                        epi);
                            if (epi == KEEL_EPI_RELU2) { /* the plain tile of the same variant, then relu2 */
                                r->n_replaces = 2;
                                stream_name(r->replaces[0], sizeof r->replaces[0], "stream", r->bits, r->group, r->sdt,
                                            r->xdt, r->ydt, KEEL_EPI_NONE);
                                snprintf(r->replaces[1], sizeof r->replaces[1], "cuda/elementwise/relu2/%s",
                                         dt_tag(r->ydt));
                                /* fp32: relu2 of the same fp32 value; bf16: the sequence rounds before squaring */
                                r->same_order = r->ydt == KEEL_DT_F32;
                            }
                        }
    /* Many-row launches: group 64, BF16 scales (the tile's code is the plain one's; what is new is the 8-row
     * groups as grid items, which gate 4 holds to row independence). Up to 8 rows it is the plain launch. */
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t xi = 0; xi < KEEL_ARRAY_LEN(XDTS); xi++)
            for (size_t yi = 0; yi < KEEL_ARRAY_LEN(YDTS); yi++)
                for (int e = 0; e < 2; e++) {
                    const keel_epilogue epi = e ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                    keel_contract_reg *r = add_tile(t, KEEL_CF_STREAM, BITS[bi], 64, KEEL_DT_BF16, XDTS[xi], YDTS[yi], epi);
                    r->entry = ROWS_ENTRY;
                    r->launch = launch_rows;
                    r->rows_max = KEEL_CUDA_STREAM_ROWS_MAX;
                    stream_name(r->name, sizeof r->name, "rows", r->bits, r->group, r->sdt, r->xdt, r->ydt, epi);
                    /* one group; three 8-row groups (the last partial) over a split k past a 64-row block; the
                     * plain tile's k-split shape (the fused sequence runs there, at m <= 8) */
                    r->n_shapes = 0;
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 1, .k = 64, .m_lo = 1, .m_hi = 1};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 67, .k = 1152, .m_lo = 1, .m_hi = 20};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 9, .k = KSPLIT_K, .m_lo = 1, .m_hi = 8};
                    if (epi == KEEL_EPI_RELU2) { /* the plain tile of the same variant, then relu2 */
                        r->n_replaces = 2;
                        stream_name(r->replaces[0], sizeof r->replaces[0], "stream", r->bits, r->group, r->sdt,
                                    r->xdt, r->ydt, KEEL_EPI_NONE);
                        snprintf(r->replaces[1], sizeof r->replaces[1], "cuda/elementwise/relu2/%s", dt_tag(r->ydt));
                        r->same_order = r->ydt == KEEL_DT_F32;
                    }
                }
    /* Packed tiles: every width and group, BF16 scales (keel_cuda_pack refuses others), both activations; fp32 and
     * bf16 plain, fp32 fused relu2.
     * Gate 4: equal bit for bit to the ring tile of the same variant (fused: the ring tile then relu2). */
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++)
            for (size_t xi = 0; xi < KEEL_ARRAY_LEN(XDTS); xi++)
                for (int e = 0; e < 3; e++) {
                    const keel_epilogue epi = e == 1 ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                    const keel_dtype ydt = e == 2 ? KEEL_DT_BF16 : KEEL_DT_F32;
                    const int G = GROUPS[gi];
                    keel_contract_reg *r = keel_contract_table_add(t);
                    r->be = &g_cuda;
                    r->path = "mma";
                    r->family = KEEL_CF_STREAM;
                    r->bits = BITS[bi], r->group = G, r->sdt = KEEL_DT_BF16, r->xdt = XDTS[xi], r->ydt = ydt;
                    r->epi = epi;
                    r->rows_min = 1;
                    r->rows_max = KEEL_CUDA_STREAM_MAX_ROWS;
                    r->tile_rows = 16; /* a warp's tile: 16 rows of W (the mma m side) */
                    r->tile_cols = KEEL_CUDA_STREAM_MAX_ROWS;
                    r->arith = KEEL_CA_MMA;
                    r->available = packed_available;
                    r->entry = "keel_cuda_stream_matmul_packed";
                    r->launch = launch_packed;
                    stream_name(r->name, sizeof r->name, "packed", r->bits, G, r->sdt, r->xdt, r->ydt, epi);
                    r->splits = packed_splits;
                    /* smallest; one group past a tile, odd n; k past whole spans; several tiles a warp and two
                     * x-chunks at m = 8 (k 3200 > 3072); k in quarters (128 spans, two tiles a warp where the
                     * width allows pairs) and in halves (66 spans) at m = 1 (whole x) and m = 8 (x-chunks,
                     * several a part); the gate-4 shape (no k-split in the ring tile) */
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 1, .k = G, .m_lo = 1, .m_hi = 1};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 17, .k = G, .m_lo = 1, .m_hi = 8};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 300, .k = 3200, .m_lo = 7, .m_hi = 8};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 33, .k = 16384, .m_lo = 1, .m_hi = 1};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 33, .k = 16384, .m_lo = 8, .m_hi = 8};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 33, .k = 8448, .m_lo = 1, .m_hi = 1};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 33, .k = 8448, .m_lo = 8, .m_hi = 8};
                    r->shapes[r->n_shapes++] = (keel_contract_shape){.n = 67, .k = 3 * G, .m_lo = 1, .m_hi = 8};
                    r->n_replaces = epi == KEEL_EPI_RELU2 ? 2 : 1;
                    stream_name(r->replaces[0], sizeof r->replaces[0], "stream", r->bits, G, r->sdt, r->xdt,
                                r->ydt, KEEL_EPI_NONE);
                    if (epi == KEEL_EPI_RELU2)
                        snprintf(r->replaces[1], sizeof r->replaces[1], "cuda/elementwise/relu2/%s", dt_tag(ydt));
                    r->same_order = true; /* fp32 relu2 of the same fp32 sums */
                    add_control(r, "write-past-end", 2, pk_pastend);
                    add_control(r, "bias-dropped", 3, pk_nobias);
                    if (r->bits > 4) add_control(r, "width-as-4", 3, pk_width4);
                    if (ydt == KEEL_DT_F32) add_control(r, "row-leak", 4, pk_rowleak);
                }
    /* Routed tiles: BF16 scales (the scale load is the plain tile's code, covered above for every dtype). */
    for (size_t bi = 0; bi < KEEL_ARRAY_LEN(BITS); bi++)
        for (size_t gi = 0; gi < KEEL_ARRAY_LEN(GROUPS); gi++)
            for (size_t xi = 0; xi < KEEL_ARRAY_LEN(XDTS); xi++)
                for (size_t yi = 0; yi < KEEL_ARRAY_LEN(YDTS); yi++)
                    for (int kind = 0; kind < 3; kind++) { /* fc1 fused relu2, fc1 plain (group 64 only), fc2 */
                        if (kind == 1 && GROUPS[gi] != 64) continue;
                        const keel_contract_family fam = kind < 2 ? KEEL_CF_ROUTED_UP : KEEL_CF_ROUTED_DOWN;
                        const keel_epilogue epi = kind == 0 ? KEEL_EPI_RELU2 : KEEL_EPI_NONE;
                        keel_contract_reg *r = add_tile(t, fam, BITS[bi], GROUPS[gi], KEEL_DT_BF16, XDTS[xi], YDTS[yi],
                                                        epi);
                        r->experts = EXPERTS;
                        r->run = keel_contract_run_routed;
                        r->entry = fam == KEEL_CF_ROUTED_UP ? "keel_cuda_stream_experts_up" : "keel_cuda_stream_experts_down";
                        r->launch = fam == KEEL_CF_ROUTED_UP ? launch_up : launch_down;
                        stream_name(r->name, sizeof r->name, fam == KEEL_CF_ROUTED_UP ? "routed-up" : "routed-down",
                                    r->bits, r->group, r->sdt, r->xdt, r->ydt, epi);
                        /* per item the plain tile (fc2: fp32 out, then the weighted sum), fused fc1 then relu2 */
                        r->n_replaces = epi == KEEL_EPI_RELU2 ? 2 : 1;
                        stream_name(r->replaces[0], sizeof r->replaces[0], "stream", r->bits, r->group, r->sdt, r->xdt,
                                    fam == KEEL_CF_ROUTED_DOWN ? KEEL_DT_F32 : r->ydt, KEEL_EPI_NONE);
                        if (epi == KEEL_EPI_RELU2)
                            snprintf(r->replaces[1], sizeof r->replaces[1], "cuda/elementwise/relu2/%s", dt_tag(r->ydt));
                        /* bit for bit on every shape whose k-split both sides share (cuda_routed.c checks per shape) */
                        r->same_order = !(epi == KEEL_EPI_RELU2 && r->ydt != KEEL_DT_F32);
                    }
    return t->n - before;
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
