/* format: safetensors reading (mmap; one file, or an index and its shards; everything validated) and writing.
 *
 * Layout rules enforced as the reference implementation does: the header length fits the file and is at most
 * 100 MB, the JSON header is followed only by whitespace padding, and the tensors' data_offsets tile the data
 * section exactly: sorted by begin, each tensor starts where the previous one ends (a hole is an error, as is an
 * overlap) and the last one ends at the end of the file (trailing bytes are an error).
 */
#include "format.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER 100000000ull       /* the reference implementation's header limit */
#define ST_MAX_EXACT 9007199254740992.0  /* 2^53: integers above are not exact in a JSON double */

struct keel_st_wtensor {
    char *name;
    keel_dtype dtype;
    int ndim;
    int64_t shape[KEEL_ST_MAX_DIMS];
    const void *data;
    size_t nbytes;
};

/* ---- small helpers --------------------------------------------------------------------------------------- */

static const char *json_kind(const cJSON *v) {
    if (!v) return "nothing";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    return "an invalid value";
}

/* A JSON number that is a non-negative integer exactly representable in a double. */
static bool json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0.0) || !(d < ST_MAX_EXACT)) return false;
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return false;
    *out = u;
    return true;
}

/* Describes a value that failed json_uint, for an error message. */
static void describe_value(const cJSON *v, char *buf, size_t n) {
    if (cJSON_IsNumber(v))
        snprintf(buf, n, "%.17g", v->valuedouble);
    else
        snprintf(buf, n, "%s", json_kind(v));
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const keel_st_tensor *)a)->name, ((const keel_st_tensor *)b)->name);
}

static int cmp_meta_key(const void *a, const void *b) {
    return strcmp(((const keel_st_meta *)a)->key, ((const keel_st_meta *)b)->key);
}

typedef struct span {
    uint64_t begin, end;
    int idx;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

static void free_tensors(keel_st_tensor *t, int n) {
    for (int i = 0; t && i < n; i++) free(t[i].name);
    free(t);
}

static void free_meta(keel_st_meta *m, int n) {
    for (int i = 0; m && i < n; i++) {
        free(m[i].key);
        free(m[i].value);
    }
    free(m);
}

void keel_st_free(keel_st *st) {
    if (!st) return;
    for (int i = 0; st->shards && i < st->n_shards; i++) {
        if (st->shards[i].map) munmap((void *)st->shards[i].map, st->shards[i].size);
        free(st->shards[i].path);
    }
    free(st->shards);
    free_tensors(st->tensors, st->n_tensors);
    free_meta(st->meta, st->n_meta);
    memset(st, 0, sizeof *st);
}

/* ---- parsing one file ------------------------------------------------------------------------------------- */

static keel_code parse_meta(keel_st *st, const cJSON *obj, const char *fname, keel_err *err) {
    if (!cJSON_IsObject(obj))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: \"__metadata__\" is %s, expected an object of strings", fname,
                            json_kind(obj));
    int n = cJSON_GetArraySize(obj);
    st->meta = keel_xcalloc((size_t)n, sizeof *st->meta);
    for (const cJSON *c = obj->child; c; c = c->next) {
        if (!cJSON_IsString(c))
            return keel_err_set(err, KEEL_E_FORMAT, "%s: \"__metadata__\" key '%s' is %s, expected a string", fname,
                                c->string, json_kind(c));
        st->meta[st->n_meta].key = keel_xstrdup(c->string);
        st->meta[st->n_meta].value = keel_xstrdup(c->valuestring);
        st->n_meta++;
    }
    qsort(st->meta, (size_t)st->n_meta, sizeof *st->meta, cmp_meta_key);
    for (int i = 1; i < st->n_meta; i++)
        if (strcmp(st->meta[i - 1].key, st->meta[i].key) == 0)
            return keel_err_set(err, KEEL_E_FORMAT, "%s: \"__metadata__\" key '%s' appears twice", fname,
                                st->meta[i].key);
    return KEEL_OK;
}

