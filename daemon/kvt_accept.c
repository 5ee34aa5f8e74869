/* DESIGN: process-wide state, set once by kvt_accept_setup before any client can connect and
 * read by the interposed accept()/accept4() on whichever thread accepts (libzmq I/O threads,
 * the HTTP thread). Open client connections are counted as a total, checked against the cap at
 * accept time, and per descriptor as two generation counters: connections accepted on it and
 * connections on it reported closed. libzmq closes a descriptor only after reporting it, so the
 * k-th close report of a descriptor is about its k-th accepted connection; that lets the
 * session table tell whether a report is about the connection it knows on that descriptor or
 * an earlier one, and a report for a connection never counted (accepted before its listener
 * was watched) changes nothing. The
 * spare descriptor is the classic cure for EMFILE on a level-triggered listener: close it,
 * accept and close the pending connection, open it again — under a mutex, since two threads
 * may hit EMFILE at once. */
#include "kvt_accept.h"

#include "kvt_config.h"
#include "kvt_error.h"
#include "kvt_log.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#define S_RESERVE 64        /* descriptors never used for accepted connections */
#define S_MIN_CONNECTIONS 8 /* below this, the limit is too low to serve */
#define S_MIN_HTTP 16        /* HTTP keeps at least this many when descriptors are short */
#define S_MAX_TRACKED (1u << 22)
#define S_MAX_WATCHED KVT_MAX_LISTEN

/* __SOCKADDR_ARG: with _GNU_SOURCE the C library declares the address argument as a
 * transparent union; the interposers must match its prototypes exactly. */
typedef int (*s_accept4_fn)(int, __SOCKADDR_ARG, socklen_t *, int);
typedef int (*s_accept_fn)(int, __SOCKADDR_ARG, socklen_t *);

static pthread_once_t s_once = PTHREAD_ONCE_INIT;
static s_accept4_fn s_real_accept4;
static s_accept_fn s_real_accept;

static _Atomic bool s_ready;
static uint32_t s_cap;               /* client connections allowed at once */
static uint64_t s_fd_limit;          /* the soft RLIMIT_NOFILE after setup */
static uint64_t s_ceiling;           /* accepted descriptors must stay below this */
static _Atomic uint32_t *s_accepted; /* client connections accepted, per descriptor */
static _Atomic uint32_t *s_closed;   /* ... and reported closed */
static _Atomic int s_watched[S_MAX_WATCHED];
static _Atomic int s_nwatched;
static _Atomic uint64_t s_open;
static _Atomic uint64_t s_refused_cap, s_refused_fds;

static pthread_mutex_t s_spare_lock = PTHREAD_MUTEX_INITIALIZER;
static int s_spare = -1;

static kvt_errrep_t s_rep_cap = KVT_ERRREP_INIT(10000);
static kvt_errrep_t s_rep_fds = KVT_ERRREP_INIT(10000);

static void s_resolve(void)
{
    s_real_accept4 = (s_accept4_fn)dlsym(RTLD_NEXT, "accept4");
    s_real_accept = (s_accept_fn)dlsym(RTLD_NEXT, "accept");
}

