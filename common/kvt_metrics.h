/* kvt_metrics: the registry of metric sources and their three renderings (Prometheus text for
 * /metrics, JSON for /status, the STATS reply) from one sample stream, plus the latency
 * histogram every layer uses.
 *
 * Modules own their counters (relaxed atomics written by their own threads) and contribute
 * them through sources registered at start-up (before any reader runs); a source is called
 * from the reading thread and must only read atomics or take its own short locks. */
#ifndef KVT_METRICS_H
#define KVT_METRICS_H

#include <jansson.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_metrics kvt_metrics_t;

typedef enum { KVT_METRIC_COUNTER, KVT_METRIC_GAUGE, KVT_METRIC_HISTOGRAM } kvt_metric_kind_t;

/* One sample. Samples of one family (same name) are emitted consecutively. Histograms carry
 * cumulative bucket counts for `bounds` (the +Inf bucket is `count`). */
typedef struct {
    const char *name; /* without the kvtier_ prefix: "requests_total" */
    const char *help;
    kvt_metric_kind_t kind;
    const char *label; /* NULL when unlabelled */
    const char *label_value;
    double value;
    const double *bounds;
    const uint64_t *buckets;
    int nbounds;
    uint64_t count;
    double sum;
} kvt_sample_t;

typedef void (*kvt_sample_fn)(void *emit_ctx, const kvt_sample_t *s);
typedef void (*kvt_source_fn)(void *src_ctx, kvt_sample_fn emit, void *emit_ctx);

/* A latency histogram (seconds, buckets from 10 us to 10 s) of relaxed atomics: observe from
 * any thread, emit from a metrics source. Zero-initialised memory is an empty histogram. */
#define KVT_HIST_BOUNDS 19
typedef struct {
    _Atomic uint64_t count;
    _Atomic uint64_t sum_ns;
    _Atomic uint64_t buckets[KVT_HIST_BOUNDS];
} kvt_hist_t;

void kvt_hist_observe(kvt_hist_t *h, uint64_t ns);

/* Emits the histogram as one sample of family `name` (label may be NULL). */
void kvt_hist_emit(kvt_hist_t *h, const char *name, const char *help, const char *label,
                   const char *label_value, kvt_sample_fn emit, void *emit_ctx);

kvt_metrics_t *kvt_metrics_new(void);
void kvt_metrics_destroy(kvt_metrics_t **self_p);

/* Adds a source of samples; start-up only (main thread, before HTTP starts). */
void kvt_metrics_add_source(kvt_metrics_t *self, kvt_source_fn fn, void *ctx);

/* Emits every sample: each source in registration order. */
void kvt_metrics_each(kvt_metrics_t *self, kvt_sample_fn emit, void *ctx);

/* Metrics source (ctx: the registry): kvtier_uptime_seconds and kvtier_start_time_seconds,
 * counted from kvt_metrics_new. */
void kvt_metrics_uptime_source(void *ctx, kvt_sample_fn emit, void *emit_ctx);

/* Prometheus text exposition format 0.0.4, names prefixed kvtier_. Caller frees. */
char *kvt_metrics_prometheus(kvt_metrics_t *self, size_t *len);

/* The same numbers as an object: unlabelled -> number, labelled -> {label_value: number},
 * histograms -> {count, sum} (per label value when labelled). Caller json_decref()s. */
json_t *kvt_metrics_json(kvt_metrics_t *self);

#endif
