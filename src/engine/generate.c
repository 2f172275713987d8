/* engine: generation: the prompt in one forward, then draw, hand over and decode one token at a time until an
 * eos id, the token budget, the context limit or the callback stops it. */
#include <stdlib.h>

#include "engine.h"

static bool is_eos(const int *eos, int n_eos, int tok) {
    for (int i = 0; i < n_eos; i++)
        if (eos[i] == tok) return true;
    return false;
}

keel_code keel_generate(keel_engine *e, const int *prompt, int n_prompt, const keel_gen_opts *o, keel_token_fn fn,
                        void *user, keel_gen_result *res, keel_err *err) {
    KEEL_ASSERT(e && o && res);
    memset(res, 0, sizeof *res);
    if (n_prompt < 1) return keel_err_set(err, KEEL_E_ARG, "the prompt is empty: at least one token is needed");
    if (n_prompt > e->max_ctx)
        return keel_err_set(err, KEEL_E_RANGE, "the prompt has %d tokens, longer than the context of %d tokens",
                            n_prompt, e->max_ctx);
    const int *eos = o->eos ? o->eos : e->cfg->eos_ids;
    const int n_eos = o->eos ? o->n_eos : e->cfg->n_eos;
    keel_engine_reset(e);
    float *logits = malloc((size_t)e->cfg->vocab * sizeof(float));
    if (!logits) return keel_err_set(err, KEEL_E_NOMEM, "generate: cannot allocate %d logits", e->cfg->vocab);
    keel_sampler s;
    keel_sampler_init(&s, &o->samp, e->cfg->vocab);
    double t0 = keel_now();
    keel_code rc = keel_engine_forward(e, prompt, n_prompt, logits, KEEL_LOGITS_LAST, NULL, err);
    res->n_prompt = n_prompt;
    double t1 = keel_now();
    res->prompt_s = t1 - t0;
    while (rc == KEEL_OK) {
        if (o->n_predict >= 0 && res->n_gen >= o->n_predict) {
            res->stop = KEEL_STOP_LENGTH;
            break;
        }
        const int64_t pos = e->pos; /* the drawn token's position */
        if (pos >= e->max_ctx) {
            res->stop = KEEL_STOP_CONTEXT;
            break;
        }
        const int tok = keel_sampler_sample(&s, logits, pos);
        if (is_eos(eos, n_eos, tok)) {
            res->stop = KEEL_STOP_EOS;
            res->stop_token = tok;
            break;
        }
        res->n_gen++;
        if (fn && fn(user, tok, pos)) {
            res->stop = KEEL_STOP_CALLBACK;
            break;
        }
        if (o->n_predict >= 0 && res->n_gen >= o->n_predict) {
            res->stop = KEEL_STOP_LENGTH;
            break;
        }
        if (pos + 1 >= e->max_ctx) { /* no room to process it: the sequence is full */
            res->stop = KEEL_STOP_CONTEXT;
            break;
        }
        rc = keel_engine_forward(e, &tok, 1, logits, KEEL_LOGITS_LAST, NULL, err);
    }
    res->gen_s = keel_now() - t1;
    keel_sampler_free(&s);
    free(logits);
    return rc;
}