static bool s_is_watched(int lfd)
{
    int n = atomic_load_explicit(&s_nwatched, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (atomic_load_explicit(&s_watched[i], memory_order_relaxed) == lfd)
            return true;
    return false;
}

/* EMFILE/ENFILE: the pending connection is taken off the listener and closed, with the spare
 * descriptor freed for the moment it takes. */
static void s_shed(int lfd, int flags)
{
    pthread_mutex_lock(&s_spare_lock);
    if (s_spare >= 0) {
        close(s_spare);
        int fd = s_real_accept4
                     ? s_real_accept4(lfd, (struct sockaddr *)NULL, NULL, flags | SOCK_CLOEXEC)
                     : -1;
        if (fd >= 0)
            close(fd);
        s_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    pthread_mutex_unlock(&s_spare_lock);
}

/* What every accept goes through once set up: fd is the C library's result. */
static int s_guard(int lfd, int fd, int flags)
{
    if (!atomic_load_explicit(&s_ready, memory_order_acquire))
        return fd;
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
            s_shed(lfd, flags);
            atomic_fetch_add_explicit(&s_refused_fds, 1, memory_order_relaxed);
            kvt_errrep_report(&s_rep_fds, KVT_LOG_WARN,
                              "accept: out of file descriptors (limit %llu): connection refused",
                              (unsigned long long)s_fd_limit);
            errno = ECONNABORTED;
        }
        return -1;
    }
    if ((uint64_t)fd >= s_ceiling) {
        close(fd);
        atomic_fetch_add_explicit(&s_refused_fds, 1, memory_order_relaxed);
        kvt_errrep_report(&s_rep_fds, KVT_LOG_WARN,
                          "accept: connection refused: only the last %d of %llu file "
                          "descriptors are left (kept for L2 and HTTP)",
                          S_RESERVE / 2, (unsigned long long)s_fd_limit);
        errno = ECONNABORTED;
        return -1;
    }
    if (s_is_watched(lfd)) {
        if (atomic_fetch_add_explicit(&s_open, 1, memory_order_relaxed) >= s_cap) {
            atomic_fetch_sub_explicit(&s_open, 1, memory_order_relaxed);
            close(fd);
            atomic_fetch_add_explicit(&s_refused_cap, 1, memory_order_relaxed);
            kvt_errrep_report(&s_rep_cap, KVT_LOG_WARN,
                              "connection refused: %u client connections are open "
                              "(max_connections)",
                              s_cap);
            errno = ECONNABORTED;
            return -1;
        }
        atomic_fetch_add_explicit(&s_accepted[fd], 1, memory_order_release);
    }
    return fd;
}

/* The interposers: libzmq and libmicrohttpd call these instead of the C library's. */
int accept4(int lfd, __SOCKADDR_ARG addr, socklen_t *restrict addrlen, int flags)
{
    pthread_once(&s_once, s_resolve);
    if (!s_real_accept4) {
        errno = ENOSYS;
        return -1;
    }
    return s_guard(lfd, s_real_accept4(lfd, addr, addrlen, flags), flags);
}

int accept(int lfd, __SOCKADDR_ARG addr, socklen_t *restrict addrlen)
{
    pthread_once(&s_once, s_resolve);
    if (!s_real_accept) {
        errno = ENOSYS;
        return -1;
    }
    return s_guard(lfd, s_real_accept(lfd, addr, addrlen), 0);
}

/* Descriptors open right now (the daemon's baseline before it serves). */
static uint64_t s_open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return 64;
    uint64_t n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n > 3 ? n - 3 : n; /* ".", ".." and the directory's own descriptor */
}

int kvt_accept_setup(uint32_t max_connections, uint32_t http_connections,
                     kvt_accept_budget_t *out, char *err, size_t errlen)
{
    pthread_once(&s_once, s_resolve);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        snprintf(err, errlen, "cannot read the open-files limit: %s", strerror(errno));
        return KVT_EINVAL;
    }
    rlim_t before = rl.rlim_cur;
    if (rl.rlim_cur != rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
            kvt_log(KVT_LOG_WARN, "cannot raise the open-files limit from %llu to %llu: %s",
                    (unsigned long long)before, (unsigned long long)rl.rlim_max,
                    strerror(errno));
            rl.rlim_cur = before;
        } else {
            kvt_log(KVT_LOG_INFO, "open-files limit raised from %llu to %llu",
                    (unsigned long long)before, (unsigned long long)rl.rlim_cur);
        }
    }
    uint64_t limit = rl.rlim_cur == RLIM_INFINITY ? S_MAX_TRACKED : (uint64_t)rl.rlim_cur;
    if (limit > S_MAX_TRACKED)
        limit = S_MAX_TRACKED; /* descriptors past this are refused; nobody needs 4 M */
    uint64_t used = s_open_fds() + S_RESERVE;
    uint64_t room = limit > used ? limit - used : 0;
    uint64_t http = http_connections, clients = max_connections;
    if (clients + http > room) {
        if (http > room / 4)
            http = room / 4 > S_MIN_HTTP ? room / 4 : S_MIN_HTTP;
        if (http > http_connections)
            http = http_connections;
        clients = room > http ? room - http : 0;
        if (clients > max_connections)
            clients = max_connections;
    }
    if (clients < S_MIN_CONNECTIONS) {
        snprintf(err, errlen,
                 "the open-files limit (%llu) leaves room for %llu client connections: raise it "
                 "(LimitNOFILE=, ulimit -n) to at least %llu",
                 (unsigned long long)limit, (unsigned long long)clients,
                 (unsigned long long)(used + http + S_MIN_CONNECTIONS));
        return KVT_EINVAL;
    }
    if (clients < max_connections || http < http_connections)
        kvt_log(KVT_LOG_WARN,
                "the open-files limit (%llu, %llu open) allows only %llu client connections "
                "(max_connections %u) and %llu HTTP connections (http_max_connections %u): "
                "raise it (LimitNOFILE=, ulimit -n)",
                (unsigned long long)limit, (unsigned long long)(used - S_RESERVE),
                (unsigned long long)clients, max_connections, (unsigned long long)http,
                http_connections);
    if (!s_accepted) { /* untouched pages of these cost no memory */
        s_accepted = calloc(limit, sizeof *s_accepted);
        s_closed = calloc(limit, sizeof *s_closed);
        kvt_assert(s_accepted && s_closed);
    }
    pthread_mutex_lock(&s_spare_lock);
    if (s_spare < 0)
        s_spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pthread_mutex_unlock(&s_spare_lock);
    s_cap = (uint32_t)clients;
    s_fd_limit = limit;
    s_ceiling = limit - S_RESERVE / 2;
    atomic_store_explicit(&s_ready, true, memory_order_release);
    kvt_log(KVT_LOG_INFO, "up to %u client connections (open-files limit %llu)", s_cap,
            (unsigned long long)limit);
    *out = (kvt_accept_budget_t){.clients = s_cap, .http = (uint32_t)http, .fd_limit = limit};
    return 0;
}

