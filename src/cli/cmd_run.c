/* keel run: generate from a prompt on the CPU or CUDA engine, streaming text (or ids) as it is made; keel logits:
 * teacher-forced logits, hidden states and MTP logits of a token sequence, written as safetensors. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "engine/engine.h"
#include "kernels/cpu/cpu.h"
#ifdef KEEL_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#else
typedef struct keel_cuda_engine keel_cuda_engine; /* only ever NULL in a build without CUDA */
#endif
#include "tokenizer/tokenizer.h"

#define DEFAULT_CTX 4096

static const char *const RUN_USAGE =
    "usage: keel run MODEL_DIR (--prompt TEXT | --tokens 1,2,3) [-n N] [--greedy | --temp T --top-p P --top-k K\n"
    "                [--min-p M]] [--seed S] [--ids] [--ignore-eos] [--ctx N] [--threads T]\n"
    "                [--backend cpu|cuda] [--activations bf16|f32]\n"
    "  streams the generated text (with --ids the ids) to stdout; speed and the stop reason go to stderr.\n"
    "  --backend: the engine (default cuda where this build has CUDA and a device is present, else cpu)\n"
    "  --activations: cuda only: bf16 into the stream tiles (default) or f32 (the fp32 matvec, slower)\n"
    "  defaults: -n 128, --temp 0.8 --top-p 0.95 --min-p 0.05 --top-k 0 (off), --seed 0, --ctx max(4096, prompt+n) up to the model's limit\n";
static const char *const LOGITS_USAGE =
    "usage: keel logits MODEL_DIR (--tokens 1,2,3 | --prompt TEXT) --out FILE.safetensors [--mtp] [--threads T]\n"
    "                   [--backend cpu|cuda] [--activations bf16|f32]\n"
    "  writes teacher-forced `logits` (positions x vocab), `hidden` (after norm_f), `tokens` and, with --mtp,\n"
    "  `mtp_logits` and `mtp_hidden` (positions-1 rows: the head at position i reads token i+1), all F32.\n";

typedef struct run_args {
    const char *dir, *prompt, *tokens, *out;
    int n_predict, ctx, threads;
    bool greedy, ids, mtp, ignore_eos;
    int backend; /* keel_backend, or -1: cuda when built with CUDA and a device is present */
    bool f32;    /* --activations f32 (CUDA engine) */
    keel_sampler_cfg samp;
} run_args;

static bool parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || v != v) return false;
    *out = v;
    return true;
}

/* Parses the options of both commands; `logits` selects which are allowed. Returns 0, an exit status, or -1
 * after printing the usage for --help. */
