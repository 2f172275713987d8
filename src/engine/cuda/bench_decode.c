/* engine/cuda: `keel bench decode`: prompt tokens/s, decode tokens/s at batch 1 (greedy) and, on the CUDA engine,
 * the time per decoded token by kernel family from CUDA events (a second, profiled pass). */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "../engine.h"
#ifdef KEEL_HAVE_CUDA
#include "../../kernels/cuda/cuda.h"
#include "ecuda.h"
#endif

static const char *const USAGE =
    "usage: keel bench decode MODEL_DIR [--prompt-tokens P] [--tokens N] [--context C] [--backend cpu|cuda]\n"
    "                         [--activations bf16|f32] [--graphs on|off] [--pdl on|off] [--pdl-engine on|off]\n"
    "                         [--prefetch S] [--split-target Q] [--split-long on|off] [--split-round up|down]\n"
    "                         [--side on|off|low] [--fused-router on|off] [--fused-mamba on|off]\n"
    "                         [--route-window on|off] [--fused-norm on|off] [--packed on|off|all]\n"
    "  runs a P-token prompt (default 512) then N greedy decode steps (default 128) and reports prompt and decode\n"
    "  tokens/s. On cuda also: the bandwidth floor (bytes one step reads over the read bandwidth measured in the same\n"
    "  run) and its ratio to the measured time, and the time per token by kernel family (CUDA events, a second pass\n"
    "  launch by launch). --context C (cuda) starts decoding at context C: the prompt sits at C - P after C - P\n"
    "  positions of zero keys and values. --graphs off decodes launch by launch instead of replaying a CUDA graph.\n"
    "  --pdl off launches the stream tiles after the previous kernel ends instead of as programmatic dependents;\n"
    "  --pdl-engine off does so for the engine's other kernels only (norms, router, Mamba, attention; default on);\n"
    "  --prefetch S sets the tiles' L2 prefetch chunk in stages (default 0: none); --split-target Q splits k so that\n"
    "  a matrix gives about Q/4 blocks an SM (default 4); --split-long on halves long slices of matrices with enough\n"
    "  row tiles where both halves fit the SMs at once (default off); --split-round down rounds the split's slice\n"
    "  count down (at most Q/4 blocks an SM; default up: at least); --side off runs a layer's independent\n"
    "  launches (the shared expert, k and v) in one stream instead of two (low: the second at the lowest priority);\n"
    "  --fused-router on routes in one launch (matvec, top-k, unions) instead of three; --fused-mamba on runs Mamba's\n"
    "  step (conv, scan, gated norm) in one launch instead of three (both default off: slower in the graph);\n"
    "  --route-window off runs the router's top-k and its unions as two launches instead of one (default on);\n"
    "  --fused-norm off runs the residual add and norm before a MoE layer as a launch of its own instead of in the\n"
    "  router's matvec (default on); --packed off keeps windows of at most 8 rows on the ring tile instead of the\n"
    "  packed tile's copies of the matrices where it gives the same bits (default on: those with a row tile for every\n"
    "  warp of a full grid; all: every matrix where it gives the same bits, whatever its size).\n";

static int fail(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "keel bench decode: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, "\n");
    return 1;
}

