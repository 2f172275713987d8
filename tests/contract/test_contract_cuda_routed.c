/* The routed gates (src/contract/cuda_routed.c, which run the CUDA experts_up/experts_down registrations) proven
 * on any host: routed fc1/fc2 written here from keel_cpu_matmul on the CPU backend (fp32 activations) pass gates
 * 1-4, and routed kernels with one fault each go red at the gate that fault belongs to: a write outside an
 * item's token mask (2), an unselected routing weight read (3), the items summed in reverse order (4, within the
 * bound), a token's result leaking into the next token's (4). Then the CUDA table's structure: every tile variant
 * registered, each with its controls, and every replaced registration present and compatible. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "contract/contract.h"
#include "kernels/cuda/cuda.h"

typedef enum fault { F_NONE, F_OUTSIDE_MASK, F_READ_UNSELECTED, F_REVERSE, F_LEAK } fault;
static fault g_fault;

/* W's rows of expert e (n rows each) as a matrix of its own. */
static keel_qmat expert(const keel_contract_args *a, int E, int e) {
    keel_qmat w = a->W;
    w.n = a->W.n / E;
    const size_t words = keel_quant_row_words(w.k, w.bits), sb = keel_dtype_size(w.sdt) * (size_t)(w.k / w.group);
    w.w = a->W.w + (size_t)e * (size_t)w.n * words;
    w.scales = (const uint8_t *)a->W.scales + (size_t)e * (size_t)w.n * sb;
    w.biases = (const uint8_t *)a->W.biases + (size_t)e * (size_t)w.n * sb;
    return w;
}

static void launch_plain(const keel_contract_reg *reg, const keel_contract_args *a) {
    keel_cpu_matmul(&a->W, (const float *)a->x, a->m, (float *)a->y, reg->epi);
}
static void launch_relu2(const keel_contract_reg *reg, const keel_contract_args *a) {
    (void)reg;
    keel_cpu_relu2((float *)a->y, a->count);
}

static void launch_up(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_route *it = a->items;
    const int m = a->m, n = a->W.n / reg->experts;
    float *tmp = keel_xmalloc((size_t)m * (size_t)n * sizeof(float));
    for (int i = 0; i < a->n_items; i++) {
        const keel_qmat w = expert(a, reg->experts, it[i].expert);
        keel_cpu_matmul(&w, (const float *)a->x, m, tmp, reg->epi);
        for (int r = 0; r < m; r++) {
            const bool sel = (it[i].mask >> r) & 1u;
            if (!sel && !(g_fault == F_OUTSIDE_MASK && i == 0)) continue;
            float *row = (float *)a->y + ((size_t)i * (size_t)m + (size_t)r) * (size_t)n;
            for (int j = 0; j < n; j++) {
                float v = tmp[(size_t)r * (size_t)n + (size_t)j];
                if (g_fault == F_LEAK && r % 2 == 1) { /* a trace of the token before, inside the bound */
                    const float p = tmp[(size_t)(r - 1) * (size_t)n + (size_t)j];
                    v += copysignf(fminf(fabsf(v), fabsf(p)) * 0x1p-22f, p);
                }
                row[j] = v;
            }
        }
    }
    free(tmp);
}

static void launch_down(const keel_contract_reg *reg, const keel_contract_args *a) {
    const keel_cuda_route *it = a->items;
    const int m = a->m, n = a->W.n / reg->experts, k = a->W.k;
    float *tmp = keel_xmalloc((size_t)m * (size_t)n * sizeof(float));
    float *tot = keel_xcalloc((size_t)m * (size_t)n, sizeof(float));
    for (int s = 0; s < a->n_items; s++) {
        const int i = g_fault == F_REVERSE ? a->n_items - 1 - s : s;
        const keel_qmat w = expert(a, reg->experts, it[i].expert);
        keel_cpu_matmul(&w, (const float *)a->x + (size_t)i * (size_t)m * (size_t)k, m, tmp, KEEL_EPI_NONE);
        for (int r = 0; r < m; r++) {
            const bool sel = (it[i].mask >> r) & 1u;
            if (!sel && g_fault != F_READ_UNSELECTED) continue;
            for (int j = 0; j < n; j++) {
                const size_t o = (size_t)r * (size_t)n + (size_t)j;
                tot[o] = fmaf(a->weights[i * 8 + r], tmp[o], tot[o]);
            }
        }
    }
    memcpy(a->y, tot, (size_t)m * (size_t)n * sizeof(float));
    free(tmp), free(tot);
}

