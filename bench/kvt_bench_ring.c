/* kvt-bench-ring: request/reply round trips between two processes over a pair of shared-memory
 * rings (common/kvt_ring.c), against a bare ZeroMQ ipc echo (DEALER -> ROUTER, libzmq on both
 * ends) of the same message in the same run — the measure of issue 17's fast path before it is
 * wired into the daemon. The message is what a 64-key LOOKUP sends: the v1 frames [uid, type,
 * body] with a 1.2 KB msgpack body. Cases:
 *
 *   zmq echo        the 3 frames to a forked ROUTER that sends them back (the baseline)
 *   ring echo       the same frames through the request ring, back through the reply ring
 *   ring lookup     the same request; the reply is a LOOKUP-sized 3-frame reply (~20 bytes)
 *   ring sleep      ring lookup with spinning off on both sides: every wait is a futex sleep
 *                   and every message a futex wake (what an idle daemon's first request costs)
 *   pipelined       32 requests in flight, ZMQ and ring: messages/s
 *   idle            a server waiting on an empty ring for 1 s after a busy start: its CPU
 *                   time (the adaptive spin must leave it asleep); the difference of two runs,
 *                   with and without the idle second
 *
 * The server is a forked child (PR_SET_PDEATHSIG) that copies each request out, parses its
 * frames (kvt_ring_parse) and answers; nothing is decoded (the daemon's own LOOKUP work is
 * measured by kvt-bench-l1 and kvtier-bench). p50/p99 are of single round trips after a
 * warm-up of a tenth.
 *
 *   build/kvt-bench-ring [--quick] [--n N] [--json FILE]
 *
 * --quick is a smoke run (< 5 s) that judges nothing. */
#include "kvt_error.h"
#include "kvt_ring.h"

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define S_RING_CAP (256u << 10) /* 256 KiB per direction */
#define S_WINDOW 32
#define S_TIMEOUT_NS 5000000000LL
#define S_BODY 1200
#define S_MAX_MSG 4096

typedef struct {
    bool quick;
    uint32_t n;
    const char *json_path;
} s_opts_t;

static s_opts_t s_opt = {.n = 100000};
static json_t *s_out;
static uint8_t s_uid[9] = {0xcf}, s_type[1] = {0x04}, s_body[S_BODY];
static const uint8_t s_reply_body[] = {0x83, 0xa2, 'o',  'k',  0xc3, 0xa4, 'h', 'i',
                                       't',  's',  0x40, 0xa2, 'l',  '1',  0x40};

static double s_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static int s_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double s_pct(double *v, size_t n, double q)
{
    qsort(v, n, sizeof *v, s_cmp);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static void s_die(const char *what, int rc)
{
    fprintf(stderr, "kvt-bench-ring: %s: %s (%d)\n", what, kvt_strerror(rc), rc);
    exit(1);
}

/* A body shaped like a 64-key LOOKUP's: a msgpack map, ns, then 64 bin16 keys. */
static void s_make_body(void)
{
    uint8_t *p = s_body;
    *p++ = 0x82;
    memcpy(p, "\xa2ns\xa9llama3-8b", 13);
    p += 13;
    memcpy(p, "\xa4keys\xdc\x00\x40", 8);
    p += 8;
    for (int k = 0; k < 64 && p + 18 <= s_body + S_BODY; k++) {
        *p++ = 0xc4;
        *p++ = 16;
        for (int i = 0; i < 16; i++)
            *p++ = (uint8_t)(k * 31 + i);
    }
    memset(p, 0, (size_t)(s_body + S_BODY - p));
}

static void s_child_setup(void)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1)
        _exit(1);
}

/* ---- rings ---- */

typedef struct {
    uint8_t *map;
    size_t size;
} s_pair_t;

static uint8_t *s_req_region(s_pair_t *p)
{
    return p->map;
}

static uint8_t *s_rep_region(s_pair_t *p)
{
    return p->map + kvt_ring_region_size(S_RING_CAP);
}

static void s_pair_new(s_pair_t *p)
{
    size_t one = kvt_ring_region_size(S_RING_CAP);
    p->size = 2 * one;
    p->map = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p->map == MAP_FAILED)
        s_die("mmap", KVT_ENOMEM);
    if (kvt_ring_format(s_req_region(p), one, S_RING_CAP, 1) ||
        kvt_ring_format(s_rep_region(p), one, S_RING_CAP, 1))
        s_die("format", KVT_EINVAL);
}

