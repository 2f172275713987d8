/* Loading checkpoints: the fixture bound with each matrix's width as its README lists it, and crafted checkpoints
 * (fixture tensors rewritten with one thing wrong) each refused with the tensor, file, expected and found named. */
#include <cjson/cJSON.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "model/model.h"
#include "common/testkit.h"

static const char *fixdir(void) {
    static char p[1024];
    return tk_fixture(p, sizeof p, "nemotron_h_tiny");
}

static const keel_mat_info *find_mat(const keel_model *m, const char *path) {
    for (int i = 0; i < m->n_mats; i++)
        if (!strcmp(m->mats[i].path, path)) return &m->mats[i];
    return NULL;
}

/* Every README.txt row ("path bits=B group=G scales=DT") against the loaded model. */
static void test_fixture_readme(void **state) {
    (void)state;
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, fixdir(), NULL, &err)) fail_msg("%s", err.msg);
    char path[1100];
    snprintf(path, sizeof path, "%s/README.txt", fixdir());
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    char line[512];
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        char name[256], bits[16], group[16], sc[16];
        if (sscanf(line, "%255s bits=%15s group=%15s scales=%15s", name, bits, group, sc) != 4) continue;
        const keel_mat_info *mi = find_mat(&m, name);
        if (!mi) fail_msg("README matrix %s not bound", name);
        assert_int_equal(mi->bits, strcmp(bits, "float") ? atoi(bits) : 0);
        assert_int_equal(mi->group, strcmp(group, "-") ? atoi(group) : 0);
        assert_string_equal(keel_dtype_name(mi->sdt), sc);
        rows++;
    }
    fclose(f);
    assert_int_equal(rows, 30);
    /* bound structures agree with the listing */
    assert_int_equal(m.layers[2].mamba.in_proj.bits, 5);
    assert_int_equal(m.layers[2].mamba.in_proj.group, 128);
    assert_int_equal(m.layers[2].mamba.in_proj.n, 584);
    assert_int_equal(m.layers[2].mamba.in_proj.k, 256);
    assert_int_equal(m.layers[4].moe.shared.up.sdt, KEEL_DT_F16);
    assert_int_equal(m.layers[5].mlp.up.sdt, KEEL_DT_F32);
    assert_int_equal(m.layers[7].attn.v.bits, 0);
    assert_int_equal(m.layers[7].attn.v.sdt, KEEL_DT_BF16);
    assert_int_equal(m.layers[1].moe.fc2.m.bits, 5);
    assert_int_equal(m.layers[1].moe.fc2.m.group, 32);
    assert_int_equal(m.layers[1].moe.fc2.n_expert, 8);
    assert_int_equal(m.layers[1].moe.fc2.w_stride, (size_t)256 * 20 * 4);
    assert_int_equal(m.layers[1].moe.fc2.s_stride, (size_t)256 * 4 * 2);
    assert_int_equal(m.layers[1].moe.gate.bits, 0);
    assert_int_equal(m.layers[0].mamba.conv_w.n, 320 * 4);
    assert_int_equal(m.layers[0].mamba.A_log.dt, KEEL_DT_F32);
    assert_int_equal(m.layers[0].kind, KEEL_MIXER_MAMBA);
    assert_int_equal(m.layers[3].kind, KEEL_MIXER_ATTN);
    assert_int_equal(m.embed.bits, 6);
    assert_int_equal(m.lm_head.bits, 8);
    /* the expert view steps by the stride into the file's mapping */
    const keel_st_tensor *t = keel_st_find(&m.st, "backbone.layers.1.mixer.switch_mlp.fc2.weight");
    keel_qmat e3 = keel_qstack_expert(&m.layers[1].moe.fc2, 3);
    assert_ptr_equal(e3.w, (const uint8_t *)t->data + 3 * t->nbytes / 8);
    /* the MTP head, beside the checkpoint: 6 bits, group 64 */
    assert_true(m.has_mtp);
    assert_int_equal(m.mtp.bits, 6);
    assert_int_equal(m.mtp.group, 64);
    assert_int_equal(m.mtp.eh_proj.bits, 6);
    assert_int_equal(m.mtp.eh_proj.k, 512);
    assert_int_equal(m.mtp.moe.fc1.m.bits, 6);
    assert_int_equal(m.mtp.moe.gate.bits, 0);
    const keel_mat_info *mi = find_mat(&m, "mtp.layers.0.eh_proj");
    assert_non_null(mi);
    assert_int_equal(mi->bits, 6);
    /* totals: the sum of the listed bytes */
    size_t sum = 0, sum_model = 0, by;
    for (int i = 0; i < m.n_mats; i++) {
        sum += m.mats[i].bytes;
        if (strncmp(m.mats[i].path, "mtp.", 4)) sum_model += m.mats[i].bytes;
    }
    double bpw;
    keel_model_totals(&m, true, &by, &bpw);
    assert_int_equal(by, sum);
    keel_model_totals(&m, false, &by, &bpw);
    assert_int_equal(by, sum_model);
    assert_true(bpw > 2.0 && bpw < 9.0);
    keel_model_free(&m);
    keel_model_free(&m);
    keel_model_free(NULL);

    /* "" means no MTP head */
    assert_int_equal(keel_model_load(&m, fixdir(), "", &err), KEEL_OK);
    assert_false(m.has_mtp);
    assert_null(find_mat(&m, "mtp.layers.0.eh_proj"));
    keel_model_free(&m);
    /* a named MTP file that does not exist */
    assert_int_equal(keel_model_load(&m, fixdir(), "/nonexistent/mtp.safetensors", &err), KEEL_E_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/mtp.safetensors"));
    keel_model_free(&m);
}