/* Parses one header entry into t (name already set); data offsets go to sp. */
static keel_code parse_entry(keel_st_tensor *t, span *sp, const cJSON *obj, uint64_t data_size, const char *fname,
                             keel_err *err) {
    const char *nm = t->name;
    if (!cJSON_IsObject(obj))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': entry is %s, expected an object", fname, nm,
                            json_kind(obj));
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL;
    for (const cJSON *c = obj->child; c; c = c->next) {
        const cJSON **slot = strcmp(c->string, "dtype") == 0          ? &dtype
                             : strcmp(c->string, "shape") == 0        ? &shape
                             : strcmp(c->string, "data_offsets") == 0 ? &offs
                                                                      : NULL;
        if (!slot) continue; /* unknown fields are ignored, as the reference implementation does */
        if (*slot)
            return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': field \"%s\" appears twice", fname, nm,
                                c->string);
        *slot = c;
    }
    if (!cJSON_IsString(dtype))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': \"dtype\" is %s, expected a dtype name", fname, nm,
                            json_kind(dtype));
    if (keel_dtype_parse(dtype->valuestring, &t->dtype) != KEEL_OK)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': unknown dtype '%s'", fname, nm, dtype->valuestring);
    if (!cJSON_IsArray(shape))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': \"shape\" is %s, expected an array", fname, nm,
                            json_kind(shape));
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > KEEL_ST_MAX_DIMS)
        return keel_err_set(err, KEEL_E_UNSUPPORTED, "%s: tensor '%s': %d dimensions, at most %d supported", fname,
                            nm, ndim, KEEL_ST_MAX_DIMS);
    t->ndim = ndim;
    int64_t numel = 1;
    bool overflow = false;
    int d = 0;
    for (const cJSON *c = shape->child; c; c = c->next, d++) {
        uint64_t v;
        if (!json_uint(c, &v)) {
            char what[64];
            describe_value(c, what, sizeof what);
            return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': shape[%d] is %s, expected a non-negative integer",
                                fname, nm, d, what);
        }
        t->shape[d] = (int64_t)v;
        if (__builtin_mul_overflow(numel, (int64_t)v, &numel)) overflow = true;
    }
    size_t esize = keel_dtype_size(t->dtype), nbytes = 0;
    if (overflow || numel < 0 || __builtin_mul_overflow((uint64_t)numel, (uint64_t)esize, &nbytes))
        return keel_err_set(err, KEEL_E_SHAPE, "%s: tensor '%s': element count of its shape overflows", fname, nm);
    t->numel = numel;
    t->nbytes = nbytes;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': \"data_offsets\" is %s, expected [begin, end]",
                            fname, nm, cJSON_IsArray(offs) ? "an array not of 2 values" : json_kind(offs));
    uint64_t be[2];
    for (int i = 0; i < 2; i++) {
        const cJSON *c = cJSON_GetArrayItem(offs, i);
        if (!json_uint(c, &be[i])) {
            char what[64];
            describe_value(c, what, sizeof what);
            return keel_err_set(err, KEEL_E_FORMAT,
                                "%s: tensor '%s': data_offsets[%d] is %s, expected a non-negative integer", fname, nm,
                                i, what);
        }
    }
    if (be[0] > be[1])
        return keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] begin after they end",
                            fname, nm, (unsigned long long)be[0], (unsigned long long)be[1]);
    if (be[1] > data_size)
        return keel_err_set(err, KEEL_E_FORMAT,
                            "%s: tensor '%s': data_offsets [%llu, %llu] run beyond the data section of %llu bytes",
                            fname, nm, (unsigned long long)be[0], (unsigned long long)be[1],
                            (unsigned long long)data_size);
    if (be[1] - be[0] != nbytes)
        return keel_err_set(err, KEEL_E_SHAPE,
                            "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes but %lld elements of %s "
                            "need %zu",
                            fname, nm, (unsigned long long)be[0], (unsigned long long)be[1],
                            (unsigned long long)(be[1] - be[0]), (long long)numel, keel_dtype_name(t->dtype), nbytes);
    sp->begin = be[0];
    sp->end = be[1];
    return KEEL_OK;
}

