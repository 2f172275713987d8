/* format: safetensors files (read by mmap, one file or shards; written atomically) and MLX affine quantization.
 *
 * safetensors: an 8-byte little-endian header length, a JSON header mapping names to
 * {dtype, shape, data_offsets:[begin,end]} (offsets relative to the end of the header) plus an optional
 * "__metadata__" object of string values, then the data. The reader validates everything before any tensor is
 * handed out: header inside the file, JSON that parses, known dtypes, offsets inside the data section, tensors
 * neither overlapping nor out of order, byte sizes agreeing with shape x dtype, no duplicate names, and across
 * shards no name in two shards and no shard missing. Every error names the file and the tensor.
 *
 * MLX affine quantization: a matrix W (n, k) is cut into groups of `group` consecutive columns; each group has
 * a scale and a bias (BF16, F16 or F32) and codes q in [0, 2^bits): w = scale * q + bias. Codes of one row are
 * a little-endian, least-significant-bit-first bit stream packed into uint32 words: row r, column c sits at bit
 * c*bits of the row's k*bits/32 words, and 3-, 5- and 6-bit codes may straddle two words.
 */
#ifndef KEEL_FORMAT_H
#define KEEL_FORMAT_H

#include "../core/core.h"

/* ---- dtypes -------------------------------------------------------------------------------------------- */

typedef enum keel_dtype {
    KEEL_DT_BOOL,
    KEEL_DT_U8,
    KEEL_DT_I8,
    KEEL_DT_U16,
    KEEL_DT_I16,
    KEEL_DT_F16,
    KEEL_DT_BF16,
    KEEL_DT_U32,
    KEEL_DT_I32,
    KEEL_DT_F32,
    KEEL_DT_U64,
    KEEL_DT_I64,
    KEEL_DT_F64,
    KEEL_DT_F8_E4M3, /* read and listed, refused where a kernel needs them */
    KEEL_DT_F8_E5M2,
    KEEL_DT_F8_E8M0,
    KEEL_DT_COUNT
} keel_dtype;

const char *keel_dtype_name(keel_dtype dt); /* "BF16" */
size_t keel_dtype_size(keel_dtype dt);      /* bytes per element */
/* Parses a safetensors dtype name; unknown names return KEEL_E_FORMAT. */
keel_code keel_dtype_parse(const char *name, keel_dtype *out);
/* Reads element i of a BF16, F16, F32 or F64 array as float; other dtypes abort (callers check first). */
float keel_dtype_get_f32(keel_dtype dt, const void *data, size_t i);
/* Writes element i of a BF16, F16 or F32 array, rounding to nearest even. */
void keel_dtype_set_f32(keel_dtype dt, void *data, size_t i, float v);

/* ---- safetensors reading ------------------------------------------------------------------------------- */

#define KEEL_ST_MAX_DIMS 8

typedef struct keel_st_tensor {
    char *name;
    keel_dtype dtype;
    int ndim;
    int64_t shape[KEEL_ST_MAX_DIMS];
    int64_t numel;
    const void *data; /* points into the file's read-only mapping */
    size_t nbytes;
    int shard;        /* index into keel_st.shards */
} keel_st_tensor;

typedef struct keel_st_meta {
    char *key;
    char *value;
} keel_st_meta;

typedef struct keel_st_shard {
    char *path;
    const uint8_t *map; /* whole file, read-only mmap (or NULL when empty) */
    size_t size;
    size_t data_off;    /* where the data section starts: 8 + the header's length (0 until the file parses) */
} keel_st_shard;

typedef struct keel_st {
    int n_shards;
    keel_st_shard *shards;
    int n_tensors;
    keel_st_tensor *tensors; /* sorted by name */
    int n_meta;
    keel_st_meta *meta;      /* "__metadata__" of the first shard (or of the single file) */
} keel_st;

/* Opens `path`: a .safetensors file, a model.safetensors.index.json, or a directory holding one of them
 * (the index is preferred). On failure st is left empty and safe to free. */
keel_code keel_st_open(keel_st *st, const char *path, keel_err *err);
void keel_st_free(keel_st *st); /* accepts NULL and a zeroed struct */