static void with_fault(fault f, const keel_contract_reg *reg, const keel_contract_args *a) {
    g_fault = f;
    (reg->family == KEEL_CF_ROUTED_UP ? launch_up : launch_down)(reg, a);
    g_fault = F_NONE;
}
static void twin_outside(const keel_contract_reg *r, const keel_contract_args *a) { with_fault(F_OUTSIDE_MASK, r, a); }
static void twin_unselected(const keel_contract_reg *r, const keel_contract_args *a) { with_fault(F_READ_UNSELECTED, r, a); }
static void twin_reverse(const keel_contract_reg *r, const keel_contract_args *a) { with_fault(F_REVERSE, r, a); }
static void twin_leak(const keel_contract_reg *r, const keel_contract_args *a) { with_fault(F_LEAK, r, a); }

/* A CPU table: the plain tile and relu2 (what the routed kernels replace) and routed fc1 (relu2) and fc2. */
static void cpu_table(keel_contract_table *t, int bits, int G) {
    const keel_contract_backend *be = keel_contract_cpu_backend();
    keel_contract_reg *r = keel_contract_table_add(t);
    *r = (keel_contract_reg){.be = be, .entry = "keel_cpu_matmul", .path = "test", .family = KEEL_CF_STREAM,
                             .bits = bits, .group = G, .sdt = KEEL_DT_BF16, .xdt = KEEL_DT_F32, .ydt = KEEL_DT_F32,
                             .rows_min = 1, .rows_max = 8, .launch = launch_plain, .n_shapes = 1};
    snprintf(r->name, sizeof r->name, "cpu/test/stream/q%dg%d", bits, G);
    r->shapes[0] = (keel_contract_shape){.n = 5, .k = G, .m_lo = 1, .m_hi = 8};
    r = keel_contract_table_add(t);
    *r = (keel_contract_reg){.be = be, .entry = "keel_cpu_relu2", .path = "test", .family = KEEL_CF_RELU2,
                             .xdt = KEEL_DT_F32, .ydt = KEEL_DT_F32, .sdt = KEEL_DT_F32, .launch = launch_relu2,
                             .n_shapes = 1};
    snprintf(r->name, sizeof r->name, "cpu/test/relu2");
    r->shapes[0] = (keel_contract_shape){.n = 7, .m_lo = 1, .m_hi = 1};
    for (int down = 0; down < 2; down++) {
        r = keel_contract_table_add(t);
        *r = (keel_contract_reg){.be = be, .entry = "test", .path = "test",
                                 .family = down ? KEEL_CF_ROUTED_DOWN : KEEL_CF_ROUTED_UP, .bits = bits, .group = G,
                                 .sdt = KEEL_DT_BF16, .xdt = KEEL_DT_F32, .ydt = KEEL_DT_F32,
                                 .epi = down ? KEEL_EPI_NONE : KEEL_EPI_RELU2, .rows_min = 1, .rows_max = 8,
                                 .arith = KEEL_CA_MMA, .experts = 4, .run = keel_contract_run_routed,
                                 .launch = down ? launch_down : launch_up, .same_order = !down, .n_shapes = 3};
        snprintf(r->name, sizeof r->name, "cpu/test/routed-%s", down ? "down" : "up");
        r->shapes[0] = (keel_contract_shape){.n = 1, .k = G, .m_lo = 1, .m_hi = 1};
        r->shapes[1] = (keel_contract_shape){.n = 5, .k = G, .m_lo = 1, .m_hi = 8};
        r->shapes[2] = (keel_contract_shape){.n = 9, .k = 3 * G, .m_lo = 1, .m_hi = 8};
        r->n_replaces = down ? 1 : 2;
        snprintf(r->replaces[0], sizeof r->replaces[0], "cpu/test/stream/q%dg%d", bits, G);
        if (!down) snprintf(r->replaces[1], sizeof r->replaces[1], "cpu/test/relu2");
    }
}

