/* DESIGN: see client/kvtier.c (liveness, faulting the arena in, the fast path). This file is a
 * handle's connection: HELLO and BYE, the arena's mapping (and the prefault thread, which shares
 * only an atomic stop flag), the ring pair's attachment, the GPU registrations kept to be said
 * again, re-establishment, connect and close. Caller's thread, but the prefault thread. */
#include "kvtier_int.h"

#include "kvt_error.h"
#include "kvt_fdpass.h"
#include "kvt_hash.h"
#include "kvt_msg.h"
#include "kvt_proto.h"
#include "kvt_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <msgpack.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

static _Atomic unsigned s_seq;

/* ---- connection ---- */

static uint64_t s_uint(const msgpack_object *o)
{
    return o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? o->via.u64 : 0;
}

/* ---- faulting the arena in ---- */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL: pages are touched */
#endif
#define S_PREFAULT_CHUNK (16u << 20) /* the stop flag is read this often */

struct kvc_prefault {
    char *base;
    size_t size;
    atomic_bool stop;
    pid_t pid; /* the process whose thread it is: a forked child has none to join */
    pthread_t thread;
};

typedef enum { S_MAP_LAZY, S_MAP_POPULATE, S_MAP_BACKGROUND } s_map_mode_t;

/* KVTIER_MAP_POPULATE: "1" (or "true"), "background", anything else lazy. */
static s_map_mode_t s_map_mode(void)
{
    const char *v = getenv("KVTIER_MAP_POPULATE");
    if (!v)
        return S_MAP_LAZY;
    if (strcmp(v, "1") == 0 || strcmp(v, "true") == 0)
        return S_MAP_POPULATE;
    return strcmp(v, "background") == 0 ? S_MAP_BACKGROUND : S_MAP_LAZY;
}

/* Page tables first (MADV_POPULATE_WRITE), then a read of every page: under a hypervisor that
 * shadows the guest's page tables, the first access to each page of a new mapping still exits
 * to it (about 5 us a page on the development VM, populated or not) until the CPU has touched
 * the page; on bare metal the reads cost a cache miss a page. */
static void *s_prefault_run(void *arg)
{
    kvc_prefault_t *pf = arg;
    for (size_t off = 0; off < pf->size && !atomic_load(&pf->stop); off += S_PREFAULT_CHUNK) {
        size_t len = pf->size - off < S_PREFAULT_CHUNK ? pf->size - off : S_PREFAULT_CHUNK;
        if (madvise(pf->base + off, len, MADV_POPULATE_WRITE) != 0 && errno != EINVAL)
            break; /* not an old kernel: touching would only turn it into SIGBUS */
        for (size_t p = 0; p < len; p += 4096) /* a read maps the page as well */
            (void)*(volatile const char *)(pf->base + off + p);
    }
    return NULL;
}

/* Starts the background fault-in; without a thread the mapping simply stays lazy. */
static kvc_prefault_t *s_prefault_start(void *base, size_t size)
{
    kvc_prefault_t *pf = calloc(1, sizeof *pf);
    if (!pf)
        return NULL;
    pf->base = base;
    pf->size = size;
    pf->pid = getpid();
    atomic_init(&pf->stop, false);
    sigset_t all, old;
    sigfillset(&all); /* the caller's signals stay on the caller's threads */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&pf->thread, NULL, s_prefault_run, pf);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(pf);
        return NULL;
    }
    return pf;
}

static void s_prefault_stop(kvc_prefault_t **pf_p)
{
    kvc_prefault_t *pf = *pf_p;
    if (!pf)
        return;
    atomic_store(&pf->stop, true);
    if (pf->pid == getpid())
        pthread_join(pf->thread, NULL);
    free(pf);
    *pf_p = NULL;
}

/* Unmaps the arena, after the thread faulting it in (if any) has stopped and the ring pair in
 * it has been dropped (nothing may touch a ring after this). */
static void s_unmap_arena(kvtier_t *self)
{
    kvc_pair_drop(self);
    s_prefault_stop(&self->prefault);
    if (self->arena)
        munmap(self->arena, self->arena_map_len);
    self->arena = NULL;
    self->arena_size = 0;
    self->arena_map_len = 0;
}

