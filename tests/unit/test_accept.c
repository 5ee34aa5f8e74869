/* Unit tests of daemon/kvt_accept.c: how the open-files limit is raised and shared between
 * client and HTTP connections, the cap on a watched listener (and none on another), the
 * generation of a descriptor across close and reuse, the descriptors kept in reserve, and
 * EMFILE turned into a refused connection that leaves nothing pending. The module's state is
 * process-wide, so every case runs in a child process of its own (its verdict is the exit
 * status); the accept() the cases call is the module's interposer, linked into this binary. */
#include "kvt_accept.h"
#include "kvt_error.h"

#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#define S_RESERVE 64 /* as in kvt_accept.c */

/* In the child: a failed check exits 1 with the line; cmocka's asserts would longjmp out of
 * the fork. */
#define CHECK(expr)                                                                            \
    do {                                                                                       \
        if (!(expr)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #expr);           \
            _exit(1);                                                                          \
        }                                                                                      \
    } while (0)

static void s_in_child(void (*fn)(void))
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        fn();
        _exit(0);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static void s_set_nofile(rlim_t soft, rlim_t hard)
{
    struct rlimit rl = {soft, hard};
    CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
}

static uint64_t s_open_now(void)
{
    uint64_t n = 0;
    for (int fd = 0; fd < 65536; fd++)
        if (fcntl(fd, F_GETFD) >= 0)
            n++;
    return n;
}

/* A listening unix socket in the abstract namespace (nothing on disk), non-blocking. */
static int s_listener(struct sockaddr_un *addr)
{
    static int seq;
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    snprintf(addr->sun_path + 1, sizeof addr->sun_path - 1, "kvt-test-accept-%d-%d",
             (int)getpid(), seq++);
    int l = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    CHECK(l >= 0);
    CHECK(bind(l, (struct sockaddr *)addr, sizeof *addr) == 0);
    CHECK(listen(l, 64) == 0);
    return l;
}

static int s_connect(const struct sockaddr_un *addr)
{
    int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(c >= 0);
    CHECK(connect(c, (const struct sockaddr *)addr, sizeof *addr) == 0);
    return c;
}

/* A refused connection was closed by the daemon's side: the client reads end-of-file. */
static bool s_closed_by_peer(int c)
{
    struct timeval tv = {2, 0};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char b;
    ssize_t n = recv(c, &b, 1, 0);
    return n == 0 || (n < 0 && errno == ECONNRESET);
}

typedef struct {
    double connections, max, refused_cap, refused_fds, limit;
} s_gauges_t;

static void s_collect(void *ctx, const kvt_sample_t *s)
{
    s_gauges_t *g = ctx;
    if (strcmp(s->name, "connections") == 0)
        g->connections = s->value;
    else if (strcmp(s->name, "connections_max") == 0)
        g->max = s->value;
    else if (strcmp(s->name, "connections_refused_total") == 0 &&
             strcmp(s->label_value, "max_connections") == 0)
        g->refused_cap = s->value;
    else if (strcmp(s->name, "connections_refused_total") == 0)
        g->refused_fds = s->value;
    else if (strcmp(s->name, "open_files_limit") == 0)
        g->limit = s->value;
}

static s_gauges_t s_gauges(void)
{
    s_gauges_t g = {0};
    kvt_accept_metrics_source(NULL, s_collect, &g);
    return g;
}

/* ---- the budget ---- */

static void s_budget_fits(void)
{
    s_set_nofile(4096, 4096);
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(100, 50, &b, err, sizeof err) == 0);
    CHECK(b.clients == 100 && b.http == 50 && b.fd_limit == 4096);
    s_gauges_t g = s_gauges();
    CHECK(g.max == 100 && g.limit == 4096 && g.connections == 0);
}

static void test_budget_fits(void **state)
{
    (void)state;
    s_in_child(s_budget_fits);
}

/* The soft limit goes up to the hard one before anything is shared out. */
static void s_soft_raised(void)
{
    s_set_nofile(512, 2048);
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(100, 10, &b, err, sizeof err) == 0);
    struct rlimit rl;
    CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
    CHECK(rl.rlim_cur == 2048 && b.fd_limit == 2048);
}

static void test_soft_limit_raised_to_hard(void **state)
{
    (void)state;
    s_in_child(s_soft_raised);
}

/* Too few descriptors for what is asked: HTTP gets a quarter of the room (at least 16),
 * clients the rest, and together they fit under the limit with the reserve kept. */
