/* Unit tests of l2/kvt_l2_redis against a real redis-server started on a free loopback port in a
 * temporary directory (every test is skipped when redis-server is not installed): a key of another
 * type (EIO), the key layout and prefix isolation, ACL user + password + db, bad specs, pooled
 * connections closed by the server (retried, not failed), a stopped server (a timeout within the
 * deadline), a killed server (fail fast with UNAVAIL during the backoff, health says why) and its
 * restart on the same port (calls succeed again within a bounded wait), 4 threads across a kill
 * and restart, and — when a 3-node cluster can be created in time — cluster routing, MOVED after a
 * reshard, and a dead master. The adapter contract (round trips, vectored, NOTFOUND, NOSPC, empty
 * objects, threads) is test_l2_conformance.c. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_log.h"

#include <hiredis/hiredis.h>

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#define S_MIB (1024u * 1024u)

static bool s_have_redis;
static char s_dir[64];
static int s_port;
static pid_t s_pid;

/* ---- helpers: processes, ports, a raw client --------------------------------------------- */

static bool s_in_path(const char *prog)
{
    const char *path = getenv("PATH");
    char *copy = strdup(path ? path : "/usr/bin:/bin");
    bool found = false;
    char *save = NULL;
    for (char *d = strtok_r(copy, ":", &save); d && !found; d = strtok_r(NULL, ":", &save)) {
        char full[512];
        snprintf(full, sizeof full, "%s/%s", d, prog);
        found = access(full, X_OK) == 0;
    }
    free(copy);
    return found;
}

static bool s_port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return ok;
}

/* A free port whose cluster bus port (+10000) is free too. */
static int s_free_port(void)
{
    for (int tries = 0; tries < 200; tries++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t al = sizeof a;
        assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
        assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
        close(fd);
        int port = ntohs(a.sin_port);
        if (port < 55000 && s_port_free(port + 10000))
            return port;
    }
    fail_msg("no free port");
    return -1;
}