/* ---- crafted checkpoints ---------------------------------------------------------------------------------- */

typedef struct craft {
    const char *drop;    /* tensor left out */
    const char *put;     /* tensor added, or replaced when it exists */
    keel_dtype put_dt;
    int put_nd;
    int64_t put_shape[3];
    const char *cfg_set; /* config edits: "key=JSON" at the top level, or "quantization.key=JSON" */
    const char *cfg_set2;
    const char *cfg_del; /* top-level key deleted */
} craft;

static void cfg_apply(cJSON *root, const char *edit) {
    char key[256];
    const char *eq = strchr(edit, '=');
    assert_non_null(eq);
    snprintf(key, sizeof key, "%.*s", (int)(eq - edit), edit);
    cJSON *obj = root;
    char *k = key;
    if (!strncmp(key, "quantization.", 13)) {
        obj = cJSON_GetObjectItem(root, "quantization");
        k = key + 13;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(obj, k);
    cJSON *v = cJSON_Parse(eq + 1);
    assert_non_null(v);
    cJSON_AddItemToObject(obj, k, v);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* Writes KEEL_TMP/load_<tag>/{config.json, model.safetensors} from the fixture with the edits of c. */
static void make_ckpt(const char *tag, const craft *c, char *dir, size_t n) {
    snprintf(dir, n, "%s/load_%s", tk_tmp(), tag);
    mkdir(dir, 0755);
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", fixdir());
    char *text = NULL;
    keel_err err = {0};
    assert_int_equal(keel_read_file(path, &text, NULL, &err), KEEL_OK);
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (c->cfg_set) cfg_apply(root, c->cfg_set);
    if (c->cfg_set2) cfg_apply(root, c->cfg_set2);
    if (c->cfg_del) cJSON_DeleteItemFromObjectCaseSensitive(root, c->cfg_del);
    text = cJSON_Print(root);
    cJSON_Delete(root);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_file(path, text);
    free(text);

    keel_st st;
    snprintf(path, sizeof path, "%s/model.safetensors", fixdir());
    if (keel_st_open(&st, path, &err)) fail_msg("%s", err.msg);
    keel_st_writer w;
    keel_st_writer_init(&w);
    void *buf = NULL;
    for (int i = 0; i < st.n_tensors; i++) {
        const keel_st_tensor *t = &st.tensors[i];
        if ((c->drop && !strcmp(t->name, c->drop)) || (c->put && !strcmp(t->name, c->put))) continue;
        assert_int_equal(keel_st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, t->data, &err), KEEL_OK);
    }
    if (c->put) {
        size_t nb = keel_dtype_size(c->put_dt);
        for (int d = 0; d < c->put_nd; d++) nb *= (size_t)c->put_shape[d];
        buf = calloc(1, nb ? nb : 1);
        assert_int_equal(keel_st_writer_add(&w, c->put, c->put_dt, c->put_nd, c->put_shape, buf, &err), KEEL_OK);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (keel_st_writer_write(&w, path, &err)) fail_msg("%s", err.msg);
    keel_st_writer_free(&w);
    keel_st_free(&st);
    free(buf);
}

typedef struct ccase {
    const char *tag;
    craft c;
    keel_code code;
    const char *named[3]; /* substrings the reason must hold */
} ccase;

static const ccase cases[] = {
    {"missing", {.drop = "backbone.layers.0.mixer.D"}, KEEL_E_MISSING,
     {"backbone.layers.0.mixer.D", "model.safetensors", "layer 0"}},
    {"unused", {.put = "backbone.layers.0.mixer.extra.weight", .put_dt = KEEL_DT_BF16, .put_nd = 1, .put_shape = {4}},
     KEEL_E_UNUSED, {"backbone.layers.0.mixer.extra.weight", "model.safetensors", "not used"}},
    {"packed", {.put = "backbone.layers.0.mixer.in_proj.weight", .put_dt = KEEL_DT_U32, .put_nd = 2, .put_shape = {584, 33}},
     KEEL_E_SHAPE, {"backbone.layers.0.mixer.in_proj.weight", "[584, 32]", "[584, 33]"}},
    {"rows", {.put = "backbone.layers.3.mixer.k_proj.weight", .put_dt = KEEL_DT_U32, .put_nd = 2, .put_shape = {64, 24}},
     KEEL_E_SHAPE, {"backbone.layers.3.mixer.k_proj.weight", "[128, 24]", "[64, 24]"}},
    {"norm", {.put = "backbone.layers.3.norm.weight", .put_dt = KEEL_DT_BF16, .put_nd = 1, .put_shape = {255}},
     KEEL_E_SHAPE, {"backbone.layers.3.norm.weight", "[256]", "[255]"}},
    {"codes_dtype", {.put = "backbone.layers.0.mixer.in_proj.weight", .put_dt = KEEL_DT_I32, .put_nd = 2, .put_shape = {584, 32}},
     KEEL_E_FORMAT, {"backbone.layers.0.mixer.in_proj.weight", "U32", "I32"}},
    {"bias_dtype", {.put = "backbone.layers.0.mixer.in_proj.biases", .put_dt = KEEL_DT_F32, .put_nd = 2, .put_shape = {584, 4}},
     KEEL_E_FORMAT, {"backbone.layers.0.mixer.in_proj.biases", "BF16", "F32"}},
    {"no_biases", {.drop = "backbone.layers.0.mixer.in_proj.biases"}, KEEL_E_MISSING,
     {"backbone.layers.0.mixer.in_proj.biases", "model.safetensors", NULL}},
    {"map_bits", {.cfg_set = "quantization.backbone.layers.0.mixer.out_proj={\"bits\": 4, \"group_size\": 64}"},
     KEEL_E_SHAPE, {"backbone.layers.0.mixer.out_proj.weight", "bits=4", "bits=5"}},
    {"map_group", {.cfg_set = "quantization.backbone.layers.2.mixer.in_proj={\"bits\": 5, \"group_size\": 64}"},
     KEEL_E_SHAPE, {"backbone.layers.2.mixer.in_proj.scales", "[584, 4]", "[584, 2]"}},
    {"map_false", {.cfg_set = "quantization.backbone.layers.3.mixer.k_proj=false"}, KEEL_E_FORMAT,
     {"backbone.layers.3.mixer.k_proj", "false", NULL}},
    {"float_unmarked", {.cfg_set = "quantization.backbone.layers.7.mixer.v_proj=true"}, KEEL_E_FORMAT,
     {"backbone.layers.7.mixer.v_proj", "float", "bits=4"}},
    {"pattern_kind", {.cfg_set = "hybrid_override_pattern=\"MEM*E-M*M\"", .cfg_del = "layers_block_type"},
     KEEL_E_MISSING, {"backbone.layers.8.mixer.in_proj.weight", "layer 8", "Mamba"}},
    {"pattern_short", {.cfg_set = "hybrid_override_pattern=\"MEM*E-M*\"", .cfg_del = "layers_block_type"},
     KEEL_E_UNUSED, {"backbone.layers.8.", "MEM*E-M*", NULL}},
    {"tied", {.cfg_set = "tie_word_embeddings=true"}, KEEL_E_UNUSED, {"lm_head.", "tied", NULL}},
    {"no_lm_head", {.drop = "lm_head.weight"}, KEEL_E_MISSING, {"lm_head.weight", NULL, NULL}},
    {"legacy_only", {.cfg_set = "quantization=null"}, KEEL_OK, {NULL, NULL, NULL}},
    {"no_map", {.cfg_set = "quantization=null", .cfg_set2 = "quantization_config=null"}, KEEL_E_MISSING,
     {"backbone.embeddings", "no quantization map", NULL}},
    {"nonaffine", {.cfg_set = "quantization.mode=\"mxfp4\""}, KEEL_E_UNSUPPORTED, {"mxfp4", "config.json", NULL}},
};

static void test_crafted(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const ccase *k = &cases[i];
        char dir[1024];
        make_ckpt(k->tag, &k->c, dir, sizeof dir);
        keel_model m;
        keel_err err = {0};
        keel_code rc = keel_model_load(&m, dir, "", &err);
        bool ok = rc == k->code;
        for (int j = 0; j < 3 && ok && rc; j++) ok = !k->named[j] || strstr(err.msg, k->named[j]);
        if (!ok)
            fail_msg("case %s: expected %s naming %s / %s / %s, got %s: %s", k->tag, keel_code_name(k->code),
                     k->named[0], k->named[1] ? k->named[1] : "", k->named[2] ? k->named[2] : "", keel_code_name(rc),
                     err.msg);
        if (rc == KEEL_OK) {
            const keel_mat_info *mi = find_mat(&m, "backbone.layers.2.mixer.in_proj"); /* from the legacy map */
            assert_non_null(mi);
            assert_int_equal(mi->bits, 5);
            assert_int_equal(mi->group, 128);
        } else {
            assert_int_equal(m.n_mats, 0); /* freed on failure */
        }
        keel_model_free(&m);
    }
}

/* MTP heads written from the fixture's with one thing changed. */
static void make_mtp(const char *tag, const char *quant_meta, const char *drop, const char *extra, char *path,
                     size_t n) {
    snprintf(path, n, "%s/load_mtp_%s.safetensors", tk_tmp(), tag);
    char src[1200];
    snprintf(src, sizeof src, "%s/mtp.safetensors", fixdir());
    keel_st st;
    keel_err err = {0};
    if (keel_st_open(&st, src, &err)) fail_msg("%s", err.msg);
    keel_st_writer w;
    keel_st_writer_init(&w);
    for (int i = 0; i < st.n_tensors; i++) {
        const keel_st_tensor *t = &st.tensors[i];
        if (drop && !strcmp(t->name, drop)) continue;
        assert_int_equal(keel_st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, t->data, &err), KEEL_OK);
    }
    static const uint16_t one[256] = {0};
    int64_t s1[1] = {256};
    if (extra) assert_int_equal(keel_st_writer_add(&w, extra, KEEL_DT_BF16, 1, s1, one, &err), KEEL_OK);
    keel_st_writer_meta(&w, "format", "nemotron-h-mtp");
    if (quant_meta) keel_st_writer_meta(&w, "quantization", quant_meta);
    if (keel_st_writer_write(&w, path, &err)) fail_msg("%s", err.msg);
    keel_st_writer_free(&w);
    keel_st_free(&st);
}

