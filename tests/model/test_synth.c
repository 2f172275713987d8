/* keel_synth_write: configs/demo.json written and loaded back with and without an MTP head, widths as asked,
 * values at the scales the forward pass needs, deterministic from the seed, a consistent byte-level tokenizer,
 * the same bytes on any thread count, and refusals that leave nothing half-written. */
#include <cjson/cJSON.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/cpu/cpu.h"
#include "model/model.h"
#include "common/testkit.h"

static char *demo_config(void) { return tk_read_text("configs/demo.json"); }

static void out_dir(const char *tag, char *buf, size_t n) {
    snprintf(buf, n, "%s/synth_%s", tk_tmp(), tag);
}

static void synth(const char *cfg, const char *dir, keel_synth_opts o) {
    keel_err err = {0};
    if (keel_synth_write(cfg, dir, &o, &err)) fail_msg("%s", err.msg);
}

static bool file_exists(const char *dir, const char *name) {
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

static void stats(const keel_qmat *m, double *mean, double *std) {
    float *w = malloc((size_t)m->n * (size_t)m->k * sizeof(float));
    keel_quant_dequantize(m, w);
    double s = 0, s2 = 0, n = (double)m->n * m->k;
    for (size_t i = 0; i < (size_t)n; i++) s += w[i], s2 += (double)w[i] * w[i];
    free(w);
    *mean = s / n;
    *std = sqrt(s2 / n - *mean * *mean);
}

static void test_roundtrip(void **state) {
    (void)state;
    char *cfg = demo_config(), dir[1024];
    out_dir("mtp", dir, sizeof dir);
    synth(cfg, dir, (keel_synth_opts){4, 64, KEEL_DT_BF16, 6, 5});
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, dir, NULL, &err)) fail_msg("%s", err.msg);
    assert_string_equal(m.cfg.pattern, "MEM*E-M*E");
    assert_true(m.has_mtp);
    assert_int_equal(m.mtp.bits, 6);
    assert_int_equal(m.mtp.group, 64);
    int n_mtp = 0;
    for (int i = 0; i < m.n_mats; i++) {
        const keel_mat_info *mi = &m.mats[i];
        bool mtp = !strncmp(mi->path, "mtp.", 4), router = strstr(mi->path, ".gate") != NULL;
        n_mtp += mtp;
        assert_int_equal(mi->bits, router ? 0 : mtp ? 6 : 4);
        assert_int_equal(mi->group, router ? 0 : 64);
        assert_int_equal(mi->sdt, KEEL_DT_BF16);
    }
    assert_int_equal(n_mtp, 10);
    /* magnitudes: matrices ~ N(0, 1/in), the embedding table ~ N(0, 1) */
    double mean, std;
    stats(&m.layers[0].mamba.in_proj, &mean, &std);
    assert_true(fabs(mean) < 0.01 && fabs(std - 1.0 / 16) < 0.1 / 16);
    stats(&m.layers[1].moe.fc2.m, &mean, &std); /* expert 0 of fc2, in = moe_inter 128 */
    assert_true(fabs(std - 1.0 / sqrt(128.0)) < 0.1 / sqrt(128.0));
    stats(&m.embed, &mean, &std);
    assert_true(fabs(std - 1.0) < 0.1);
    stats(&m.layers[1].moe.gate, &mean, &std);
    assert_true(fabs(std - 1.0 / 16) < 0.15 / 16);
    for (int l = 0; l < m.cfg.n_layer; l++) {
        const keel_layer *L = &m.layers[l];
        for (int i = 0; i < m.cfg.hidden; i++) assert_true(fabsf(keel_vec_get(&L->norm, i) - 1.0f) < 0.5f);
        if (L->kind == KEEL_MIXER_MAMBA) {
            assert_int_equal(L->mamba.A_log.dt, KEEL_DT_F32);
            for (int h = 0; h < m.cfg.mamba_heads; h++) {
                float a = keel_vec_get(&L->mamba.A_log, h), dtb = keel_vec_get(&L->mamba.dt_bias, h);
                double dt = log1p(exp((double)dtb)); /* softplus */
                assert_true(a > 0.0f && a <= logf(16.0f) + 1e-6f);
                assert_true(dt > 0.0009 && dt < 0.11);
                assert_true(fabsf(keel_vec_get(&L->mamba.D, h) - 1.0f) < 0.5f);
            }
        }
        if (L->kind == KEEL_MIXER_MOE) {
            assert_int_equal(L->moe.corr_bias.dt, KEEL_DT_F32);
            for (int e = 0; e < m.cfg.n_experts; e++) assert_true(fabsf(keel_vec_get(&L->moe.corr_bias, e)) < 0.1f);
        }
    }
    keel_model_free(&m);

    /* written again without a head: the stale head goes, and the model loads alone */
    synth(cfg, dir, (keel_synth_opts){4, 64, KEEL_DT_BF16, 0, 5});
    assert_false(file_exists(dir, "mtp.safetensors"));
    if (keel_model_load(&m, dir, NULL, &err)) fail_msg("%s", err.msg);
    assert_false(m.has_mtp);
    keel_model_free(&m);
    free(cfg);
}