/* Maps map_len (>= size: the L1 objects and, past them, the fast path's rings) bytes of the
 * arena file; arena_size stays `size`, the bound of every slot. Failure is not an error of
 * connect: a client on another host has no such file, and PUT/GET still work for it. The
 * reason is kept for the KVT_EUNAVAIL that RESERVE and ACQUIRE then answer. */
static void s_map_arena(kvtier_t *self, const char *file, uint64_t size, uint64_t map_len)
{
    const char *why = NULL;
    int fd = open(file, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        why = strerror(errno);
    else if (fstat(fd, &st) != 0)
        why = strerror(errno);
    else if (map_len > SIZE_MAX || (uint64_t)st.st_size < size)
        /* a mapping past the end of the file would SIGBUS on the first touch */
        why = "the file is smaller than the size HELLO announced";
    else if ((uint64_t)st.st_size < map_len)
        map_len = size; /* the L1 objects alone: no fast path */
    if (!why) {
        s_map_mode_t mode = s_map_mode();
        void *p = mmap(NULL, (size_t)map_len, PROT_READ | PROT_WRITE,
                       MAP_SHARED | (mode == S_MAP_POPULATE ? MAP_POPULATE : 0), fd, 0);
        if (p == MAP_FAILED) {
            why = strerror(errno);
        } else {
            self->arena = p;
            self->arena_size = (size_t)size;
            self->arena_map_len = (size_t)map_len;
            self->arena_dev = st.st_dev;
            self->arena_ino = st.st_ino;
            if (mode == S_MAP_BACKGROUND)
                self->prefault = s_prefault_start(p, (size_t)map_len);
        }
    }
    if (fd >= 0)
        close(fd); /* the mapping keeps the memory; the descriptor is not needed */
    if (why)
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's arena %.120s cannot be mapped here (%s): a client on another "
                 "host uses kvtier_put/kvtier_get",
                 file, why);
}

/* Follows the arena a HELLO announced: the mapping stays while the announcement is the same;
 * another one (a restarted daemon) unmaps the old arena — slots into it are dead — and maps
 * the new one. A client that wants the fast path maps shm.map_size bytes (shm.size when the
 * daemon predates it). */
static void s_follow_arena(kvtier_t *self, const msgpack_object *hello)
{
    const msgpack_object *shm = kvc_get(hello, "shm");
    const msgpack_object *path = shm ? kvc_get(shm, "path") : NULL;
    uint64_t size = s_uint(shm ? kvc_get(shm, "size") : NULL);
    uint64_t map_len = self->fastpath_on ? s_uint(shm ? kvc_get(shm, "map_size") : NULL) : 0;
    if (map_len < size)
        map_len = size;
    bool named = path && path->type == MSGPACK_OBJECT_STR && path->via.str.size && size;
    if (named && self->arena_path && self->arena_announced == size &&
        self->arena_map_announced == map_len && strlen(self->arena_path) == path->via.str.size &&
        memcmp(self->arena_path, path->via.str.ptr, path->via.str.size) == 0)
        return;
    s_unmap_arena(self);
    free(self->arena_path);
    self->arena_path = NULL;
    self->arena_announced = self->arena_map_announced = 0;
    if (!named) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named no shared-memory arena (use kvtier_put/kvtier_get)");
        return;
    }
    if (path->via.str.size >= 4096 || memchr(path->via.str.ptr, 0, path->via.str.size)) {
        snprintf(self->arena_why, sizeof self->arena_why,
                 "the daemon's HELLO named an unusable shared-memory path");
        return;
    }
    self->arena_path = strndup(path->via.str.ptr, path->via.str.size);
    if (!self->arena_path) {
        snprintf(self->arena_why, sizeof self->arena_why, "out of memory");
        return;
    }
    self->arena_announced = size;
    self->arena_map_announced = map_len;
    s_map_arena(self, self->arena_path, size, map_len);
}

/* A string field of a msgpack map, copied into buf (NUL-terminated); false when absent, not a
 * string, too long or holding a NUL. */
static bool s_str(const msgpack_object *map, const char *key, char *buf, size_t cap)
{
    const msgpack_object *o = kvc_get(map, key);
    if (!o || o->type != MSGPACK_OBJECT_STR || o->via.str.size >= cap ||
        memchr(o->via.str.ptr, 0, o->via.str.size))
        return false;
    memcpy(buf, o->via.str.ptr, o->via.str.size);
    buf[o->via.str.size] = '\0';
    return true;
}