static bool parse_count(const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || end == s || *end || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

/* "on" or "off" into *out (1 or 0); false for anything else. */
static bool parse_onoff(const char *s, int *out) {
    if (!s || (strcmp(s, "on") && strcmp(s, "off"))) return false;
    *out = !strcmp(s, "on");
    return true;
}

#ifdef KEEL_HAVE_CUDA
/* At the first generated token, restarts the family counters so they cover decode steps only. */
static int first_token_resets(void *user, int tok, int64_t pos) {
    (void)tok, (void)pos;
    bool *seen = ((void **)user)[1];
    if (!*seen) keel_cuda_engine_profile(((void **)user)[0], true);
    *seen = true;
    return 0;
}
#endif

int keel_engine_bench_decode(int argc, char **argv) {
    const char *dir = NULL;
    int P = 512, N = 128, backend = -1, C = 0;
    bool f32 = false, graphs = true;
    /* the stream tiles' levers; -1: not given, the library's default */
    int pdl = -1, pdl_engine = -1, prefetch = -1, split_q = -1, split_long = -1, split_down = -1;
    int side = -1; /* the engine's second stream: 0 off, 1 on, 2 low priority; -1: not given, the engine's default */
    int fused_router = -1, fused_mamba = -1, route_window = -1, fused_norm = -1, packed = -1; /* -1: the engine's default */
    int pack_all = 0; /* --packed all: every eligible matrix packed (keel_cuda_engine_pack_scope) */
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            fputs(USAGE, stdout);
            return 0;
        }
        if (o[0] != '-' && !dir) {
            dir = o;
            continue;
        }
        if (!strcmp(o, "--prompt-tokens")) {
            if (!parse_count(v, 1, 1 << 20, &P)) return fail("--prompt-tokens '%s': expected 1..1048576%s", v ? v : "", "");
        } else if (!strcmp(o, "--tokens")) {
            if (!parse_count(v, 2, 1 << 20, &N)) return fail("--tokens '%s': expected 2..1048576%s", v ? v : "", "");
        } else if (!strcmp(o, "--context")) {
            if (!parse_count(v, 1, 1 << 24, &C)) return fail("--context '%s': expected 1..16777216%s", v ? v : "", "");
        } else if (!strcmp(o, "--graphs")) {
            int on = 0;
            if (!parse_onoff(v, &on)) return fail("--graphs '%s': expected on or off%s", v ? v : "", "");
            graphs = on;
        } else if (!strcmp(o, "--pdl")) {
            if (!parse_onoff(v, &pdl)) return fail("--pdl '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--pdl-engine")) {
            if (!parse_onoff(v, &pdl_engine)) return fail("--pdl-engine '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--prefetch")) {
            if (!parse_count(v, 0, 64, &prefetch)) return fail("--prefetch '%s': expected 0..64 stages%s", v ? v : "", "");
        } else if (!strcmp(o, "--split-round")) {
            if (v && !strcmp(v, "up")) split_down = 0;
            else if (v && !strcmp(v, "down")) split_down = 1;
            else return fail("--split-round '%s': expected up or down%s", v ? v : "", "");
        } else if (!strcmp(o, "--split-long")) {
            if (!parse_onoff(v, &split_long)) return fail("--split-long '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--side")) {
            if (v && !strcmp(v, "low")) side = 2;
            else if (!parse_onoff(v, &side)) return fail("--side '%s': expected on, off or low%s", v ? v : "", "");
        } else if (!strcmp(o, "--route-window")) {
            if (!parse_onoff(v, &route_window)) return fail("--route-window '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--fused-router")) {
            if (!parse_onoff(v, &fused_router)) return fail("--fused-router '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--fused-norm")) {
            if (!parse_onoff(v, &fused_norm)) return fail("--fused-norm '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--packed")) {
            if (v && !strcmp(v, "all")) packed = pack_all = 1;
            else if (!parse_onoff(v, &packed)) return fail("--packed '%s': expected on, off or all%s", v ? v : "", "");
        } else if (!strcmp(o, "--fused-mamba")) {
            if (!parse_onoff(v, &fused_mamba)) return fail("--fused-mamba '%s': expected on or off%s", v ? v : "", "");
        } else if (!strcmp(o, "--split-target")) {
            if (!parse_count(v, 1, 64, &split_q)) return fail("--split-target '%s': expected 1..64%s", v ? v : "", "");
        } else if (!strcmp(o, "--activations")) {
            if (v && (!strcmp(v, "bf16") || !strcmp(v, "f32"))) f32 = !strcmp(v, "f32");
            else return fail("--activations '%s': expected bf16 or f32%s", v ? v : "", "");
        } else if (!strcmp(o, "--backend")) {
            if (v && !strcmp(v, "cpu")) backend = KEEL_BACKEND_CPU;
            else if (v && !strcmp(v, "cuda")) backend = KEEL_BACKEND_CUDA;
            else return fail("--backend '%s': expected cpu or cuda%s", v ? v : "", "");
        } else {
            return fail("unknown option '%s'%s", o, "");
        }
        i++;
    }
    if (!dir) return fail("no MODEL_DIR given%s%s", "", "");
#ifdef KEEL_HAVE_CUDA
    if (backend < 0) backend = keel_cuda_device_count() > 0 ? KEEL_BACKEND_CUDA : KEEL_BACKEND_CPU;
#else
    if (backend == KEEL_BACKEND_CUDA) return fail("--backend cuda: this keel was built without CUDA%s%s", "", "");
    backend = KEEL_BACKEND_CPU;
