/* DESIGN: bindings are a ring of S_BIND_BYTES / chunk entries (at least 1024), each a chunk key,
 * its parent and its tokens in one flat array; a u64map from the key's first 8 bytes finds the
 * entry (the whole key is compared). A new binding takes the oldest slot and drops that entry's
 * map slot when it still points there.
 *
 * A poll reads the log S_PAGE records at a time, turning each record of the model into events
 * (a removed record into one event, a stored record into one event per run of bound chunks
 * whose parents chain, at most S_MAX_RUN_TOKENS tokens each), until max_events are collected
 * or S_SCAN records were read. A record is taken whole or not at all: one whose events would
 * go past max_events waits for the next poll, unless it is the reply's first. The
 * events point into the records and the bindings, both kept until the reply is packed. Which
 * state each (block, medium) had last in this reply is kept in a u64map, so the TP workers'
 * copies of a chunk come out once. */
#include "kvt_lmc_events.h"

#include "kvt_lmc.h"
#include "kvt_log.h"
#include "kvt_u64map.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define S_BIND_BYTES (16u << 20) /* token ids kept for the bindings */
#define S_MIN_BINDINGS 4          /* even with chunks of a million tokens: 16 MiB */
#define S_MAX_RUN_TOKENS (1u << 20) /* token ids in one event: a longer run is split */
#define S_PAGE 256
#define S_SCAN 65536 /* records one poll reads at most (other models' included) */
#define S_PREFIX "lmcache/"

typedef struct {
    kvt_key_t key, parent;
    bool used, has_parent;
} s_bind_t;

typedef struct {
    uint64_t seq;
    bool stored, storage;
    uint32_t h0, n; /* hashes[h0 .. h0+n) of the reply */
    const kvt_key_t *parent;
} s_ev_t;

struct kvt_lmc_events {
    kvt_evlog_t *log;
    uint32_t chunk;
    s_bind_t *binds;
    uint32_t *tokens; /* cap * chunk */
    uint32_t cap, next;
    kvt_u64map_t *by_key; /* key's first 8 bytes -> entry index + 1 */
    /* one reply's, reused */
    s_ev_t *evs;
    uint32_t nev, evcap;
    kvt_key_t *hashes;
    const uint32_t **toks; /* per hash: its tokens (stored), parallel to hashes */
    uint32_t nh, hcap, tcap;
    kvt_evrec_t **held;
    uint32_t nheld, heldcap;
    kvt_u64map_t *last; /* (block, medium) -> 1 stored / 2 removed, within one reply */
    _Atomic uint64_t sent, unbound;
};

static uint64_t s_k64(const kvt_key_t *k)
{
    uint64_t v;
    memcpy(&v, k->b, sizeof v);
    return v;
}

kvt_lmc_events_t *kvt_lmc_events_new(kvt_evlog_t *log, uint32_t chunk)
{
    kvt_lmc_events_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->log = log;
    self->chunk = chunk;
    if (!log)
        return self;
    uint64_t cap = S_BIND_BYTES / ((uint64_t)chunk * 4u);
    self->cap = cap < S_MIN_BINDINGS ? S_MIN_BINDINGS : (uint32_t)cap;
    self->binds = calloc(self->cap, sizeof *self->binds);
    self->tokens = malloc((size_t)self->cap * chunk * sizeof *self->tokens);
    kvt_assert(self->binds && self->tokens);
    self->by_key = kvt_u64map_new();
    self->last = kvt_u64map_new();
    return self;
}

void kvt_lmc_events_destroy(kvt_lmc_events_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_lmc_events_t *self = *self_p;
    kvt_u64map_destroy(&self->by_key);
    kvt_u64map_destroy(&self->last);
    free(self->binds);
    free(self->tokens);
    free(self->evs);
    free(self->hashes);
    free(self->toks);
    free(self->held);
    free(self);
    *self_p = NULL;
}

bool kvt_lmc_events_enabled(const kvt_lmc_events_t *self)
{
    return self->log != NULL;
}

static s_bind_t *s_find(kvt_lmc_events_t *self, const kvt_key_t *key)
{
    uintptr_t v = (uintptr_t)kvt_u64map_get(self->by_key, s_k64(key));
    if (!v)
        return NULL;
    s_bind_t *b = &self->binds[v - 1];
    return memcmp(b->key.b, key->b, KVT_KEY_LEN) == 0 ? b : NULL;
}

