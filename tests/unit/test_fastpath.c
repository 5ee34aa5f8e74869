/* Unit tests of daemon/kvt_fastpath.c with its real thread and its real handoff socket: a
 * "server" callback that answers each request under the lock the module was given, client
 * sides collected from the handoff socket with the offer's ticket and attached as a client
 * would. Covered: offers (a pair of its own, single-use tickets, a wrong ticket refused, the
 * client's handoff connection closing drops the pair), round trips while the thread
 * sleeps (futex_waitv wake-ups) and spins, the per-slot order of replies, a new HELLO closing
 * the old pair and a BYE coming through the ring closing its own pair after its reply, owner
 * gone, a retired connection, the client closing its side, a malformed record and a hostile
 * index, the held-reply bound, the quarantine and the epoch of a reused slot, no slot free
 * (declined), replies to a closed slot, status and metrics, stop with clients attached, and
 * which peers count as local.
 * Also in the TSan unit set (the thread against the test's thread under the lock). */
#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_fastpath.h"
#include "kvt_fdpass.h"
#include "kvt_handoff.h"
#include "kvt_ring.h"
#include "kvt_session.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define S_RING 4096u
#define S_RINGS 3u

typedef struct {
    kvt_fastpath_t *fp;
    _Atomic int calls;
    bool hold;           /* do not answer (the client stops reading, the test holds replies) */
    kvt_fastpath_ref_t last;
    int bye_on;          /* a request whose first frame is "bye": owner_gone from inside */
    uint64_t owner;
    kvt_conn_t *reopen_conn; /* a request "hello": reopen on this connection from inside */
    kvt_fastpath_offer_t reopened;
} srv_t;

typedef struct {
    kvt_config_t *cfg;
    char dir[64];
    kvt_handoff_t *handoff;
    pthread_mutex_t lock;
    _Atomic uint32_t waiting;
    kvt_sessions_t *sessions;
    srv_t srv;
    kvt_fastpath_t *fp;
} fx_t;

/* The server's side: echoes the request's frames back as the reply (under the lock). */
static void s_request(void *ctx, kvt_fastpath_ref_t ref, kvt_conn_t *conn, const uint8_t *p,
                      size_t len)
{
    (void)conn;
    srv_t *s = ctx;
    atomic_fetch_add(&s->calls, 1);
    s->last = ref;
    kvt_ring_frame_t fr[8];
    uint32_t n = 0;
    if (kvt_ring_parse(p, len, fr, 8, &n) != 0) {
        kvt_fastpath_reject(s->fp, ref, "not frames");
        return;
    }
    if (n >= 1 && fr[0].len == 3 && memcmp(fr[0].ptr, "bye", 3) == 0)
        kvt_fastpath_owner_gone(s->fp, s->owner, false);
    if (n >= 1 && fr[0].len == 5 && memcmp(fr[0].ptr, "hello", 5) == 0)
        assert_int_equal(kvt_fastpath_open(s->fp, s->reopen_conn, s->owner, false, &s->reopened), 0);
    if (s->hold)
        return;
    kvt_ring_iov_t iov[8];
    for (uint32_t i = 0; i < n; i++)
        iov[i] = (kvt_ring_iov_t){fr[i].ptr, fr[i].len};
    int rc = kvt_fastpath_reply(s->fp, ref, iov, n);
    assert_true(rc == 0 || rc == KVT_EUNAVAIL);
}

static int s_setup(void **state)
{
    fx_t *f = calloc(1, sizeof *f);
    assert_non_null(f);
    char err[256];
    f->cfg = kvt_config_new();
    assert_non_null(f->cfg);
    char rings[16], bytes[16];
    snprintf(rings, sizeof rings, "%u", S_RINGS);
    snprintf(bytes, sizeof bytes, "%u", S_RING);
    assert_int_equal(kvt_config_set(f->cfg, "fastpath.rings", rings, false, err, sizeof err), 0);
    assert_int_equal(kvt_config_set(f->cfg, "fastpath.ring_bytes", bytes, false, err, sizeof err),
                     0);
    assert_int_equal(kvt_config_set(f->cfg, "fastpath.spin_us", "20", false, err, sizeof err), 0);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvt-fp-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    assert_int_equal(kvt_config_set(f->cfg, "run_dir", f->dir, false, err, sizeof err), 0);
    /* a test's arena is not kept for a next daemon */
    assert_int_equal(kvt_config_set(f->cfg, "l1.adopt", "false", false, err, sizeof err), 0);
    f->handoff = kvt_handoff_new(f->cfg, S_RINGS, err, sizeof err);
    if (!f->handoff)
        fail_msg("handoff: %s", err);
    assert_int_equal(kvt_handoff_start(f->handoff, NULL), 0);
    pthread_mutex_init(&f->lock, NULL);
    kvt_session_limits_t lim = {.lease_ms = 60000,
                                .max_instances_per_conn = 4,
                                .reply_timeout_ms = 5000,
                                .max_reply_backlog = 1 << 20};
    f->sessions = kvt_sessions_new(&lim, NULL, NULL, NULL);
    f->fp = kvt_fastpath_new(f->cfg, f->handoff, &f->lock, &f->waiting, f->sessions, s_request,
                             &f->srv);
    assert_non_null(f->fp);
    f->srv.fp = f->fp;
    assert_int_equal(kvt_fastpath_start(f->fp, NULL), 0);
    *state = f;
    return 0;
}

