/* DESIGN: the "redis" L2 adapter — Redis / Valkey through hiredis, one object per key
 * (prefix + name, raw bytes: SET, GET, STRLEN + EXISTS, DEL), Redis Cluster when the spec
 * names several nodes.
 *
 * Spec (after "redis:"): HOST:PORT[,HOST:PORT...][,prefix=P][,timeout_ms=N][,db=N][,user=U]
 * [,password=P][,cluster=yes|no]; defaults prefix=kvtier:, timeout_ms=1000, db=0. Several
 * nodes (or cluster=yes) mean cluster mode. open fails only on a bad spec: an unreachable
 * server is an outage, not a configuration error, so the daemon starts, health says why, and
 * the adapter connects once the server answers.
 *
 * Threads: any number may call at once (max_threads says 4, but lookups and health probes
 * come from other threads too). hiredis contexts are not thread-safe, so a context is owned by
 * one call at a time: each node keeps a stack of up to S_MAX_IDLE idle contexts, a call pops
 * one (or connects) and pushes it back when it is done; past S_MAX_IDLE callers at once the
 * extra connections are closed after use. Every command runs against a deadline of
 * timeout_ms: the socket send timeout is re-armed to the time left before each write and
 * replies are read after poll(), so a stalled server costs one timeout, not one per syscall.
 *
 * Failures: a connection that fails (I/O error, EOF, timeout, refused connect, refused AUTH)
 * is freed, never reused, and starts an exponential backoff on its node (100 ms doubling to
 * 5 s). During a backoff calls fail at once with KVT_EUNAVAIL without touching the network;
 * once it is over, one call probes (the others keep failing fast until it succeeds). A failure
 * also bumps the node's generation so that idle contexts opened before it are dropped instead
 * of reused. A pooled context that finds its connection closed is retried once on a fresh
 * connection first: the server may have restarted or dropped an idle client, not died. Error
 * replies leave the connection usable: OOM (maxmemory) is KVT_ENOSPC, transient states
 * (LOADING, CLUSTERDOWN, READONLY, NOAUTH...) KVT_EUNAVAIL, the rest KVT_EIO.
 *
 * Cluster: a slot map (16384 entries -> node index) filled from CLUSTER SLOTS at open and
 * whenever it is stale (MOVED, a node failure), at most once per S_REFRESH_MIN_MS. MOVED
 * updates its slot at once and marks the map stale; ASK is followed for the one command
 * (ASKING first). Reads and writes go to masters only. Nodes are learned from the map and
 * redirects and never forgotten (at most S_MAX_NODES). The backoff is per node, so one dead
 * master does not stop the slots of the others.
 *
 * The process must ignore SIGPIPE (daemon/main.c does): hiredis writes with write(2).
 *
 * Lock order: s_redis_t.lock is a leaf; no network I/O happens under it. */
#include "kvt_error.h"
#include "kvt_l2.h"
#include "kvt_log.h"

#include <hiredis/hiredis.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>

#define S_TAG 0x52454449u      /* "REDI" */
#define S_TAG_DEAD 0xdeadbeefu /* poisoned on close */
#define S_MAX_THREADS 4
#define S_MAX_NODES 64
#define S_MAX_IDLE 16 /* idle contexts kept per node (one per concurrent caller) */
#define S_BACKOFF_MIN_MS 100
#define S_BACKOFF_MAX_MS 5000
#define S_SLOTS 16384
#define S_NO_NODE 0xffff
#define S_MAX_REDIRECTS 5
#define S_REFRESH_MIN_MS 100      /* at most one CLUSTER SLOTS per 100 ms */
#define S_HEALTH_REFRESH_MS 10000 /* health refreshes a map older than this */
#define S_PREFIX_MAX 128
#define S_HOST_MAX 256
#define S_SECRET_MAX 256
#define S_ERR_MAX 160
#define S_DEFAULT_TIMEOUT_MS 1000
#define S_MAX_CMDS 2 /* commands one call pipelines (lookup: STRLEN + EXISTS) */

typedef struct {
    char host[S_HOST_MAX]; /* immutable once the node is in the table */
    int port;
    redisContext *idle[S_MAX_IDLE];
    int nidle;
    uint64_t gen;         /* bumped on failure: older contexts are not pooled again */
    uint32_t fails;       /* consecutive failures, 0 when healthy */
    uint64_t retry_at_ms; /* while fails > 0: no network before this */
    char last_err[S_ERR_MAX];
} s_node_t;

typedef struct {
    uint32_t tag;
    pthread_mutex_t lock; /* leaf: nodes' pools and backoff, the slot map, flags below */
    char prefix[S_PREFIX_MAX + 1];
    size_t prefix_len;
    int timeout_ms;
    int db;
    char user[S_SECRET_MAX];
    char password[S_SECRET_MAX]; /* empty: no AUTH; never logged */
    bool cluster;
    int nseeds; /* nodes[0..nseeds) are the nodes of the spec */
    int nnodes;
    s_node_t *nodes[S_MAX_NODES];
    uint16_t *slot_node; /* cluster mode: S_SLOTS node indices or S_NO_NODE */
    bool map_stale;
    bool refreshing;
    uint64_t map_at_ms; /* last refresh attempt */
    char map_err[S_ERR_MAX];
    kvt_errrep_t rep;
} s_redis_t;

/* A context taken from a node for one call. */
typedef struct {
    int ni;
    redisContext *c;
    uint64_t gen;
    bool reused;
} s_conn_t;

typedef struct {
    int argc;
    const char *argv[3];
    size_t argvlen[3];
    /* when set, the last argument is the concatenation of these vectors (SET of payload +
     * trailer) instead of argv[argc - 1] */
    const struct iovec *iov;
    int iovcnt;
} s_cmd_t;

/* ---- spec parsing ------------------------------------------------------------------------ */

