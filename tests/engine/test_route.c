/* engine: the MoE router against its definition computed directly here: sigmoid scores plus correction bias
 * choose (within the topk_group best groups by top-2 sum; other groups' scores become 0 as in mlx-lm and
 * transformers), unbiased scores weigh, normalised by sum + 1e-20, times routed_scaling_factor. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine/engine.h"

enum { E = 16 };

static double sig(double x) { return 1.0 / (1.0 + exp(-x)); }

/* Direct definition in double: returns the chosen set as a mask and each expert's weight. */
static void direct(const keel_config *c, const float *lg, const float *bias, bool *chosen, double *w) {
    const int G = c->n_group, per = E / G;
    double b[E], gs[8];
    for (int i = 0; i < E; i++) b[i] = (double)(1.0f / (1.0f + expf(-lg[i])) + bias[i]); /* float, as routed */
    for (int q = 0; q < G; q++) { /* top-2 sum: the best pair of distinct experts */
        double best = -INFINITY;
        for (int i = q * per; i < (q + 1) * per; i++)
            for (int j = i + 1; j < (q + 1) * per; j++) best = fmax(best, b[i] + b[j]);
        gs[q] = best;
    }
    for (int i = 0; i < E; i++) {
        int q = i / per, better_groups = 0;
        for (int r = 0; r < G; r++) better_groups += gs[r] > gs[q] || (gs[r] == gs[q] && r < q);
        if (G > 1 && better_groups >= c->topk_group) b[i] = 0.0;
    }
    double sum = 0.0;
    for (int i = 0; i < E; i++) {
        int ahead = 0;
        for (int j = 0; j < E; j++) ahead += b[j] > b[i] || (b[j] == b[i] && j < i);
        chosen[i] = ahead < c->top_k;
        if (chosen[i]) sum += sig(lg[i]);
    }
    for (int i = 0; i < E; i++)
        w[i] = chosen[i] ? (c->norm_topk_prob ? sig(lg[i]) / (sum + 1e-20) : sig(lg[i])) * c->routed_scaling : 0.0;
}

static void check(const keel_config *c, unsigned seed, float bias_shift) {
    float lg[E], bias[E];
    unsigned s = seed * 2654435761u + 7u;
    for (int i = 0; i < E; i++) {
        s = s * 1103515245u + 12345u;
        lg[i] = (float)((s >> 8) % 4000) / 500.0f - 4.0f;
        s = s * 1103515245u + 12345u;
        bias[i] = (float)((s >> 8) % 1000) / 2000.0f + bias_shift;
    }
    lg[5] = lg[9]; /* a tie in scores */
    bias[5] = bias[9];
    keel_vec bv = {.data = bias, .dt = KEEL_DT_F32, .n = E};
    int sel[E];
    float w[E];
    keel_engine_route(c, lg, &bv, sel, w);
    bool chosen[E];
    double dw[E];
    direct(c, lg, bias, chosen, dw);
    for (int k = 0; k < c->top_k; k++) {
        assert_true(sel[k] >= 0 && sel[k] < E);
        assert_true(chosen[sel[k]]);
        assert_true(fabs(w[k] - dw[sel[k]]) <= 1e-5 * c->routed_scaling);
        for (int j = 0; j < k; j++) assert_int_not_equal(sel[j], sel[k]);
    }
}

static void test_route(void **state) {
    (void)state;
    keel_config c = {.n_experts = E, .routed_scaling = 2.5f};
    const struct { int top_k, n_group, topk_group; bool norm; } cases[] = {
        {2, 1, 1, true}, {4, 4, 2, true}, {3, 8, 3, false}, {1, 2, 1, true}, {6, 4, 1, true}, {16, 1, 1, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        c.top_k = cases[i].top_k;
        c.n_group = cases[i].n_group;
        c.topk_group = cases[i].topk_group;
        c.norm_topk_prob = cases[i].norm;
        for (unsigned seed = 0; seed < 50; seed++) {
            check(&c, seed, 0.0f);
            check(&c, seed, -0.9f); /* negative biased scores: masked groups' zeros can win, as upstream */
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_route)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