static void expect_mtp(const char *tag, const char *meta, const char *drop, const char *extra, keel_code code,
                       const char *n1, const char *n2) {
    char path[1024];
    make_mtp(tag, meta, drop, extra, path, sizeof path);
    keel_model m;
    keel_err err = {0};
    keel_code rc = keel_model_load(&m, fixdir(), path, &err);
    if (rc != code || (rc && (!strstr(err.msg, n1) || !strstr(err.msg, n2) || !strstr(err.msg, path))))
        fail_msg("mtp case %s: expected %s naming %s and %s, got %s: %s", tag, keel_code_name(code), n1, n2,
                 keel_code_name(rc), err.msg);
    if (!rc) {
        assert_true(m.has_mtp);
        assert_int_equal(m.mtp.bits, 6);
        assert_int_equal(m.mtp.group, 64);
    }
    keel_model_free(&m);
}

static void test_mtp_crafted(void **state) {
    (void)state;
    expect_mtp("copy", "{\"group_size\": 64, \"bits\": 6}", NULL, NULL, KEEL_OK, "", "");
    expect_mtp("bits", "{\"group_size\": 64, \"bits\": 4}", NULL, NULL, KEEL_E_SHAPE, "layers.0.eh_proj.weight",
               "bits=6");
    expect_mtp("nometa", NULL, NULL, NULL, KEEL_E_MISSING, "layers.0.eh_proj", "no quantization map");
    expect_mtp("missing", "{\"group_size\": 64, \"bits\": 6}", "layers.1.final_layernorm.weight", NULL,
               KEEL_E_MISSING, "layers.1.final_layernorm.weight", "MTP");
    expect_mtp("unused", "{\"group_size\": 64, \"bits\": 6}", NULL, "layers.2.norm.weight", KEEL_E_UNUSED,
               "layers.2.norm.weight", "MTP");
    expect_mtp("mode", "{\"group_size\": 32, \"bits\": 4, \"mode\": \"nvfp4\"}", NULL, NULL, KEEL_E_UNSUPPORTED,
               "nvfp4", "quantization");
}

static void test_no_dir(void **state) {
    (void)state;
    keel_model m;
    keel_err err = {0};
    assert_int_equal(keel_model_load(&m, "/nonexistent/model", NULL, &err), KEEL_E_IO);
    assert_non_null(strstr(err.msg, "/nonexistent/model/config.json"));
    keel_model_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_readme),
        cmocka_unit_test(test_crafted),
        cmocka_unit_test(test_mtp_crafted),
        cmocka_unit_test(test_no_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