static int s_parse_int(const char *s, long min, long max, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < min || v > max)
        return KVT_EINVAL;
    *out = (int)v;
    return 0;
}

/* "host:port" or "[v6]:port" into a new node. */
static int s_parse_node(const char *tok, s_node_t **out, char *err, size_t errlen)
{
    const char *colon = strrchr(tok, ':');
    const char *h = tok;
    size_t hlen = colon ? (size_t)(colon - tok) : 0;
    if (hlen >= 2 && tok[0] == '[' && tok[hlen - 1] == ']') {
        h++;
        hlen -= 2;
    }
    int port;
    if (!colon || hlen == 0 || hlen >= S_HOST_MAX || s_parse_int(colon + 1, 1, 65535, &port)) {
        snprintf(err, errlen, "redis: bad node \"%s\" (want HOST:PORT)", tok);
        return KVT_EINVAL;
    }
    s_node_t *n = calloc(1, sizeof *n);
    kvt_assert(n);
    memcpy(n->host, h, hlen);
    n->host[hlen] = '\0';
    n->port = port;
    *out = n;
    return 0;
}

static int s_set_str(char *dst, size_t cap, const char *v, const char *key, char *err,
                     size_t errlen)
{
    size_t n = strlen(v);
    if (n >= cap) {
        snprintf(err, errlen, "redis: %s longer than %zu bytes", key, cap - 1);
        return KVT_EINVAL;
    }
    memcpy(dst, v, n + 1);
    return 0;
}

static int s_parse_option(s_redis_t *s, char *tok, bool *cluster_opt, char *err, size_t errlen)
{
    char *eq = strchr(tok, '=');
    *eq = '\0';
    const char *k = tok, *v = eq + 1;
    if (strcmp(k, "prefix") == 0) {
        int rc = s_set_str(s->prefix, sizeof s->prefix, v, k, err, errlen);
        s->prefix_len = strlen(s->prefix);
        return rc;
    }
    if (strcmp(k, "user") == 0)
        return s_set_str(s->user, sizeof s->user, v, k, err, errlen);
    if (strcmp(k, "password") == 0)
        return s_set_str(s->password, sizeof s->password, v, k, err, errlen);
    if (strcmp(k, "timeout_ms") == 0) {
        if (s_parse_int(v, 1, 600000, &s->timeout_ms) == 0)
            return 0;
        snprintf(err, errlen, "redis: timeout_ms must be 1..600000, not \"%s\"", v);
        return KVT_EINVAL;
    }
    if (strcmp(k, "db") == 0) {
        if (s_parse_int(v, 0, INT_MAX, &s->db) == 0)
            return 0;
        snprintf(err, errlen, "redis: db must be a number >= 0, not \"%s\"", v);
        return KVT_EINVAL;
    }
    if (strcmp(k, "cluster") == 0) {
        if (strcmp(v, "yes") == 0 || strcmp(v, "no") == 0) {
            s->cluster = strcmp(v, "yes") == 0;
            *cluster_opt = true;
            return 0;
        }
        snprintf(err, errlen, "redis: cluster must be yes or no, not \"%s\"", v);
        return KVT_EINVAL;
    }
    snprintf(err, errlen, "redis: unknown option \"%s\"", k);
    return KVT_EINVAL;
}

static int s_parse_spec(s_redis_t *s, const char *args, char *err, size_t errlen)
{
    char *copy = strdup(args ? args : "");
    kvt_assert(copy);
    bool cluster_opt = false;
    int rc = 0;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok && rc == 0; tok = strtok_r(NULL, ",", &save)) {
        if (strchr(tok, '=')) {
            rc = s_parse_option(s, tok, &cluster_opt, err, errlen);
        } else if (s->nnodes == S_MAX_NODES) {
            snprintf(err, errlen, "redis: more than %d nodes", S_MAX_NODES);
            rc = KVT_EINVAL;
        } else {
            rc = s_parse_node(tok, &s->nodes[s->nnodes], err, errlen);
            if (rc == 0)
                s->nnodes++;
        }
    }
    free(copy);
    if (rc)
        return rc;
    if (s->nnodes == 0) {
        snprintf(err, errlen, "redis: no HOST:PORT in \"%s\"", args ? args : "");
        return KVT_EINVAL;
    }
    s->nseeds = s->nnodes;
    if (!cluster_opt)
        s->cluster = s->nnodes > 1;
    if (s->cluster && s->db != 0) {
        snprintf(err, errlen, "redis: a cluster has only db 0");
        return KVT_EINVAL;
    }
    if (s->user[0] && !s->password[0]) {
        snprintf(err, errlen, "redis: user= needs password=");
        return KVT_EINVAL;
    }
    return 0;
}

/* ---- keys and slots ---------------------------------------------------------------------- */