static int parse_args(const char *cmd, int argc, char **argv, bool logits, run_args *a) {
    memset(a, 0, sizeof *a);
    a->backend = -1;
    a->n_predict = 128;
    a->samp = (keel_sampler_cfg){.temp = 0.8f, .top_k = 0, .top_p = 0.95f, .min_p = 0.05f, .seed = 0};
    bool sampling_set = false;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        long n;
        bool takes = true;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            fputs(logits ? LOGITS_USAGE : RUN_USAGE, stdout);
            return -1;
        }
        if (o[0] != '-' && !a->dir) {
            a->dir = o;
            continue;
        }
        if (!strcmp(o, "--greedy") && !logits) a->greedy = true, takes = false;
        else if (!strcmp(o, "--ids") && !logits) a->ids = true, takes = false;
        else if (!strcmp(o, "--ignore-eos") && !logits) a->ignore_eos = true, takes = false;
        else if (!strcmp(o, "--mtp") && logits) a->mtp = true, takes = false;
        if (!takes) continue;
        if (!v) return keel_cli_fail(cmd, "option %s needs a value (or is unknown)", o);
        if (!strcmp(o, "--prompt")) a->prompt = v;
        else if (!strcmp(o, "--tokens")) a->tokens = v;
        else if (!strcmp(o, "--out") && logits) a->out = v;
        else if (!strcmp(o, "--backend")) {
            if (!strcmp(v, "cpu")) a->backend = KEEL_BACKEND_CPU;
            else if (!strcmp(v, "cuda")) a->backend = KEEL_BACKEND_CUDA;
            else return keel_cli_fail(cmd, "--backend '%s': expected cpu or cuda", v);
        } else if (!strcmp(o, "--activations")) {
            if (strcmp(v, "bf16") && strcmp(v, "f32")) return keel_cli_fail(cmd, "--activations '%s': expected bf16 or f32", v);
            a->f32 = !strcmp(v, "f32");
        }
        else if (!strcmp(o, "--threads")) {
            if (!keel_cli_parse_long(v, 1, 4096, &n)) return keel_cli_fail(cmd, "--threads '%s': expected 1..4096", v);
            a->threads = (int)n;
        } else if (!strcmp(o, "--ctx")) {
            if (!keel_cli_parse_long(v, 1, INT_MAX, &n)) return keel_cli_fail(cmd, "--ctx '%s': expected a positive count", v);
            a->ctx = (int)n;
        } else if (logits) {
            return keel_cli_fail(cmd, "unknown option '%s'", o);
        } else if (!strcmp(o, "-n")) {
            if (!keel_cli_parse_long(v, -1, INT_MAX, &n)) return keel_cli_fail(cmd, "-n '%s': expected a count (-1: no limit)", v);
            a->n_predict = (int)n;
        } else if (!strcmp(o, "--temp")) {
            if (!parse_float(v, &a->samp.temp) || a->samp.temp < 0.0f)
                return keel_cli_fail(cmd, "--temp '%s': expected a number >= 0", v);
            sampling_set = true;
        } else if (!strcmp(o, "--top-p")) {
            if (!parse_float(v, &a->samp.top_p) || a->samp.top_p <= 0.0f || a->samp.top_p > 1.0f)
                return keel_cli_fail(cmd, "--top-p '%s': expected a number in (0, 1]", v);
            sampling_set = true;
        } else if (!strcmp(o, "--top-k")) {
            if (!keel_cli_parse_long(v, 0, INT_MAX, &n)) return keel_cli_fail(cmd, "--top-k '%s': expected a count >= 0", v);
            a->samp.top_k = (int)n;
            sampling_set = true;
        } else if (!strcmp(o, "--min-p")) {
            if (!parse_float(v, &a->samp.min_p) || a->samp.min_p < 0.0f || a->samp.min_p > 1.0f)
                return keel_cli_fail(cmd, "--min-p '%s': expected a number in [0, 1]", v);
            sampling_set = true;
        } else if (!strcmp(o, "--seed")) {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 10);
            if (errno || end == v || *end) return keel_cli_fail(cmd, "--seed '%s': expected a non-negative integer", v);
            a->samp.seed = (uint64_t)s;
        } else {
            return keel_cli_fail(cmd, "unknown option '%s'", o);
        }
        i++;
    }
    if (!a->dir) return keel_cli_fail(cmd, "no MODEL_DIR given");
    if (!a->prompt == !a->tokens) return keel_cli_fail(cmd, "give exactly one of --prompt TEXT and --tokens 1,2,3");
    if (logits && !a->out) return keel_cli_fail(cmd, "--out FILE.safetensors is required");
    if (a->greedy && sampling_set) return keel_cli_fail(cmd, "--greedy cannot be combined with --temp/--top-p/--top-k/--min-p");
    if (a->greedy) a->samp.temp = 0.0f;
#ifdef KEEL_HAVE_CUDA
    if (a->backend < 0) a->backend = keel_cuda_device_count() > 0 ? KEEL_BACKEND_CUDA : KEEL_BACKEND_CPU;
#else
    if (a->backend == KEEL_BACKEND_CUDA)
        return keel_cli_fail(cmd, "--backend cuda: this keel was built without CUDA (no nvcc at build time)");
    a->backend = KEEL_BACKEND_CPU;
#endif
    if (a->f32 && a->backend == KEEL_BACKEND_CPU)
        return keel_cli_fail(cmd, "--activations f32 is a CUDA engine option (the CPU engine is always f32)");
    return 0;
}