/* Parses and validates one complete in-memory safetensors file (header and data) into st, with tensor data
 * pointing into buf; `fname` names it in errors. This is what the fuzzer drives. st->shards stays empty. */
keel_code keel_st_parse(keel_st *st, const uint8_t *buf, size_t len, const char *fname, keel_err *err);

const keel_st_tensor *keel_st_find(const keel_st *st, const char *name);
const char *keel_st_meta_get(const keel_st *st, const char *key); /* NULL when absent */
/* The file a tensor lives in, for error messages. */
const char *keel_st_tensor_file(const keel_st *st, const keel_st_tensor *t);

/* ---- safetensors writing ------------------------------------------------------------------------------- */

typedef struct keel_st_writer {
    int n, cap;
    struct keel_st_wtensor *items; /* name, dtype, shape, borrowed data pointer */
    int n_meta, cap_meta;
    keel_st_meta *meta;
} keel_st_writer;

void keel_st_writer_init(keel_st_writer *w);
void keel_st_writer_free(keel_st_writer *w); /* accepts NULL */
/* Adds a tensor; data is borrowed and must stay valid until keel_st_writer_write returns. */
keel_code keel_st_writer_add(keel_st_writer *w, const char *name, keel_dtype dt, int ndim, const int64_t *shape,
                             const void *data, keel_err *err);
void keel_st_writer_meta(keel_st_writer *w, const char *key, const char *value);
/* Writes to a temporary file beside `path`, syncs, then renames over `path`: never a half file under the name. */
keel_code keel_st_writer_write(const keel_st_writer *w, const char *path, keel_err *err);

/* ---- MLX affine quantization --------------------------------------------------------------------------- */

/* A matrix as the kernels read it: packed codes with per-group scale and bias, or a plain float matrix. */
typedef struct keel_qmat {
    int n;                /* output rows */
    int k;                /* input columns */
    int bits;             /* 2, 3, 4, 5, 6 or 8; 0 for a float matrix */
    int group;            /* 32, 64 or 128; 0 for a float matrix */
    keel_dtype sdt;       /* scale and bias dtype (BF16, F16, F32); for a float matrix, the weight's dtype */
    const uint32_t *w;    /* (n, k*bits/32) packed codes, or (n, k) floats of dtype sdt when bits == 0 */
    const void *scales;   /* (n, k/group) */
    const void *biases;   /* (n, k/group) */
} keel_qmat;

static inline bool keel_quant_bits_ok(int bits) {
    return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}
static inline bool keel_quant_group_ok(int group) { return group == 32 || group == 64 || group == 128; }
/* uint32 words of one packed row of k codes (k is a multiple of 32 for every valid group). */
static inline size_t keel_quant_row_words(int k, int bits) { return (size_t)k * (size_t)bits / 32u; }

/* Code c of a packed row. */
static inline uint32_t keel_quant_code(const uint32_t *row, int bits, int c) {
    size_t bit = (size_t)c * (size_t)bits, wi = bit >> 5;
    unsigned sh = (unsigned)(bit & 31u);
    uint64_t two = (uint64_t)row[wi] | (sh + (unsigned)bits > 32u ? (uint64_t)row[wi + 1] << 32 : 0);
    return (uint32_t)(two >> sh) & ((1u << bits) - 1u);
}

/* Packs k codes (each < 2^bits) into k*bits/32 words; the inverse unpacks. */
void keel_quant_pack_row(const uint8_t *codes, int k, int bits, uint32_t *out);
void keel_quant_unpack_row(const uint32_t *row, int k, int bits, uint8_t *codes);

/* Quantizes W (n, k) row-major float32 exactly as MLX's affine quantizer does (bit for bit), writing codes
 * (n, k*bits/32), scales and biases (n, k/group) of dtype sdt. Requires valid bits, group, k % group == 0. */
void keel_quant_quantize(const float *w, int n, int k, int bits, int group, keel_dtype sdt, uint32_t *codes,
                         void *scales, void *biases);
/* Dequantizes rows [0, n) of m into out (n, k) float32: w = scale * q + bias, computed in float32. */
void keel_quant_dequantize(const keel_qmat *m, float *out);
/* Dequantizes one row into out (k). Works for float matrices too. */
void keel_quant_dequantize_row(const keel_qmat *m, int row, float *out);

#endif