/* CRC16-CCITT (XMODEM), the hash of Redis Cluster key slots. */
static uint16_t s_crc16(const char *buf, size_t len)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((uint8_t)buf[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (crc & 0x8000) ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

/* The key slot, honouring a {hashtag}: a prefix such as "kv{a}:" must route like Redis
 * does or every call would bounce on MOVED. */
static int s_slot(const char *key, size_t len)
{
    const char *open = memchr(key, '{', len);
    if (open) {
        size_t rest = len - (size_t)(open - key) - 1;
        const char *close = memchr(open + 1, '}', rest);
        if (close && close > open + 1)
            return s_crc16(open + 1, (size_t)(close - open - 1)) & (S_SLOTS - 1);
    }
    return s_crc16(key, len) & (S_SLOTS - 1);
}

static int s_key(const s_redis_t *s, const char *name, char *key, size_t *keylen)
{
    size_t n = strnlen(name, KVT_L2_NAME_LEN);
    if (n == 0 || n == KVT_L2_NAME_LEN)
        return KVT_EINVAL;
    memcpy(key, s->prefix, s->prefix_len);
    memcpy(key + s->prefix_len, name, n);
    *keylen = s->prefix_len + n;
    return 0;
}

/* ---- nodes, pools and backoff ------------------------------------------------------------ */

static uint64_t s_backoff_ms(uint32_t fails)
{
    uint64_t ms = S_BACKOFF_MIN_MS;
    for (uint32_t i = 1; i < fails && ms < S_BACKOFF_MAX_MS; i++)
        ms *= 2;
    return ms < S_BACKOFF_MAX_MS ? ms : S_BACKOFF_MAX_MS;
}

/* Index of host:port, added when new; -1 when the table is full. Lock held. */
static int s_node_index_locked(s_redis_t *s, const char *host, size_t hlen, int port)
{
    for (int i = 0; i < s->nnodes; i++)
        if (s->nodes[i]->port == port && strlen(s->nodes[i]->host) == hlen &&
            memcmp(s->nodes[i]->host, host, hlen) == 0)
            return i;
    if (s->nnodes == S_MAX_NODES || hlen == 0 || hlen >= S_HOST_MAX)
        return -1;
    s_node_t *n = calloc(1, sizeof *n);
    kvt_assert(n);
    memcpy(n->host, host, hlen);
    n->host[hlen] = '\0';
    n->port = port;
    s->nodes[s->nnodes] = n;
    return s->nnodes++;
}

/* Drops the idle contexts of a node (freed by the caller, outside the lock). Lock held. */
static int s_take_idle_locked(s_node_t *n, redisContext **out)
{
    int k = n->nidle;
    memcpy(out, n->idle, (size_t)k * sizeof *out);
    n->nidle = 0;
    return k;
}

static void s_free_all(redisContext **cs, int k)
{
    for (int i = 0; i < k; i++)
        redisFree(cs[i]);
}

/* The node failed with a context of generation `gen`: start or extend its backoff, once per
 * generation (several threads see the same outage at the same moment). */
static void s_node_failed(s_redis_t *s, int ni, uint64_t gen, const char *why)
{
    s_node_t *n = s->nodes[ni];
    redisContext *drop[S_MAX_IDLE];
    int k = 0;
    bool counted = false;
    uint32_t fails = 0;
    pthread_mutex_lock(&s->lock);
    if (gen == n->gen) {
        n->gen++;
        n->fails++;
        n->retry_at_ms = kvt_now_ms() + s_backoff_ms(n->fails);
        snprintf(n->last_err, sizeof n->last_err, "%s", why);
        k = s_take_idle_locked(n, drop);
        counted = true;
        fails = n->fails;
    }
    if (s->cluster)
        s->map_stale = true; /* a failover may have moved its slots */
    pthread_mutex_unlock(&s->lock);
    s_free_all(drop, k);
    if (counted)
        kvt_errrep_report(&s->rep, KVT_LOG_WARN,
                          "l2 redis %s:%d: %s (failure %u, retry in %llu ms)", n->host, n->port,
                          why, fails, (unsigned long long)s_backoff_ms(fails));
}

/* A pooled context found the connection closed: drop the node's idle contexts (opened before
 * the same event) without a backoff, so the caller retries on a fresh connection. */
static void s_node_stale(s_redis_t *s, int ni, uint64_t gen)
{
    s_node_t *n = s->nodes[ni];
    redisContext *drop[S_MAX_IDLE];
    int k = 0;
    pthread_mutex_lock(&s->lock);
    if (gen == n->gen) {
        n->gen++;
        k = s_take_idle_locked(n, drop);
    }
    pthread_mutex_unlock(&s->lock);
    s_free_all(drop, k);
}

static struct timeval s_tv(int ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    return tv;
}

static int s_left_ms(uint64_t deadline)
{
    uint64_t now = kvt_now_ms();
    return now >= deadline ? 0 : (int)(deadline - now);
}

/* Appends a command whose last argument is gathered from cmd->iov. The RESP text is built
 * here in one buffer, which hiredis then appends to its output buffer: two copies of the
 * value, as redisAppendCommandArgv makes of a contiguous one, so the vectors cost nothing
 * extra. REDIS_ERR with c->err set when out of memory. */
static int s_append_vectored(redisContext *c, const s_cmd_t *cmd)
{
    size_t vlen = 0, len = 32 + (size_t)cmd->argc * 24;
    for (int i = 0; i < cmd->iovcnt; i++)
        vlen += cmd->iov[i].iov_len;
    for (int i = 0; i < cmd->argc - 1; i++)
        len += cmd->argvlen[i];
    char *buf = malloc(len + vlen); /* large: fails softly (STYLE 4) */
    if (!buf) {
        c->err = REDIS_ERR_OOM;
        snprintf(c->errstr, sizeof c->errstr, "Out of memory");
        return REDIS_ERR;
    }
    size_t o = (size_t)snprintf(buf, len, "*%d\r\n", cmd->argc);
    for (int i = 0; i < cmd->argc - 1; i++) {
        o += (size_t)snprintf(buf + o, len - o, "$%zu\r\n", cmd->argvlen[i]);
        memcpy(buf + o, cmd->argv[i], cmd->argvlen[i]);
        o += cmd->argvlen[i];
        memcpy(buf + o, "\r\n", 2);
        o += 2;
    }
    o += (size_t)snprintf(buf + o, len - o, "$%zu\r\n", vlen);
    for (int i = 0; i < cmd->iovcnt; i++) {
        memcpy(buf + o, cmd->iov[i].iov_base, cmd->iov[i].iov_len);
        o += cmd->iov[i].iov_len;
    }
    memcpy(buf + o, "\r\n", 2);
    int rc = redisAppendFormattedCommand(c, buf, o + 2);
    free(buf);
    return rc;
}

/* Sends ncmd commands in one write (ASKING first when asking) and reads their replies, all
 * before timeout_ms. 0 and replies[0..ncmd) (ASKING's reply is dropped); otherwise a negative
 * code, a reason in why, and the context must be freed (it may be mid-reply). */
static int s_exec(const s_redis_t *s, redisContext *c, bool asking, const s_cmd_t *cmds, int ncmd,
                  redisReply **replies, char *why, size_t whylen)
{
    uint64_t deadline = kvt_now_ms() + (uint64_t)s->timeout_ms;
    /* hiredis 0.14 takes `const char **`, hence the copies of the argv arrays */
    const char *asking_argv[1] = {"ASKING"};
    static const size_t asking_len[1] = {6};
    int nrep = ncmd + (asking ? 1 : 0);
    redisReply *got[S_MAX_CMDS + 1] = {NULL}; /* + ASKING */
    kvt_assert(ncmd <= S_MAX_CMDS);

    if (asking && redisAppendCommandArgv(c, 1, asking_argv, asking_len) != REDIS_OK)
        goto io;
    for (int i = 0; i < ncmd; i++) {
        const char *argv[3];
        memcpy(argv, cmds[i].argv, sizeof argv);
        if ((cmds[i].iov
                 ? s_append_vectored(c, &cmds[i])
                 : redisAppendCommandArgv(c, cmds[i].argc, argv, cmds[i].argvlen)) != REDIS_OK)
            goto io;
    }

    /* The socket is blocking: write(2) sends everything unless SO_SNDTIMEO expires, which is
     * re-armed to the time left so that the whole send fits the deadline. */
    int done = 0;
    while (!done) {
        int left = s_left_ms(deadline);
        if (left == 0)
            goto timeout;
        struct timeval tv = s_tv(left);
        setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        errno = 0;
        if (redisBufferWrite(c, &done) != REDIS_OK) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                goto timeout;
            goto io;
        }
    }
    for (int i = 0; i < nrep; i++) {
        void *r = NULL;
        for (;;) {
            if (redisGetReplyFromReader(c, &r) != REDIS_OK)
                goto io;
            if (r)
                break;
            int left = s_left_ms(deadline);
            if (left == 0)
                goto timeout;
            struct pollfd p = {.fd = c->fd, .events = POLLIN};
            int pr = poll(&p, 1, left);
            if (pr < 0 && errno == EINTR)
                continue;
            if (pr == 0)
                goto timeout;
            if (pr < 0 || redisBufferRead(c) != REDIS_OK)
                goto io;
        }
        got[i] = r;
    }
    if (asking)
        freeReplyObject(got[0]);
    memcpy(replies, got + (asking ? 1 : 0), (size_t)ncmd * sizeof *replies);
    return 0;

timeout:
    snprintf(why, whylen, "timed out after %d ms", s->timeout_ms);
    for (int i = 0; i < nrep; i++)
        if (got[i])
            freeReplyObject(got[i]);
    return KVT_ETIMEDOUT;
io:
    snprintf(why, whylen, "%s", c->err ? c->errstr : strerror(errno ? errno : EIO));
    for (int i = 0; i < nrep; i++)
        if (got[i])
            freeReplyObject(got[i]);
    /* Out of memory for a large object is ours, not the server's: no backoff for it. */
    return c->err == REDIS_ERR_OOM ? KVT_ENOMEM : KVT_EUNAVAIL;
}

/* Whether a failed context saw the peer close the connection (a restart, an idle timeout)
 * rather than a timeout or a refusal. hiredis keeps strerror's text in errstr: errno itself
 * is long gone by the time the caller looks. */
static bool s_closed(const redisContext *c)
{
    return c->err == REDIS_ERR_EOF ||
           (c->err == REDIS_ERR_IO &&
            (strstr(c->errstr, "Broken pipe") || strstr(c->errstr, "Connection reset")));
}

/* Connects and authenticates; NULL and a reason on failure. */
static redisContext *s_connect(const s_redis_t *s, const s_node_t *n, char *why, size_t whylen)
{
    redisContext *c = redisConnectWithTimeout(n->host, n->port, s_tv(s->timeout_ms));
    if (!c) {
        snprintf(why, whylen, "cannot allocate a connection");
        return NULL;
    }
    if (c->err) {
        snprintf(why, whylen, "connect: %s", c->errstr);
        goto fail;
    }
    if (redisSetTimeout(c, s_tv(s->timeout_ms)) != REDIS_OK) {
        snprintf(why, whylen, "cannot set timeout: %s", c->errstr);
        goto fail;
    }
    (void)redisEnableKeepAlive(c); /* best effort: only speeds up noticing a dead peer */

    s_cmd_t cmds[2];
    memset(cmds, 0, sizeof cmds); /* no vectored argument (iov NULL) */
    int ncmd = 0;
    char dbstr[16];
    if (s->password[0]) {
        s_cmd_t *a = &cmds[ncmd++];
        a->argc = 0;
        a->argv[a->argc] = "AUTH";
        a->argvlen[a->argc++] = 4;
        if (s->user[0]) {
            a->argv[a->argc] = s->user;
            a->argvlen[a->argc++] = strlen(s->user);
        }
        a->argv[a->argc] = s->password;
        a->argvlen[a->argc++] = strlen(s->password);
    }
    if (s->db) {
        snprintf(dbstr, sizeof dbstr, "%d", s->db);
        cmds[ncmd++] = (s_cmd_t){2, {"SELECT", dbstr}, {6, strlen(dbstr)}, NULL, 0};
    }
    if (ncmd) {
        redisReply *r[2] = {NULL, NULL};
        if (s_exec(s, c, false, cmds, ncmd, r, why, whylen) != 0)
            goto fail;
        bool ok = true;
        for (int i = 0; i < ncmd; i++) {
            if (ok && r[i]->type == REDIS_REPLY_ERROR) {
                /* AUTH errors never echo the password, so the reply is safe to log */
                snprintf(why, whylen, "%s: %s", cmds[i].argv[0], r[i]->str);
                ok = false;
            }
            freeReplyObject(r[i]);
        }
        if (!ok)
            goto fail;
    }
    return c;
fail:
    redisFree(c);
    return NULL;
}

/* Takes a context of node ni: an idle one, or a new connection unless the node is backing
 * off (then KVT_EUNAVAIL at once, no network). */
static int s_acquire(s_redis_t *s, int ni, s_conn_t *cn, char *why, size_t whylen)
{
    s_node_t *n = s->nodes[ni];
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&s->lock);
    if (n->fails && now < n->retry_at_ms) {
        snprintf(why, whylen, "%.100s (retry in %llu ms)", n->last_err,
                 (unsigned long long)(n->retry_at_ms - now));
        pthread_mutex_unlock(&s->lock);
        return KVT_EUNAVAIL;
    }
    *cn = (s_conn_t){.ni = ni, .gen = n->gen};
    if (n->nidle > 0) {
        cn->c = n->idle[--n->nidle];
        cn->reused = true;
        pthread_mutex_unlock(&s->lock);
        return 0;
    }
    /* This call probes; the others keep failing fast until it has an answer. */
    if (n->fails)
        n->retry_at_ms = now + s_backoff_ms(n->fails);
    pthread_mutex_unlock(&s->lock);

    cn->c = s_connect(s, n, why, whylen);
    if (!cn->c) {
        s_node_failed(s, ni, cn->gen, why);
        return KVT_EUNAVAIL;
    }
    uint32_t was = 0;
    pthread_mutex_lock(&s->lock);
    if (cn->gen == n->gen && n->fails) {
        was = n->fails;
        n->fails = 0;
        n->retry_at_ms = 0;
    }
    pthread_mutex_unlock(&s->lock);
    if (was)
        kvt_log(KVT_LOG_INFO, "l2 redis %s:%d: connected again after %u failures", n->host, n->port,
                was);
    return 0;
}