/* Attaches the pair HELLO offered, `fastpath: {socket, ticket, size, request, reply,
 * capacity}` (the previous one is dropped already: kvc_exchange, before the HELLO went out):
 * collects the pair's memory from the daemon's handoff socket with the ticket (a memfd no
 * other process holds), maps it and attaches both rings, which must lie inside it apart from
 * each other. The handoff connection stays open: its end tells this client that the daemon
 * went, and the daemon that this client did. false, with nothing attached, when the offer
 * does not check out or the handoff fails: the socket serves, as it does without an offer. */
static bool s_pair_attach(kvtier_t *self, const msgpack_object *offer)
{
    char path[256], ticket[64], why[256];
    uint64_t req = s_uint(kvc_get(offer, "request")), rep = s_uint(kvc_get(offer, "reply"));
    uint64_t cap = s_uint(kvc_get(offer, "capacity")), size = s_uint(kvc_get(offer, "size"));
    if (cap < KVT_RING_MIN_CAPACITY || cap > KVT_RING_MAX_CAPACITY || (cap & (cap - 1)) ||
        size > SIZE_MAX || !s_str(offer, "socket", path, sizeof path) ||
        !s_str(offer, "ticket", ticket, sizeof ticket))
        return false;
    uint64_t region = kvt_ring_region_size((uint32_t)cap);
    if (!(req % 8 == 0 && rep % 8 == 0 && req <= size && rep <= size && region <= size - req &&
          region <= size - rep && (req + region <= rep || rep + region <= req)))
        return false;
    uint64_t rsize = s_uint(kvc_get(offer, "resident"));
    int fds[2] = {-1, -1}, sock = -1, nfds = 0;
    if (kvt_fdpass_fetch(path, ticket, self->timeout_ms, fds, rsize ? 2 : 1, &nfds, &sock, why,
                         sizeof why) != 0) {
        snprintf(self->error, sizeof self->error, "fast path: %.200s", why);
        return false;
    }
    int fd = fds[0];
    const uint8_t *res = NULL;
    struct stat rst;
    if (nfds == 2 && fstat(fds[1], &rst) == 0 && rsize <= (uint64_t)rst.st_size &&
        rsize <= SIZE_MAX) {
        /* populated: a probe lands on any page of the map and should not fault there */
        void *m = mmap(NULL, (size_t)rsize, PROT_READ, MAP_SHARED | MAP_POPULATE, fds[1], 0);
        res = m == MAP_FAILED ? NULL : m;
    }
    if (nfds == 2)
        close(fds[1]);
    struct stat st;
    uint8_t *base = NULL;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size == size) {
        void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        base = p == MAP_FAILED ? NULL : p;
    }
    close(fd); /* the mapping keeps the memory */
    kvt_ring_t *p = base ? kvt_ring_new(base + req, (size_t)region, (uint32_t)cap,
                                        KVT_RING_PRODUCER, why, sizeof why)
                         : NULL;
    kvt_ring_t *c = p ? kvt_ring_new(base + rep, (size_t)region, (uint32_t)cap,
                                     KVT_RING_CONSUMER, why, sizeof why)
                      : NULL;
    size_t need = c ? kvt_ring_max_payload(c) : 0;
    if (c && self->ring_buf_cap < need) {
        uint8_t *b = realloc(self->ring_buf, need);
        if (b) {
            self->ring_buf = b;
            self->ring_buf_cap = need;
        }
    }
    if (!c || self->ring_buf_cap < need) {
        kvt_ring_destroy(&p);
        kvt_ring_destroy(&c);
        if (base)
            munmap(base, (size_t)size);
        if (res)
            munmap((void *)res, (size_t)rsize);
        close(sock);
        return false;
    }
    /* KVTIER_RING_SPIN: the most spin iterations a ring wait makes before it sleeps (the
     * budget adapts below it; 0 sleeps at once) */
    int spin = kvc_env_int("KVTIER_RING_SPIN", -1, 0, 1 << 20);
    if (spin >= 0) {
        kvt_ring_set_spin(p, (uint32_t)spin);
        kvt_ring_set_spin(c, (uint32_t)spin);
    }
    self->req_ring = p;
    self->rep_ring = c;
    self->ring_map = base;
    self->ring_map_len = (size_t)size;
    self->res_map = res;
    self->res_map_len = res ? (size_t)rsize : 0;
    self->res_checked_ns = kvc_mono_ns();
    self->ring_sock = sock;
    self->ring_gen = atomic_load_explicit(&kvc_fork_gen, memory_order_relaxed);
    self->ring_posted = 0;
    self->ring_seen_ns = kvc_mono_ns();
    return true;
}