/* Checks that the sorted spans tile [0, data_size) exactly. */
static keel_code check_tiling(const keel_st *st, span *sp, int n, uint64_t data_size, const char *fname,
                              keel_err *err) {
    qsort(sp, (size_t)n, sizeof *sp, cmp_span);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        const char *nm = st->tensors[sp[i].idx].name;
        if (sp[i].begin < at)
            return keel_err_set(err, KEEL_E_FORMAT,
                                "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' ending at %llu", fname,
                                nm, (unsigned long long)sp[i].begin, (unsigned long long)sp[i].end,
                                st->tensors[sp[i - 1].idx].name, (unsigned long long)at);
        if (sp[i].begin > at) {
            if (i == 0)
                return keel_err_set(err, KEEL_E_FORMAT,
                                    "%s: tensor '%s': data_offsets [%llu, %llu] leave a hole of %llu bytes at the "
                                    "start of the data section",
                                    fname, nm, (unsigned long long)sp[i].begin, (unsigned long long)sp[i].end,
                                    (unsigned long long)sp[i].begin);
            return keel_err_set(err, KEEL_E_FORMAT,
                                "%s: tensor '%s': data_offsets [%llu, %llu] leave a hole of %llu bytes after tensor "
                                "'%s' ending at %llu",
                                fname, nm, (unsigned long long)sp[i].begin, (unsigned long long)sp[i].end,
                                (unsigned long long)(sp[i].begin - at), st->tensors[sp[i - 1].idx].name,
                                (unsigned long long)at);
        }
        at = sp[i].end;
    }
    if (at != data_size) {
        if (n == 0)
            return keel_err_set(err, KEEL_E_FORMAT, "%s: %llu data bytes but no tensors", fname,
                                (unsigned long long)data_size);
        return keel_err_set(err, KEEL_E_FORMAT,
                            "%s: %llu trailing bytes after the last tensor '%s' (ends at %llu, data section %llu)",
                            fname, (unsigned long long)(data_size - at), st->tensors[sp[n - 1].idx].name,
                            (unsigned long long)at, (unsigned long long)data_size);
    }
    return KEEL_OK;
}

static keel_code parse_header(keel_st *st, const cJSON *root, const uint8_t *data, uint64_t data_size,
                              const char *fname, keel_err *err) {
    int n = cJSON_GetArraySize(root);
    st->tensors = keel_xcalloc((size_t)n, sizeof *st->tensors);
    span *sp = keel_xcalloc((size_t)n, sizeof *sp);
    bool seen_meta = false;
    keel_code rc = KEEL_OK;
    for (const cJSON *c = root->child; c && rc == KEEL_OK; c = c->next) {
        if (strcmp(c->string, "__metadata__") == 0) {
            if (seen_meta)
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s: \"__metadata__\" appears twice", fname);
            else
                rc = parse_meta(st, c, fname, err);
            seen_meta = true;
            continue;
        }
        keel_st_tensor *t = &st->tensors[st->n_tensors];
        t->name = keel_xstrdup(c->string);
        st->n_tensors++;
        rc = parse_entry(t, &sp[st->n_tensors - 1], c, data_size, fname, err);
        if (rc == KEEL_OK) {
            sp[st->n_tensors - 1].idx = st->n_tensors - 1;
            t->data = data + sp[st->n_tensors - 1].begin;
        }
    }
    if (rc == KEEL_OK) {
        /* duplicates are found on a name-sorted copy so that the spans keep their indices for check_tiling */
        int nt = st->n_tensors;
        keel_st_tensor *sorted = keel_xmalloc((size_t)(nt ? nt : 1) * sizeof *sorted);
        memcpy(sorted, st->tensors, (size_t)nt * sizeof *sorted);
        qsort(sorted, (size_t)nt, sizeof *sorted, cmp_tensor_name);
        for (int i = 1; i < nt && rc == KEEL_OK; i++)
            if (strcmp(sorted[i - 1].name, sorted[i].name) == 0)
                rc = keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s' appears twice in the header", fname,
                                  sorted[i].name);
        if (rc == KEEL_OK) rc = check_tiling(st, sp, nt, data_size, fname, err);
        if (rc == KEEL_OK) memcpy(st->tensors, sorted, (size_t)nt * sizeof *sorted);
        free(sorted);
    }
    free(sp);
    return rc;
}

/* The little-endian header length at the start of a file of at least 8 bytes. */
static uint64_t header_len(const uint8_t *buf) {
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)buf[i] << (8 * i);
    return hlen;
}