/* Gives a healthy context back to its node's pool (or frees it when the pool is full or the
 * node failed since it was taken). */
static void s_release(s_redis_t *s, s_conn_t *cn)
{
    s_node_t *n = s->nodes[cn->ni];
    redisContext *c = cn->c;
    cn->c = NULL;
    pthread_mutex_lock(&s->lock);
    if (cn->gen == n->gen && n->nidle < S_MAX_IDLE && !c->err) {
        n->idle[n->nidle++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&s->lock);
    if (c)
        redisFree(c);
}

/* ---- replies ----------------------------------------------------------------------------- */

static bool s_prefix(const char *s, const char *p)
{
    return strncmp(s, p, strlen(p)) == 0;
}

/* An error reply as a KVT code. OOM is maxmemory with noeviction: the tier is full. The
 * transient or configuration states say "unavailable" so the daemon retries later. */
static int s_reply_code(const char *msg)
{
    static const char *const unavail[] = {"LOADING",  "BUSY",      "MASTERDOWN", "CLUSTERDOWN",
                                          "TRYAGAIN", "NOAUTH",    "WRONGPASS",  "READONLY",
                                          "NOPERM",   "NOREPLICAS"};
    if (s_prefix(msg, "OOM"))
        return KVT_ENOSPC;
    for (size_t i = 0; i < sizeof unavail / sizeof unavail[0]; i++)
        if (s_prefix(msg, unavail[i]))
            return KVT_EUNAVAIL;
    return KVT_EIO;
}

/* "MOVED 3999 host:port" / "ASK ..." -> slot, host (may be empty: the same host) and port. */
static bool s_parse_redirect(const char *msg, bool *ask, int *slot, const char **host, size_t *hlen,
                             int *port)
{
    const char *p;
    if (s_prefix(msg, "MOVED ")) {
        *ask = false;
        p = msg + 6;
    } else if (s_prefix(msg, "ASK ")) {
        *ask = true;
        p = msg + 4;
    } else {
        return false;
    }
    char *end;
    long sl = strtol(p, &end, 10);
    if (end == p || *end != ' ' || sl < 0 || sl >= S_SLOTS)
        return false;
    const char *addr = end + 1;
    const char *colon = strrchr(addr, ':');
    if (!colon)
        return false;
    long pt = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end != '\0' || pt < 1 || pt > 65535)
        return false;
    *slot = (int)sl;
    *host = addr;
    *hlen = (size_t)(colon - addr);
    *port = (int)pt;
    return true;
}