/* Parses "1,2,3" into ids; every id must be in [0, vocab). */
static int parse_tokens(const char *cmd, const char *s, int vocab, int **ids, int *n) {
    int cap = 16, cnt = 0;
    int *v = keel_xmalloc((size_t)cap * sizeof(int));
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (errno || end == p || (*end && *end != ',') || x < INT_MIN || x > INT_MAX) {
            free(v);
            return keel_cli_fail(cmd, "--tokens '%s': expected comma-separated integers (at character %d)", s,
                                 (int)(p - s) + 1);
        }
        if (x < 0 || x >= vocab) {
            free(v);
            return keel_cli_fail(cmd, "token id %ld is outside the model's vocabulary of %d ids (0..%d)", x, vocab,
                                 vocab - 1);
        }
        if (cnt == cap) v = keel_xrealloc(v, (size_t)(cap *= 2) * sizeof(int));
        v[cnt++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (!cnt) {
        free(v);
        return keel_cli_fail(cmd, "--tokens is empty: at least one token id is needed");
    }
    *ids = v;
    *n = cnt;
    return 0;
}

/* Loads DIR/tokenizer.json and checks it against the model's vocabulary. */
static int load_tokenizer(const char *cmd, const keel_model *m, const char *why, keel_tokenizer **t) {
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", m->dir);
    struct stat sb;
    if (stat(path, &sb) != 0) return keel_cli_fail(cmd, "%s needs %s, which does not exist", why, path);
    keel_err err = {0};
    if (keel_tokenizer_load(t, path, &err) != KEEL_OK) return keel_cli_fail(cmd, "%s", err.msg);
    int tv = keel_tokenizer_vocab_size(*t);
    if (tv > m->cfg.vocab) {
        keel_tokenizer_free(*t);
        *t = NULL;
        return keel_cli_fail(cmd, "%s has %d token ids but the model's vocab_size is %d: they do not belong together",
                             path, tv, m->cfg.vocab);
    }
    return 0;
}

/* The prompt as ids: from --tokens, or --prompt through the tokenizer. */
static int prompt_ids(const char *cmd, const run_args *a, const keel_model *m, const keel_tokenizer *t, int **ids,
                      int *n) {
    if (a->tokens) return parse_tokens(cmd, a->tokens, m->cfg.vocab, ids, n);
    int32_t *v = NULL;
    keel_err err = {0};
    if (keel_tokenizer_encode(t, a->prompt, strlen(a->prompt), &v, n, &err) != KEEL_OK)
        return keel_cli_fail(cmd, "%s", err.msg);
    if (*n == 0) {
        free(v);
        return keel_cli_fail(cmd, "--prompt encodes to no tokens: at least one is needed");
    }
    *ids = keel_xmalloc((size_t)*n * sizeof(int));
    for (int i = 0; i < *n; i++) (*ids)[i] = v[i];
    free(v);
    return 0;
}

/* The context: --ctx, else what the prompt and budget need (at least DEFAULT_CTX), within the model's limit. */
static int choose_ctx(const char *cmd, const run_args *a, const keel_config *c, int n_prompt, int n_predict) {
    if (a->ctx) {
        if (a->ctx > c->max_ctx) {
            keel_cli_fail(cmd, "--ctx %d exceeds the model's max_position_embeddings of %d", a->ctx, c->max_ctx);
            return -1;
        }
        return a->ctx;
    }
    int64_t want = (int64_t)n_prompt + (n_predict >= 0 ? n_predict : DEFAULT_CTX);
    return (int)KEEL_MIN((int64_t)c->max_ctx, KEEL_MAX(want, (int64_t)DEFAULT_CTX));
}

typedef struct stream {
    bool ids;
    bool tty; /* stdout is a terminal: control bytes are shown as U+FFFD instead of driving it */
    keel_detok d;
    int n;
    bool failed;
    keel_err err;
} stream;

static void write_text(const char *buf, size_t n, bool tty) {
    if (!tty) {
        fwrite(buf, 1, n, stdout);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)buf[i];
        if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) fputs("\xef\xbf\xbd", stdout);
        else putchar(c);
    }
}

static int on_token(void *user, int tok, int64_t pos) {
    (void)pos;
    stream *s = user;
    if (s->ids) {
        printf("%s%d", s->n ? " " : "", tok);
    } else {
        char buf[256];
        size_t w = 0;
        if (keel_detok_push(&s->d, tok, buf, sizeof buf, &w, &s->err) != KEEL_OK) {
            s->failed = true;
            return 1;
        }
        write_text(buf, w, s->tty);
    }
    s->n++;
    fflush(stdout);
    return 0;
}

/* The engine a->backend names, for up to ctx positions: *ce on CUDA, e on the CPU. 0, or an exit status. */
static int start_engine(const char *cmd, const run_args *a, const keel_model *m, int ctx, keel_engine *e,
                        keel_cuda_engine **ce) {
    keel_err err = {0};
#ifdef KEEL_HAVE_CUDA
    if (a->backend == KEEL_BACKEND_CUDA &&
        (keel_cuda_engine_init(ce, m, ctx, &err) != KEEL_OK ||
         keel_cuda_engine_set_activations(*ce, a->f32 ? KEEL_DT_F32 : KEEL_DT_BF16, &err) != KEEL_OK))
        return keel_cli_fail(cmd, "%s", err.msg);
#else
    (void)ce;
#endif
    if (a->backend == KEEL_BACKEND_CPU && keel_engine_init(e, m, ctx, &err) != KEEL_OK)
        return keel_cli_fail(cmd, "%s", err.msg);
    return 0;
}