void kvt_lmc_events_bind(kvt_lmc_events_t *self, const kvt_key_t *keys, const uint32_t *tokens,
                         uint32_t base, const uint32_t *idx, uint32_t m)
{
    if (!self->log)
        return;
    for (uint32_t j = 0; j < m; j++) {
        uint32_t c = base + idx[j];
        if (s_find(self, &keys[c]))
            continue; /* the same key is the same tokens */
        uint32_t e = self->next;
        self->next = (e + 1) % self->cap;
        s_bind_t *b = &self->binds[e];
        if (b->used && (uintptr_t)kvt_u64map_get(self->by_key, s_k64(&b->key)) == e + 1)
            kvt_u64map_remove(self->by_key, s_k64(&b->key));
        b->used = true;
        b->key = keys[c];
        b->has_parent = c > 0;
        if (c > 0)
            b->parent = keys[c - 1];
        memcpy(&self->tokens[(size_t)e * self->chunk], &tokens[(size_t)c * self->chunk],
               (size_t)self->chunk * sizeof *tokens);
        kvt_u64map_set(self->by_key, s_k64(&keys[c]), (void *)(uintptr_t)(e + 1));
    }
}

/* Whether ns is one of the door's namespaces of `model`: "lmcache/<model>/<world>/<worker>". */
static bool s_of_model(const kvt_ns_t *ns, const char *model, size_t mlen)
{
    size_t plen = strlen(S_PREFIX), n = ns->name_len;
    const char *s = (const char *)ns->name;
    if (n < plen + mlen + 4 || memcmp(s, S_PREFIX, plen) != 0 ||
        memcmp(s + plen, model, mlen) != 0 || s[plen + mlen] != '/')
        return false;
    const char *rest = s + plen + mlen + 1, *end = s + n; /* "<world>/<worker>" */
    const char *slash = memchr(rest, '/', (size_t)(end - rest));
    return slash && slash > rest && slash + 1 < end &&
           !memchr(slash + 1, '/', (size_t)(end - slash - 1));
}

static void s_grow(void **p, uint32_t *cap, uint32_t need, size_t size)
{
    if (need <= *cap)
        return;
    uint32_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    *p = realloc(*p, (size_t)c * size);
    kvt_assert(*p);
    *cap = c;
}

/* Whether (key, medium) is to be reported as `stored` / removed now: not when this reply
 * reported it in that state last. */
static bool s_changed(kvt_lmc_events_t *self, const kvt_key_t *key, bool storage, bool stored)
{
    uint64_t k = s_k64(key) ^ (storage ? 0x9e3779b97f4a7c15ull : 0);
    uintptr_t want = stored ? 1 : 2;
    if ((uintptr_t)kvt_u64map_get(self->last, k) == want)
        return false;
    kvt_u64map_set(self->last, k, (void *)want);
    return true;
}

static s_ev_t *s_ev_open(kvt_lmc_events_t *self, const kvt_evrec_t *r, bool stored, bool storage,
                         const kvt_key_t *parent)
{
    s_grow((void **)&self->evs, &self->evcap, self->nev + 1, sizeof *self->evs);
    s_ev_t *ev = &self->evs[self->nev++];
    *ev = (s_ev_t){r->seq, stored, storage, self->nh, 0, parent};
    return ev;
}

static void s_ev_add(kvt_lmc_events_t *self, s_ev_t *ev, const kvt_key_t *key, const uint32_t *t)
{
    s_grow((void **)&self->hashes, &self->hcap, self->nh + 1, sizeof *self->hashes);
    s_grow((void **)&self->toks, &self->tcap, self->nh + 1, sizeof *self->toks);
    self->hashes[self->nh] = *key;
    self->toks[self->nh++] = t;
    ev->n++;
}

/* The events of one record of the model. */
static void s_translate(kvt_lmc_events_t *self, const kvt_evrec_t *r)
{
    bool storage = r->kind == KVT_EV_L2_STORED || r->kind == KVT_EV_L2_REMOVED;
    bool stored = r->kind == KVT_EV_STORED || r->kind == KVT_EV_L2_STORED;
    if (!stored) {
        s_ev_t *ev = NULL;
        for (uint32_t i = 0; i < r->n; i++) {
            if (!s_changed(self, &r->keys[i], storage, false))
                continue;
            if (!ev)
                ev = s_ev_open(self, r, false, storage, NULL);
            s_ev_add(self, ev, &r->keys[i], NULL);
        }
        return;
    }
    s_ev_t *ev = NULL;
    const kvt_key_t *prev = NULL;
    for (uint32_t i = 0; i < r->n; i++) {
        const kvt_key_t *k = &r->keys[i];
        s_bind_t *b = s_find(self, k);
        if (!b) {
            atomic_fetch_add_explicit(&self->unbound, 1, memory_order_relaxed);
            ev = NULL;
            continue;
        }
        if (!s_changed(self, k, storage, true)) {
            ev = NULL;
            continue;
        }
        /* a run goes on while each block's parent is the block before it (and it is not
         * too long for one event) */
        if (!ev || !b->has_parent || !prev || memcmp(b->parent.b, prev->b, KVT_KEY_LEN) != 0 ||
            (uint64_t)(ev->n + 1) * self->chunk > S_MAX_RUN_TOKENS)
            ev = s_ev_open(self, r, true, storage, b->has_parent ? &b->parent : NULL);
        s_ev_add(self, ev, k, &self->tokens[(size_t)(b - self->binds) * self->chunk]);
        prev = k;
    }
}