/* ---- cluster map ------------------------------------------------------------------------- */

/* Fills the slot map from one CLUSTER SLOTS reply of node `from`; false when it is malformed.
 * Lock held. Replicas (entries past the master) are ignored: reads go to masters too, so a
 * value just stored is always seen. */
static bool s_apply_slots_locked(s_redis_t *s, const redisReply *r, int from)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return false;
    uint16_t *map = malloc(S_SLOTS * sizeof *map);
    kvt_assert(map);
    for (int i = 0; i < S_SLOTS; i++)
        map[i] = S_NO_NODE;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
            continue;
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const redisReply *m = e->element[2];
        if (lo < 0 || hi >= S_SLOTS || lo > hi || m->element[0]->type != REDIS_REPLY_STRING ||
            m->element[1]->type != REDIS_REPLY_INTEGER || m->element[1]->integer < 1 ||
            m->element[1]->integer > 65535)
            continue;
        const char *host = m->element[0]->str;
        size_t hlen = m->element[0]->len;
        if (hlen == 1 && host[0] == '?') /* endpoint unknown to the cluster */
            continue;
        if (hlen == 0) { /* "the node you asked" */
            host = s->nodes[from]->host;
            hlen = strlen(host);
        }
        int ni = s_node_index_locked(s, host, hlen, (int)m->element[1]->integer);
        if (ni < 0)
            continue;
        for (long long sl = lo; sl <= hi; sl++)
            map[sl] = (uint16_t)ni;
    }
    memcpy(s->slot_node, map, S_SLOTS * sizeof *map);
    free(map);
    return true;
}