static bool same_file(const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    keel_err err = {0};
    assert_int_equal(keel_read_file(a, &x, &nx, &err), KEEL_OK);
    assert_int_equal(keel_read_file(b, &y, &ny, &err), KEEL_OK);
    bool same = nx == ny && !memcmp(x, y, nx);
    free(x);
    free(y);
    return same;
}

static void test_deterministic_and_widths(void **state) {
    (void)state;
    char *cfg = demo_config(), a[1024], b[1024], c[1024], pa[1100], pb[1100], pc[1100];
    out_dir("seed_a", a, sizeof a);
    out_dir("seed_b", b, sizeof b);
    out_dir("seed_c", c, sizeof c);
    keel_synth_opts o = {3, 32, KEEL_DT_F16, 0, 42};
    synth(cfg, a, o);
    synth(cfg, b, o);
    o.seed = 43;
    synth(cfg, c, o);
    snprintf(pa, sizeof pa, "%s/model.safetensors", a);
    snprintf(pb, sizeof pb, "%s/model.safetensors", b);
    snprintf(pc, sizeof pc, "%s/model.safetensors", c);
    assert_true(same_file(pa, pb));
    assert_false(same_file(pa, pc));
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, a, NULL, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m.layers[3].attn.k.bits, 3);
    assert_int_equal(m.layers[3].attn.k.group, 32);
    assert_int_equal(m.layers[3].attn.k.sdt, KEEL_DT_F16);
    assert_int_equal(m.lm_head.bits, 3);
    keel_model_free(&m);
    free(cfg);
}

/* A config whose embedding and lm_head span several units of work, so threads split single tensors. */
static char *wide_vocab_config(void) {
    char *t = demo_config();
    cJSON *c = cJSON_Parse(t);
    free(t);
    cJSON_ReplaceItemInObject(c, "vocab_size", cJSON_CreateNumber(131072));
    t = cJSON_PrintUnformatted(c);
    cJSON_Delete(c);
    return t;
}

static void synth_threads(const char *cfg, const char *tag, int threads, uint64_t seed, char *dir, size_t n) {
    out_dir(tag, dir, n);
    keel_cpu_set_threads(threads);
    synth(cfg, dir, (keel_synth_opts){4, 64, KEEL_DT_BF16, 6, seed});
    keel_cpu_set_threads(0);
}