static const char *stop_text(keel_stop s) {
    switch (s) {
    case KEEL_STOP_EOS: return "end of sequence";
    case KEEL_STOP_LENGTH: return "token budget (-n)";
    case KEEL_STOP_CONTEXT: return "context limit";
    case KEEL_STOP_CALLBACK: return "output error";
    default: return "none";
    }
}

int keel_cli_run(int argc, char **argv) {
    const char *cmd = "run";
    run_args a;
    int rc = parse_args(cmd, argc, argv, false, &a);
    if (rc) return rc < 0 ? 0 : rc;
    if (a.threads) keel_cpu_set_threads(a.threads);
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, a.dir, "", &err) != KEEL_OK) {
        keel_model_free(&m);
        return keel_cli_fail(cmd, "%s", err.msg);
    }
    keel_tokenizer *t = NULL;
    int *ids = NULL, n = 0;
    keel_engine e = {0};
    keel_cuda_engine *ce = NULL; /* the CUDA engine where a.backend picks it */
    stream st = {.ids = a.ids, .tty = isatty(fileno(stdout)) != 0};
    if (!a.ids || a.prompt) {
        rc = load_tokenizer(cmd, &m, a.prompt ? "--prompt" : "printing text (without --ids)", &t);
        if (rc) goto done;
    }
    rc = prompt_ids(cmd, &a, &m, t, &ids, &n);
    if (rc) goto done;
    int ctx = choose_ctx(cmd, &a, &m.cfg, n, a.n_predict);
    if (ctx < 0) {
        rc = 1;
        goto done;
    }
    if (n > ctx) {
        rc = keel_cli_fail(cmd, "the prompt has %d tokens, longer than the context of %d tokens (--ctx)", n, ctx);
        goto done;
    }
    if ((rc = start_engine(cmd, &a, &m, ctx, &e, &ce))) goto done;
    if (t) keel_detok_init(&st.d, t);
    static const int no_eos[1] = {-1};
    keel_gen_opts o = {.n_predict = a.n_predict, .samp = a.samp, .eos = a.ignore_eos ? no_eos : NULL, .n_eos = 0};
    keel_gen_result res;
#ifdef KEEL_HAVE_CUDA
    keel_code gc = ce ? keel_cuda_generate(ce, ids, n, &o, on_token, &st, &res, &err)
                      : keel_generate(&e, ids, n, &o, on_token, &st, &res, &err);
#else
    keel_code gc = keel_generate(&e, ids, n, &o, on_token, &st, &res, &err);
#endif
    if (!a.ids && t) {
        char tail[16];
        size_t w = keel_detok_flush(&st.d, tail, sizeof tail);
        write_text(tail, w, st.tty);
    }
    printf("\n");
    fflush(stdout);
    if (gc != KEEL_OK) {
        rc = keel_cli_fail(cmd, "%s", err.msg);
        goto done;
    }
    if (st.failed) {
        rc = keel_cli_fail(cmd, "%s", st.err.msg);
        goto done;
    }
    fprintf(stderr, "prompt: %d tokens in %.3f s (%.1f tokens/s); generation: %d tokens in %.3f s (%.1f tokens/s)\n",
            res.n_prompt, res.prompt_s, res.prompt_s > 0 ? res.n_prompt / res.prompt_s : 0.0, res.n_gen, res.gen_s,
            res.gen_s > 0 ? res.n_gen / res.gen_s : 0.0);
    if (res.stop == KEEL_STOP_CONTEXT)
        fprintf(stderr, "stopped: the context limit of %d tokens was reached (raise it with --ctx, at most %d)\n",
                ctx, m.cfg.max_ctx);
    else
        fprintf(stderr, "stopped: %s\n", stop_text(res.stop));
done:
#ifdef KEEL_HAVE_CUDA
    keel_cuda_engine_free(ce);
#endif
    keel_engine_free(&e);
    free(ids);
    keel_tokenizer_free(t);
    keel_model_free(&m);
    return rc;
}