#endif
    if (f32 && backend == KEEL_BACKEND_CPU) return fail("--activations f32 is a CUDA engine option%s%s", "", "");
    if ((C || !graphs || pdl >= 0 || pdl_engine >= 0 || prefetch >= 0 || split_q >= 0 || split_long >= 0 ||
         split_down >= 0 || side >= 0 || fused_router >= 0 || fused_mamba >= 0 || route_window >= 0 ||
         fused_norm >= 0 || packed >= 0) &&
        backend == KEEL_BACKEND_CPU)
        return fail("--context, --graphs, --pdl, --pdl-engine, --prefetch, --split-target, --split-long, "
                    "--split-round, --side, --fused-router, --fused-mamba, --route-window, --fused-norm and --packed are "
                    "CUDA engine options%s%s", "", "");
    if (C && C < P) return fail("--context must be at least --prompt-tokens%s%s", "", "");
    const int start = C ? C - P : 0;
    keel_model m;
    keel_err err = {0};
    if (keel_model_load(&m, dir, "", &err) != KEEL_OK) {
        keel_model_free(&m);
        return fail("%s%s", err.msg, "");
    }
    const int ctx = start + P + N + 1;
    int *prompt = keel_xmalloc((size_t)P * sizeof(int));
    uint64_t z = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < P; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int)((z >> 33) % (uint64_t)m.cfg.vocab);
    }
    static const int no_eos[1] = {-1};
    keel_gen_opts o = {.n_predict = N, .samp = {.temp = 0.0f}, .eos = no_eos, .n_eos = 0};
    keel_gen_result res;
    int rc = 0;
    char dev[128] = "cpu";
    if (backend == KEEL_BACKEND_CPU) {
        keel_engine e;
        if (keel_engine_init(&e, &m, ctx, &err) != KEEL_OK || keel_generate(&e, prompt, P, &o, NULL, NULL, &res, &err)) {
            rc = fail("%s%s", err.msg, "");
        }
        keel_engine_free(&e);
    }
#ifdef KEEL_HAVE_CUDA
    keel_cuda_engine *ce = NULL;
    double ms[KEEL_CUF_N] = {0};
    long launches[KEEL_CUF_N] = {0};
    int prof_steps = 0;
    double read_gbs = 0;
    if (backend == KEEL_BACKEND_CUDA) {
        keel_cuda_device_name(dev, sizeof dev);
        read_gbs = keel_cuda_read_gbs();
        if (pdl < 0) pdl = KEEL_CUDA_STREAM_PDL_DEFAULT;
        if (pdl_engine < 0) pdl_engine = KEEL_ECU_PDL_DEFAULT;
        if (prefetch < 0) prefetch = KEEL_CUDA_STREAM_PREFETCH_DEFAULT;
        if (split_q < 0) split_q = KEEL_CUDA_STREAM_SPLIT_TARGET_DEFAULT;
        if (split_long < 0) split_long = KEEL_CUDA_STREAM_SPLIT_LONG_DEFAULT;
        if (split_down < 0) split_down = KEEL_CUDA_STREAM_SPLIT_ROUND_DEFAULT;
        if (side < 0) side = KEEL_CUDA_ENGINE_SIDE_DEFAULT;
        if (fused_router < 0) fused_router = KEEL_CUDA_ENGINE_FUSED_ROUTER_DEFAULT;
        if (fused_mamba < 0) fused_mamba = KEEL_CUDA_ENGINE_FUSED_MAMBA_DEFAULT;
        if (route_window < 0) route_window = KEEL_CUDA_ENGINE_ROUTE_WINDOW_DEFAULT;
        if (fused_norm < 0) fused_norm = KEEL_CUDA_ENGINE_FUSED_NORM_DEFAULT;
        if (packed < 0) packed = KEEL_CUDA_ENGINE_PACKED_DEFAULT;
        keel_cuda_stream_split_long(split_long);
        keel_cuda_stream_split_round(split_down);
        keel_cuda_stream_pdl(pdl);
        keel_ecu_set_pdl(pdl_engine);
        keel_cuda_stream_prefetch(prefetch);
        keel_cuda_stream_split_target(split_q);
        keel_cuda_engine_pack_scope(pack_all ? KEEL_CUDA_ENGINE_PACK_ALL : KEEL_CUDA_ENGINE_PACK_LARGE);
        if (keel_cuda_engine_init(&ce, &m, ctx, &err) != KEEL_OK ||
            keel_cuda_engine_set_activations(ce, f32 ? KEEL_DT_F32 : KEEL_DT_BF16, &err) != KEEL_OK ||
            (keel_cuda_engine_set_graphs(ce, graphs), keel_cuda_engine_set_start(ce, start),
             keel_cuda_engine_set_side(ce, side), keel_cuda_engine_set_fused_router(ce, fused_router),
             keel_cuda_engine_set_fused_mamba(ce, fused_mamba), keel_cuda_engine_set_route_window(ce, route_window),
             keel_cuda_engine_set_fused_norm(ce, fused_norm), keel_cuda_engine_set_packed(ce, packed),
             keel_cuda_generate(ce, prompt, KEEL_MIN(P, 8), &o, NULL, NULL, &res, &err)) != KEEL_OK || /* warm-up */
            keel_cuda_generate(ce, prompt, P, &o, NULL, NULL, &res, &err) != KEEL_OK) {
            rc = fail("%s%s", err.msg, "");
        } else {
            bool seen = false;
            void *u[2] = {ce, &seen};
            keel_gen_result pr;
            keel_cuda_engine_profile(ce, true);
            if (keel_cuda_generate(ce, prompt, P, &o, first_token_resets, u, &pr, &err) != KEEL_OK)
                rc = fail("%s%s", err.msg, "");
            keel_cuda_engine_profile_get(ce, ms, launches);
            keel_cuda_engine_profile(ce, false);
            prof_steps = pr.n_gen - 1;
        }
    }