static kvt_ring_t *s_attach(uint8_t *region, kvt_ring_role_t role, uint32_t spin)
{
    char err[160];
    kvt_ring_t *r =
        kvt_ring_new(region, kvt_ring_region_size(S_RING_CAP), S_RING_CAP, role, err, sizeof err);
    if (!r) {
        fprintf(stderr, "kvt-bench-ring: %s\n", err);
        exit(1);
    }
    kvt_ring_set_spin(r, spin);
    return r;
}

/* The server: pops, parses, answers (echo: the same frames; else a LOOKUP-sized reply), until
 * the client closes its request ring. */
static void s_ring_server(s_pair_t *p, bool echo, uint32_t spin)
{
    kvt_ring_t *in = s_attach(s_req_region(p), KVT_RING_CONSUMER, spin);
    kvt_ring_t *out = s_attach(s_rep_region(p), KVT_RING_PRODUCER, spin);
    uint8_t *buf = malloc(kvt_ring_max_payload(in));
    for (;;) {
        int rc = kvt_ring_wait(in, 0, 60 * S_TIMEOUT_NS);
        if (rc == KVT_EUNAVAIL)
            break;
        if (rc)
            s_die("server wait", rc);
        size_t len;
        while ((rc = kvt_ring_pop(in, buf, kvt_ring_max_payload(in), &len)) == 0) {
            kvt_ring_frame_t fr[8];
            uint32_t n;
            if ((rc = kvt_ring_parse(buf, len, fr, 8, &n)) != 0 || n < 3)
                s_die("server parse", rc ? rc : KVT_EBADREQ);
            kvt_ring_iov_t f[8];
            for (uint32_t i = 0; i < n; i++)
                f[i] = (kvt_ring_iov_t){fr[i].ptr, fr[i].len};
            if (!echo)
                f[2] = (kvt_ring_iov_t){s_reply_body, sizeof s_reply_body};
            while ((rc = kvt_ring_push(out, f, n)) == KVT_EBUSY)
                if ((rc = kvt_ring_wait(out, kvt_ring_msg_size(f, n), S_TIMEOUT_NS)))
                    s_die("server wait for room", rc);
            if (rc)
                s_die("server push", rc);
        }
        if (rc != KVT_EBUSY && rc != KVT_EUNAVAIL)
            s_die("server pop", rc);
    }
    kvt_ring_close(out);
    free(buf);
    kvt_ring_destroy(&in);
    kvt_ring_destroy(&out);
}

typedef struct {
    double p50, p99, rate; /* us, us, round trips/s */
} s_res_t;

static void s_send_req(kvt_ring_t *out, uint64_t uid)
{
    memcpy(s_uid + 1, &uid, 8);
    kvt_ring_iov_t f[3] = {{s_uid, 9}, {s_type, 1}, {s_body, S_BODY}};
    int rc;
    while ((rc = kvt_ring_push(out, f, 3)) == KVT_EBUSY)
        if ((rc = kvt_ring_wait(out, kvt_ring_msg_size(f, 3), S_TIMEOUT_NS)))
            s_die("client wait for room", rc);
    if (rc)
        s_die("client push", rc);
}

static void s_recv_rep(kvt_ring_t *in, uint8_t *buf, size_t cap)
{
    size_t len;
    int rc;
    while ((rc = kvt_ring_pop(in, buf, cap, &len)) == KVT_EBUSY)
        if ((rc = kvt_ring_wait(in, 0, S_TIMEOUT_NS)))
            s_die("client wait for reply", rc);
    if (rc)
        s_die("client pop", rc);
}