/* Whether HELLO asks for a pair: not with KVTIER_FASTPATH=0, nor once this handle knows that
 * the arena does not map here (a client on another host). The first HELLO cannot know. */
static bool s_fastpath_ask(const kvtier_t *self)
{
    return self->fastpath_on && (self->arena || !self->arena_path);
}

/* Takes in what a HELLO answered: server facts, the instance's token, the arena, the pair. */
static void s_apply_hello(kvtier_t *self, const msgpack_object *body)
{
    const msgpack_object *server = kvc_get(body, "server"), *token = kvc_get(body, "token");
    self->info.version = (uint32_t)s_uint(kvc_get(body, "version"));
    self->info.chunk_tokens = (uint32_t)s_uint(kvc_get(body, "chunk_tokens"));
    self->info.lease_ms = (uint32_t)s_uint(kvc_get(body, "lease_ms"));
    self->info.max_message = s_uint(kvc_get(body, "max_message"));
    if (server && server->type == MSGPACK_OBJECT_STR)
        snprintf(self->info.server, sizeof self->info.server, "%.*s", (int)server->via.str.size,
                 server->via.str.ptr);
    self->token[0] = '\0';
    if (token && token->type == MSGPACK_OBJECT_STR && token->via.str.size <= KVT_MAX_TOKEN &&
        !memchr(token->via.str.ptr, 0, token->via.str.size)) {
        memcpy(self->token, token->via.str.ptr, token->via.str.size);
        self->token[token->via.str.size] = '\0';
    }
    s_follow_arena(self, body);
    const msgpack_object *offer = kvc_get(body, "fastpath");
    if (offer && self->fastpath_on)
        s_pair_attach(self, offer); /* an offer that does not check out: the socket serves */
}

/* HELLO {version, client, instance, token?, fastpath?, resident?}: token joins an instance
 * that exists; fastpath asks for a ring pair, and the residency map with it. */
void kvc_hello_body(msgpack_sbuffer *sb, const char *client, const char *instance,
                         const char *token, bool fastpath)
{
    msgpack_packer pk;
    bool with_token = token && *token;
    kvc_body_begin(sb, &pk, 3 + (with_token ? 1 : 0) + (fastpath ? 2 : 0));
    kvt_pack_str(&pk, "version");
    msgpack_pack_uint32(&pk, KVT_PROTO_VERSION);
    kvt_pack_str(&pk, "client");
    kvt_pack_str(&pk, client);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, instance);
    if (with_token) {
        kvt_pack_str(&pk, "token");
        kvt_pack_str(&pk, token);
    }
    if (fastpath) {
        kvt_pack_str(&pk, "fastpath");
        msgpack_pack_true(&pk);
        kvt_pack_str(&pk, "resident");
        msgpack_pack_true(&pk);
    }
}

/* A body naming the instance: PING (alive only if this connection acts for it) and BYE. */
void kvc_instance_body(msgpack_sbuffer *sb, const char *instance)
{
    msgpack_packer pk;
    kvc_body_begin(sb, &pk, 1);
    kvt_pack_str(&pk, "instance");
    kvt_pack_str(&pk, instance);
}

static int s_hello(kvtier_t *self, const char *token, bool fastpath, kvc_reply_t *r)
{
    msgpack_sbuffer sb;
    kvc_hello_body(&sb, self->client, self->instance, token, fastpath);
    int rc = kvc_call_once(self, KVT_REQ_HELLO, sb.data, sb.size, NULL, NULL, 0, KVC_DATA_NONE, r);
    msgpack_sbuffer_destroy(&sb);
    return rc;
}

/* BYE, best effort: an instance that is not told expires after lease_ms anyway. */
static void s_bye(kvtier_t *self)
{
    msgpack_sbuffer sb;
    kvc_instance_body(&sb, self->instance);
    kvc_reply_t r;
    kvc_reply_init(&r);
    kvc_call_once(self, KVT_REQ_BYE, sb.data, sb.size, NULL, NULL, 0, KVC_DATA_NONE, &r);
    kvc_reply_free(&r);
    msgpack_sbuffer_destroy(&sb);
}