int keel_cli_logits(int argc, char **argv) {
    const char *cmd = "logits";
    run_args a;
    int rc = parse_args(cmd, argc, argv, true, &a);
    if (rc) return rc < 0 ? 0 : rc;
    if (a.threads) keel_cpu_set_threads(a.threads);
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, a.dir, a.mtp ? NULL : "", &err) != KEEL_OK) {
        keel_model_free(&m);
        return keel_cli_fail(cmd, "%s", err.msg);
    }
    keel_tokenizer *t = NULL;
    int *ids = NULL, n = 0;
    float *lg = NULL, *hd = NULL, *ml = NULL, *mh = NULL;
    keel_engine e = {0};
    keel_cuda_engine *ce = NULL; /* the CUDA engine where a.backend picks it */
    keel_st_writer w;
    keel_st_writer_init(&w);
    if (a.mtp && !m.has_mtp) {
        rc = keel_cli_fail(cmd, "--mtp: %s has no mtp.safetensors", a.dir);
        goto done;
    }
    if (a.prompt && (rc = load_tokenizer(cmd, &m, "--prompt", &t))) goto done;
    if ((rc = prompt_ids(cmd, &a, &m, t, &ids, &n))) goto done;
    if (a.mtp && n < 2) {
        rc = keel_cli_fail(cmd, "--mtp needs at least 2 tokens (the head at position i reads token i+1), got %d", n);
        goto done;
    }
    if (a.ctx && n > a.ctx) {
        rc = keel_cli_fail(cmd, "the prompt has %d tokens, longer than the context of %d tokens (--ctx)", n, a.ctx);
        goto done;
    }
    if ((rc = start_engine(cmd, &a, &m, n, &e, &ce))) goto done;
    const int V = m.cfg.vocab, H = m.cfg.hidden;
    lg = malloc((size_t)n * V * sizeof(float));
    hd = malloc((size_t)n * H * sizeof(float));
    if (a.mtp) {
        ml = malloc((size_t)(n - 1) * V * sizeof(float));
        mh = malloc((size_t)(n - 1) * H * sizeof(float));
    }
    if (!lg || !hd || (a.mtp && (!ml || !mh))) {
        rc = keel_cli_fail(cmd, "cannot allocate logits for %d positions of %d ids", n, V);
        goto done;
    }
    double t0 = keel_now();
    keel_code fc;
#ifdef KEEL_HAVE_CUDA
    if (ce)
        fc = keel_cuda_engine_forward(ce, ids, n, lg, KEEL_LOGITS_ALL, hd, &err);
    else
#endif
        fc = keel_engine_forward(&e, ids, n, lg, KEEL_LOGITS_ALL, hd, &err);
    if (fc == KEEL_OK && a.mtp) {
#ifdef KEEL_HAVE_CUDA
        if (ce)
            fc = keel_cuda_engine_mtp(ce, hd, ids + 1, n - 1, ml, mh, &err);
        else
#endif
            fc = keel_engine_mtp(&e, hd, ids + 1, n - 1, ml, mh, &err);
    }
    if (fc != KEEL_OK) {
        rc = keel_cli_fail(cmd, "%s", err.msg);
        goto done;
    }
    double dt = keel_now() - t0;
    int32_t *tok32 = (int32_t *)ids; /* int is 32 bits on every supported platform */
    _Static_assert(sizeof(int) == sizeof(int32_t), "int must be 32 bits");
    int64_t s_tok[1] = {n}, s_lg[2] = {n, V}, s_hd[2] = {n, H}, s_ml[2] = {n - 1, V}, s_mh[2] = {n - 1, H};
    if (keel_st_writer_add(&w, "tokens", KEEL_DT_I32, 1, s_tok, tok32, &err) ||
        keel_st_writer_add(&w, "logits", KEEL_DT_F32, 2, s_lg, lg, &err) ||
        keel_st_writer_add(&w, "hidden", KEEL_DT_F32, 2, s_hd, hd, &err) ||
        (a.mtp && (keel_st_writer_add(&w, "mtp_logits", KEEL_DT_F32, 2, s_ml, ml, &err) ||
                   keel_st_writer_add(&w, "mtp_hidden", KEEL_DT_F32, 2, s_mh, mh, &err)))) {
        rc = keel_cli_fail(cmd, "%s", err.msg);
        goto done;
    }
    keel_st_writer_meta(&w, "made_by", a.backend != KEEL_BACKEND_CUDA ? "keel logits (CPU engine, float32)"
                                       : a.f32 ? "keel logits (CUDA engine, f32 activations)"
                                               : "keel logits (CUDA engine, bf16 activations)");
    if (keel_st_writer_write(&w, a.out, &err) != KEEL_OK) {
        rc = keel_cli_fail(cmd, "%s", err.msg);
        goto done;
    }
    fprintf(stderr, "%d positions in %.3f s (%.1f tokens/s)%s -> %s\n", n, dt, dt > 0 ? n / dt : 0.0,
            a.mtp ? " with the MTP head" : "", a.out);
done:
    keel_st_writer_free(&w);
#ifdef KEEL_HAVE_CUDA
    keel_cuda_engine_free(ce);
#endif
    keel_engine_free(&e);
    free(lg);
    free(hd);
    free(ml);
    free(mh);
    free(ids);
    keel_tokenizer_free(t);
    keel_model_free(&m);
    return rc;
}