/* window 1: latency of each round trip; window > 1: messages/s only */
static s_res_t s_ring_case(bool echo, uint32_t spin, uint32_t n, uint32_t window)
{
    s_pair_t p;
    s_pair_new(&p);
    pid_t pid = fork();
    if (pid == 0) {
        s_child_setup();
        s_ring_server(&p, echo, spin);
        _exit(0);
    }
    kvt_ring_t *out = s_attach(s_req_region(&p), KVT_RING_PRODUCER, spin);
    kvt_ring_t *in = s_attach(s_rep_region(&p), KVT_RING_CONSUMER, spin);
    uint8_t *buf = malloc(S_MAX_MSG);
    double *lat = malloc(n * sizeof *lat);
    uint32_t warm = n / 10;
    s_res_t res = {0};
    for (uint32_t i = 0; i < warm; i++) {
        s_send_req(out, i);
        s_recv_rep(in, buf, S_MAX_MSG);
    }
    double t0 = s_now_us();
    if (window <= 1) {
        for (uint32_t i = 0; i < n; i++) {
            double t = s_now_us();
            s_send_req(out, i);
            s_recv_rep(in, buf, S_MAX_MSG);
            lat[i] = s_now_us() - t;
        }
    } else {
        uint32_t sent = 0, got = 0;
        while (got < n) {
            while (sent < n && sent - got < window)
                s_send_req(out, sent++);
            s_recv_rep(in, buf, S_MAX_MSG);
            got++;
        }
    }
    double el = s_now_us() - t0;
    res.rate = n / (el * 1e-6);
    if (window <= 1) {
        res.p50 = s_pct(lat, n, 0.50);
        res.p99 = s_pct(lat, n, 0.99);
    }
    kvt_ring_close(out);
    int st;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        s_die("ring server", KVT_EINTERNAL);
    kvt_ring_destroy(&out);
    kvt_ring_destroy(&in);
    free(lat);
    free(buf);
    munmap(p.map, p.size);
    return res;
}

/* CPU time of a server that answers 1000 round trips (its spin budget then at its maximum),
 * then waits `idle_s` seconds on an empty ring (adaptive spin, then futex sleeps). */
static double s_server_cpu_ms(time_t idle_s)
{
    s_pair_t p;
    s_pair_new(&p);
    pid_t pid = fork();
    if (pid == 0) {
        s_child_setup();
        s_ring_server(&p, true, 4096);
        _exit(0);
    }
    kvt_ring_t *out = s_attach(s_req_region(&p), KVT_RING_PRODUCER, 4096);
    kvt_ring_t *in = s_attach(s_rep_region(&p), KVT_RING_CONSUMER, 4096);
    uint8_t buf[S_MAX_MSG];
    for (int i = 0; i < 1000; i++) { /* a busy start: the server's spin budget is at its max */
        s_send_req(out, (uint64_t)i);
        s_recv_rep(in, buf, sizeof buf);
    }
    struct timespec ts = {idle_s, 0};
    nanosleep(&ts, NULL);
    kvt_ring_close(out);
    int st;
    struct rusage ru;
    wait4(pid, &st, 0, &ru);
    kvt_ring_destroy(&out);
    kvt_ring_destroy(&in);
    munmap(p.map, p.size);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-3;
}

/* ---- ZeroMQ ---- */

static void s_zmq_server(const char *ep)
{
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(s, ep) != 0)
        _exit(2);
    for (;;) { /* [rid, uid, type, body] back as they came; an empty message ends */
        zmq_msg_t parts[8];
        int n = 0, more = 1;
        while (more && n < 8) {
            zmq_msg_init(&parts[n]);
            if (zmq_msg_recv(&parts[n], s, 0) < 0)
                _exit(3);
            more = zmq_msg_more(&parts[n]);
            n++;
        }
        if (n == 2 && zmq_msg_size(&parts[1]) == 0)
            break;
        for (int i = 0; i < n; i++)
            zmq_msg_send(&parts[i], s, i + 1 < n ? ZMQ_SNDMORE : 0);
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
}

static void s_zmq_req(void *d, uint64_t uid)
{
    memcpy(s_uid + 1, &uid, 8);
    zmq_send(d, s_uid, 9, ZMQ_SNDMORE);
    zmq_send(d, s_type, 1, ZMQ_SNDMORE);
    zmq_send(d, s_body, S_BODY, 0);
}

static void s_zmq_rep(void *d)
{
    int more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, d, 0) < 0)
            s_die("zmq reply timed out", KVT_ETIMEDOUT);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
}