void kvt_accept_watch(int fd)
{
    int n = atomic_load(&s_nwatched);
    if (fd < 0 || n >= S_MAX_WATCHED || s_is_watched(fd))
        return;
    atomic_store(&s_watched[n], fd);
    atomic_store_explicit(&s_nwatched, n + 1, memory_order_release);
}

uint32_t kvt_accept_generation(int fd)
{
    if (!s_accepted || fd < 0 || (uint64_t)fd >= s_fd_limit)
        return 0;
    return atomic_load_explicit(&s_accepted[fd], memory_order_acquire);
}

uint32_t kvt_accept_closed(int fd)
{
    if (!s_accepted || fd < 0 || (uint64_t)fd >= s_fd_limit)
        return 0;
    /* the server thread and the LMCache door's thread both report closes (a descriptor can
     * move from one socket's connection to the other's): each close is counted once */
    uint32_t closed = atomic_load_explicit(&s_closed[fd], memory_order_relaxed);
    do {
        if (closed >= atomic_load_explicit(&s_accepted[fd], memory_order_acquire))
            return 0;
    } while (!atomic_compare_exchange_weak_explicit(&s_closed[fd], &closed, closed + 1,
                                                    memory_order_relaxed,
                                                    memory_order_relaxed));
    atomic_fetch_sub_explicit(&s_open, 1, memory_order_relaxed);
    return closed + 1;
}

uint64_t kvt_accept_open(void)
{
    return atomic_load_explicit(&s_open, memory_order_relaxed);
}

void kvt_accept_metrics_source(void *ctx, kvt_sample_fn emit, void *emit_ctx)
{
    (void)ctx;
    kvt_sample_t s = {.name = "connections",
                      .help = "Client connections open.",
                      .kind = KVT_METRIC_GAUGE,
                      .value = (double)kvt_accept_open()};
    emit(emit_ctx, &s);
    s = (kvt_sample_t){.name = "connections_max",
                       .help = "Client connections allowed at once (max_connections, or less "
                               "when the open-files limit is lower).",
                       .kind = KVT_METRIC_GAUGE,
                       .value = (double)s_cap};
    emit(emit_ctx, &s);
    static const char *const why[] = {"max_connections", "file_descriptors"};
    _Atomic uint64_t *counts[] = {&s_refused_cap, &s_refused_fds};
    for (int i = 0; i < 2; i++) {
        s = (kvt_sample_t){.name = "connections_refused_total",
                           .help = "Connections closed at accept: too many open, or too few "
                                   "file descriptors left.",
                           .kind = KVT_METRIC_COUNTER,
                           .label = "reason",
                           .label_value = why[i],
                           .value = (double)atomic_load(counts[i])};
        emit(emit_ctx, &s);
    }
    s = (kvt_sample_t){.name = "open_files_limit",
                       .help = "The daemon's open-files limit (soft RLIMIT_NOFILE) after start.",
                       .kind = KVT_METRIC_GAUGE,
                       .value = (double)s_fd_limit};
    emit(emit_ctx, &s);
}