/* ---- GPU registrations kept for re-establishment ---- */

static int s_gpu_find(const kvtier_t *self, uint32_t device)
{
    for (uint32_t i = 0; i < self->ngpu; i++)
        if (self->gpu[i].device == device)
            return (int)i;
    return -1;
}

/* Room for one more, made before REGISTER_GPU is sent: once the daemon holds a registration,
 * keeping its copy cannot fail. */
int kvc_gpu_room(kvtier_t *self)
{
    if (self->ngpu < self->gpu_cap)
        return 0;
    uint32_t cap = self->gpu_cap ? 2 * self->gpu_cap : 4;
    kvc_gpu_reg_t *g = realloc(self->gpu, cap * sizeof *g);
    if (!g)
        return KVT_ENOMEM;
    self->gpu = g;
    self->gpu_cap = cap;
    return 0;
}

/* Keeps (owns) the body of a registration the daemon accepted. */
void kvc_gpu_keep(kvtier_t *self, uint32_t device, void *body, size_t len)
{
    int i = s_gpu_find(self, device);
    if (i < 0)
        i = (int)self->ngpu++;
    else
        free(self->gpu[i].body);
    self->gpu[i] = (kvc_gpu_reg_t){device, true, body, len};
}

void kvc_gpu_forget(kvtier_t *self, uint32_t device)
{
    int i = s_gpu_find(self, device);
    if (i < 0)
        return;
    free(self->gpu[i].body);
    self->gpu[i] = self->gpu[--self->ngpu];
}

/* Says one kept registration again; it is live when the daemon accepts it. */
static int s_gpu_register_again(kvtier_t *self, kvc_gpu_reg_t *g)
{
    kvc_reply_t r;
    kvc_reply_init(&r);
    int rc = kvc_call_once(self, KVT_REQ_REGISTER_GPU, g->body, g->len, NULL, NULL, 0,
                           KVC_DATA_NONE, &r);
    kvc_reply_free(&r);
    g->live = rc == 0;
    return rc;
}

/* Before STORE_GPU / RETRIEVE_GPU: a registration whose re-establishment failed is tried once
 * more, and if it fails again the call fails saying why (not a bare "send REGISTER_GPU"). */
int kvc_gpu_ensure(kvtier_t *self, uint32_t type, uint32_t device)
{
    int i = s_gpu_find(self, device);
    if (i < 0 || self->gpu[i].live)
        return 0;
    int rc = s_gpu_register_again(self, &self->gpu[i]);
    if (rc == 0)
        return 0;
    char why[sizeof self->error];
    memcpy(why, self->error, sizeof why);
    return kvc_fail(self, rc,
                  "%s: the GPU registration of device %u was lost with the instance, and "
                  "registering it again failed: %s",
                  kvt_proto_name(type), device, why);
}

/* ---- re-establishment ---- */

/* The instance is gone (a call answered instance_dropped, or the heartbeat said so): HELLO
 * again under the same name with the freshest token. The token that comes back tells what
 * happened: the caller's own (only this connection had lost the instance, e.g. after a
 * reconnect: its leases and registrations live on) or a new one (the instance is new: every
 * lease is gone, and the GPU layouts are registered again). */
int kvc_reestablish(kvtier_t *self)
{
    char presented[KVT_MAX_TOKEN + 1], before[KVT_MAX_TOKEN + 1];
    memcpy(before, self->token, sizeof before);
    kvc_hb_token(self, presented);
    kvc_reply_t r;
    kvc_reply_init(&r);
    int rc = s_hello(self, presented, s_fastpath_ask(self), &r);
    if (rc == KVT_EBADREQ && kvc_hb_newer_token(self, presented)) {
        kvc_reply_free(&r);
        kvc_reply_init(&r);
        rc = s_hello(self, presented, s_fastpath_ask(self), &r);
    }
    if (rc) {
        char why[sizeof self->error];
        memcpy(why, self->error, sizeof why);
        kvc_reply_free(&r);
        return kvc_fail(self, rc,
                      "instance '%.64s' was dropped by the daemon, and saying HELLO again "
                      "failed: %s",
                      self->instance, why);
    }
    s_apply_hello(self, &r.up.data);
    kvc_reply_free(&r);
    bool same = self->token[0] && strcmp(self->token, before) == 0;
    kvc_hb_publish(self);
    for (uint32_t i = 0; !same && i < self->ngpu; i++)
        s_gpu_register_again(self, &self->gpu[i]); /* a failure: kvc_gpu_ensure reports it */
    self->error[0] = '\0';
    return 0;
}