void kvt_lmc_events_poll(kvt_lmc_events_t *self, const char *model, uint64_t cursor,
                         uint32_t max_events, msgpack_packer *pk)
{
    if (!self->log) {
        kvt_lmc_pack_poll_head(pk, false, 0, 0, false, 0);
        return;
    }
    if (max_events > KVT_LMC_EVENTS_MAX)
        max_events = KVT_LMC_EVENTS_MAX;
    uint64_t inc = kvt_evlog_incarnation(self->log);
    kvt_evlog_span_t span = kvt_evlog_span(self->log);
    if (cursor > span.last) {
        kvt_lmc_pack_poll_head(pk, true, inc, span.last, true, 0);
        return;
    }
    bool lost = false;
    size_t mlen = strlen(model);
    self->nev = self->nh = self->nheld = 0;
    uint64_t next = cursor;
    for (uint32_t scanned = 0; scanned < S_SCAN;) {
        s_grow((void **)&self->held, &self->heldcap, self->nheld + S_PAGE, sizeof *self->held);
        kvt_evrec_t **page = self->held + self->nheld;
        uint32_t n = kvt_evlog_read(self->log, next, page, S_PAGE, &span);
        if (span.first > next + 1)
            lost = true; /* older than the log, or dropped while this poll read */
        uint32_t used = 0;
        bool full = false;
        while (used < n && !full) {
            kvt_evrec_t *r = page[used];
            if (s_of_model(&r->ns, model, mlen)) {
                uint32_t nev = self->nev, nh = self->nh;
                s_translate(self, r);
                /* past max_events: this record waits for the next poll, unless it is the
                 * reply's first (one record alone may make more; it must not block) */
                if (self->nev > max_events && nev) {
                    self->nev = nev, self->nh = nh;
                    full = true;
                    break;
                }
                full = self->nev >= max_events;
            }
            next = r->seq;
            used++;
        }
        kvt_evlog_put(page + used, n - used);
        self->nheld += used;
        scanned += used;
        if (n < S_PAGE || full)
            break;
    }
    kvt_lmc_pack_poll_head(pk, true, inc, next, lost, self->nev);
    for (uint32_t i = 0; i < self->nev; i++) {
        const s_ev_t *e = &self->evs[i];
        kvt_lmc_kv_event_t w = {.seq = e->seq,
                                .stored = e->stored,
                                .storage = e->storage,
                                .model = model,
                                .hashes = &self->hashes[e->h0],
                                .n = e->n,
                                .parent = e->parent,
                                .tokens = e->stored ? &self->toks[e->h0] : NULL,
                                .block_size = self->chunk};
        kvt_lmc_pack_kv_event(pk, &w);
    }
    atomic_fetch_add_explicit(&self->sent, self->nev, memory_order_relaxed);
    kvt_evlog_put(self->held, self->nheld);
    self->nheld = 0;
    /* the per-reply state: emptied by remaking it (u64map has no clear) */
    if (kvt_u64map_size(self->last)) {
        kvt_u64map_destroy(&self->last);
        self->last = kvt_u64map_new();
    }
}

void kvt_lmc_events_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    kvt_lmc_events_t *self = ctx;
    kvt_sample_t s = {.name = "lmcache_kv_events_total",
                      .help = "KV events (block runs) answered to LMCache's poll_kv_events.",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->sent)};
    emit(emit_ctx, &s);
    kvt_sample_t u = {.name = "lmcache_kv_events_unbound_total",
                      .help = "Stored chunks left out of poll_kv_events: their token ids were "
                              "no longer known (bound at prepare_store, the oldest forgotten).",
                      .kind = KVT_METRIC_COUNTER,
                      .value = (double)atomic_load(&self->unbound)};
    emit(emit_ctx, &u);
}