static void test_thread_count_invariant(void **state) {
    (void)state;
    char *cfg = wide_vocab_config(), d1[1024], d2[1024], d3[1024], ds[1024], a[1100], b[1100];
    synth_threads(cfg, "thr1", 1, 11, d1, sizeof d1);
    synth_threads(cfg, "thr2", 2, 11, d2, sizeof d2);
    synth_threads(cfg, "thr3", 3, 11, d3, sizeof d3);
    synth_threads(cfg, "thr_seed", 2, 12, ds, sizeof ds);
    const char *files[2] = {"model.safetensors", "mtp.safetensors"};
    for (int f = 0; f < 2; f++) {
        snprintf(a, sizeof a, "%s/%s", d1, files[f]);
        snprintf(b, sizeof b, "%s/%s", d2, files[f]);
        assert_true(same_file(a, b));
        snprintf(b, sizeof b, "%s/%s", d3, files[f]);
        assert_true(same_file(a, b));
        snprintf(b, sizeof b, "%s/%s", ds, files[f]);
        assert_false(same_file(a, b));
    }
    /* the multi-unit tables load, and every row of them is drawn (no unit left as zeros) at N(0, 1) and 1/sqrt(in) */
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, d2, NULL, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m.embed.n, 131072);
    const keel_qmat *tabs[2] = {&m.embed, &m.lm_head};
    const double want[2] = {1.0, 1.0 / 16};
    float *row = malloc((size_t)m.embed.k * sizeof *row);
    for (int t = 0; t < 2; t++) {
        double s2 = 0;
        int zero_rows = 0;
        for (int r = 0; r < tabs[t]->n; r++) {
            keel_quant_dequantize_row(tabs[t], r, row);
            double rs = 0;
            for (int c = 0; c < tabs[t]->k; c++) rs += (double)row[c] * row[c];
            zero_rows += rs == 0;
            s2 += rs;
        }
        double std = sqrt(s2 / ((double)tabs[t]->n * tabs[t]->k));
        assert_int_equal(zero_rows, 0);
        assert_true(fabs(std - want[t]) < 0.05 * want[t]);
    }
    free(row);
    keel_model_free(&m);
    free(cfg);
}

static void test_tokenizer(void **state) {
    (void)state;
    char *cfg = demo_config(), dir[1024], path[1100], *text = NULL;
    out_dir("tok", dir, sizeof dir);
    synth(cfg, dir, (keel_synth_opts){4, 64, KEEL_DT_BF16, 0, 1});
    free(cfg);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &text, NULL, &err), KEEL_OK);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    cJSON *model = cJSON_GetObjectItem(root, "model");
    assert_string_equal(cJSON_GetObjectItem(model, "type")->valuestring, "BPE");
    cJSON *vocab = cJSON_GetObjectItem(model, "vocab"), *merges = cJSON_GetObjectItem(model, "merges"), *it;
    assert_int_equal(cJSON_GetArraySize(vocab), 512);
    bool seen[512] = {false};
    int single = 0;
    cJSON_ArrayForEach(it, vocab) {
        int id = it->valueint;
        assert_true(id >= 0 && id < 512 && !seen[id]);
        seen[id] = true;
        /* one byte-level character: a code point below 0x144 in one or two UTF-8 bytes */
        size_t n = strlen(it->string);
        if ((n == 1 && (unsigned char)it->string[0] > 32) || (n == 2 && (unsigned char)it->string[0] >= 0xc2 &&
                                                              (unsigned char)it->string[0] <= 0xc5))
            single++;
    }
    assert_int_equal(single, 256);
    assert_int_equal(cJSON_GetArraySize(merges), 512 - 3 - 256);
    cJSON_ArrayForEach(it, merges) {
        const char *l = cJSON_GetArrayItem(it, 0)->valuestring, *r = cJSON_GetArrayItem(it, 1)->valuestring;
        char joined[16];
        snprintf(joined, sizeof joined, "%s%s", l, r);
        assert_non_null(cJSON_GetObjectItem(vocab, l));
        assert_non_null(cJSON_GetObjectItem(vocab, r));
        assert_non_null(cJSON_GetObjectItem(vocab, joined));
    }
    assert_int_equal(cJSON_GetObjectItem(vocab, "<s>")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(vocab, "</s>")->valueint, 2);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(root, "added_tokens")), 3);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(root, "decoder"), "type")->valuestring, "ByteLevel");
    cJSON_Delete(root);
}