/* Reloads the slot map from the first node that answers CLUSTER SLOTS. One thread at a
 * time; the others go on with the map they have (MOVED keeps them correct meanwhile). */
static void s_refresh(s_redis_t *s)
{
    int order[S_MAX_NODES], n = 0;
    pthread_mutex_lock(&s->lock);
    if (s->refreshing) {
        pthread_mutex_unlock(&s->lock);
        return;
    }
    s->refreshing = true;
    s->map_at_ms = kvt_now_ms();
    /* Nodes that own slots first (they are the live cluster), then the seeds, then the rest. */
    bool seen[S_MAX_NODES] = {false};
    for (int sl = 0; sl < S_SLOTS; sl++) {
        int ni = s->slot_node[sl];
        if (ni != S_NO_NODE && !seen[ni]) {
            seen[ni] = true;
            order[n++] = ni;
        }
    }
    for (int i = 0; i < s->nnodes; i++)
        if (!seen[i])
            order[n++] = i;
    pthread_mutex_unlock(&s->lock);

    static const s_cmd_t cmd = {2, {"CLUSTER", "SLOTS"}, {7, 5}, NULL, 0};
    char why[S_ERR_MAX] = "no node to ask";
    bool ok = false;
    for (int i = 0; i < n && !ok; i++) {
        s_conn_t cn;
        redisReply *r = NULL;
        if (s_acquire(s, order[i], &cn, why, sizeof why) != 0)
            continue;
        if (s_exec(s, cn.c, false, &cmd, 1, &r, why, sizeof why) != 0) {
            redisFree(cn.c);
            s_node_failed(s, order[i], cn.gen, why);
            continue;
        }
        s_release(s, &cn);
        pthread_mutex_lock(&s->lock);
        if (r->type == REDIS_REPLY_ERROR)
            snprintf(why, sizeof why, "CLUSTER SLOTS: %s", r->str);
        else if (!(ok = s_apply_slots_locked(s, r, order[i])))
            snprintf(why, sizeof why, "CLUSTER SLOTS: malformed reply");
        pthread_mutex_unlock(&s->lock);
        freeReplyObject(r);
    }
    pthread_mutex_lock(&s->lock);
    s->refreshing = false;
    if (ok) {
        s->map_stale = false;
        s->map_err[0] = '\0';
    } else {
        snprintf(s->map_err, sizeof s->map_err, "%s", why);
    }
    pthread_mutex_unlock(&s->lock);
    if (!ok)
        kvt_errrep_report(&s->rep, KVT_LOG_WARN, "l2 redis cluster: cannot load the slot map: %s",
                          why);
}

/* The node serving a slot: the map's, else the first seed not backing off. */
static int s_route(s_redis_t *s, int slot)
{
    bool refresh = false;
    int ni = -1;
    uint64_t now = kvt_now_ms();
    pthread_mutex_lock(&s->lock);
    if (s->cluster) {
        refresh = s->map_stale && !s->refreshing && now - s->map_at_ms >= S_REFRESH_MIN_MS;
        if (s->slot_node[slot] != S_NO_NODE)
            ni = s->slot_node[slot];
    }
    for (int i = 0; ni < 0 && i < s->nseeds; i++)
        if (!s->nodes[i]->fails || now >= s->nodes[i]->retry_at_ms)
            ni = i;
    pthread_mutex_unlock(&s->lock);
    if (refresh) {
        s_refresh(s);
        if (s->cluster) {
            pthread_mutex_lock(&s->lock);
            if (s->slot_node[slot] != S_NO_NODE)
                ni = s->slot_node[slot];
            pthread_mutex_unlock(&s->lock);
        }
    }
    return ni < 0 ? 0 : ni;
}

/* ---- one call ---------------------------------------------------------------------------- */

/* Runs the commands of one key on the node that serves it, following redirects and retrying
 * once when a pooled connection turns out closed. 0 and replies none of which is an error, or
 * a negative code (replies freed). */
static int s_call(s_redis_t *s, const char *key, size_t keylen, const s_cmd_t *cmds, int ncmd,
                  redisReply **replies)
{
    int slot = s_slot(key, keylen);
    int ni = s_route(s, slot);
    bool asking = false, retried = false;
    char why[S_ERR_MAX];
    for (int hops = 0;; hops++) {
        s_conn_t cn;
        int rc = s_acquire(s, ni, &cn, why, sizeof why);
        if (rc)
            return rc;
        rc = s_exec(s, cn.c, asking, cmds, ncmd, replies, why, sizeof why);
        if (rc) {
            bool closed = s_closed(cn.c);
            redisFree(cn.c);
            if (rc == KVT_ENOMEM)
                return rc;
            if (cn.reused && closed && !retried) {
                retried = true;
                s_node_stale(s, ni, cn.gen);
                continue;
            }
            s_node_failed(s, ni, cn.gen, why);
            return rc;
        }
        s_release(s, &cn);

        int err = 0;
        bool redirect = false, ask = false;
        const char *host = NULL;
        size_t hlen = 0;
        int rslot = 0, rport = 0, next = -1;
        for (int i = 0; i < ncmd && !err && !redirect; i++) {
            if (replies[i]->type != REDIS_REPLY_ERROR)
                continue;
            redirect = s_parse_redirect(replies[i]->str, &ask, &rslot, &host, &hlen, &rport);
            if (redirect) {
                pthread_mutex_lock(&s->lock);
                if (hlen == 0) { /* Redis 7 says ":port" for "the host you asked" */
                    host = s->nodes[ni]->host;
                    hlen = strlen(host);
                }
                next = s_node_index_locked(s, host, hlen, rport);
                if (!ask && next >= 0 && s->slot_node) {
                    s->slot_node[rslot] = (uint16_t)next;
                    s->map_stale = true;
                }
                pthread_mutex_unlock(&s->lock);
                kvt_log(KVT_LOG_DEBUG, "l2 redis %s:%d: %s", s->nodes[ni]->host, s->nodes[ni]->port,
                        replies[i]->str);
            } else {
                err = s_reply_code(replies[i]->str);
                kvt_errrep_report(&s->rep, KVT_LOG_WARN, "l2 redis %s:%d: %s: %s",
                                  s->nodes[ni]->host, s->nodes[ni]->port, cmds[i].argv[0],
                                  replies[i]->str);
            }
        }
        if (!err && !redirect)
            return 0;
        for (int i = 0; i < ncmd; i++)
            freeReplyObject(replies[i]);
        if (err)
            return err;
        if (!s->cluster || next < 0 || hops >= S_MAX_REDIRECTS) {
            kvt_errrep_report(&s->rep, KVT_LOG_WARN,
                              "l2 redis %s:%d: redirect to slot %d not followed (%s)",
                              s->nodes[ni]->host, s->nodes[ni]->port, rslot,
                              !s->cluster ? "not in cluster mode: name several nodes or "
                                            "cluster=yes"
                              : next < 0  ? "too many nodes"
                                          : "too many redirects");
            return KVT_EUNAVAIL;
        }
        ni = next;
        asking = ask;
    }
}

