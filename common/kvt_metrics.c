/* DESIGN: the registry holds no counters of its own (uptime is a source like the others, so
 * the daemon decides where it appears): every family comes from a source, and sources are
 * appended only at start-up, so the readers (HTTP thread, STATS on the
 * server thread) need no lock to walk them while writers keep counting their own atomics. */
#include "kvt_metrics.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S_MAX_SOURCES 16

static const double s_bounds[KVT_HIST_BOUNDS] = {
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
    25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0};
#define S_NB KVT_HIST_BOUNDS

struct kvt_metrics {
    double started_wall;
    uint64_t started_ms;
    struct {
        kvt_source_fn fn;
        void *ctx;
    } sources[S_MAX_SOURCES];
    int nsources;
};

kvt_metrics_t *kvt_metrics_new(void)
{
    kvt_metrics_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->started_wall = kvt_wall_s();
    self->started_ms = kvt_now_ms();
    return self;
}

void kvt_metrics_destroy(kvt_metrics_t **self_p)
{
    if (self_p && *self_p) {
        free(*self_p);
        *self_p = NULL;
    }
}

void kvt_hist_observe(kvt_hist_t *h, uint64_t ns)
{
    double s = (double)ns / 1e9;
    int b = 0;
    while (b < S_NB && s > s_bounds[b])
        b++;
    if (b < S_NB)
        atomic_fetch_add_explicit(&h->buckets[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, ns, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->count, 1, memory_order_relaxed);
}

void kvt_metrics_add_source(kvt_metrics_t *self, kvt_source_fn fn, void *ctx)
{
    kvt_assert(self->nsources < S_MAX_SOURCES);
    self->sources[self->nsources].fn = fn;
    self->sources[self->nsources].ctx = ctx;
    self->nsources++;
}

static uint64_t s_load(_Atomic uint64_t *v)
{
    return atomic_load_explicit(v, memory_order_relaxed);
}

void kvt_hist_emit(kvt_hist_t *h, const char *name, const char *help, const char *label,
                   const char *label_value, kvt_sample_fn emit, void *emit_ctx)
{
    uint64_t cum[S_NB], acc = 0;
    for (int b = 0; b < S_NB; b++) {
        acc += s_load(&h->buckets[b]);
        cum[b] = acc;
    }
    uint64_t count = s_load(&h->count);
    kvt_sample_t s = {.name = name, .help = help, .kind = KVT_METRIC_HISTOGRAM, .label = label,
                      .label_value = label_value, .bounds = s_bounds, .buckets = cum,
                      .nbounds = S_NB, .count = count < acc ? acc : count,
                      .sum = (double)s_load(&h->sum_ns) / 1e9};
    emit(emit_ctx, &s);
}

static void s_scalar(kvt_sample_fn emit, void *ctx, const char *name, const char *help,
                     kvt_metric_kind_t kind, double v)
{
    kvt_sample_t s = {.name = name, .help = help, .kind = kind, .value = v};
    emit(ctx, &s);
}

void kvt_metrics_uptime_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_metrics_t *self = ctx;
    s_scalar(emit, emit_ctx, "uptime_seconds", "Seconds since the daemon started.",
             KVT_METRIC_GAUGE, (double)(kvt_now_ms() - self->started_ms) / 1e3);
    s_scalar(emit, emit_ctx, "start_time_seconds", "Start time of the daemon, Unix epoch seconds.",
             KVT_METRIC_GAUGE, self->started_wall);
}

void kvt_metrics_each(kvt_metrics_t *self, kvt_sample_fn emit, void *ctx)
{
    for (int i = 0; i < self->nsources; i++)
        self->sources[i].fn(self->sources[i].ctx, emit, ctx);
}

/* ---- Prometheus text ---- */

typedef struct {
    FILE *f;
    const char *last; /* family whose HELP/TYPE was written last */
} s_prom_t;

static const char *s_kind_name(kvt_metric_kind_t k)
{
    return k == KVT_METRIC_COUNTER ? "counter" : k == KVT_METRIC_GAUGE ? "gauge" : "histogram";
}

static void s_labels(FILE *f, const kvt_sample_t *s, const char *le)
{
    if (!s->label && !le)
        return;
    fputc('{', f);
    if (s->label) {
        /* label values may come from configuration (adapter specs): escape per the format */
        fprintf(f, "%s=\"", s->label);
        for (const char *c = s->label_value; *c; c++) {
            if (*c == '\\' || *c == '"')
                fputc('\\', f);
            if (*c == '\n')
                fputs("\\n", f);
            else
                fputc(*c, f);
        }
        fputc('"', f);
    }
    if (le)
        fprintf(f, "%sle=\"%s\"", s->label ? "," : "", le);
    fputc('}', f);
}

static void s_prom_emit(void *ctx, const kvt_sample_t *s)
{
    s_prom_t *p = ctx;
    if (!p->last || strcmp(p->last, s->name) != 0) {
        fprintf(p->f, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\n", s->name, s->help, s->name,
                s_kind_name(s->kind));
        p->last = s->name;
    }
    if (s->kind != KVT_METRIC_HISTOGRAM) {
        fprintf(p->f, "kvtier_%s", s->name);
        s_labels(p->f, s, NULL);
        fprintf(p->f, " %.17g\n", s->value);
        return;
    }
    char le[32];
    for (int b = 0; b < s->nbounds; b++) {
        snprintf(le, sizeof le, "%g", s->bounds[b]);
        fprintf(p->f, "kvtier_%s_bucket", s->name);
        s_labels(p->f, s, le);
        fprintf(p->f, " %llu\n", (unsigned long long)s->buckets[b]);
    }
    fprintf(p->f, "kvtier_%s_bucket", s->name);
    s_labels(p->f, s, "+Inf");
    fprintf(p->f, " %llu\nkvtier_%s_sum", (unsigned long long)s->count, s->name);
    s_labels(p->f, s, NULL);
    fprintf(p->f, " %.9f\nkvtier_%s_count", s->sum, s->name);
    s_labels(p->f, s, NULL);
    fprintf(p->f, " %llu\n", (unsigned long long)s->count);
}

char *kvt_metrics_prometheus(kvt_metrics_t *self, size_t *len)
{
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f)
        return NULL;
    s_prom_t p = {f, NULL};
    kvt_metrics_each(self, s_prom_emit, &p);
    fclose(f);
    *len = n;
    return buf;
}

/* ---- JSON ---- */

static void s_json_emit(void *ctx, const kvt_sample_t *s)
{
    json_t *root = ctx;
    json_t *v;
    if (s->kind == KVT_METRIC_HISTOGRAM)
        v = json_pack("{s:I,s:f}", "count", (json_int_t)s->count, "sum", s->sum);
    else if (s->value == (double)(json_int_t)s->value)
        v = json_integer((json_int_t)s->value);
    else
        v = json_real(s->value);
    if (!s->label) {
        json_object_set_new(root, s->name, v);
        return;
    }
    json_t *group = json_object_get(root, s->name);
    if (!group) {
        group = json_object();
        json_object_set_new(root, s->name, group);
    }
    json_object_set_new(group, s->label_value, v);
}

json_t *kvt_metrics_json(kvt_metrics_t *self)
{
    json_t *root = json_object();
    kvt_assert(root);
    kvt_metrics_each(self, s_json_emit, root);
    return root;
}