static void s_budget_short(void)
{
    s_set_nofile(512, 512);
    uint64_t open_before = s_open_now();
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(4096, 1024, &b, err, sizeof err) == 0);
    uint64_t room = 512 - open_before - S_RESERVE;
    CHECK(b.http == room / 4);
    CHECK(b.clients == room - b.http);
    CHECK(b.clients + b.http + open_before + S_RESERVE <= 512);
}

static void test_budget_short_shares_room(void **state)
{
    (void)state;
    s_in_child(s_budget_short);
}

/* HTTP keeps its minimum even when a quarter is less; clients keep what they asked for when
 * that is less than the rest. */
static void s_budget_http_min(void)
{
    s_set_nofile(200, 200);
    uint64_t open_before = s_open_now();
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(1000, 1000, &b, err, sizeof err) == 0);
    uint64_t room = 200 - open_before - S_RESERVE;
    CHECK(room / 4 < 16 ? b.http == 16 : b.http == room / 4);
    CHECK(b.clients == room - b.http);
}

static void test_budget_http_minimum(void **state)
{
    (void)state;
    s_in_child(s_budget_http_min);
}

static void s_budget_too_low(void)
{
    s_set_nofile(80, 80);
    kvt_accept_budget_t b = {0};
    char err[256] = "";
    CHECK(kvt_accept_setup(1000, 100, &b, err, sizeof err) == KVT_EINVAL);
    CHECK(strstr(err, "LimitNOFILE") != NULL);
    CHECK(b.clients == 0); /* untouched */
}

static void test_budget_too_low_is_an_error(void **state)
{
    (void)state;
    s_in_child(s_budget_too_low);
}

/* ---- the cap and the generations ---- */

static void s_cap(void)
{
    s_set_nofile(4096, 4096);
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(8, 0, &b, err, sizeof err) == 0 && b.clients == 8);
    struct sockaddr_un addr;
    int l = s_listener(&addr);
    kvt_accept_watch(l);
    int cl[10], sv[8];
    for (int i = 0; i < 10; i++)
        cl[i] = s_connect(&addr);
    for (int i = 0; i < 8; i++) {
        sv[i] = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        CHECK(sv[i] >= 0);
        CHECK(kvt_accept_generation(sv[i]) == 1);
    }
    CHECK(kvt_accept_open() == 8);
    for (int i = 8; i < 10; i++) {
        errno = 0;
        CHECK(accept(l, NULL, NULL) < 0 && errno == ECONNABORTED);
        CHECK(s_closed_by_peer(cl[i]));
    }
    s_gauges_t g = s_gauges();
    CHECK(g.connections == 8 && g.refused_cap == 2 && g.refused_fds == 0);

    /* one closes: its generation is reported once, the slot is free again */
    int c = s_connect(&addr); /* before the close: it must not take the freed descriptor */
    int fd = sv[3];
    close(sv[3]);
    CHECK(kvt_accept_closed(fd) == 1);
    CHECK(kvt_accept_closed(fd) == 0); /* a second report of the same close counts nothing */
    CHECK(kvt_accept_open() == 7);
    int s = accept4(l, NULL, NULL, SOCK_CLOEXEC);
    CHECK(s == fd);                          /* the lowest free descriptor, reused */
    CHECK(kvt_accept_generation(s) == 2); /* and told apart from the connection before */
    CHECK(kvt_accept_open() == 8);

    /* a listener nobody watches (HTTP) is not capped by max_connections */
    struct sockaddr_un addr2;
    int l2 = s_listener(&addr2);
    int c2 = s_connect(&addr2);
    int s2 = accept(l2, NULL, NULL);
    CHECK(s2 >= 0 && kvt_accept_generation(s2) == 0 && kvt_accept_open() == 8);
    CHECK(kvt_accept_closed(s2) == 0); /* never counted, so never uncounted */
    for (int i = 0; i < 10; i++)
        close(cl[i]);
    close(c), close(s), close(c2), close(s2), close(l), close(l2);
}

static void test_cap_and_generations(void **state)
{
    (void)state;
    s_in_child(s_cap);
}

/* Before setup the interposers pass everything through. */
static void s_passthrough(void)
{
    struct sockaddr_un addr;
    int l = s_listener(&addr);
    kvt_accept_watch(l);
    int c[3], s[3];
    for (int i = 0; i < 3; i++) {
        c[i] = s_connect(&addr);
        s[i] = accept(l, NULL, NULL);
        CHECK(s[i] >= 0);
    }
    CHECK(kvt_accept_open() == 0);
    for (int i = 0; i < 3; i++)
        close(c[i]), close(s[i]);
    close(l);
}

