/* contract: the registration table, the known-findings list, and a whole run: every registration and control,
 * one line per failing or notable registration, one SUMMARY line per chip, optional JSON. */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "contract.h"

/* ---- table ------------------------------------------------------------------------------------------ */

void keel_contract_table_init(keel_contract_table *t) { memset(t, 0, sizeof *t); }

void keel_contract_table_free(keel_contract_table *t) {
    if (!t) return;
    free(t->regs);
    memset(t, 0, sizeof *t);
}

keel_contract_reg *keel_contract_table_add(keel_contract_table *t) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 64;
        t->regs = keel_xrealloc(t->regs, (size_t)t->cap * sizeof *t->regs);
    }
    keel_contract_reg *r = &t->regs[t->n++];
    memset(r, 0, sizeof *r);
    return r;
}

const keel_contract_reg *keel_contract_table_find(const keel_contract_table *t, const char *name) {
    for (int i = 0; i < t->n; i++)
        if (strcmp(t->regs[i].name, name) == 0) return &t->regs[i];
    return NULL;
}

/* ---- known findings --------------------------------------------------------------------------------- */

void keel_contract_findings_free(keel_contract_findings *f) {
    if (!f) return;
    free(f->items);
    memset(f, 0, sizeof *f);
}

keel_code keel_contract_findings_parse(keel_contract_findings *f, const char *text, const char *path,
                                       keel_err *err) {
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    int line = 0, cap = 0;
    for (const char *p = text; *p;) {
        const char *e = strchr(p, '\n');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        char buf[512];
        line++;
        if (len >= sizeof buf) {
            keel_contract_findings_free(f);
            return keel_err_set(err, KEEL_E_FORMAT, "%s:%d: line longer than %zu characters", path, line, sizeof buf - 1);
        }
        memcpy(buf, p, len);
        buf[len] = '\0';
        p = e ? e + 1 : p + len;
        char *s = buf;
        while (isspace((unsigned char)*s)) s++;
        if (*s == '\0' || *s == '#') continue;
        keel_contract_finding it = {.line = line};
        int used = 0;
        if (sscanf(s, "%95s %d %n", it.name, &it.gate, &used) != 2 || it.gate < 1 || it.gate > 5) {
            keel_contract_findings_free(f);
            return keel_err_set(err, KEEL_E_FORMAT,
                                "%s:%d: expected \"<registration> <gate 1-5> <reason>\", found \"%s\"", path, line, s);
        }
        char *reason = s + used;
        size_t rl = strlen(reason);
        while (rl && isspace((unsigned char)reason[rl - 1])) reason[--rl] = '\0';
        if (rl == 0) {
            keel_contract_findings_free(f);
            return keel_err_set(err, KEEL_E_FORMAT, "%s:%d: finding %s has no reason (why it fails, why not fixed yet)",
                                path, line, it.name);
        }
        snprintf(it.reason, sizeof it.reason, "%s", reason);
        const keel_contract_finding *dup = keel_contract_findings_find(f, it.name);
        if (dup) {
            const int first = dup->line;
            keel_contract_findings_free(f);
            return keel_err_set(err, KEEL_E_FORMAT, "%s:%d: %s is already listed on line %d", path, line, it.name, first);
        }
        if (f->n == cap) {
            cap = cap ? 2 * cap : 8;
            f->items = keel_xrealloc(f->items, (size_t)cap * sizeof *f->items);
        }
        f->items[f->n++] = it;
    }
    return KEEL_OK;
}

keel_code keel_contract_findings_load(keel_contract_findings *f, const char *path, keel_err *err) {
    memset(f, 0, sizeof *f);
    char *text = NULL;
    size_t len = 0;
    keel_code c = keel_read_file(path, &text, &len, err);
    if (c != KEEL_OK) return c;
    c = keel_contract_findings_parse(f, text, path, err);
    free(text);
    return c;
}

const keel_contract_finding *keel_contract_findings_find(const keel_contract_findings *f, const char *name) {
    for (int i = 0; f && i < f->n; i++)
        if (strcmp(f->items[i].name, name) == 0) return &f->items[i];
    return NULL;
}

/* ---- a run ------------------------------------------------------------------------------------------ */

static const char *const FAMILY_NAMES[KEEL_CF_COUNT] = {"stream", "stream-float", "relu2", "routed-up",
                                                            "routed-down"};