static void test_routed_gates_pass_and_catch(void **state) {
    (void)state;
    const int cfg[][2] = {{4, 32}, {5, 64}, {8, 128}, {3, 64}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        keel_contract_table t;
        keel_contract_table_init(&t);
        cpu_table(&t, cfg[c][0], cfg[c][1]);
        for (int i = 2; i < 4; i++) {
            const keel_contract_reg *reg = &t.regs[i];
            keel_contract_result res;
            keel_contract_run(&t, reg, reg->launch, 4, &res);
            if (res.first_red) fail_msg("%s q%dg%d: red at gate %d: %s", reg->name, reg->bits, reg->group,
                                        res.first_red, res.gate[res.first_red].detail);
            assert_true(res.gate[3].bound_at_max > 0 && res.gate[3].frac <= 1);
            const struct {
                keel_contract_launch_fn twin;
                int gate;
                bool down_only, up_only;
            } faults[] = {{twin_outside, 2, false, true}, {twin_unselected, 3, true, false},
                          {twin_reverse, 4, true, false}, {twin_leak, 4, false, true}};
            for (size_t f = 0; f < sizeof faults / sizeof faults[0]; f++) {
                const bool down = reg->family == KEEL_CF_ROUTED_DOWN;
                if ((faults[f].down_only && !down) || (faults[f].up_only && down)) continue;
                keel_contract_run(&t, reg, faults[f].twin, 4, &res);
                if (res.first_red != faults[f].gate)
                    fail_msg("%s q%dg%d fault %zu: red at gate %d, planted for %d (%s)", reg->name, reg->bits,
                             reg->group, f, res.first_red, faults[f].gate,
                             res.first_red ? res.gate[res.first_red].detail : "passed");
            }
        }
        keel_contract_table_free(&t);
    }
}

/* A routed registration whose replaced registration is missing fails gate 4 saying so. */
static void test_routed_missing_replaced(void **state) {
    (void)state;
    keel_contract_table t;
    keel_contract_table_init(&t);
    cpu_table(&t, 4, 64);
    snprintf(t.regs[2].replaces[0], sizeof t.regs[2].replaces[0], "cpu/test/stream/q9g64");
    keel_contract_result res;
    keel_contract_run(&t, &t.regs[2], t.regs[2].launch, 4, &res);
    assert_int_equal(res.first_red, 4);
    assert_non_null(strstr(res.gate[4].detail, "cpu/test/stream/q9g64, which is not registered"));
    keel_contract_table_free(&t);
}

