/* format: dtype names, sizes, and float access to BF16/F16/F32/F64 arrays through core's conversions. */
#include "format.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[KEEL_DT_COUNT] = {
    [KEEL_DT_BOOL] = {"BOOL", 1},       [KEEL_DT_U8] = {"U8", 1},         [KEEL_DT_I8] = {"I8", 1},
    [KEEL_DT_U16] = {"U16", 2},         [KEEL_DT_I16] = {"I16", 2},       [KEEL_DT_F16] = {"F16", 2},
    [KEEL_DT_BF16] = {"BF16", 2},       [KEEL_DT_U32] = {"U32", 4},       [KEEL_DT_I32] = {"I32", 4},
    [KEEL_DT_F32] = {"F32", 4},         [KEEL_DT_U64] = {"U64", 8},       [KEEL_DT_I64] = {"I64", 8},
    [KEEL_DT_F64] = {"F64", 8},         [KEEL_DT_F8_E4M3] = {"F8_E4M3", 1}, [KEEL_DT_F8_E5M2] = {"F8_E5M2", 1},
    [KEEL_DT_F8_E8M0] = {"F8_E8M0", 1},
};

const char *keel_dtype_name(keel_dtype dt) {
    return ((int)dt >= 0 && dt < KEEL_DT_COUNT) ? dtypes[dt].name : "?";
}

size_t keel_dtype_size(keel_dtype dt) {
    KEEL_ASSERTF((int)dt >= 0 && dt < KEEL_DT_COUNT, "dtype %d out of range", (int)dt);
    return dtypes[dt].size;
}

keel_code keel_dtype_parse(const char *name, keel_dtype *out) {
    for (int i = 0; name && i < KEEL_DT_COUNT; i++)
        if (strcmp(name, dtypes[i].name) == 0) {
            *out = (keel_dtype)i;
            return KEEL_OK;
        }
    return KEEL_E_FORMAT;
}

float keel_dtype_get_f32(keel_dtype dt, const void *data, size_t i) {
    const uint8_t *p = data;
    switch (dt) {
    case KEEL_DT_BF16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return keel_bf16_to_f32(h);
    }
    case KEEL_DT_F16: {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        return keel_f16_to_f32(h);
    }
    case KEEL_DT_F32: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    case KEEL_DT_F64: {
        double d;
        memcpy(&d, p + 8 * i, 8);
        return (float)d;
    }
    default:
        keel_panic(__FILE__, __LINE__, "keel_dtype_get_f32 on dtype %s", keel_dtype_name(dt));
    }
}

void keel_dtype_set_f32(keel_dtype dt, void *data, size_t i, float v) {
    uint8_t *p = data;
    switch (dt) {
    case KEEL_DT_BF16: {
        uint16_t h = keel_f32_to_bf16(v);
        memcpy(p + 2 * i, &h, 2);
        return;
    }
    case KEEL_DT_F16: {
        uint16_t h = keel_f32_to_f16(v);
        memcpy(p + 2 * i, &h, 2);
        return;
    }
    case KEEL_DT_F32:
        memcpy(p + 4 * i, &v, 4);
        return;
    default:
        keel_panic(__FILE__, __LINE__, "keel_dtype_set_f32 on dtype %s", keel_dtype_name(dt));
    }
}
