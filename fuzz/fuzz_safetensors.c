/* libFuzzer target: keel_st_parse on arbitrary bytes must either fail with a reason naming the file or hand out
 * tensors whose sizes agree and whose bytes and metadata are all readable. */
#include "format/format.h"

#include <stdio.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    keel_st st;
    keel_err err = {0};
    keel_code rc = keel_st_parse(&st, data, size, "fuzz.safetensors", &err);
    if (rc != KEEL_OK) {
        KEEL_ASSERT(err.code == rc && strstr(err.msg, "fuzz.safetensors") != NULL);
        KEEL_ASSERT(st.n_tensors == 0 && st.tensors == NULL && st.n_meta == 0);
    } else {
        volatile uint8_t sink = 0;
        for (int i = 0; i < st.n_tensors; i++) {
            const keel_st_tensor *t = &st.tensors[i];
            KEEL_ASSERT(t->ndim >= 0 && t->ndim <= KEEL_ST_MAX_DIMS);
            KEEL_ASSERT(t->nbytes == (size_t)t->numel * keel_dtype_size(t->dtype));
            const uint8_t *p = t->data;
            KEEL_ASSERT(p >= data && p + t->nbytes <= data + size);
            if (t->nbytes) sink ^= p[0] ^ p[t->nbytes / 2] ^ p[t->nbytes - 1];
            KEEL_ASSERT(keel_st_find(&st, t->name) == t);
            if (i) KEEL_ASSERT(strcmp(st.tensors[i - 1].name, t->name) < 0);
        }
        for (int i = 0; i < st.n_meta; i++) {
            sink ^= (uint8_t)strlen(st.meta[i].value);
            KEEL_ASSERT(keel_st_meta_get(&st, st.meta[i].key) == st.meta[i].value);
        }
        (void)sink;
    }
    keel_st_free(&st);
    keel_st_free(&st); /* a freed struct is zeroed and safe to free again */
    return 0;
}