/* The CUDA table (built without touching a device): every variant, its controls, its replaced registrations. */
static void test_cuda_table(void **state) {
    (void)state;
    keel_contract_table t;
    keel_contract_table_init(&t);
    const int n = keel_contract_register_cuda(&t);
#if !defined(KEEL_HAVE_CUDA)
    assert_int_equal(n, 0);
    keel_contract_table_free(&t);
    skip();
#endif
    assert_int_equal(n, t.n);
    const int bits[] = {2, 3, 4, 5, 6, 8}, groups[] = {32, 64, 128};
    const keel_dtype sdts[] = {KEEL_DT_BF16, KEEL_DT_F16, KEEL_DT_F32}, xdts[] = {KEEL_DT_BF16, KEEL_DT_F16},
                     ydts[] = {KEEL_DT_F32, KEEL_DT_BF16};
    int stream = 0;
    for (int b = 0; b < 6; b++)
        for (int g = 0; g < 3; g++)
            for (int s = 0; s < 3; s++)
                for (int x = 0; x < 2; x++)
                    for (int y = 0; y < 2; y++)
                        for (int e = 0; e < 2; e++) {
                            bool found = false;
                            for (int i = 0; i < t.n && !found; i++) {
                                const keel_contract_reg *r = &t.regs[i];
                                found = r->family == KEEL_CF_STREAM && r->bits == bits[b] && r->group == groups[g] &&
                                        r->sdt == sdts[s] && r->xdt == xdts[x] && r->ydt == ydts[y] &&
                                        r->epi == (keel_epilogue)e && strcmp(r->entry, "keel_cuda_stream_matmul") == 0;
                            }
                            if (!found) fail_msg("no CUDA stream tile q%dg%d %s x%s y%s epi %d", bits[b], groups[g],
                                                 keel_dtype_name(sdts[s]), keel_dtype_name(xdts[x]),
                                                 keel_dtype_name(ydts[y]), e);
                            stream++;
                        }
    assert_int_equal(stream, 432);
    bool fam[KEEL_CF_COUNT] = {false};
    for (int i = 0; i < t.n; i++) {
        const keel_contract_reg *r = &t.regs[i];
        fam[r->family] = true;
        assert_non_null(keel_contract_table_find(&t, r->name));
        assert_ptr_equal(keel_contract_table_find(&t, r->name), r); /* names are unique */
        if (r->n_controls < 1) fail_msg("%s has no control", r->name);
        bool gates[5] = {false};
        for (int c = 0; c < r->n_controls; c++) gates[r->controls[c].gate] = true;
        assert_true(gates[2]); /* every CUDA registration: a write past the end */
        if (r->family == KEEL_CF_RELU2) continue;
        /* gate 4: a row leak on every fp32 output (docs/kernel-contract.md, CUDA controls) */
        const bool leak_ok = r->ydt == KEEL_DT_F32;
        if (!gates[3] || (leak_ok && !gates[4])) fail_msg("%s lacks a gate-3 or gate-4 control", r->name);
        /* edge shapes: k of one group, odd n, a shape whose k spans several x-chunks, every m 1..8 */
        bool one_group = false, odd = false, multi_chunk = false, rows8 = false;
        for (int s = 0; s < r->n_shapes; s++) {
            one_group |= r->shapes[s].k == r->group;
            odd |= r->shapes[s].n % 2 == 1 && r->shapes[s].n > 1;
            multi_chunk |= r->shapes[s].k > 1024;
            rows8 |= r->shapes[s].m_lo == 1 && r->shapes[s].m_hi == 8;
        }
        if (!one_group || !odd || !multi_chunk || !rows8) fail_msg("%s lacks an edge shape", r->name);
        for (int k = 0; k < r->n_replaces; k++) {
            const keel_contract_reg *p = keel_contract_table_find(&t, r->replaces[k]);
            if (!p) fail_msg("%s replaces %s, which is not registered", r->name, r->replaces[k]);
            if (k == 0)
                assert_true(p->family == KEEL_CF_STREAM && p->bits == r->bits && p->group == r->group &&
                            p->sdt == r->sdt && p->xdt == r->xdt && p->epi == KEEL_EPI_NONE);
            else
                assert_true(p->family == KEEL_CF_RELU2 && p->ydt == r->ydt);
        }
        if (r->family == KEEL_CF_ROUTED_UP || r->family == KEEL_CF_ROUTED_DOWN)
            assert_true(r->run != NULL && r->experts >= 2 && r->n_replaces >= 1);
        if (r->epi == KEEL_EPI_RELU2) assert_true(r->n_replaces == 2);
    }
    assert_true(fam[KEEL_CF_STREAM] && fam[KEEL_CF_RELU2] && fam[KEEL_CF_ROUTED_UP] && fam[KEEL_CF_ROUTED_DOWN]);
    keel_contract_table_free(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_routed_gates_pass_and_catch),
        cmocka_unit_test(test_routed_missing_replaced),
        cmocka_unit_test(test_cuda_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