static void test_passthrough_before_setup(void **state)
{
    (void)state;
    s_in_child(s_passthrough);
}

/* ---- descriptors running out ---- */

/* An accepted descriptor among the last ones of the limit is refused: they stay free for L2
 * files and HTTP. */
static void s_reserve(void)
{
    s_set_nofile(256, 256);
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(8, 0, &b, err, sizeof err) == 0);
    struct sockaddr_un addr;
    int l = s_listener(&addr);
    int c = s_connect(&addr);
    /* fill the descriptors below the ceiling (limit - reserve / 2) */
    int filler[256], nfill = 0;
    for (;;) {
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        CHECK(fd >= 0);
        if (fd >= 256 - S_RESERVE / 2) {
            close(fd);
            break;
        }
        filler[nfill++] = fd;
    }
    errno = 0;
    CHECK(accept(l, NULL, NULL) < 0 && errno == ECONNABORTED);
    CHECK(s_closed_by_peer(c));
    s_gauges_t g = s_gauges();
    CHECK(g.refused_fds == 1 && g.refused_cap == 0);
    /* one freed below the ceiling: served again */
    int c2 = s_connect(&addr);
    close(filler[--nfill]);
    int s2 = accept(l, NULL, NULL);
    CHECK(s2 >= 0 && s2 < 256 - S_RESERVE / 2);
    while (nfill)
        close(filler[--nfill]);
    close(c), close(c2), close(s2), close(l);
}

static void test_reserve_kept_free(void **state)
{
    (void)state;
    s_in_child(s_reserve);
}

/* EMFILE: the pending connection is taken off the listener with the spare descriptor and
 * closed (the client sees the close, nothing spins on a readable listener), and the caller
 * gets ECONNABORTED, which libzmq treats as one failed accept. */
static void s_emfile(void)
{
    s_set_nofile(4096, 4096);
    kvt_accept_budget_t b;
    char err[256] = "";
    CHECK(kvt_accept_setup(8, 0, &b, err, sizeof err) == 0);
    struct sockaddr_un addr;
    int l = s_listener(&addr);
    kvt_accept_watch(l);
    int c = s_connect(&addr);
    /* now lower the limit to what is open, as a process that used up its descriptors */
    int top = -1;
    for (int fd = 0; fd < 4096; fd++)
        if (fcntl(fd, F_GETFD) >= 0)
            top = fd;
    s_set_nofile((rlim_t)top + 1, 4096);
    int filler[4096], nfill = 0;
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;)
        filler[nfill++] = fd;
    CHECK(errno == EMFILE);
    errno = 0;
    CHECK(accept(l, NULL, NULL) < 0 && errno == ECONNABORTED);
    CHECK(s_closed_by_peer(c));
    s_gauges_t g = s_gauges();
    CHECK(g.refused_fds == 1 && g.connections == 0);
    /* nothing is left pending: with room again, the listener has no connection to give */
    while (nfill)
        close(filler[--nfill]);
    s_set_nofile(4096, 4096);
    errno = 0;
    CHECK(accept(l, NULL, NULL) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
    /* and the spare descriptor was taken again: a second EMFILE is handled the same way */
    int c2 = s_connect(&addr);
    s_set_nofile((rlim_t)top + 1, 4096);
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;)
        filler[nfill++] = fd;
    errno = 0;
    CHECK(accept(l, NULL, NULL) < 0 && errno == ECONNABORTED);
    CHECK(s_closed_by_peer(c2));
    CHECK(s_gauges().refused_fds == 2);
    while (nfill)
        close(filler[--nfill]);
    close(c), close(c2), close(l);
}

static void test_emfile_sheds_the_connection(void **state)
{
    (void)state;
    s_in_child(s_emfile);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_budget_fits),
        cmocka_unit_test(test_soft_limit_raised_to_hard),
        cmocka_unit_test(test_budget_short_shares_room),
        cmocka_unit_test(test_budget_http_minimum),
        cmocka_unit_test(test_budget_too_low_is_an_error),
        cmocka_unit_test(test_passthrough_before_setup),
        cmocka_unit_test(test_cap_and_generations),
        cmocka_unit_test(test_reserve_kept_free),
        cmocka_unit_test(test_emfile_sheds_the_connection),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
