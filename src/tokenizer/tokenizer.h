/* tokenizer: byte-level BPE read from a Hugging Face tokenizer.json, with streaming decode.
 *
 * Encoding follows HF `tokenizers` with add_special_tokens=False: added tokens are split out first (longest match
 * at the leftmost position, lstrip/rstrip/single_word/normalized honoured), the rest goes through the
 * pre-tokenizer (Split regexes through PCRE2, then ByteLevel) and BPE merges by rank. No BOS/EOS is added.
 *
 * Any byte string encodes and decodes back to itself: bytes that are not valid UTF-8 never match the split
 * regex, so they become pre-tokens of their own and the byte-level alphabet represents them. keel_tokenizer_decode
 * returns the raw bytes (lossless); the streaming decoder is for display and replaces invalid bytes by U+FFFD.
 * A loaded tokenizer is read-only: encode and decode may run from several threads at once.
 */
#ifndef KEEL_TOKENIZER_H
#define KEEL_TOKENIZER_H

#include "core/core.h"

typedef struct keel_tokenizer keel_tokenizer;

keel_code keel_tokenizer_load(keel_tokenizer **out, const char *path_to_tokenizer_json, keel_err *err);
void keel_tokenizer_free(keel_tokenizer *t);
/* 1 + the largest id in the vocab and the added tokens. */
int keel_tokenizer_vocab_size(const keel_tokenizer *t);
/* Encodes len bytes of text (any bytes); the caller frees *ids (NULL when *n is 0). */
keel_code keel_tokenizer_encode(const keel_tokenizer *t, const char *text, size_t len, int32_t **ids, int *n,
                                keel_err *err);
/* Concatenated bytes of the tokens, NUL-terminated for convenience (*len excludes it); the caller frees *out.
 * An id outside [0, vocab_size) or without a token gives KEEL_E_RANGE naming it. */
keel_code keel_tokenizer_decode(const keel_tokenizer *t, const int32_t *ids, int n, char **out, size_t *len,
                                keel_err *err);
/* The id of a token (added tokens first, then the vocab), e.g. "<|im_end|>"; -1 when absent. */
int keel_tokenizer_token_id(const keel_tokenizer *t, const char *token);

/* Streaming decode: holds an incomplete UTF-8 sequence until it completes, so output never ends mid-character. */
typedef struct keel_detok {
    const keel_tokenizer *t;
    uint8_t held[8];
    int n_held;
} keel_detok;

void keel_detok_init(keel_detok *d, const keel_tokenizer *t);
/* Writes the bytes that are now complete (invalid sequences as U+FFFD) into out. A bad id gives KEEL_E_RANGE and
 * an out too small (3 bytes per token byte always suffices) KEEL_E_ARG; either leaves d unchanged. */
keel_code keel_detok_push(keel_detok *d, int32_t id, char *out, size_t cap, size_t *written, keel_err *err);
/* End of stream: emits what is held as one U+FFFD (cap must be at least 3); returns the bytes written. */
size_t keel_detok_flush(keel_detok *d, char *out, size_t cap);

#endif