keel_code keel_st_parse(keel_st *st, const uint8_t *buf, size_t len, const char *fname, keel_err *err) {
    memset(st, 0, sizeof *st);
    if (!fname) fname = "(buffer)";
    if (len < 8)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: %zu bytes, shorter than the 8-byte header length", fname, len);
    const uint64_t hlen = header_len(buf);
    if (hlen > (uint64_t)(len - 8))
        return keel_err_set(err, KEEL_E_FORMAT, "%s: header length %llu runs beyond the file of %zu bytes", fname,
                            (unsigned long long)hlen, len);
    if (hlen > ST_MAX_HEADER)
        return keel_err_set(err, KEEL_E_FORMAT, "%s: header length %llu is absurd (limit %llu)", fname,
                            (unsigned long long)hlen, ST_MAX_HEADER);
    /* a NUL-terminated copy so the JSON parser can never read past the header */
    char *text = keel_xmalloc((size_t)hlen + 1);
    memcpy(text, buf + 8, (size_t)hlen);
    text[hlen] = 0;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, 0);
    keel_code rc = KEEL_OK;
    if (!root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        rc = keel_err_set(err, KEEL_E_FORMAT, "%s: JSON header does not parse (near byte %zu of %llu)", fname, at,
                          (unsigned long long)hlen);
        goto out;
    }
    for (const char *p = end; p < text + hlen; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s: unexpected byte 0x%02x after the JSON header at byte %zu",
                              fname, (unsigned)(uint8_t)*p, (size_t)(p - text));
            goto out;
        }
    if (!cJSON_IsObject(root)) {
        rc = keel_err_set(err, KEEL_E_FORMAT, "%s: header is %s, expected a JSON object", fname, json_kind(root));
        goto out;
    }
    rc = parse_header(st, root, buf + 8 + hlen, (uint64_t)(len - 8) - hlen, fname, err);
out:
    cJSON_Delete(root);
    free(text);
    if (rc != KEEL_OK) keel_st_free(st);
    return rc;
}

/* ---- opening files ---------------------------------------------------------------------------------------- */

static bool path_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *s = keel_xmalloc(a + b + 2);
    memcpy(s, dir, a);
    s[a] = '/';
    memcpy(s + a + 1, name, b + 1);
    return s;
}

/* Maps `path` read-only as a new shard of st and parses it into part. */
static keel_code load_shard(keel_st *st, const char *path, keel_st *part, keel_err *err) {
    memset(part, 0, sizeof *part);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return keel_err_set(err, KEEL_E_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        int e = errno;
        close(fd);
        return keel_err_set(err, KEEL_E_IO, "%s: not a regular file%s%s", path, e ? ": " : "", e ? strerror(e) : "");
    }
    size_t size = (size_t)sb.st_size;
    const uint8_t *map = NULL;
    if (size > 0) {
        void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return keel_err_set(err, KEEL_E_IO, "%s: cannot map %zu bytes: %s", path, size, strerror(e));
        }
        map = m;
    }
    close(fd);
    st->shards = keel_xrealloc(st->shards, (size_t)(st->n_shards + 1) * sizeof *st->shards);
    st->shards[st->n_shards] = (keel_st_shard){keel_xstrdup(path), map, size, 0};
    keel_code rc = keel_st_parse(part, map, size, path, err);
    if (rc == KEEL_OK) st->shards[st->n_shards].data_off = (size_t)(8 + header_len(map));
    st->n_shards++;
    return rc;
}

static keel_code open_single(keel_st *st, const char *path, keel_err *err) {
    keel_st part;
    keel_code rc = load_shard(st, path, &part, err);
    if (rc != KEEL_OK) return rc;
    st->tensors = part.tensors;
    st->n_tensors = part.n_tensors;
    st->meta = part.meta;
    st->n_meta = part.n_meta;
    return KEEL_OK;
}

typedef struct index_entry {
    const char *name, *file;
    int shard;
} index_entry;

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const index_entry *)a)->name, ((const index_entry *)b)->name);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

static keel_code check_index(const keel_st *st, const index_entry *e, int ne, const char *ipath, keel_err *err) {
    int i = 0, j = 0;
    while (i < st->n_tensors || j < ne) {
        int c = i >= st->n_tensors ? 1 : j >= ne ? -1 : strcmp(st->tensors[i].name, e[j].name);
        if (c < 0) {
            const keel_st_tensor *t = &st->tensors[i];
            return keel_err_set(err, KEEL_E_UNUSED, "%s: tensor '%s' in shard %s is not listed in the index", ipath,
                                t->name, st->shards[t->shard].path);
        }
        if (c > 0)
            return keel_err_set(err, KEEL_E_MISSING, "%s: index maps tensor '%s' to shard %s, which does not hold it",
                                ipath, e[j].name, st->shards[e[j].shard].path);
        if (st->tensors[i].shard != e[j].shard)
            return keel_err_set(err, KEEL_E_FORMAT, "%s: index maps tensor '%s' to shard %s but it is in shard %s",
                                ipath, e[j].name, st->shards[e[j].shard].path,
                                st->shards[st->tensors[i].shard].path);
        i++, j++;
    }
    return KEEL_OK;
}