kvtier_t *kvtier_connect(const char *endpoint, const char *client, const char *instance,
                         int timeout_ms, char *err, size_t errlen)
{
    return kvtier_connect_curve(endpoint, client, instance, timeout_ms, NULL, err, errlen);
}

kvtier_t *kvtier_connect_curve(const char *endpoint, const char *client, const char *instance,
                               int timeout_ms, const kvtier_curve_t *curve, char *err,
                               size_t errlen)
{
    if (!endpoint) {
        snprintf(err, errlen, "no endpoint given");
        return NULL;
    }
    if (!client || !*client)
        client = "kvtier";
    if (strlen(client) > KVT_MAX_NAME || (instance && strlen(instance) > KVT_MAX_NAME)) {
        snprintf(err, errlen, "client and instance names are at most %d bytes", KVT_MAX_NAME);
        return NULL;
    }
    kvtier_t *self = calloc(1, sizeof *self);
    if (!self) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    self->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    self->next_uid = 1;
    self->pid = getpid();
    self->ring_sock = -1;
    snprintf(self->client, sizeof self->client, "%s", client);
    if (instance)
        snprintf(self->instance, sizeof self->instance, "%s", instance);
    else
        snprintf(self->instance, sizeof self->instance, "%s-%d-%u", client, (int)self->pid,
                 atomic_fetch_add(&s_seq, 1));
    self->spin_ns = (uint64_t)kvc_env_int("KVTIER_SPIN_US", 0, 0, 100000) * 1000u;
    const char *fastpath = getenv("KVTIER_FASTPATH");
    self->fastpath_on = !fastpath || strcmp(fastpath, "0") != 0;
    self->ctx = kvc_ctx_acquire();
    self->sock = self->ctx ? zmq_socket(self->ctx, ZMQ_DEALER) : NULL;
    if (!self->sock) {
        snprintf(err, errlen, "cannot create a socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int linger = 0;
    zmq_setsockopt(self->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(self->sock, ZMQ_RCVTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    zmq_setsockopt(self->sock, ZMQ_SNDTIMEO, &self->timeout_ms, sizeof self->timeout_ms);
    bool curved = false;
    if (kvt__curve_setup(self->sock, endpoint, curve, &curved, err, errlen) != 0)
        goto fail;
    if (zmq_connect(self->sock, endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(zmq_errno()));
        goto fail;
    }
    kvc_reply_t r;
    kvc_reply_init(&r);
    int rc = s_hello(self, NULL, s_fastpath_ask(self), &r);
    if (rc) {
        snprintf(err, errlen, "HELLO to %s failed: %s (%s)%s", endpoint, self->error,
                 kvt_err_wire(rc),
                 curved && rc == KVT_ETIMEDOUT
                     ? "; with CURVE, check the server key and that this client's "
                       "certificate is in the daemon's curve.clients"
                     : "");
        kvc_reply_free(&r);
        goto fail;
    }
    s_apply_hello(self, &r.up.data);
    kvc_reply_free(&r);
    if (kvc_hb_start(self, endpoint, curve, err, errlen) != 0) {
        s_bye(self);
        goto fail;
    }
    return self;
fail:
    s_unmap_arena(self);
    free(self->arena_path);
    free(self->ring_buf);
    if (self->sock)
        zmq_close(self->sock);
    kvc_ctx_release(self->ctx);
    free(self);
    return NULL;
}

void kvtier_close(kvtier_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvtier_t *self = *self_p;
    /* the heartbeat first: nothing may join or ping the instance after its BYE */
    kvc_hb_stop(&self->hb);
    /* the pair: our sides closed before BYE (a forked child only frees its copies) */
    kvc_pair_drop(self);
    /* a child forked after connect inherited the parent's instance: it is not its to end */
    if (self->pid == getpid())
        s_bye(self);
    s_unmap_arena(self);
    free(self->arena_path);
    free(self->ring_buf);
    for (uint32_t i = 0; i < self->ngpu; i++)
        free(self->gpu[i].body);
    free(self->gpu);
    zmq_close(self->sock);
    kvc_ctx_release(self->ctx);
    free(self);
    *self_p = NULL;
}