void keel_contract_summary(const char *chip, const keel_contract_report *r, char *buf, size_t cap) {
    char early[48] = "";
    if (r->red_early) snprintf(early, sizeof early, ", %d red early", r->red_early);
    snprintf(buf, cap,
             "SUMMARY %s %d kernels: %d pass gates 1-4, %d fail, %d known findings; %d controls: %d red as planted%s, "
             "%d missed; %d limit problems",
             chip, r->kernels, r->pass, r->fail, r->known, r->controls, r->red_as_planted, early, r->missed,
             r->limit_problems);
}

static cJSON *gate_json(int g, const keel_contract_gate_result *gr) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "gate", g);
    cJSON_AddStringToObject(o, "result", !gr->ran ? "not run" : gr->pass ? "pass" : "fail");
    if (g == 3 && gr->ran) {
        cJSON_AddNumberToObject(o, "max_error", gr->max_err);
        cJSON_AddNumberToObject(o, "bound_at_max", gr->bound_at_max);
        cJSON_AddNumberToObject(o, "fraction_of_bound", gr->frac);
    }
    if (gr->ran && !gr->pass) cJSON_AddStringToObject(o, "detail", gr->detail);
    return o;
}

static cJSON *reg_json(const keel_contract_reg *reg, const keel_contract_result *res, const char *status) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", reg->name);
    cJSON_AddStringToObject(o, "backend", reg->be->name);
    cJSON_AddStringToObject(o, "chip", reg->be->chip);
    cJSON_AddStringToObject(o, "entry", reg->entry);
    cJSON_AddStringToObject(o, "path", reg->path);
    cJSON_AddStringToObject(o, "family", FAMILY_NAMES[reg->family]);
    cJSON_AddNumberToObject(o, "bits", reg->bits);
    cJSON_AddNumberToObject(o, "group", reg->group);
    cJSON_AddStringToObject(o, "dtype", keel_dtype_name(reg->sdt));
    cJSON_AddStringToObject(o, "epilogue", reg->epi == KEEL_EPI_RELU2 ? "relu2" : "none");
    cJSON_AddNumberToObject(o, "rows_min", reg->rows_min);
    cJSON_AddNumberToObject(o, "rows_max", reg->rows_max);
    cJSON *sh = cJSON_AddArrayToObject(o, "shapes");
    for (int i = 0; i < reg->n_shapes; i++) {
        cJSON *s = cJSON_CreateObject();
        cJSON_AddNumberToObject(s, "n", reg->shapes[i].n);
        cJSON_AddNumberToObject(s, "k", reg->shapes[i].k);
        cJSON_AddNumberToObject(s, "m_lo", reg->shapes[i].m_lo);
        cJSON_AddNumberToObject(s, "m_hi", reg->shapes[i].m_hi);
        cJSON_AddItemToArray(sh, s);
    }
    cJSON *rp = cJSON_AddArrayToObject(o, "replaces");
    for (int i = 0; i < reg->n_replaces; i++) cJSON_AddItemToArray(rp, cJSON_CreateString(reg->replaces[i]));
    cJSON_AddStringToObject(o, "status", status);
    cJSON *gs = cJSON_AddArrayToObject(o, "gates");
    for (int g = 1; g <= 4; g++) cJSON_AddItemToArray(gs, gate_json(g, &res->gate[g]));
    cJSON_AddArrayToObject(o, "controls");
    return o;
}

static void add_control_json(cJSON *o, const keel_contract_control *c, const keel_contract_result *res,
                             const char *verdict) {
    cJSON *c_ = cJSON_CreateObject();
    cJSON_AddStringToObject(c_, "name", c->name);
    cJSON_AddNumberToObject(c_, "planted_gate", c->gate);
    cJSON_AddNumberToObject(c_, "red_at", res->first_red);
    cJSON_AddStringToObject(c_, "verdict", verdict);
    if (res->first_red) cJSON_AddStringToObject(c_, "detail", res->gate[res->first_red].detail);
    cJSON_AddItemToArray(cJSON_GetObjectItem(o, "controls"), c_);
}