static keel_code open_index(keel_st *st, const char *ipath, keel_err *err) {
    char *text = NULL;
    size_t len = 0;
    keel_code rc = keel_read_file(ipath, &text, &len, err);
    if (rc != KEEL_OK) return rc;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    index_entry *e = NULL;
    const char **files = NULL;
    char *dir = NULL;
    int ne = 0, nf = 0;
    if (!root) {
        rc = keel_err_set(err, KEEL_E_FORMAT, "%s: index does not parse as JSON", ipath);
        goto out;
    }
    const cJSON *wm = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(wm)) {
        rc = keel_err_set(err, KEEL_E_FORMAT, "%s: \"weight_map\" is %s, expected an object of tensor -> shard file",
                          ipath, json_kind(wm));
        goto out;
    }
    int n = cJSON_GetArraySize(wm);
    e = keel_xcalloc((size_t)n, sizeof *e);
    files = keel_xcalloc((size_t)n, sizeof *files);
    for (const cJSON *c = wm->child; c; c = c->next) {
        if (!cJSON_IsString(c) || !c->valuestring[0]) {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s: weight_map maps tensor '%s' to %s, expected a shard file name",
                              ipath, c->string, cJSON_IsString(c) ? "an empty name" : json_kind(c));
            goto out;
        }
        e[ne++] = (index_entry){c->string, c->valuestring, -1};
        files[nf++] = c->valuestring;
    }
    qsort(e, (size_t)ne, sizeof *e, cmp_entry_name);
    for (int i = 1; i < ne; i++)
        if (strcmp(e[i - 1].name, e[i].name) == 0) {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s: weight_map lists tensor '%s' twice", ipath, e[i].name);
            goto out;
        }
    /* shards in file-name order, so "the first shard" (whose metadata is kept) is model-00001-of-... */
    qsort(files, (size_t)nf, sizeof *files, cmp_str);
    int u = 0;
    for (int i = 0; i < nf; i++)
        if (u == 0 || strcmp(files[u - 1], files[i]) != 0) files[u++] = files[i];
    nf = u;
    for (int i = 0; i < ne; i++) {
        const char **f = bsearch(&e[i].file, files, (size_t)nf, sizeof *files, cmp_str);
        KEEL_ASSERT(f);
        e[i].shard = (int)(f - files);
    }
    const char *slash = strrchr(ipath, '/');
    if (slash) {
        dir = keel_xmalloc((size_t)(slash - ipath) + 2);
        memcpy(dir, ipath, (size_t)(slash - ipath));
        dir[slash - ipath] = 0;
        if (slash == ipath) strcpy(dir, "/");
    } else {
        dir = keel_xstrdup(".");
    }
    for (int s = 0; s < nf; s++) {
        char *sp = path_join(dir, files[s]);
        if (!path_exists(sp)) {
            const char *example = "";
            for (int i = 0; i < ne; i++)
                if (e[i].shard == s) {
                    example = e[i].name;
                    break;
                }
            rc = keel_err_set(err, KEEL_E_MISSING, "%s: shard %s is missing (the index maps tensor '%s' to it)", ipath,
                              sp, example);
            free(sp);
            goto out;
        }
        keel_st part;
        rc = load_shard(st, sp, &part, err);
        free(sp);
        if (rc != KEEL_OK) goto out;
        st->tensors = keel_xrealloc(st->tensors, (size_t)(st->n_tensors + part.n_tensors + 1) * sizeof *st->tensors);
        for (int i = 0; i < part.n_tensors; i++) {
            part.tensors[i].shard = s;
            st->tensors[st->n_tensors++] = part.tensors[i];
        }
        free(part.tensors);
        if (s == 0) {
            st->meta = part.meta;
            st->n_meta = part.n_meta;
        } else {
            free_meta(part.meta, part.n_meta);
        }
    }
    qsort(st->tensors, (size_t)st->n_tensors, sizeof *st->tensors, cmp_tensor_name);
    for (int i = 1; i < st->n_tensors; i++)
        if (strcmp(st->tensors[i - 1].name, st->tensors[i].name) == 0) {
            rc = keel_err_set(err, KEEL_E_FORMAT, "%s: tensor '%s' is in both shard %s and shard %s", ipath,
                              st->tensors[i].name, st->shards[st->tensors[i - 1].shard].path,
                              st->shards[st->tensors[i].shard].path);
            goto out;
        }
    rc = check_index(st, e, ne, ipath, err);