static void test_refusals(void **state) {
    (void)state;
    char *cfg = demo_config(), dir[1024];
    keel_err err = {0};
    /* shared_experts.down_proj has 192 inputs: not a multiple of 128; nothing is written */
    out_dir("group128", dir, sizeof dir);
    keel_synth_opts o = {4, 128, KEEL_DT_BF16, 0, 1};
    assert_int_equal(keel_synth_write(cfg, dir, &o, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "shared_experts.down_proj"));
    assert_non_null(strstr(err.msg, "192"));
    assert_false(file_exists(dir, "model.safetensors"));
    assert_false(file_exists(dir, "config.json"));
    o.group = 64;
    o.bits = 7;
    assert_int_equal(keel_synth_write(cfg, dir, &o, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "bits 7"));
    o.bits = 4;
    o.mtp_bits = 1;
    assert_int_equal(keel_synth_write(cfg, dir, &o, &err), KEEL_E_ARG);
    o.mtp_bits = 0;
    o.sdt = KEEL_DT_U8;
    assert_int_equal(keel_synth_write(cfg, dir, &o, &err), KEEL_E_ARG);
    o.sdt = KEEL_DT_BF16;
    /* a small vocabulary, an invalid config, an MTP head without attention */
    cJSON *c = cJSON_Parse(cfg);
    cJSON_ReplaceItemInObject(c, "vocab_size", cJSON_CreateNumber(200));
    char *s = cJSON_PrintUnformatted(c);
    assert_int_equal(keel_synth_write(s, dir, &o, &err), KEEL_E_ARG);
    assert_non_null(strstr(err.msg, "vocab_size"));
    free(s);
    cJSON_ReplaceItemInObject(c, "vocab_size", cJSON_CreateNumber(512));
    cJSON_ReplaceItemInObject(c, "num_key_value_heads", cJSON_CreateNumber(3));
    s = cJSON_PrintUnformatted(c);
    assert_int_equal(keel_synth_write(s, dir, &o, &err), KEEL_E_FORMAT);
    assert_non_null(strstr(err.msg, "num_key_value_heads"));
    free(s);
    cJSON_ReplaceItemInObject(c, "hybrid_override_pattern", cJSON_CreateString("MEM-E"));
    cJSON_DeleteItemFromObject(c, "num_attention_heads");
    cJSON_DeleteItemFromObject(c, "num_hidden_layers");
    s = cJSON_PrintUnformatted(c);
    o.mtp_bits = 6;
    assert_int_equal(keel_synth_write(s, dir, &o, &err), KEEL_E_MISSING);
    assert_non_null(strstr(err.msg, "num_attention_heads"));
    free(s);
    /* ... which without the head is a valid model with no attention, tied embeddings */
    o.mtp_bits = 0;
    cJSON_ReplaceItemInObject(c, "tie_word_embeddings", cJSON_CreateTrue());
    s = cJSON_PrintUnformatted(c);
    out_dir("noattn", dir, sizeof dir);
    if (keel_synth_write(s, dir, &o, &err)) fail_msg("%s", err.msg);
    free(s);
    cJSON_Delete(c);
    keel_model m;
    if (keel_model_load(&m, dir, NULL, &err)) fail_msg("%s", err.msg);
    assert_string_equal(m.cfg.pattern, "MEM-E");
    assert_ptr_equal(m.lm_head.w, m.embed.w);
    keel_model_free(&m);
    free(cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_deterministic_and_widths),
        cmocka_unit_test(test_thread_count_invariant),
        cmocka_unit_test(test_tokenizer),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