#endif
    if (!rc) {
        printf("keel bench decode: %s, backend %s (%s)%s\n", dir, backend == KEEL_BACKEND_CUDA ? "cuda" : "cpu", dev,
               backend == KEEL_BACKEND_CUDA ? (f32 ? ", f32 activations" : ", bf16 activations") : "");
        printf("prompt: %d tokens in %.3f s: %.1f tokens/s\n", res.n_prompt, res.prompt_s,
               res.prompt_s > 0 ? res.n_prompt / res.prompt_s : 0.0);
        printf("decode: %d tokens in %.3f s: %.2f tokens/s at batch 1 (%.3f ms/token)%s, context %d..%d\n", res.n_gen,
               res.gen_s, res.gen_s > 0 ? res.n_gen / res.gen_s : 0.0, res.n_gen ? 1e3 * res.gen_s / res.n_gen : 0.0,
               backend == KEEL_BACKEND_CUDA ? (graphs ? ", CUDA graph" : ", launch by launch") : "", start + P,
               start + P + res.n_gen);
#ifdef KEEL_HAVE_CUDA
        if (backend == KEEL_BACKEND_CUDA)
            printf("stream tiles: programmatic dependent launch %s (the engine's kernels %s), L2 prefetch chunk %d "
                   "stages, k-split target %d/4 blocks an SM%s, long slices halved %s; second stream %s; router in %s; "
                   "Mamba step in %s; norms %s; packed tile %s (%d matrices)\n",
                   pdl ? "on" : "off", pdl && pdl_engine ? "too" : "not", prefetch, split_q,
                   split_down ? " (at most)" : "", split_long ? "on" : "off",
                   side == 0 ? "off" : side == 2 ? "on (lowest priority)" : "on",
                   fused_router ? "one launch" : route_window ? "two launches (top-k with the unions)" : "three launches",
                   fused_mamba ? "one launch" : "three launches",
                   fused_norm ? "in the router" : "launches of their own", pack_all ? "on, all" : packed ? "on" : "off",
                   keel_cuda_engine_packed_count(ce));
        if (backend == KEEL_BACKEND_CUDA && res.n_gen > 0 && read_gbs > 0) {
            const double bytes = (double)keel_cuda_engine_step_bytes(ce, start + P + res.n_gen / 2);
            const double floor_ms = bytes / (read_gbs * 1e9) * 1e3, ms = 1e3 * res.gen_s / res.n_gen;
            printf("bandwidth floor: %.3f GB read per token (weights streamed, Mamba states, keys and values at the "
                   "middle context) / %.0f GB/s measured read bandwidth = %.3f ms/token (%.0f tokens/s); measured "
                   "time is %.2fx the floor\n", bytes / 1e9, read_gbs, floor_ms, 1e3 / floor_ms, ms / floor_ms);
        }
        if (backend == KEEL_BACKEND_CUDA && prof_steps > 0) {
            double tot = 0;
            for (int f = 0; f < KEEL_CUF_N; f++) tot += ms[f];
            printf("time per decoded token by kernel family (CUDA events around each family, launch by launch, %d "
                   "steps; the events and launch gaps add time a graph does not spend):\n", prof_steps);
            printf("  %-28s %10s %9s %7s\n", "family", "ms/token", "spans", "share");
            for (int f = 0; f < KEEL_CUF_N; f++)
                printf("  %-28s %10.4f %9.1f %6.1f%%\n", keel_cuda_family_name((keel_cuda_family)f), ms[f] / prof_steps,
                       (double)launches[f] / prof_steps, tot > 0 ? 100.0 * ms[f] / tot : 0.0);
            printf("  %-28s %10.4f\n", "sum of families", tot / prof_steps);
        }
        keel_cuda_engine_free(ce);
#endif
    }
#ifdef KEEL_HAVE_CUDA
    else keel_cuda_engine_free(ce);
#endif
    free(prompt);
    keel_model_free(&m);
    return rc;
}