static int s_teardown(void **state)
{
    fx_t *f = *state;
    kvt_fastpath_destroy(&f->fp);
    kvt_handoff_destroy(&f->handoff);
    rmdir(f->dir);
    kvt_sessions_destroy(&f->sessions);
    pthread_mutex_destroy(&f->lock);
    kvt_config_destroy(&f->cfg);
    free(f);
    return 0;
}

/* A client's view of an offered pair: its mapping of the pair's memory, its handoff
 * connection. */
typedef struct {
    kvt_ring_t *req, *rep;
    uint8_t *map;
    size_t len;
    int sock;
    uint8_t buf[S_RING];
} cli_t;

static void s_attach(fx_t *f, const kvt_fastpath_offer_t *o, cli_t *c)
{
    char err[256];
    size_t rs = kvt_ring_region_size(S_RING);
    assert_int_equal(o->capacity, S_RING);
    assert_string_equal(o->socket, kvt_handoff_path(f->handoff));
    assert_int_equal(strlen(o->ticket), KVT_FDPASS_TICKET_HEX);
    assert_true(o->request == 0 && o->reply == rs && o->size >= 2 * rs && o->size % 4096 == 0);
    int fd = -1, nf = 0;
    if (kvt_fdpass_fetch(o->socket, o->ticket, 2000, &fd, 1, &nf, &c->sock, err, sizeof err) != 0)
        fail_msg("fetch: %s", err);
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    assert_int_equal((uint64_t)st.st_size, o->size);
    /* sealed: the client cannot shrink the daemon's mapping from under it */
    assert_int_not_equal(ftruncate(fd, 0), 0);
    c->len = o->size;
    c->map = mmap(NULL, c->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(c->map != MAP_FAILED);
    close(fd);
    c->req = kvt_ring_new(c->map + o->request, rs, S_RING, KVT_RING_PRODUCER, err, sizeof err);
    c->rep = kvt_ring_new(c->map + o->reply, rs, S_RING, KVT_RING_CONSUMER, err, sizeof err);
    assert_non_null(c->req);
    assert_non_null(c->rep);
}

static void s_detach(cli_t *c)
{
    kvt_ring_destroy(&c->req);
    kvt_ring_destroy(&c->rep);
    munmap(c->map, c->len);
    close(c->sock);
}

static int s_send(cli_t *c, const char *msg)
{
    kvt_ring_iov_t iov[2] = {{msg, strlen(msg)}, {"x", 1}};
    return kvt_ring_push(c->req, iov, 2);
}

/* Waits for one reply and checks it echoes `msg`; returns the ring's code. */
static int s_expect(cli_t *c, const char *msg)
{
    int rc = kvt_ring_wait(c->rep, 0, 2000000000LL);
    if (rc)
        return rc;
    size_t len = 0;
    if ((rc = kvt_ring_pop(c->rep, c->buf, sizeof c->buf, &len)) != 0)
        return rc;
    kvt_ring_frame_t fr[4];
    uint32_t n = 0;
    assert_int_equal(kvt_ring_parse(c->buf, len, fr, 4, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(fr[0].len, strlen(msg));
    assert_memory_equal(fr[0].ptr, msg, fr[0].len);
    return 0;
}

static kvt_conn_t *s_conn(fx_t *f, const char *rid, int fd)
{
    return kvt_sessions_conn(f->sessions, (const uint8_t *)rid, strlen(rid), fd, 1, 1000);
}

static int s_open(fx_t *f, kvt_conn_t *c, uint64_t owner, kvt_fastpath_offer_t *o)
{
    pthread_mutex_lock(&f->lock);
    int rc = kvt_fastpath_open(f->fp, c, owner, false, o);
    pthread_mutex_unlock(&f->lock);
    return rc;
}

/* A connection `rid` (descriptor fd) acting for `owner`, its ring pair opened and mapped by
 * the client `cl`. */
static kvt_conn_t *s_client(fx_t *f, const char *rid, int fd, uint64_t owner, cli_t *cl)
{
    kvt_conn_t *c = s_conn(f, rid, fd);
    kvt_fastpath_offer_t o;
    assert_int_equal(s_open(f, c, owner, &o), 0);
    s_attach(f, &o, cl);
    return c;
}

/* msg: n - 1 copies of ch, then NUL. */
static void s_fill(char *msg, size_t n, char ch)
{
    memset(msg, ch, n - 1);
    msg[n - 1] = '\0';
}

static json_int_t s_status(fx_t *f, const char *key, const char *sub)
{
    json_t *j = kvt_fastpath_json(f->fp);
    json_t *v = json_object_get(j, key);
    if (sub)
        v = json_object_get(v, sub);
    json_int_t r = json_integer_value(v);
    json_decref(j);
    return r;
}

static void s_wait_status(fx_t *f, const char *key, const char *sub, json_int_t want)
{
    for (int i = 0; i < 400 && s_status(f, key, sub) != want; i++)
        usleep(5000);
    assert_int_equal(s_status(f, key, sub), want);
}

static void test_round_trips_sleeping_and_spinning(void **state)
{
    fx_t *f = *state;
    cli_t cl;
    kvt_conn_t *c = s_client(f, "a", 10, 7, &cl);
    assert_int_equal(s_status(f, "rings_open", NULL), 1);
    /* back to back: the thread spins between them */
    char msg[32];
    for (int i = 0; i < 200; i++) {
        snprintf(msg, sizeof msg, "m%d", i);
        assert_int_equal(s_send(&cl, msg), 0);
        assert_int_equal(s_expect(&cl, msg), 0);
    }
    /* a pipeline of 10, answered in order */
    for (int i = 0; i < 10; i++) {
        snprintf(msg, sizeof msg, "p%d", i);
        assert_int_equal(s_send(&cl, msg), 0);
    }
    for (int i = 0; i < 10; i++) {
        snprintf(msg, sizeof msg, "p%d", i);
        assert_int_equal(s_expect(&cl, msg), 0);
    }
    /* after idle gaps longer than the spin: the thread sleeps and a push wakes it */
    for (int i = 0; i < 5; i++) {
        usleep(30000);
        snprintf(msg, sizeof msg, "s%d", i);
        assert_int_equal(s_send(&cl, msg), 0);
        assert_int_equal(s_expect(&cl, msg), 0);
    }
    assert_int_equal(s_status(f, "requests", NULL), 215);
    s_detach(&cl);
    kvt_conn_unref(&c);
}

static void test_rehello_and_bye_through_the_ring(void **state)
{
    fx_t *f = *state;
    kvt_conn_t *c = s_conn(f, "b", 11);
    kvt_fastpath_offer_t o1, o2;
    assert_int_equal(s_open(f, c, 8, &o1), 0);
    cli_t c1, c2;
    s_attach(f, &o1, &c1);
    /* a second HELLO on the socket: a new pair, the old one closed at once */
    assert_int_equal(s_open(f, c, 8, &o2), 0);
    assert_string_not_equal(o2.ticket, o1.ticket);
    s_attach(f, &o2, &c2);
    assert_int_equal(s_send(&c1, "old"), KVT_EUNAVAIL);
    assert_int_equal(s_status(f, "dropped", "rehello"), 1);
    assert_int_equal(s_status(f, "rings_open", NULL), 1);
    /* a HELLO through the ring itself: its reply still comes back on that ring */
    pthread_mutex_lock(&f->lock);
    f->srv.owner = 8;
    f->srv.reopen_conn = c;
    pthread_mutex_unlock(&f->lock);
    assert_int_equal(s_send(&c2, "hello"), 0);
    assert_int_equal(s_expect(&c2, "hello"), 0);
    assert_int_equal(kvt_ring_wait(c2.rep, 0, 1000000000LL), KVT_EUNAVAIL); /* then it closed */
    assert_int_equal(s_send(&c2, "after"), KVT_EUNAVAIL);
    pthread_mutex_lock(&f->lock);
    kvt_fastpath_offer_t o3 = f->srv.reopened;
    pthread_mutex_unlock(&f->lock);
    cli_t c3;
    s_attach(f, &o3, &c3);
    /* BYE through the ring: its reply comes, then the pair closes */
    assert_int_equal(s_send(&c3, "bye"), 0);
    assert_int_equal(s_expect(&c3, "bye"), 0);
    assert_int_equal(kvt_ring_wait(c3.rep, 0, 1000000000LL), KVT_EUNAVAIL);
    assert_int_equal(s_status(f, "dropped", "bye"), 1);
    assert_int_equal(s_status(f, "rings_open", NULL), 0);
    s_detach(&c1);
    s_detach(&c2);
    s_detach(&c3);
    kvt_conn_unref(&c);
}

static void test_reclaim_reasons(void **state)
{
    fx_t *f = *state;
    kvt_conn_t *c1 = s_conn(f, "c1", 12), *c2 = s_conn(f, "c2", 13), *c3 = s_conn(f, "c3", 14);
    kvt_fastpath_offer_t o1, o2, o3, o4;
    assert_int_equal(s_open(f, c1, 21, &o1), 0);
    assert_int_equal(s_open(f, c2, 22, &o2), 0);
    assert_int_equal(s_open(f, c3, 23, &o3), 0);
    /* all three slots taken: the fourth is declined */
    kvt_conn_t *c4 = s_conn(f, "c4", 15);
    assert_int_equal(s_open(f, c4, 24, &o4), KVT_EBUSY);
    assert_int_equal(s_status(f, "declined", NULL), 1);
    cli_t a, b, d;
    s_attach(f, &o1, &a);
    s_attach(f, &o2, &b);
    s_attach(f, &o3, &d);
    /* owner gone (silence) */
    pthread_mutex_lock(&f->lock);
    kvt_fastpath_owner_gone(f->fp, 21, true);
    pthread_mutex_unlock(&f->lock);
    assert_int_equal(kvt_ring_wait(a.rep, 0, 1000000000LL), KVT_EUNAVAIL);
    assert_int_equal(s_status(f, "dropped", "expired"), 1);
    /* the connection closes (the monitor's report retires it) */
    kvt_sessions_on_disconnect(f->sessions, 13, 1);
    assert_true(kvt_conn_retired(c2));
    s_wait_status(f, "dropped", "disconnected", 1);
    assert_int_equal(s_send(&b, "late"), KVT_EUNAVAIL);
    /* the client closes its side */
    kvt_ring_close(d.req);
    s_wait_status(f, "dropped", "client_closed", 1);
    s_wait_status(f, "rings_open", NULL, 0);
    /* a slot rests 100 ms before it is handed out again, then with a new epoch */
    usleep(150000);
    assert_int_equal(s_open(f, c4, 24, &o4), 0);
    assert_int_equal(s_send(&a, "stale"), KVT_EUNAVAIL);
    assert_int_equal(kvt_ring_wait(d.rep, 0, 0), KVT_EUNAVAIL);
    cli_t e;
    s_attach(f, &o4, &e);
    assert_int_equal(s_send(&e, "fresh"), 0);
    assert_int_equal(s_expect(&e, "fresh"), 0);
    s_detach(&a);
    s_detach(&b);
    s_detach(&d);
    s_detach(&e);
    kvt_conn_unref(&c1);
    kvt_conn_unref(&c2);
    kvt_conn_unref(&c3);
    kvt_conn_unref(&c4);
}

static void test_hostile_client(void **state)
{
    fx_t *f = *state;
    kvt_conn_t *c = s_conn(f, "h", 16);
    kvt_fastpath_offer_t o;
    assert_int_equal(s_open(f, c, 31, &o), 0);
    cli_t h, good;
    kvt_conn_t *g = s_client(f, "g", 17, 32, &good);
    s_attach(f, &o, &h);
    /* a record that is not a list of frames (written by hand, as a hostile client would):
     * the server's parse rejects it and the pair closes */
    uint8_t *hdr = h.map + o.request;
    uint32_t rec[4] = {8, KVT_RING_KIND_MSG, 0x7fffffffu, 5}; /* count 2^31 - 1 */
    memcpy(hdr + KVT_RING_HDR_SIZE, rec, sizeof rec);
    uint64_t head = 16;
    __atomic_store_n((uint64_t *)(hdr + KVT_RING_OFF_HEAD), head, __ATOMIC_RELEASE);
    s_wait_status(f, "dropped", "malformed", 1);
    /* a second pair of the same client: an impossible head index */
    kvt_fastpath_offer_t o2;
    usleep(150000);
    assert_int_equal(s_open(f, c, 31, &o2), 0);
    cli_t h2;
    s_attach(f, &o2, &h2);
    hdr = h2.map + o2.request;
    __atomic_store_n((uint64_t *)(hdr + KVT_RING_OFF_HEAD), 0x7777777777777777ull,
                     __ATOMIC_RELEASE); /* no wake: the thread's idle sweep finds it */
    s_wait_status(f, "dropped", "malformed", 2);
    /* the other client never noticed */
    assert_int_equal(s_send(&good, "fine"), 0);
    assert_int_equal(s_expect(&good, "fine"), 0);
    s_detach(&h);
    s_detach(&h2);
    s_detach(&good);
    kvt_conn_unref(&c);
    kvt_conn_unref(&g);
}

static void test_held_replies_are_bounded(void **state)
{
    fx_t *f = *state;
    cli_t cl;
    kvt_conn_t *c = s_client(f, "r", 18, 41, &cl);
    /* the client sends and never reads: replies fill the ring, then the backlog, then the
     * pair closes; the thread never blocks */
    char msg[200];
    s_fill(msg, sizeof msg, 'q');
    int sent = 0;
    for (int i = 0; i < 2000 && s_status(f, "dropped", "reply_backlog") == 0; i++) {
        int rc = s_send(&cl, msg);
        if (rc == KVT_EBUSY) {
            usleep(1000);
            continue;
        }
        if (rc == KVT_EUNAVAIL)
            break;
        assert_int_equal(rc, 0);
        sent++;
    }
    s_wait_status(f, "dropped", "reply_backlog", 1);
    assert_true(sent > 20);
    /* what was pushed before the close is still the client's to read, then unavailable */
    int got = 0;
    while (s_expect(&cl, msg) == 0)
        got++;
    assert_true(got >= 18 && got < sent);
    s_detach(&cl);
    kvt_conn_unref(&c);
}

static void test_reply_to_a_closed_slot_and_stop(void **state)
{
    fx_t *f = *state;
    cli_t cl;
    kvt_conn_t *c = s_client(f, "z", 19, 51, &cl);
    kvt_fastpath_offer_t o;
    pthread_mutex_lock(&f->lock);
    f->srv.hold = true; /* answered later, as a pooled request would be */
    pthread_mutex_unlock(&f->lock);
    assert_int_equal(s_send(&cl, "later"), 0);
    for (int i = 0; i < 400 && atomic_load(&f->srv.calls) == 0; i++)
        usleep(5000);
    pthread_mutex_lock(&f->lock);
    kvt_fastpath_ref_t ref = f->srv.last;
    kvt_ring_iov_t iov[2] = {{"later", 5}, {"x", 1}};
    assert_int_equal(kvt_fastpath_reply(f->fp, ref, iov, 2), 0);
    /* too large for the ring: the caller answers something smaller instead */
    static uint8_t big[S_RING];
    kvt_ring_iov_t bigv = {big, sizeof big};
    assert_false(kvt_fastpath_reply_fits(f->fp, ref, &bigv, 1));
    assert_true(kvt_fastpath_reply_fits(f->fp, ref, iov, 2));
    assert_int_equal(kvt_fastpath_reply(f->fp, ref, &bigv, 1), KVT_ETOOBIG);
    kvt_fastpath_owner_gone(f->fp, 51, false);
    assert_true(kvt_fastpath_reply_fits(f->fp, ref, &bigv, 1)); /* gone: the reply drops it */
    assert_int_equal(kvt_fastpath_reply(f->fp, ref, iov, 2), KVT_EUNAVAIL); /* slot gone */
    f->srv.hold = false;
    pthread_mutex_unlock(&f->lock);
    assert_int_equal(s_expect(&cl, "later"), 0);
    assert_int_equal(kvt_ring_wait(cl.rep, 0, 0), KVT_EUNAVAIL);
    /* metrics name every reason */
    s_detach(&cl);
    kvt_conn_unref(&c);
    /* stop with a client attached: its next push finds the ring closed */
    kvt_conn_t *c2 = s_conn(f, "y", 20);
    usleep(150000);
    assert_int_equal(s_open(f, c2, 52, &o), 0);
    s_attach(f, &o, &cl);
    kvt_fastpath_destroy(&f->fp);
    assert_int_equal(s_send(&cl, "gone"), KVT_EUNAVAIL);
    s_detach(&cl);
    kvt_conn_unref(&c2);
}

/* A client that keeps the thread busy (requests without end) never keeps the server loop from
 * the lock for long: the loop says it waits and the thread lets it in. */
typedef struct {
    cli_t *c;
    _Atomic bool stop;
    uint64_t sent;
} flood_t;

static void *s_flood(void *arg)
{
    flood_t *fl = arg;
    uint8_t buf[S_RING];
    while (!atomic_load(&fl->stop)) {
        if (s_send(fl->c, "flood") == 0)
            fl->sent++;
        size_t len;
        while (kvt_ring_pop(fl->c->rep, buf, sizeof buf, &len) == 0)
            ;
    }
    return NULL;
}

static uint64_t s_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void test_server_loop_is_never_starved(void **state)
{
    fx_t *f = *state;
    cli_t cl;
    kvt_conn_t *c = s_client(f, "f", 21, 61, &cl);
    flood_t fl = {.c = &cl};
    pthread_t th;
    pthread_create(&th, NULL, s_flood, &fl);
    usleep(20000);
    uint64_t worst = 0;
    for (int i = 0; i < 200; i++) {
        uint64_t t0 = s_ns();
        atomic_fetch_add(&f->waiting, 1); /* as kvt_server's s_lock */
        pthread_mutex_lock(&f->lock);
        atomic_fetch_sub(&f->waiting, 1);
        uint64_t dt = s_ns() - t0;
        worst = dt > worst ? dt : worst;
        pthread_mutex_unlock(&f->lock);
        usleep(500);
    }
    atomic_store(&fl.stop, true);
    pthread_join(th, NULL);
    print_message("flood: %llu requests; the loop waited %llu us at worst\n",
                  (unsigned long long)fl.sent, (unsigned long long)(worst / 1000));
    assert_true(fl.sent > 1000);
    /* the thread's turn is one slot's batch (microseconds here); the bound is the server
     * thread's supervisor limit, which valgrind's one-thread-at-a-time scheduling must pass too
     * (about 0.3 s there). Without the hand-over the loop waits as long as the flood lasts. */
    assert_true(worst < 1000000000ull);
    s_detach(&cl);
    kvt_conn_unref(&c);
}

/* A client that flips its wait word and wakes the thread without sending anything is left out
 * of the wait (`quieted`); its requests are still served, and so are the others'. */
typedef struct {
    uint32_t *word; /* a request ring's cons_wait, in the client's mapping */
    _Atomic bool stop;
} poke_t;

static void *s_poke(void *arg)
{
    poke_t *pk = arg;
    while (!atomic_load(&pk->stop)) {
        __atomic_store_n(pk->word, 0, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, pk->word, FUTEX_WAKE, 1, NULL, NULL, 0);
        usleep(50);
    }
    return NULL;
}

static void test_spurious_wakes_are_quieted(void **state)
{
    fx_t *f = *state;
    kvt_conn_t *c = s_conn(f, "w", 22);
    kvt_fastpath_offer_t o;
    assert_int_equal(s_open(f, c, 71, &o), 0);
    cli_t bad, good;
    kvt_conn_t *g = s_client(f, "v", 23, 72, &good);
    s_attach(f, &o, &bad);
    usleep(50000); /* past the spin: the thread sleeps */
    poke_t pk = {.word = (uint32_t *)(bad.map + o.request + KVT_RING_OFF_CONS_WAIT)};
    pthread_t th;
    pthread_create(&th, NULL, s_poke, &pk);
    for (int i = 0; i < 400 && s_status(f, "quieted", NULL) == 0; i++)
        usleep(5000);
    assert_true(s_status(f, "quieted", NULL) >= 1);
    assert_int_equal(s_send(&good, "still"), 0);
    assert_int_equal(s_expect(&good, "still"), 0);
    assert_int_equal(s_send(&bad, "mine"), 0); /* found by an idle sweep (<= 200 ms) */
    assert_int_equal(s_expect(&bad, "mine"), 0);
    atomic_store(&pk.stop, true);
    pthread_join(th, NULL);
    s_detach(&bad);
    s_detach(&good);
    kvt_conn_unref(&c);
    kvt_conn_unref(&g);
}

/* Asking again with every other slot in use re-formats the connection's own pair for it. */
static void test_rehello_with_no_slot_free(void **state)
{
    fx_t *f = *state;
    kvt_conn_t *c[3];
    kvt_fastpath_offer_t o[3], again;
    for (int i = 0; i < 3; i++) {
        char rid[16];
        snprintf(rid, sizeof rid, "n%d", i);
        c[i] = s_conn(f, rid, 30 + i);
        assert_int_equal(s_open(f, c[i], 80 + (uint64_t)i, &o[i]), 0);
    }
    cli_t old, fresh;
    s_attach(f, &o[0], &old);
    assert_int_equal(s_open(f, c[0], 80, &again), 0);
    assert_string_not_equal(again.ticket, o[0].ticket); /* its own slot, a new pair */
    assert_int_equal(s_send(&old, "stale"), KVT_EUNAVAIL);
    s_attach(f, &again, &fresh);
    assert_int_equal(s_send(&fresh, "new"), 0);
    assert_int_equal(s_expect(&fresh, "new"), 0);
    assert_int_equal(s_status(f, "declined", NULL), 0);
    s_detach(&old);
    s_detach(&fresh);
    for (int i = 0; i < 3; i++)
        kvt_conn_unref(&c[i]);
}

/* Replies that wait for room reach the client as soon as it reads (the thread sleeps on the
 * reply ring's word meanwhile, no polling). */
static void test_held_replies_flow_when_read(void **state)
{
    fx_t *f = *state;
    cli_t cl;
    kvt_conn_t *c = s_client(f, "q", 24, 91, &cl);
    char msg[160];
    s_fill(msg, sizeof msg, 'h');
    for (int i = 0; i < 30; i++) { /* about 22 fit the reply ring: the rest are held */
        int rc;
        while ((rc = s_send(&cl, msg)) == KVT_EBUSY) /* the thread has not taken them yet */
            assert_int_equal(kvt_ring_wait(cl.req, 200, 1000000000LL), 0);
        assert_int_equal(rc, 0);
    }
    usleep(100000);
    for (int i = 0; i < 30; i++)
        assert_int_equal(s_expect(&cl, msg), 0);
    assert_int_equal(s_status(f, "rings_open", NULL), 1);
    s_detach(&cl);
    kvt_conn_unref(&c);
}

/* Only a client that can be on this machine is offered a pair. */
static void test_local_peers(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    assert_true(kvt_fastpath_local(sv[0]));
    close(sv[0]);
    close(sv[1]);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    assert_int_equal(bind(l, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(l, 1), 0);
    assert_int_equal(getsockname(l, (struct sockaddr *)&a, &alen), 0);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    assert_int_equal(connect(c, (struct sockaddr *)&a, sizeof a), 0);
    int s = accept(l, NULL, NULL);
    assert_true(s >= 0);
    assert_true(kvt_fastpath_local(s)); /* from 127.0.0.1 */
    assert_false(kvt_fastpath_local(l)); /* not connected: no peer */
    close(s);
    close(c);
    close(l);
    assert_false(kvt_fastpath_local(-1));
    int fd = open("/dev/null", O_RDONLY);
    assert_false(kvt_fastpath_local(fd));
    close(fd);
}

static void s_count(void *ctx, const kvt_sample_t *s)
{
    int *n = ctx;
    if (strcmp(s->name, "fastpath_dropped_total") == 0)
        (*n)++;
}

static void test_metrics(void **state)
{
    fx_t *f = *state;
    int n = 0;
    kvt_fastpath_metrics_source(f->fp, s_count, &n);
    assert_int_equal(n, 10);
    json_t *j = kvt_fastpath_json(f->fp);
    assert_true(json_is_true(json_object_get(j, "enabled")));
    assert_int_equal(json_integer_value(json_object_get(j, "rings_max")), S_RINGS);
    assert_int_equal(json_integer_value(json_object_get(j, "ring_bytes")), S_RING);
    json_decref(j);
    j = kvt_fastpath_json(NULL); /* fast path off */
    assert_true(json_is_false(json_object_get(j, "enabled")));
    json_decref(j);
}

/* Issue 28: a pair goes to the ticket's holder once; a wrong or used ticket gets nothing; the
 * client's process going (its handoff connection closing) drops its pair at once, lease or
 * not; a pair nobody collects is dropped (unclaimed). */
static void test_handoff_tickets(void **state)
{
    fx_t *f = *state;
    char err[256];
    int fd = -1, sock = -1, nf = 0;
    kvt_conn_t *c = s_conn(f, "t", 40);
    kvt_fastpath_offer_t o;
    assert_int_equal(s_open(f, c, 61, &o), 0);
    /* a guessed ticket */
    char wrong[KVT_FDPASS_TICKET_HEX + 1];
    memcpy(wrong, o.ticket, sizeof wrong);
    wrong[0] = wrong[0] == 'a' ? 'b' : 'a';
    assert_int_equal(kvt_fdpass_fetch(o.socket, wrong, 2000, &fd, 1, &nf, &sock, err, sizeof err),
                     KVT_EUNAVAIL);
    assert_non_null(strstr(err, "no such ticket"));
    assert_int_equal(kvt_fdpass_fetch(o.socket, "not-hex-at-all-not-hex-at-all-!!", 2000, &fd,
                                      1, &nf, &sock, err, sizeof err),
                     KVT_EUNAVAIL);
    assert_non_null(strstr(err, "not a ticket"));
    cli_t cl;
    s_attach(f, &o, &cl); /* the holder: the pair */
    /* the same ticket again (a process that read it somewhere): nothing */
    assert_int_equal(kvt_fdpass_fetch(o.socket, o.ticket, 2000, &fd, 1, &nf, &sock, err, sizeof err),
                     KVT_EUNAVAIL);
    assert_true(fd < 0);
    assert_int_equal(s_send(&cl, "mine"), 0);
    assert_int_equal(s_expect(&cl, "mine"), 0);
    json_t *j = kvt_handoff_json(f->handoff);
    assert_int_equal(json_integer_value(json_object_get(j, "claimed")), 1);
    json_t *r = json_object_get(j, "refused");
    assert_int_equal(json_integer_value(json_object_get(r, "unknown_ticket")), 2);
    assert_int_equal(json_integer_value(json_object_get(r, "malformed")), 1);
    json_decref(j);
    /* the client's process dies: its handoff connection closes, the pair goes with it */
    close(cl.sock);
    cl.sock = -1;
    s_wait_status(f, "dropped", "client_gone", 1);
    assert_int_equal(kvt_ring_wait(cl.rep, 0, 0), KVT_EUNAVAIL);
    kvt_ring_destroy(&cl.req);
    kvt_ring_destroy(&cl.rep);
    munmap(cl.map, cl.len);
    kvt_conn_unref(&c);
}

/* An offer not collected in time is gone; the handoff's table is bounded. */
static void test_handoff_expiry_and_bound(void **state)
{
    fx_t *f = *state;
    char ticket[KVT_FDPASS_TICKET_HEX + 1], err[256];
    int fd = open("/dev/null", O_RDONLY), got = -1, sock = -1, nf = 0;
    kvt_handoff_peer_t anyone = {0, 0};
    uint64_t id = kvt_handoff_offer(f->handoff, fd, -1, anyone, 50, ticket);
    assert_true(id != 0);
    assert_int_equal(kvt_handoff_state(f->handoff, id), KVT_HANDOFF_WAITING);
    usleep(80000);
    assert_int_equal(kvt_handoff_state(f->handoff, id), KVT_HANDOFF_EXPIRED);
    assert_int_equal(
        kvt_fdpass_fetch(kvt_handoff_path(f->handoff), ticket, 2000, &got, 1, &nf, &sock, err, sizeof err),
        KVT_EUNAVAIL);
    kvt_handoff_cancel(f->handoff, id);
    /* S_RINGS offers at once, then no more until one ends */
    uint64_t ids[S_RINGS];
    for (unsigned i = 0; i < S_RINGS; i++)
        assert_true((ids[i] = kvt_handoff_offer(f->handoff, fd, -1, anyone, 60000, ticket)) != 0);
    assert_int_equal(kvt_handoff_offer(f->handoff, fd, -1, anyone, 60000, ticket), 0);
    kvt_handoff_cancel(f->handoff, ids[0]);
    uint64_t again = kvt_handoff_offer(f->handoff, fd, -1, anyone, 60000, ticket);
    assert_true(again != 0);
    /* the holder of the newest ticket gets a descriptor */
    assert_int_equal(
        kvt_fdpass_fetch(kvt_handoff_path(f->handoff), ticket, 2000, &got, 1, &nf, &sock, err, sizeof err),
        0);
    assert_true(got >= 0);
    assert_int_equal(kvt_handoff_state(f->handoff, again), KVT_HANDOFF_CLAIMED);
    close(got);
    close(sock);
    for (int i = 0; i < 400 && kvt_handoff_state(f->handoff, again) != KVT_HANDOFF_GONE; i++)
        usleep(5000);
    assert_int_equal(kvt_handoff_state(f->handoff, again), KVT_HANDOFF_GONE);
    for (unsigned i = 1; i < S_RINGS; i++)
        kvt_handoff_cancel(f->handoff, ids[i]);
    kvt_handoff_cancel(f->handoff, again);
    close(fd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trips_sleeping_and_spinning, s_setup,
                                        s_teardown),
        cmocka_unit_test_setup_teardown(test_rehello_and_bye_through_the_ring, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_reclaim_reasons, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_hostile_client, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_held_replies_are_bounded, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_reply_to_a_closed_slot_and_stop, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_metrics, s_setup, s_teardown),
        cmocka_unit_test(test_local_peers),
        cmocka_unit_test_setup_teardown(test_server_loop_is_never_starved, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_spurious_wakes_are_quieted, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_rehello_with_no_slot_free, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_held_replies_flow_when_read, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_handoff_tickets, s_setup, s_teardown),
        cmocka_unit_test_setup_teardown(test_handoff_expiry_and_bound, s_setup, s_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
