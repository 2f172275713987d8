/* model: the MLX quantization map: global width plus per-module entries (a dict, true for global, false for float). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "model.h"

static bool is_setting(const char *k) { return !strcmp(k, "bits") || !strcmp(k, "group_size") || !strcmp(k, "mode"); }

static keel_code check_mode(const cJSON *mode, const char *where, const char *path, keel_err *err) {
    if (!mode) return KEEL_OK;
    if (!cJSON_IsString(mode))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: quantization %s%smode: expected a string", where,
                            path ? path : "", path ? " " : "");
    if (strcmp(mode->valuestring, "affine"))
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "%s: quantization %s%smode \"%s\" is not supported: keel reads MLX affine quantization only "
                            "(mxfp4, mxfp8 and nvfp4 are refused)",
                            where, path ? path : "", path ? " " : "", mode->valuestring);
    return KEEL_OK;
}

/* Reads bits and group_size of obj (defaults when absent and def_ok), checking they are widths MLX affine has. */
static keel_code read_width(const cJSON *obj, const char *where, const char *path, int def_bits, int def_group,
                            bool def_ok, int *bits, int *group, keel_err *err) {
    const char *names[2] = {"bits", "group_size"};
    int *outs[2] = {bits, group}, defs[2] = {def_bits, def_group};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, names[i]);
        if (!v) {
            if (!def_ok)
                return keel_err_set(err, KEEL_E_MISSING, "%s: quantization %s%sfield %s is missing", where,
                                    path ? path : "", path ? " " : "", names[i]);
            *outs[i] = defs[i];
            continue;
        }
        bool ok = cJSON_IsNumber(v) && v->valuedouble == floor(v->valuedouble) &&
                  (i == 0 ? keel_quant_bits_ok((int)v->valuedouble) : keel_quant_group_ok((int)v->valuedouble));
        if (!ok) {
            char *s = cJSON_PrintUnformatted(v);
            keel_code rc = keel_err_set(err, KEEL_E_UNSUPPORTED,
                                        "%s: quantization %s%s%s: expected %s, found %.40s", where, path ? path : "",
                                        path ? " " : "", names[i],
                                        i == 0 ? "2, 3, 4, 5, 6 or 8" : "32, 64 or 128", s ? s : "?");
            free(s);
            return rc;
        }
        *outs[i] = (int)v->valuedouble;
    }
    return KEEL_OK;
}

static keel_code parse_obj(keel_qmap *q, const cJSON *root, const char *where, keel_err *err) {
    keel_code rc;
    const cJSON *qm = cJSON_GetObjectItemCaseSensitive(root, "quant_method");
    if (qm)
        return keel_err_set(err, KEEL_E_UNSUPPORTED,
                            "%s: quantization quant_method %s%s%s is not MLX affine quantization", where,
                            cJSON_IsString(qm) ? "\"" : "", cJSON_IsString(qm) ? qm->valuestring : "(not a string)",
                            cJSON_IsString(qm) ? "\"" : "");
    if ((rc = check_mode(cJSON_GetObjectItemCaseSensitive(root, "mode"), where, NULL, err))) return rc;
    if ((rc = read_width(root, where, NULL, 0, 0, false, &q->bits, &q->group, err))) return rc;
    int cap = cJSON_GetArraySize(root);
    q->entries = keel_xcalloc((size_t)(cap > 0 ? cap : 1), sizeof *q->entries);
    const cJSON *it;
    cJSON_ArrayForEach(it, root) {
        if (is_setting(it->string)) continue;
        keel_qentry e = {NULL, 1, q->bits, q->group};
        if (cJSON_IsBool(it)) {
            e.quant = cJSON_IsTrue(it) ? 1 : 0;
            if (!e.quant) e.bits = e.group = 0;
        } else if (cJSON_IsObject(it)) {
            if ((rc = check_mode(cJSON_GetObjectItemCaseSensitive(it, "mode"), where, it->string, err))) return rc;
            if ((rc = read_width(it, where, it->string, q->bits, q->group, true, &e.bits, &e.group, err))) return rc;
        } else {
            char *s = cJSON_PrintUnformatted(it);
            rc = keel_err_set(err, KEEL_E_FORMAT,
                              "%s: quantization entry %s: expected a settings object, true or false, found %.40s",
                              where, it->string, s ? s : "?");
            free(s);
            return rc;
        }
        e.path = keel_xstrdup(it->string);
        q->entries[q->n++] = e;
    }
    return KEEL_OK;
}

keel_code keel_qmap_parse(keel_qmap *q, const char *json_object, const char *where, keel_err *err) {
    memset(q, 0, sizeof *q);
    cJSON *root = cJSON_Parse(json_object);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return keel_err_set(err, KEEL_E_FORMAT, "%s: quantization: expected a JSON object", where);
    }
    keel_code rc = parse_obj(q, root, where, err);
    cJSON_Delete(root);
    if (rc) {
        keel_qmap_free(q);
        return rc;
    }
    q->present = true;
    return KEEL_OK;
}

void keel_qmap_free(keel_qmap *q) {
    if (!q) return;
    for (int i = 0; i < q->n; i++) free(q->entries[i].path);
    free(q->entries);
    memset(q, 0, sizeof *q);
}

void keel_qmap_lookup(const keel_qmap *q, const char *path, int *quant, int *bits, int *group) {
    for (int i = 0; i < q->n; i++)
        if (!strcmp(q->entries[i].path, path)) {
            *quant = q->entries[i].quant;
            *bits = q->entries[i].bits;
            *group = q->entries[i].group;
            return;
        }
    *quant = q->present ? 1 : 0;
    *bits = q->present ? q->bits : 0;
    *group = q->present ? q->group : 0;
}