out:
    free(dir);
    free(files);
    free(e);
    cJSON_Delete(root);
    return rc;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

keel_code keel_st_open(keel_st *st, const char *path, keel_err *err) {
    memset(st, 0, sizeof *st);
    struct stat sb;
    if (stat(path, &sb) != 0) return keel_err_set(err, KEEL_E_IO, "%s: cannot open: %s", path, strerror(errno));
    keel_code rc;
    if (S_ISDIR(sb.st_mode)) {
        char *idx = path_join(path, "model.safetensors.index.json");
        char *one = path_join(path, "model.safetensors");
        if (path_exists(idx))
            rc = open_index(st, idx, err);
        else if (path_exists(one))
            rc = open_single(st, one, err);
        else
            rc = keel_err_set(err, KEEL_E_MISSING,
                              "%s: directory holds neither model.safetensors.index.json nor model.safetensors", path);
        free(idx);
        free(one);
    } else if (ends_with(path, ".json")) {
        rc = open_index(st, path, err);
    } else {
        rc = open_single(st, path, err);
    }
    if (rc != KEEL_OK) keel_st_free(st);
    return rc;
}

const keel_st_tensor *keel_st_find(const keel_st *st, const char *name) {
    if (!st || !st->tensors || !name) return NULL;
    keel_st_tensor key = {.name = (char *)name};
    return bsearch(&key, st->tensors, (size_t)st->n_tensors, sizeof *st->tensors, cmp_tensor_name);
}

const char *keel_st_meta_get(const keel_st *st, const char *key) {
    if (!st || !st->meta || !key) return NULL;
    keel_st_meta k = {.key = (char *)key};
    const keel_st_meta *m = bsearch(&k, st->meta, (size_t)st->n_meta, sizeof *st->meta, cmp_meta_key);
    return m ? m->value : NULL;
}

const char *keel_st_tensor_file(const keel_st *st, const keel_st_tensor *t) {
    if (!st || !t || t->shard < 0 || t->shard >= st->n_shards) return "(in memory)";
    return st->shards[t->shard].path;
}

/* ---- writing ---------------------------------------------------------------------------------------------- */

void keel_st_writer_init(keel_st_writer *w) { memset(w, 0, sizeof *w); }

void keel_st_writer_free(keel_st_writer *w) {
    if (!w) return;
    for (int i = 0; w->items && i < w->n; i++) free(w->items[i].name);
    free(w->items);
    free_meta(w->meta, w->n_meta);
    memset(w, 0, sizeof *w);
}

keel_code keel_st_writer_add(keel_st_writer *w, const char *name, keel_dtype dt, int ndim, const int64_t *shape,
                             const void *data, keel_err *err) {
    if (!name || !name[0]) return keel_err_set(err, KEEL_E_ARG, "safetensors writer: empty tensor name");
    if (strcmp(name, "__metadata__") == 0)
        return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor name '__metadata__' is reserved");
    if ((int)dt < 0 || dt >= KEEL_DT_COUNT)
        return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': dtype %d out of range", name, (int)dt);
    if (ndim < 0 || ndim > KEEL_ST_MAX_DIMS || (ndim > 0 && !shape))
        return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': %d dimensions%s, expected 0..%d",
                            name, ndim, ndim > 0 && !shape ? " without a shape" : "", KEEL_ST_MAX_DIMS);
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': shape[%d] is %lld, negative", name,
                                d, (long long)shape[d]);
        if (__builtin_mul_overflow(numel, shape[d], &numel))
            return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': element count overflows", name);
    }
    size_t nbytes;
    if (__builtin_mul_overflow((uint64_t)numel, (uint64_t)keel_dtype_size(dt), &nbytes) ||
        (double)nbytes >= ST_MAX_EXACT)
        return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': byte size overflows", name);
    if (nbytes > 0 && !data)
        return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s': %zu bytes but no data", name, nbytes);
    for (int i = 0; i < w->n; i++)
        if (strcmp(w->items[i].name, name) == 0)
            return keel_err_set(err, KEEL_E_ARG, "safetensors writer: tensor '%s' added twice", name);
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 16;
        w->items = keel_xrealloc(w->items, (size_t)w->cap * sizeof *w->items);
    }
    struct keel_st_wtensor *t = &w->items[w->n++];
    memset(t, 0, sizeof *t);
    t->name = keel_xstrdup(name);
    t->dtype = dt;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    t->data = data;
    t->nbytes = nbytes;
    return KEEL_OK;
}