/* fork + exec with output to `log`; the child dies with the test (PDEATHSIG). */
static pid_t s_spawn(char *const argv[], const char *log)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execvp(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Waits for pid at most ms; its exit status, or -1 after killing it. */
static int s_wait_exit(pid_t pid, int ms)
{
    int status = 0;
    for (int waited = 0; waited <= ms; waited += 20) {
        if (waitpid(pid, &status, WNOHANG) == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

static redisContext *s_raw(int port)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c && c->err) {
        redisFree(c);
        return NULL;
    }
    if (c)
        redisSetTimeout(c, tv);
    return c;
}

/* One command on a fresh connection; the reply (caller frees) or NULL. */
static redisReply *s_cmd(int port, const char *fmt, ...)
{
    redisContext *c = s_raw(port);
    if (!c)
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

static bool s_pings(int port)
{
    redisReply *r = s_cmd(port, "PING");
    bool ok = r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0;
    if (r)
        freeReplyObject(r);
    return ok;
}

static long long s_int(int port, const char *fmt, const char *arg)
{
    redisReply *r = s_cmd(port, fmt, arg);
    long long v = r && r->type == REDIS_REPLY_INTEGER ? r->integer : -1;
    if (r)
        freeReplyObject(r);
    return v;
}

/* Starts redis-server on port in dir (extra arguments appended); its pid once PING answers,
 * or -1. */
static pid_t s_redis_start(const char *dir, int port, const char *const *extra)
{
    char ports[16], log[128];
    snprintf(ports, sizeof ports, "%d", port);
    snprintf(log, sizeof log, "%s/redis-%d.log", dir, port);
    const char *argv[32] = {
        "redis-server", "--port", ports,   "--bind", "127.0.0.1",   "--save", "",
        "--appendonly", "no",     "--dir", dir,      "--daemonize", "no"};
    int n = 13;
    for (int i = 0; extra && extra[i] && n < 31; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = s_spawn((char *const *)argv, log);
    for (int i = 0; i < 500; i++) { /* 10 s */
        if (s_pings(port))
            return pid;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid)
            return -1;
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static void s_kill(pid_t *pid)
{
    if (*pid > 0) {
        kill(*pid, SIGKILL);
        waitpid(*pid, NULL, 0);
    }
    *pid = -1;
}

static int s_rm(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

/* ---- fixtures ---------------------------------------------------------------------------- */

static int s_setup(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN); /* as the daemon does */
    kvt_log_set_level(KVT_LOG_ERROR);
    s_pid = -1;
    s_have_redis = s_in_path("redis-server");
    if (!s_have_redis) {
        fprintf(stderr, "redis-server not installed: every test is skipped\n");
        return 0;
    }
    snprintf(s_dir, sizeof s_dir, "/tmp/kvt-l2-redis-XXXXXX");
    assert_non_null(mkdtemp(s_dir));
    s_port = s_free_port();
    s_pid = s_redis_start(s_dir, s_port, NULL);
    if (s_pid < 0) {
        fprintf(stderr, "redis-server did not start on port %d\n", s_port);
        return -1;
    }
    return 0;
}

static int s_teardown(void **state)
{
    (void)state;
    s_kill(&s_pid);
    if (s_dir[0])
        nftw(s_dir, s_rm, 16, FTW_DEPTH | FTW_PHYS);
    return 0;
}

#define S_NEED_REDIS()                                                                             \
    do {                                                                                           \
        if (!s_have_redis)                                                                         \
            skip();                                                                                \
    } while (0)

static void *s_open(const char *fmt, ...)
{
    char spec[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(spec, sizeof spec, fmt, ap);
    va_end(ap);
    void *st = NULL;
    char err[256] = "";
    int rc = kvt_l2_redis_ops()->open(spec, &st, err, sizeof err);
    if (rc)
        fail_msg("open \"%s\": %s (%s)", spec, kvt_err_name(rc), err);
    return st;
}

static void s_name(char out[KVT_L2_NAME_LEN], unsigned i)
{
    snprintf(out, KVT_L2_NAME_LEN, "%032x-%032x", 0x5eedu, i);
}

static void s_fill(uint8_t *p, size_t n, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        p[i] = (uint8_t)(x >> 16);
    }
}

/* ---- tests ------------------------------------------------------------------------------- */

/* A key of another type under an object's name is an I/O error, not a crash. (The contract —
 * round trips, vectored, NOTFOUND, NOSPC, threads — is tests/unit/test_l2_conformance.c.) */
static void test_wrong_type(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d,timeout_ms=2000", s_port);
    char name[KVT_L2_NAME_LEN], key[128];
    s_name(name, 100);
    size_t len = 0;
    uint8_t *buf = aligned_alloc(4096, 8192);
    snprintf(key, sizeof key, "kvtier:%s", name);
    redisReply *r = s_cmd(s_port, "LPUSH %s x", key);
    assert_non_null(r);
    freeReplyObject(r);
    assert_int_equal(ops->lookup(st, name, &len), KVT_EIO);
    assert_int_equal(ops->load(st, name, buf, 8192, &len), KVT_EIO);
    assert_int_equal(ops->remove(st, name), 0);
    assert_int_equal(ops->lookup(st, name, &len), KVT_ENOTFOUND);
    char why[256] = "";
    assert_int_equal(ops->health(st, why, sizeof why), 0);
    free(buf);
    ops->close(st);
}

static void test_prefix_isolation(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *a = s_open("127.0.0.1:%d,prefix=tenant-a:", s_port);
    void *b = s_open("127.0.0.1:%d,prefix=tenant-b:", s_port);
    void *d = s_open("127.0.0.1:%d", s_port);
    char name[KVT_L2_NAME_LEN], key[128];
    s_name(name, 200);
    size_t len;
    uint8_t *buf = aligned_alloc(4096, 4096);
    assert_int_equal(ops->store(a, name, "from a", 6), 0);
    assert_int_equal(ops->lookup(b, name, &len), KVT_ENOTFOUND);
    assert_int_equal(ops->lookup(d, name, &len), KVT_ENOTFOUND);
    assert_int_equal(ops->store(b, name, "from b!", 7), 0);
    assert_int_equal(ops->store(d, name, "default", 7), 0);
    assert_int_equal(ops->load(a, name, buf, 4096, &len), 0);
    assert_int_equal(len, 6);
    assert_memory_equal(buf, "from a", 6);
    assert_int_equal(ops->load(b, name, buf, 4096, &len), 0);
    assert_int_equal(len, 7);
    assert_memory_equal(buf, "from b!", 7);

    /* the key layout is prefix + name, plain bytes, default prefix "kvtier:" */
    snprintf(key, sizeof key, "tenant-a:%s", name);
    assert_int_equal(s_int(s_port, "STRLEN %s", key), 6);
    snprintf(key, sizeof key, "kvtier:%s", name);
    redisReply *r = s_cmd(s_port, "GET %s", key);
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STRING);
    assert_string_equal(r->str, "default");
    freeReplyObject(r);

    assert_int_equal(ops->remove(a, name), 0);
    assert_int_equal(ops->lookup(a, name, &len), KVT_ENOTFOUND);
    assert_int_equal(ops->lookup(b, name, &len), 0);
    assert_int_equal(ops->remove(b, name), 0);
    assert_int_equal(ops->remove(d, name), 0);
    free(buf);
    ops->close(a);
    ops->close(b);
    ops->close(d);
}

static void test_auth_and_db(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    redisReply *r = s_cmd(s_port, "ACL SETUSER kvt on >s3cret ~* &* +@all");
    assert_non_null(r);
    assert_int_not_equal(r->type, REDIS_REPLY_ERROR);
    freeReplyObject(r);

    void *st = s_open("127.0.0.1:%d,user=kvt,password=s3cret,db=3,prefix=p:", s_port);
    char name[KVT_L2_NAME_LEN], key[128];
    s_name(name, 300);
    char why[256] = "";
    assert_int_equal(ops->health(st, why, sizeof why), 0);
    assert_int_equal(ops->store(st, name, "in db 3", 7), 0);
    snprintf(key, sizeof key, "p:%s", name);
    assert_int_equal(s_int(s_port, "EXISTS %s", key), 0); /* not in db 0 */
    redisContext *c = s_raw(s_port);
    assert_non_null(c);
    freeReplyObject(redisCommand(c, "SELECT 3"));
    r = redisCommand(c, "STRLEN %s", key);
    assert_int_equal(r->integer, 7);
    freeReplyObject(r);
    freeReplyObject(redisCommand(c, "DEL %s", key));
    redisFree(c);
    ops->close(st);

    /* a wrong password: open succeeds (the server may be fixed later), calls and health fail */
    st = s_open("127.0.0.1:%d,user=kvt,password=wrong", s_port);
    size_t len;
    assert_int_equal(ops->lookup(st, name, &len), KVT_EUNAVAIL);
    assert_int_equal(ops->health(st, why, sizeof why), KVT_EUNAVAIL);
    print_message("wrong password: %s\n", why);
    assert_non_null(strstr(why, "WRONGPASS"));
    assert_null(strstr(why, "wrong")); /* the password is never echoed */
    ops->close(st);
}

static void test_bad_specs(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "",
        "localhost",
        "localhost:",
        "localhost:0",
        "localhost:70000",
        "localhost:12x",
        ":6379",
        "localhost:6379,timeout_ms=0",
        "localhost:6379,timeout_ms=abc",
        "localhost:6379,db=-1",
        "localhost:6379,bogus=1",
        "localhost:6379,user=u",
        "localhost:6379,cluster=maybe",
        "a:1,b:2,db=3",
        "localhost:6379,prefix=0123456789012345678901234567890123456789012345678901234567890123"
        "456789012345678901234567890123456789012345678901234567890123456789",
    };
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        void *st = NULL;
        char err[256] = "";
        int rc = ops->open(bad[i], &st, err, sizeof err);
        if (rc != KVT_EINVAL)
            fail_msg("spec \"%s\" gave %s", bad[i], kvt_err_name(rc));
        assert_null(st);
        assert_true(strlen(err) > 0);
    }
}

/* The server closes every client (a restart or an idle timeout looks the same): the pooled
 * connections are dead, and the next call must succeed on a fresh one, not fail. */
static void test_pooled_connection_closed(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d", s_port);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 400);
    size_t len;
    assert_int_equal(ops->store(st, name, "abc", 3), 0);
    redisReply *r = s_cmd(s_port, "CLIENT KILL TYPE normal");
    assert_non_null(r);
    assert_true(r->type == REDIS_REPLY_INTEGER && r->integer >= 1);
    freeReplyObject(r);
    assert_int_equal(ops->lookup(st, name, &len), 0);
    assert_int_equal(len, 3);
    assert_int_equal(ops->remove(st, name), 0);
    ops->close(st);
}

/* A stopped server answers nothing: the call ends at its deadline, and the node backs off. */
static void test_timeout(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d,timeout_ms=300", s_port);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 500);
    size_t len;
    assert_int_equal(ops->lookup(st, name, &len), KVT_ENOTFOUND);
    kill(s_pid, SIGSTOP);
    uint64_t t0 = kvt_now_ms();
    int rc1 = ops->lookup(st, name, &len);
    uint64_t t1 = kvt_now_ms();
    int rc2 = ops->lookup(st, name, &len);
    uint64_t t2 = kvt_now_ms();
    char why[256] = "";
    int hrc = ops->health(st, why, sizeof why);
    kill(s_pid, SIGCONT);
    print_message("stopped server: %s in %llu ms, then %s in %llu ms; health: %s\n",
                  kvt_err_name(rc1), (unsigned long long)(t1 - t0), kvt_err_name(rc2),
                  (unsigned long long)(t2 - t1), why);
    assert_int_equal(rc1, KVT_ETIMEDOUT);
    assert_true(t1 - t0 >= 250 && t1 - t0 < 1500);
    assert_int_equal(rc2, KVT_EUNAVAIL); /* in the backoff: no network */
    assert_true(t2 - t1 < 50);
    assert_int_equal(hrc, KVT_EUNAVAIL);
    assert_non_null(strstr(why, "timed out"));

    uint64_t until = kvt_now_ms() + 10000;
    int rc;
    while ((rc = ops->lookup(st, name, &len)) != KVT_ENOTFOUND && kvt_now_ms() < until)
        usleep(20000);
    assert_int_equal(rc, KVT_ENOTFOUND);
    ops->close(st);
}

static void test_killed_and_restarted(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d,timeout_ms=500", s_port);
    char name[KVT_L2_NAME_LEN];
    s_name(name, 600);
    size_t len;
    char why[256] = "";
    assert_int_equal(ops->store(st, name, "before", 6), 0);

    s_kill(&s_pid);
    assert_int_equal(ops->lookup(st, name, &len), KVT_EUNAVAIL);
    uint64_t t0 = kvt_now_ms();
    for (int i = 0; i < 50; i++)
        assert_int_equal(ops->store(st, name, "x", 1), KVT_EUNAVAIL);
    uint64_t t1 = kvt_now_ms();
    assert_int_equal(ops->health(st, why, sizeof why), KVT_EUNAVAIL);
    print_message("killed: 50 calls in %llu ms; health: %s\n", (unsigned long long)(t1 - t0), why);
    assert_true(t1 - t0 < 1000); /* at most a few probes (refused at once), no waits */
    char expect[64];
    snprintf(expect, sizeof expect, "redis 127.0.0.1:%d: ", s_port);
    assert_non_null(strstr(why, expect));

    /* let the backoff grow a little, then restart on the same port */
    usleep(700 * 1000);
    (void)ops->lookup(st, name, &len);
    s_pid = s_redis_start(s_dir, s_port, NULL);
    assert_true(s_pid > 0);
    uint64_t t2 = kvt_now_ms(), until = t2 + 15000;
    int rc;
    while ((rc = ops->store(st, name, "after", 5)) != 0 && kvt_now_ms() < until)
        usleep(20000);
    print_message("restarted: store ok after %llu ms\n", (unsigned long long)(kvt_now_ms() - t2));
    assert_int_equal(rc, 0);
    assert_true(kvt_now_ms() - t2 < 5000 + 1000); /* the backoff never exceeds 5 s */
    assert_int_equal(ops->lookup(st, name, &len), 0);
    assert_int_equal(len, 5);
    assert_int_equal(ops->health(st, why, sizeof why), 0);
    assert_int_equal(ops->remove(st, name), 0);
    ops->close(st);
}

/* 4 threads keep calling while the server is killed and restarted: only UNAVAIL / TIMEDOUT
 * (or NOTFOUND once the data is gone) during the outage, never wrong bytes, and every thread
 * succeeds again after the restart. Under TSan this covers the backoff's shared state. */
typedef struct {
    const kvt_l2_ops_t *ops;
    void *st;
    unsigned id;
    atomic_bool *stop;
    atomic_uint_fast64_t last_ok_ms;
    int bad, calls, failed;
} s_outage_t;

static void *s_outage_worker(void *arg)
{
    s_outage_t *w = arg;
    uint8_t *buf = aligned_alloc(4096, 8192);
    uint8_t data[6000];
    for (unsigned i = 0; !atomic_load(w->stop); i++) {
        char name[KVT_L2_NAME_LEN];
        unsigned k = 7000 + w->id * 100 + i % 8;
        size_t n = 1000 + k % 5000, len = 0;
        s_name(name, k);
        s_fill(data, n, k);
        int rc = w->ops->store(w->st, name, data, n);
        int rc2 = w->ops->load(w->st, name, buf, 8192, &len);
        w->calls += 2;
        if (rc2 == 0 && (len != n || memcmp(buf, data, n) != 0))
            w->bad++;
        if ((rc && rc != KVT_EUNAVAIL && rc != KVT_ETIMEDOUT) ||
            (rc2 && rc2 != KVT_EUNAVAIL && rc2 != KVT_ETIMEDOUT && rc2 != KVT_ENOTFOUND))
            w->bad++;
        w->failed += (rc != 0) + (rc2 != 0);
        if (rc == 0 && rc2 == 0)
            atomic_store(&w->last_ok_ms, kvt_now_ms());
        else
            usleep(1000);
    }
    free(buf);
    return NULL;
}

static void test_concurrent_outage(void **state)
{
    (void)state;
    S_NEED_REDIS();
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d,timeout_ms=500", s_port);
    enum { N = 4 };
    atomic_bool stop = false;
    pthread_t t[N];
    s_outage_t w[N];
    for (unsigned i = 0; i < N; i++) {
        w[i] = (s_outage_t){.ops = ops, .st = st, .id = i, .stop = &stop};
        assert_int_equal(pthread_create(&t[i], NULL, s_outage_worker, &w[i]), 0);
    }
    usleep(300 * 1000);
    s_kill(&s_pid);
    usleep(600 * 1000);
    s_pid = s_redis_start(s_dir, s_port, NULL);
    uint64_t restarted = kvt_now_ms(), until = restarted + 10000;
    bool all = false;
    while (!all && kvt_now_ms() < until) {
        usleep(20000);
        all = true;
        for (unsigned i = 0; i < N; i++)
            all = all && atomic_load(&w[i].last_ok_ms) > restarted;
    }
    atomic_store(&stop, true);
    for (unsigned i = 0; i < N; i++) {
        pthread_join(t[i], NULL);
        print_message("thread %u: %d calls, %d failed, %d wrong\n", i, w[i].calls, w[i].failed,
                      w[i].bad);
        assert_int_equal(w[i].bad, 0);
        assert_true(w[i].failed > 0);
    }
    assert_true(s_pid > 0);
    assert_true(all);
    ops->close(st);
}

/* ---- cluster ----------------------------------------------------------------------------- */

typedef struct {
    int port[3];
    pid_t pid[3];
    char dir[3][96];
} s_cluster_t;

static void s_cluster_stop(s_cluster_t *cl)
{
    for (int i = 0; i < 3; i++)
        s_kill(&cl->pid[i]);
}

static bool s_cluster_ok(int port)
{
    redisReply *r = s_cmd(port, "CLUSTER INFO");
    bool ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
    if (r)
        freeReplyObject(r);
    return ok;
}

static bool s_cluster_wait_ok(const s_cluster_t *cl, int ms)
{
    for (int waited = 0; waited < ms; waited += 50) {
        if (s_cluster_ok(cl->port[0]) && s_cluster_ok(cl->port[1]) && s_cluster_ok(cl->port[2]))
            return true;
        usleep(50000);
    }
    return false;
}

/* Starts 3 masters and joins them; false (and a reason) when that is not possible here. */
static bool s_cluster_start(s_cluster_t *cl, const char **why)
{
    static const char *const extra[] = {"--cluster-enabled",
                                        "yes",
                                        "--cluster-config-file",
                                        "nodes.conf",
                                        "--cluster-node-timeout",
                                        "3000",
                                        NULL};
    memset(cl, 0, sizeof *cl);
    for (int i = 0; i < 3; i++)
        cl->pid[i] = -1;
    if (!s_in_path("redis-cli")) {
        *why = "redis-cli not installed";
        return false;
    }
    for (int i = 0; i < 3; i++) {
        do {
            cl->port[i] = s_free_port();
        } while ((i > 0 && cl->port[i] == cl->port[0]) || (i > 1 && cl->port[i] == cl->port[1]));
        snprintf(cl->dir[i], sizeof cl->dir[i], "%s/c%d", s_dir, i);
        mkdir(cl->dir[i], 0755);
        cl->pid[i] = s_redis_start(cl->dir[i], cl->port[i], extra);
        if (cl->pid[i] < 0) {
            *why = "redis-server --cluster-enabled yes did not start";
            return false;
        }
    }
    char a[3][32], log[128];
    for (int i = 0; i < 3; i++)
        snprintf(a[i], sizeof a[i], "127.0.0.1:%d", cl->port[i]);
    snprintf(log, sizeof log, "%s/cluster-create.log", s_dir);
    char *argv[] = {"redis-cli",          "--cluster", "create",        a[0], a[1], a[2],
                    "--cluster-replicas", "0",         "--cluster-yes", NULL};
    if (s_wait_exit(s_spawn(argv, log), 30000) != 0) {
        *why = "redis-cli --cluster create failed";
        return false;
    }
    if (!s_cluster_wait_ok(cl, 20000)) {
        *why = "the cluster did not reach cluster_state:ok in 20 s";
        return false;
    }
    return true;
}

static void s_myid(int port, char out[48])
{
    redisReply *r = s_cmd(port, "CLUSTER MYID");
    assert_non_null(r);
    assert_int_equal(r->type, REDIS_REPLY_STRING);
    snprintf(out, 48, "%s", r->str);
    freeReplyObject(r);
}

static void test_cluster(void **state)
{
    (void)state;
    S_NEED_REDIS();
    s_cluster_t cl;
    const char *why_not = NULL;
    if (!s_cluster_start(&cl, &why_not)) {
        s_cluster_stop(&cl);
        print_message("cluster test skipped: %s\n", why_not);
        skip();
    }
    const kvt_l2_ops_t *ops = kvt_l2_redis_ops();
    void *st = s_open("127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d,prefix=c:,timeout_ms=2000",
                      cl.port[0], cl.port[1], cl.port[2]);
    char why[256] = "";
    int hrc = ops->health(st, why, sizeof why);
    if (hrc)
        fail_msg("health: %s", why);

    enum { K = 300 };
    uint8_t data[2000];
    uint8_t *buf = aligned_alloc(4096, 4096);
    size_t len;
    for (unsigned k = 0; k < K; k++) {
        char name[KVT_L2_NAME_LEN];
        s_name(name, k);
        s_fill(data, sizeof data, k);
        assert_int_equal(ops->store(st, name, data, sizeof data - k), 0);
    }
    /* every master got some keys: routing spreads them, as Redis does */
    long long total = 0;
    for (int i = 0; i < 3; i++) {
        redisReply *r = s_cmd(cl.port[i], "DBSIZE");
        assert_non_null(r);
        assert_true(r->integer > 0);
        total += r->integer;
        freeReplyObject(r);
    }
    assert_int_equal(total, K);

    /* move 3000 slots from the first master to the second: the adapter's map is stale, MOVED
     * sends it to the new owner */
    char from[48], to[48], a0[32], log[128];
    s_myid(cl.port[0], from);
    s_myid(cl.port[1], to);
    snprintf(a0, sizeof a0, "127.0.0.1:%d", cl.port[0]);
    snprintf(log, sizeof log, "%s/cluster-reshard.log", s_dir);
    char *argv[] = {"redis-cli",    "--cluster", "reshard",         a0,     "--cluster-from", from,
                    "--cluster-to", to,          "--cluster-slots", "3000", "--cluster-yes",  NULL};
    int rrc = s_wait_exit(s_spawn(argv, log), 60000);
    assert_int_equal(rrc, 0);
    assert_true(s_cluster_wait_ok(&cl, 20000));
    for (unsigned k = 0; k < K; k++) {
        char name[KVT_L2_NAME_LEN];
        s_name(name, k);
        s_fill(data, sizeof data, k);
        int rc = ops->load(st, name, buf, 4096, &len);
        if (rc)
            fail_msg("load %u after reshard: %s", k, kvt_err_name(rc));
        assert_int_equal(len, sizeof data - k);
        assert_memory_equal(buf, data, len);
    }
    assert_int_equal(ops->health(st, why, sizeof why), 0);

    /* a dead master: its slots fail (fast once backing off), health names it */
    s_kill(&cl.pid[2]);
    int unavail = 0, ok = 0;
    for (unsigned k = 0; k < K; k++) {
        char name[KVT_L2_NAME_LEN];
        s_name(name, k);
        int rc = ops->lookup(st, name, &len);
        if (rc == 0)
            ok++;
        else if (rc == KVT_EUNAVAIL || rc == KVT_ETIMEDOUT)
            unavail++;
        else
            fail_msg("lookup %u with a dead master: %s", k, kvt_err_name(rc));
    }
    hrc = ops->health(st, why, sizeof why);
    print_message("dead master: %d ok, %d unavailable; health: %s\n", ok, unavail, why);
    assert_true(ok > 0 && unavail > 0);
    assert_int_equal(hrc, KVT_EUNAVAIL);

    free(buf);
    ops->close(st);
    s_cluster_stop(&cl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrong_type),
        cmocka_unit_test(test_prefix_isolation),
        cmocka_unit_test(test_auth_and_db),
        cmocka_unit_test(test_bad_specs),
        cmocka_unit_test(test_pooled_connection_closed),
        cmocka_unit_test(test_timeout),
        cmocka_unit_test(test_killed_and_restarted),
        cmocka_unit_test(test_concurrent_outage),
        cmocka_unit_test(test_cluster),
    };
    return cmocka_run_group_tests(tests, s_setup, s_teardown);
}