/* ---- the vtable -------------------------------------------------------------------------- */

static s_redis_t *s_self(void *state)
{
    s_redis_t *s = state;
    kvt_assert(s && s->tag == S_TAG);
    return s;
}

static void s_close(void *state)
{
    if (!state)
        return;
    s_redis_t *s = s_self(state);
    for (int i = 0; i < s->nnodes; i++) {
        s_free_all(s->nodes[i]->idle, s->nodes[i]->nidle);
        free(s->nodes[i]);
    }
    free(s->slot_node);
    explicit_bzero(s->password, sizeof s->password);
    pthread_mutex_destroy(&s->lock);
    pthread_mutex_destroy(&s->rep.lock);
    s->tag = S_TAG_DEAD;
    free(s);
}

/* One PING to node ni (a pooled connection found closed is retried once on a fresh one). */
static int s_ping(s_redis_t *s, int ni, char *why, size_t whylen)
{
    static const s_cmd_t cmd = {1, {"PING"}, {4}, NULL, 0};
    for (bool retried = false;; retried = true) {
        s_conn_t cn;
        redisReply *r = NULL;
        int rc = s_acquire(s, ni, &cn, why, whylen);
        if (rc)
            return rc;
        rc = s_exec(s, cn.c, false, &cmd, 1, &r, why, whylen);
        if (rc) {
            bool closed = s_closed(cn.c);
            redisFree(cn.c);
            if (cn.reused && closed && !retried) {
                s_node_stale(s, ni, cn.gen);
                continue;
            }
            s_node_failed(s, ni, cn.gen, why);
            return rc;
        }
        s_release(s, &cn);
        if (r->type == REDIS_REPLY_ERROR) {
            snprintf(why, whylen, "PING: %s", r->str);
            rc = s_reply_code(r->str);
        }
        freeReplyObject(r);
        return rc;
    }
}

static int s_open(const char *args, void **state, char *err, size_t errlen)
{
    s_redis_t *s = calloc(1, sizeof *s);
    kvt_assert(s);
    s->tag = S_TAG;
    pthread_mutex_init(&s->lock, NULL);
    s->rep = (kvt_errrep_t)KVT_ERRREP_INIT(10000);
    s->timeout_ms = S_DEFAULT_TIMEOUT_MS;
    strcpy(s->prefix, "kvtier:");
    s->prefix_len = strlen(s->prefix);
    int rc = s_parse_spec(s, args, err, errlen);
    if (rc)
        goto fail;
    if (s->cluster) {
        s->slot_node = malloc(S_SLOTS * sizeof *s->slot_node);
        kvt_assert(s->slot_node);
        for (int i = 0; i < S_SLOTS; i++)
            s->slot_node[i] = S_NO_NODE;
        s->map_stale = true;
        s_refresh(s);
    } else {
        /* A failure is logged by s_node_failed and starts the backoff (see DESIGN). */
        char why[S_ERR_MAX];
        (void)s_ping(s, 0, why, sizeof why);
    }
    *state = s;
    return 0;
fail:
    s_close(s);
    return rc;
}