void keel_st_writer_meta(keel_st_writer *w, const char *key, const char *value) {
    KEEL_ASSERT(key && value);
    for (int i = 0; i < w->n_meta; i++)
        if (strcmp(w->meta[i].key, key) == 0) { /* a repeated key replaces the value */
            free(w->meta[i].value);
            w->meta[i].value = keel_xstrdup(value);
            return;
        }
    if (w->n_meta == w->cap_meta) {
        w->cap_meta = w->cap_meta ? 2 * w->cap_meta : 8;
        w->meta = keel_xrealloc(w->meta, (size_t)w->cap_meta * sizeof *w->meta);
    }
    w->meta[w->n_meta++] = (keel_st_meta){keel_xstrdup(key), keel_xstrdup(value)};
}

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        while (b->n + n + 1 > b->cap) b->cap = b->cap ? 2 * b->cap : 256;
        b->p = keel_xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_str(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char esc[8];
        if (*p == '"' || *p == '\\') {
            esc[0] = '\\', esc[1] = (char)*p;
            sb_put(b, esc, 2);
        } else if (*p < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *p);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, (const char *)p, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static bool write_all(int fd, const void *data, size_t n) {
    const uint8_t *p = data;
    while (n > 0) {
        ssize_t r = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (r == 0) errno = EIO;
            return false;
        }
        p += r;
        n -= (size_t)r;
    }
    return true;
}

keel_code keel_st_writer_write(const keel_st_writer *w, const char *path, keel_err *err) {
    sbuf h = {0};
    sb_str(&h, "{");
    if (w->n_meta > 0) {
        sb_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < w->n_meta; i++) {
            if (i) sb_str(&h, ",");
            sb_json_str(&h, w->meta[i].key);
            sb_str(&h, ":");
            sb_json_str(&h, w->meta[i].value);
        }
        sb_str(&h, "}");
    }
    uint64_t off = 0;
    char num[64];
    for (int i = 0; i < w->n; i++) {
        const struct keel_st_wtensor *t = &w->items[i];
        if (i || w->n_meta > 0) sb_str(&h, ",");
        sb_json_str(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, keel_dtype_name(t->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, "%s%lld", d ? "," : "", (long long)t->shape[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + t->nbytes));
        sb_str(&h, num);
        off += t->nbytes;
    }
    sb_str(&h, "}");
    while (h.n % 8) sb_put(&h, " ", 1); /* pad so the data starts 8-byte aligned, as the reference does */
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));

    size_t plen = strlen(path) + 32;
    char *tmp = keel_xmalloc(plen);
    snprintf(tmp, plen, "%s.tmp.%ld", path, (long)getpid());
    keel_code rc = KEEL_OK;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot create temporary file %s: %s", path, tmp, strerror(errno));
        goto out;
    }
    const char *what = NULL;
    if (!write_all(fd, len8, 8) || !write_all(fd, h.p, h.n)) what = "write";
    for (int i = 0; !what && i < w->n; i++)
        if (w->items[i].nbytes > 0 && !write_all(fd, w->items[i].data, w->items[i].nbytes)) what = "write";
    if (!what && fsync(fd) != 0) what = "sync";
    int e = errno;
    if (close(fd) != 0 && !what) what = "close", e = errno;
    if (!what && rename(tmp, path) != 0) what = "rename", e = errno;
    if (what) {
        unlink(tmp);
        rc = keel_err_set(err, KEEL_E_IO, "%s: cannot %s temporary file %s: %s", path, what, tmp, strerror(e));
        goto out;
    }
    /* make the rename itself durable: sync the directory (best effort) */
    const char *slash = strrchr(path, '/');
    char *dir = slash ? keel_xmalloc((size_t)(slash - path) + 2) : keel_xstrdup(".");
    if (slash) {
        memcpy(dir, path, (size_t)(slash - path));
        dir[slash - path] = 0;
        if (slash == path) strcpy(dir, "/");
    }
    int dfd = open(dir, O_RDONLY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    free(dir);
out:
    free(tmp);
    free(h.p);
    return rc;
}