/* Runs one registration and its controls, updating rep and printing what is notable. */
static void run_one(const keel_contract_table *t, const keel_contract_reg *reg, const keel_contract_findings *known,
                    FILE *out, cJSON *json, keel_contract_report *rep) {
    keel_contract_result res;
    keel_contract_run(t, reg, reg->launch, 4, &res);
    const keel_contract_finding *kf = keel_contract_findings_find(known, reg->name);
    const char *status = "pass";
    rep->kernels++;
    if (res.first_red == 0 && kf) {
        rep->stale_findings++;
        rep->fail++;
        status = "stale-finding";
        fprintf(out, "STALE %s: listed in %s:%d as failing gate %d, but it passes gates 1-4; remove the entry\n",
                reg->name, known->path, kf->line, kf->gate);
    } else if (res.first_red == 0) {
        rep->pass++;
    } else if (kf && kf->gate == res.first_red) {
        rep->known++;
        status = "known-finding";
        fprintf(out, "KNOWN %s gate %d: %s (%s)\n", reg->name, res.first_red, kf->reason,
                res.gate[res.first_red].detail);
    } else {
        rep->fail++;
        status = "fail";
        fprintf(out, "FAIL %s gate %d: %s\n", reg->name, res.first_red, res.gate[res.first_red].detail);
        if (kf) {
            rep->stale_findings++;
            fprintf(out, "STALE %s: listed in %s:%d as failing gate %d, but it fails gate %d\n", reg->name,
                    known->path, kf->line, kf->gate, res.first_red);
        }
    }
    cJSON *o = json ? reg_json(reg, &res, status) : NULL;
    for (int c = 0; c < reg->n_controls; c++) {
        const keel_contract_control *ctl = &reg->controls[c];
        keel_contract_result cr;
        keel_contract_run(t, reg, ctl->twin, ctl->gate, &cr);
        rep->controls++;
        const char *verdict = "red as planted";
        if (cr.first_red == ctl->gate) {
            rep->red_as_planted++;
        } else if (cr.first_red == 0) {
            rep->missed++;
            verdict = "missed";
            fprintf(out, "MISSED control %s of %s: planted for gate %d, it passed gates 1-%d\n", ctl->name, reg->name,
                    ctl->gate, ctl->gate);
        } else {
            rep->red_early++;
            verdict = "red early";
            fprintf(out, "EARLY control %s of %s: planted for gate %d, red at gate %d: %s\n", ctl->name, reg->name,
                    ctl->gate, cr.first_red, cr.gate[cr.first_red].detail);
        }
        if (o) add_control_json(o, ctl, &cr, verdict);
    }
    if (reg->n_controls == 0) {
        rep->fail++;
        fprintf(out, "FAIL %s: no planted control is attached to it\n", reg->name);
    }
    if (o) cJSON_AddItemToArray(json, o);
}

keel_code keel_contract_run_all(const keel_contract_table *t, const char *filter,
                                const keel_contract_findings *known, FILE *out, void *json,
                                keel_contract_report *rep, keel_err *err) {
    memset(rep, 0, sizeof *rep);
    regex_t re;
    if (filter) {
        const int rc = regcomp(&re, filter, REG_EXTENDED | REG_NOSUB);
        if (rc != 0) {
            char msg[256];
            regerror(rc, &re, msg, sizeof msg);
            return keel_err_set(err, KEEL_E_ARG, "--filter \"%s\" is not a POSIX extended regular expression: %s",
                                filter, msg);
        }
    }
    /* One SUMMARY per chip, in table order. */
    for (int i = 0; i < t->n; i++) {
        const char *chip = t->regs[i].be->chip;
        bool seen = false;
        for (int j = 0; j < i && !seen; j++) seen = strcmp(t->regs[j].be->chip, chip) == 0;
        if (seen) continue;
        keel_contract_report cr;
        memset(&cr, 0, sizeof cr);
        for (int j = i; j < t->n; j++) {
            const keel_contract_reg *reg = &t->regs[j];
            if (strcmp(reg->be->chip, chip) != 0) continue;
            if (filter && regexec(&re, reg->name, 0, NULL, 0) != 0) continue;
            run_one(t, reg, known, out, (cJSON *)json, &cr);
        }
        /* Entries naming no registration of this backend are errors too: the list cannot rot. */
        const char *bname = t->regs[i].be->name;
        for (int f = 0; known && f < known->n; f++) {
            const keel_contract_finding *kf = &known->items[f];
            const size_t bl = strlen(bname);
            if (strncmp(kf->name, bname, bl) == 0 && kf->name[bl] == '/' && !keel_contract_table_find(t, kf->name)) {
                cr.stale_findings++;
                cr.fail++;
                fprintf(out, "STALE %s: listed in %s:%d, but no such registration exists\n", kf->name, known->path,
                        kf->line);
            }
        }
        char line[384];
        keel_contract_summary(chip, &cr, line, sizeof line);
        fprintf(out, "%s\n", line);
        rep->kernels += cr.kernels, rep->pass += cr.pass, rep->fail += cr.fail, rep->known += cr.known;
        rep->controls += cr.controls, rep->red_as_planted += cr.red_as_planted, rep->red_early += cr.red_early;
        rep->missed += cr.missed, rep->limit_problems += cr.limit_problems, rep->stale_findings += cr.stale_findings;
    }
    if (filter) regfree(&re);
    return KEEL_OK;
}