static int s_storev(void *state, const char *name, const struct iovec *iov, int iovcnt)
{
    s_redis_t *s = s_self(state);
    char key[S_PREFIX_MAX + KVT_L2_NAME_LEN];
    size_t keylen;
    if (s_key(s, name, key, &keylen) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    s_cmd_t cmd = {3, {"SET", key, ""}, {3, keylen, 0}, iov, iovcnt};
    redisReply *r;
    int rc = s_call(s, key, keylen, &cmd, 1, &r);
    if (rc)
        return rc;
    freeReplyObject(r);
    return 0;
}

static int s_store(void *state, const char *name, const void *data, size_t len)
{
    struct iovec iov = {(void *)(data ? data : ""), len};
    return s_storev(state, name, &iov, 1);
}

static int s_lookup(void *state, const char *name, size_t *len)
{
    s_redis_t *s = s_self(state);
    char key[S_PREFIX_MAX + KVT_L2_NAME_LEN];
    size_t keylen;
    if (s_key(s, name, key, &keylen))
        return KVT_EINVAL;
    /* STRLEN alone cannot tell an empty object from a missing one; EXISTS rides in the same
     * round trip. */
    s_cmd_t cmds[2] = {{2, {"STRLEN", key}, {6, keylen}, NULL, 0},
                       {2, {"EXISTS", key}, {6, keylen}, NULL, 0}};
    redisReply *r[2];
    int rc = s_call(s, key, keylen, cmds, 2, r);
    if (rc)
        return rc;
    if (r[0]->type != REDIS_REPLY_INTEGER || r[1]->type != REDIS_REPLY_INTEGER || r[0]->integer < 0)
        rc = KVT_EIO;
    else if (r[1]->integer == 0)
        rc = KVT_ENOTFOUND;
    else
        *len = (size_t)r[0]->integer;
    freeReplyObject(r[0]);
    freeReplyObject(r[1]);
    return rc;
}

static int s_loadv(void *state, const char *name, const struct iovec *iov, int iovcnt, size_t *len)
{
    s_redis_t *s = s_self(state);
    char key[S_PREFIX_MAX + KVT_L2_NAME_LEN];
    size_t keylen, cap = 0;
    if (s_key(s, name, key, &keylen) || iovcnt < 1 || iovcnt > KVT_L2_IOV_MAX)
        return KVT_EINVAL;
    for (int i = 0; i < iovcnt; i++)
        cap += iov[i].iov_len;
    /* One GET: atomic, so a concurrent replace never yields a torn object. An object larger
     * than cap is read and dropped; names are ours and their sizes bounded by the daemon. */
    s_cmd_t cmd = {2, {"GET", key}, {3, keylen}, NULL, 0};
    redisReply *r;
    int rc = s_call(s, key, keylen, &cmd, 1, &r);
    if (rc)
        return rc;
    if (r->type == REDIS_REPLY_NIL) {
        rc = KVT_ENOTFOUND;
    } else if (r->type != REDIS_REPLY_STRING) {
        rc = KVT_EIO;
    } else {
        *len = r->len;
        if (r->len > cap)
            rc = KVT_ENOSPC;
        for (size_t off = 0, i = 0; !rc && off < r->len; i++) { /* scatter */
            size_t k = r->len - off < iov[i].iov_len ? r->len - off : iov[i].iov_len;
            memcpy(iov[i].iov_base, r->str + off, k);
            off += k;
        }
    }
    freeReplyObject(r);
    return rc;
}

static int s_load(void *state, const char *name, void *buf, size_t cap, size_t *len)
{
    struct iovec iov = {buf, cap};
    return s_loadv(state, name, &iov, 1, len);
}

static int s_remove(void *state, const char *name)
{
    s_redis_t *s = s_self(state);
    char key[S_PREFIX_MAX + KVT_L2_NAME_LEN];
    size_t keylen;
    if (s_key(s, name, key, &keylen))
        return KVT_EINVAL;
    s_cmd_t cmd = {2, {"DEL", key}, {3, keylen}, NULL, 0};
    redisReply *r;
    int rc = s_call(s, key, keylen, &cmd, 1, &r);
    if (rc)
        return rc;
    rc = r->type != REDIS_REPLY_INTEGER ? KVT_EIO : r->integer == 0 ? KVT_ENOTFOUND : 0;
    freeReplyObject(r);
    return rc;
}

/* Single node: one PING. Cluster: every slot must have a master and every master must answer
 * PING — a cluster with unserved slots loses some objects, so it is not healthy. */
static int s_health(void *state, char *why, size_t whylen)
{
    s_redis_t *s = s_self(state);
    char msg[S_ERR_MAX];
    if (!s->cluster) {
        int rc = s_ping(s, 0, msg, sizeof msg);
        if (rc)
            snprintf(why, whylen, "redis %s:%d: %s", s->nodes[0]->host, s->nodes[0]->port, msg);
        return rc ? KVT_EUNAVAIL : 0;
    }
    pthread_mutex_lock(&s->lock);
    bool refresh = s->map_stale || kvt_now_ms() - s->map_at_ms >= S_HEALTH_REFRESH_MS;
    pthread_mutex_unlock(&s->lock);
    if (refresh)
        s_refresh(s);

    bool seen[S_MAX_NODES] = {false};
    int masters[S_MAX_NODES], nm = 0, unserved = 0;
    pthread_mutex_lock(&s->lock);
    for (int sl = 0; sl < S_SLOTS; sl++) {
        int ni = s->slot_node[sl];
        if (ni == S_NO_NODE) {
            unserved++;
        } else if (!seen[ni]) {
            seen[ni] = true;
            masters[nm++] = ni;
        }
    }
    snprintf(msg, sizeof msg, "%s", s->map_err);
    pthread_mutex_unlock(&s->lock);
    if (unserved) {
        snprintf(why, whylen, "redis cluster: %d of %d slots not served%s%s", unserved, S_SLOTS,
                 msg[0] ? ": " : "", msg);
        return KVT_EUNAVAIL;
    }
    for (int i = 0; i < nm; i++) {
        if (s_ping(s, masters[i], msg, sizeof msg) != 0) {
            snprintf(why, whylen, "redis %s:%d: %s", s->nodes[masters[i]]->host,
                     s->nodes[masters[i]]->port, msg);
            return KVT_EUNAVAIL;
        }
    }
    return 0;
}

static const kvt_l2_ops_t s_ops = {
    .abi = KVT_L2_ABI,
    .kind = "redis",
    .max_threads = S_MAX_THREADS,
    .open = s_open,
    .close = s_close,
    .store = s_store,
    .lookup = s_lookup,
    .load = s_load,
    .remove = s_remove,
    .health = s_health,
    /* usage: the server is shared and evicts on its own, so bytes "held" by this daemon are
     * unknowable; a count of bytes written would only mislead /metrics. */
    .usage = NULL,
    .storev = s_storev,
    .loadv = s_loadv,
};

const kvt_l2_ops_t *kvt_l2_redis_ops(void)
{
    return &s_ops;
}