static s_res_t s_zmq_case(uint32_t n, uint32_t window)
{
    char dir[] = "/tmp/kvt-bench-ring-XXXXXX", ep[128];
    if (!mkdtemp(dir))
        s_die("mkdtemp", KVT_EIO);
    snprintf(ep, sizeof ep, "ipc://%s/echo.sock", dir);
    pid_t pid = fork();
    if (pid == 0) {
        s_child_setup();
        s_zmq_server(ep);
        _exit(0);
    }
    void *ctx = zmq_ctx_new();
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int tmo = 5000, zero = 0;
    zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    zmq_connect(d, ep);
    double *lat = malloc(n * sizeof *lat);
    s_res_t res = {0};
    for (uint32_t i = 0; i < n / 10; i++) { /* warm-up (and waits for the bind) */
        s_zmq_req(d, i);
        s_zmq_rep(d);
    }
    double t0 = s_now_us();
    if (window <= 1) {
        for (uint32_t i = 0; i < n; i++) {
            double t = s_now_us();
            s_zmq_req(d, i);
            s_zmq_rep(d);
            lat[i] = s_now_us() - t;
        }
    } else {
        uint32_t sent = 0, got = 0;
        while (got < n) {
            while (sent < n && sent - got < window)
                s_zmq_req(d, sent++);
            s_zmq_rep(d);
            got++;
        }
    }
    double el = s_now_us() - t0;
    res.rate = n / (el * 1e-6);
    if (window <= 1) {
        res.p50 = s_pct(lat, n, 0.50);
        res.p99 = s_pct(lat, n, 0.99);
    }
    zmq_send(d, "", 0, 0);
    int st;
    waitpid(pid, &st, 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    free(lat);
    char path[160];
    snprintf(path, sizeof path, "%s/echo.sock", dir);
    unlink(path);
    rmdir(dir);
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        s_die("zmq server", KVT_EINTERNAL);
    return res;
}

/* ---- report ---- */

static void s_row(const char *key, const char *what, s_res_t r, const s_res_t *base)
{
    if (r.p50 > 0)
        printf("  %-44s p50 %8.2f us  p99 %8.2f us  %9.0f rt/s", what, r.p50, r.p99, r.rate);
    else
        printf("  %-44s %41.0f msg/s", what, r.rate);
    if (base && r.p50 > 0)
        printf("  p50 %.3fx echo", r.p50 / base->p50);
    else if (base)
        printf("  %.2fx zmq", r.rate / base->rate);
    printf("\n");
    json_object_set_new(
        s_out, key,
        json_pack("{s:f, s:f, s:f}", "p50_us", r.p50, "p99_us", r.p99, "per_s", r.rate));
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            s_opt.quick = true;
        else if (!strcmp(argv[i], "--n") && i + 1 < argc)
            s_opt.n = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            s_opt.json_path = argv[++i];
        else {
            fprintf(stderr, "usage: kvt-bench-ring [--quick] [--n N] [--json FILE]\n");
            return 2;
        }
    }
    if (s_opt.quick)
        s_opt.n = 2000;
    if (s_opt.n < 10)
        s_opt.n = 10;
    s_make_body();
    s_out = json_object();
    uint32_t n = s_opt.n;
    printf("kvt-bench-ring: %u round trips per case, %u-byte request (64-key LOOKUP frames), "
           "%ld CPUs\n",
           n, 9 + 1 + S_BODY, sysconf(_SC_NPROCESSORS_ONLN));
    s_res_t zmq = s_zmq_case(n, 1);
    s_row("zmq_echo", "zmq ipc echo (DEALER->ROUTER, 2 processes)", zmq, NULL);
    s_row("ring_echo", "ring echo (same frames back)", s_ring_case(true, 4096, n, 1), &zmq);
    s_res_t lk = s_ring_case(false, 4096, n, 1);
    s_row("ring_lookup", "ring lookup-sized reply", lk, &zmq);
    s_row("ring_sleep", "ring lookup-sized reply, no spin (futex)",
          s_ring_case(false, 0, s_opt.quick ? n : n / 4, 1), &zmq);
    s_res_t zp = s_zmq_case(n, S_WINDOW);
    s_row("zmq_pipelined", "zmq echo, 32 in flight", zp, NULL);
    s_row("ring_pipelined", "ring lookup-sized reply, 32 in flight",
          s_ring_case(false, 4096, n, S_WINDOW), &zp);
    /* the idle second's share: the same run with and without it */
    double idle = s_server_cpu_ms(1) - s_server_cpu_ms(0);
    if (idle < 0)
        idle = 0;
    printf("  %-44s %8.2f ms CPU in 1 s (%.2f%% of a core)\n", "ring server idle 1 s", idle,
           idle / 10.0);
    json_object_set_new(s_out, "idle_cpu_ms_per_s", json_real(idle));
    json_object_set_new(s_out, "round_trips", json_integer(n));
    if (s_opt.json_path && json_dump_file(s_out, s_opt.json_path, JSON_INDENT(2)) != 0)
        fprintf(stderr, "kvt-bench-ring: cannot write %s\n", s_opt.json_path);
    json_decref(s_out);
    return 0;
}
