/* DESIGN: fixed arrays of relaxed atomics indexed by request type and wire error; no locks on
 * the write path. A scrape walks them while writers keep counting: a consistent-enough
 * snapshot, as usual for Prometheus. */
#include "kvt_reqstats.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_proto.h"

#include <stdatomic.h>
#include <stdlib.h>

struct kvt_reqstats {
    _Atomic uint64_t requests[KVT_REQ_SLOTS];
    _Atomic uint64_t errors[KVT_WIRE_ERRORS];
    kvt_hist_t durations[KVT_REQ_SLOTS];
    _Atomic uint64_t lookup_keys, lookup_l1, lookup_l2;
    _Atomic uint64_t dropped;
    _Atomic uint64_t reply_failed;
};

kvt_reqstats_t *kvt_reqstats_new(void)
{
    kvt_reqstats_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    return self;
}

void kvt_reqstats_destroy(kvt_reqstats_t **self_p)
{
    if (self_p && *self_p) {
        free(*self_p);
        *self_p = NULL;
    }
}

void kvt_reqstats_request(kvt_reqstats_t *self, uint64_t type, int rc, uint64_t ns)
{
    size_t t = kvt_proto_info(type) ? (size_t)type : 0;
    atomic_fetch_add_explicit(&self->requests[t], 1, memory_order_relaxed);
    if (rc)
        atomic_fetch_add_explicit(&self->errors[kvt_err_wire_index(rc)], 1,
                                  memory_order_relaxed);
    kvt_hist_observe(&self->durations[t], ns);
}

void kvt_reqstats_lookup(kvt_reqstats_t *self, uint32_t keys, uint32_t l1, uint32_t l2)
{
    atomic_fetch_add_explicit(&self->lookup_keys, keys, memory_order_relaxed);
    atomic_fetch_add_explicit(&self->lookup_l1, l1, memory_order_relaxed);
    atomic_fetch_add_explicit(&self->lookup_l2, l2, memory_order_relaxed);
}

void kvt_reqstats_dropped(kvt_reqstats_t *self)
{
    atomic_fetch_add_explicit(&self->dropped, 1, memory_order_relaxed);
}

void kvt_reqstats_reply_failed(kvt_reqstats_t *self)
{
    atomic_fetch_add_explicit(&self->reply_failed, 1, memory_order_relaxed);
}

static double s_load(_Atomic uint64_t *v)
{
    return (double)atomic_load_explicit(v, memory_order_relaxed);
}

static void s_counter(kvt_sample_fn emit, void *ctx, const char *name, const char *help,
                      const char *label, const char *label_value, double v)
{
    kvt_sample_t s = {.name = name, .help = help, .kind = KVT_METRIC_COUNTER, .label = label,
                      .label_value = label_value, .value = v};
    emit(ctx, &s);
}

void kvt_reqstats_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_reqstats_t *self = ctx;
    for (size_t t = 0; t < KVT_REQ_SLOTS; t++)
        if (t == 0 || kvt_proto_info(t))
            s_counter(emit, emit_ctx, "requests_total", "Requests answered, by request type.",
                      "type", kvt_proto_name(t), s_load(&self->requests[t]));
    for (int e = 0; e < KVT_WIRE_ERRORS; e++)
        s_counter(emit, emit_ctx, "request_errors_total",
                  "Requests answered with an error, by error code.", "code",
                  kvt_err_wire_name(e), s_load(&self->errors[e]));
    for (size_t t = 0; t < KVT_REQ_SLOTS; t++)
        if (t == 0 || kvt_proto_info(t))
            kvt_hist_emit(&self->durations[t], "request_duration_seconds",
                          "Time from receiving a request to sending its reply.", "type",
                          kvt_proto_name(t), emit, emit_ctx);
    s_counter(emit, emit_ctx, "lookup_keys_total", "Keys asked for in answered LOOKUPs.", NULL,
              NULL, s_load(&self->lookup_keys));
    s_counter(emit, emit_ctx, "lookup_hit_keys_total",
              "Keys of answered LOOKUPs found cached (the prefix), by the tier that held them.",
              "tier", "l1", s_load(&self->lookup_l1));
    s_counter(emit, emit_ctx, "lookup_hit_keys_total",
              "Keys of answered LOOKUPs found cached (the prefix), by the tier that held them.",
              "tier", "l2", s_load(&self->lookup_l2));
    s_counter(emit, emit_ctx, "messages_dropped_total",
              "Messages dropped without a reply because their first frame was not a uid.", NULL,
              NULL, s_load(&self->dropped));
    s_counter(emit, emit_ctx, "replies_failed_total",
              "Replies that could not be sent (the client connection was gone).", NULL, NULL,
              s_load(&self->reply_failed));
}
