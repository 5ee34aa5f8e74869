/* DESIGN: libmicrohttpd in epoll mode driven by our own thread (not MHD's internal one), so
 * the thread can beat for the supervisor between MHD_run() calls and a wedged HTTP thread is
 * visible. The thread owns the MHD daemon; readers of other modules' state go through their
 * thread-safe accessors and the hooks given by main.
 *
 * Health probes must answer while clients that send slowly, or nothing, hold connections: MHD
 * stops accepting at its connection limit, and a probe then waits in the listen backlog. So the
 * limit is high (http_max_connections, or what kvt_accept's share of the file descriptors
 * leaves for HTTP, so that HTTP clients cannot starve the request socket and L2 of them), a
 * connection idle for http_timeout_s is closed, and on a non-loopback address one client
 * address may hold only a quarter of the connections (on loopback every client is 127.0.0.1,
 * where a per-address limit would let one local user shut the probes out).
 *
 * GET / is a status page for people: static bytes compiled in (see s_page), which the browser
 * runs to poll /status and /metrics itself, so serving it costs no more than any other GET and
 * the daemon keeps no per-viewer state. */
#include "kvt_http.h"

#include "kvt_error.h"
#include "kvt_log.h"
#include "kvt_msg.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define S_TICK_MS 200

static kvt_errrep_t s_rep_refused = KVT_ERRREP_INIT(10000);

/* The status page (daemon/kvt_status_page.html), as bytes the Makefile generates from it at
 * build time, so that the page stays an HTML file to edit and the binary needs no file at run
 * time. */
static const unsigned char s_page[] = {
#include "kvt_status_page.inc"
};

/* KVT_STATUS_PAGE_SCRIPT_HASH: "sha256-<base64>" of the page's inline script, from the same
 * build step; the page's CSP lets that script run and no other. */
#include "kvt_status_page_csp.h"

struct kvt_http {
    const kvt_config_t *cfg;
    kvt_metrics_t *metrics;
    kvt_sup_t *sup;
    kvt_http_hooks_t hooks;
    struct MHD_Daemon *mhd;
    kvt_sup_thread_t *beat;
    pthread_t tid;
    bool started;
    _Atomic bool stop;
    double started_wall;
};

/* Adds the headers (name, value, ..., NULL; a NULL name ends them early) and queues `r`, which
 * it always destroys. A header that cannot be added (out of memory) fails the answer: MHD_NO
 * closes the connection rather than sending a response without, say, its CSP. */
static enum MHD_Result s_respond(struct MHD_Connection *conn, unsigned status,
                                 struct MHD_Response *r, const char *const *headers)
{
    for (size_t i = 0; headers[i]; i += 2) {
        if (MHD_add_response_header(r, headers[i], headers[i + 1]) != MHD_YES) {
            MHD_destroy_response(r);
            return MHD_NO;
        }
    }
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* `allow`: the Allow header of a 405, or NULL. */
static enum MHD_Result s_send(struct MHD_Connection *conn, unsigned status, const char *type,
                              char *body, size_t len, const char *allow)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    return s_respond(conn, status, r,
                     (const char *const[]){"Content-Type", type, "Cache-Control", "no-store",
                                           allow ? "Allow" : NULL, allow, NULL});
}

static enum MHD_Result s_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
    char *body = strdup(text);
    kvt_assert(body);
    return s_send(conn, status, "text/plain; charset=utf-8", body, strlen(body), NULL);
}

/* 405, with the Allow header RFC 9110 requires: "GET, HEAD" or "POST". */
static enum MHD_Result s_not_allowed(struct MHD_Connection *conn, const char *allow)
{
    char text[64];
    snprintf(text, sizeof text, "method not allowed: use %s\n", allow);
    char *body = strdup(text);
    kvt_assert(body);
    return s_send(conn, 405, "text/plain; charset=utf-8", body, strlen(body), allow);
}

static enum MHD_Result s_json(struct MHD_Connection *conn, unsigned status, json_t *obj)
{
    char *body = json_dumps(obj, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(obj);
    if (!body)
        return s_text(conn, 500, "cannot encode status\n");
    size_t len = strlen(body);
    body = realloc(body, len + 2);
    kvt_assert(body);
    body[len] = '\n';
    body[len + 1] = '\0';
    return s_send(conn, status, "application/json", body, len + 1, NULL);
}

/* GET / : the page is static bytes (MHD_RESPMEM_PERSISTENT, nothing copied). Its CSP lets it
 * run its own inline script (by hash: no injected script runs, even if some text escaped the
 * page's escaping) and inline style, and fetch this origin, and nothing else: a page that is
 * meant to be self-contained cannot quietly load an asset from the network, be framed, or
 * submit or re-base anything. */
#define S_PAGE_CSP                                                                              \
    "default-src 'none'; script-src '" KVT_STATUS_PAGE_SCRIPT_HASH "'; "                         \
    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; frame-ancestors 'none'; "    \
    "base-uri 'none'; form-action 'none'"

static enum MHD_Result s_page_send(struct MHD_Connection *conn)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(sizeof s_page, (void *)s_page,
                                                             MHD_RESPMEM_PERSISTENT);
    if (!r)
        return MHD_NO;
    return s_respond(conn, 200, r,
                     (const char *const[]){"Content-Type", "text/html; charset=utf-8",
                                           "Cache-Control", "no-cache",
                                           "X-Content-Type-Options", "nosniff",
                                           "Content-Security-Policy", S_PAGE_CSP, NULL});
}

/* {ok: false, error: {code, message}}, as the wire protocol's error replies. */
static enum MHD_Result s_json_error(struct MHD_Connection *conn, unsigned status, int rc,
                                    const char *message)
{
    return s_json(conn, status,
                  json_pack("{s:b,s:{s:s,s:s}}", "ok", 0, "error", "code", kvt_err_wire(rc),
                            "message", message));
}

/* POST /clear[?ns=NAME]. The ns is held to the wire's rule for CLEAR (kvt_msg_check_ns), so
 * HTTP clears nothing the protocol would refuse; its length is MHD's, so a %00 inside is part
 * of the name, not its end. "?ns" without a value is an empty ns, not "everything". */
static enum MHD_Result s_clear(kvt_http_t *self, struct MHD_Connection *conn)
{
    const char *ns = NULL;
    size_t ns_len = 0;
    bool given = MHD_lookup_connection_value_n(conn, MHD_GET_ARGUMENT_KIND, "ns", 2, &ns,
                                               &ns_len) == MHD_YES;
    if (given && !ns) {
        ns = "";
        ns_len = 0;
    }
    char why[160];
    if (given && kvt_msg_check_ns(ns_len, why, sizeof why) != 0)
        return s_json_error(conn, 400, KVT_EBADREQ, why);
    uint64_t removed = 0;
    int rc = self->hooks.clear ? self->hooks.clear(self->hooks.ctx, ns, ns_len, &removed) : 0;
    if (rc)
        return s_json_error(conn, 500, rc, kvt_strerror(rc));
    return s_json(conn, 200, json_pack("{s:b,s:I}", "ok", 1, "removed", (json_int_t)removed));
}

/* Threads, then the owner's check (L2 adapters) that main gave the supervisor: the same answer
 * as kvtier_ready on /metrics. */
static bool s_ready(kvt_http_t *self, char *why, size_t whylen)
{
    return kvt_sup_ready(self->sup, why, whylen);
}

static json_t *s_status(kvt_http_t *self)
{
    char why[256];
    bool ready = s_ready(self, why, sizeof why);
    json_t *cfg = NULL;
    char *cfgtext = kvt_config_to_json(self->cfg);
    if (cfgtext) {
        cfg = json_loads(cfgtext, 0, NULL);
        free(cfgtext);
    }
    json_t *st = json_pack("{s:s,s:I,s:f,s:b,s:s,s:o,s:o,s:o}", "version", KVT_VERSION, "pid",
                           (json_int_t)getpid(), "uptime_seconds",
                           kvt_wall_s() - self->started_wall, "ready", ready, "not_ready_reason",
                           why, "threads", kvt_sup_status_json(self->sup), "metrics",
                           kvt_metrics_json(self->metrics), "config",
                           cfg ? cfg : json_object());
    if (self->hooks.status) {
        json_t *extra = self->hooks.status(self->hooks.ctx);
        if (extra)
            json_object_update(st, extra);
        json_decref(extra);
    }
    return st;
}

/* The request headers the checks below look at. */
typedef struct {
    int content_length, transfer_encoding, host;
    const char *host_value, *origin, *content_type;
} s_hdrs_t;

static enum MHD_Result s_hdr(void *cls, enum MHD_ValueKind kind, const char *key,
                             const char *value)
{
    (void)kind;
    s_hdrs_t *h = cls;
    if (strcasecmp(key, "Content-Length") == 0)
        h->content_length++;
    else if (strcasecmp(key, "Transfer-Encoding") == 0)
        h->transfer_encoding++;
    else if (strcasecmp(key, "Host") == 0) {
        h->host++;
        h->host_value = value;
    } else if (strcasecmp(key, "Origin") == 0)
        h->origin = value;
    else if (strcasecmp(key, "Content-Type") == 0)
        h->content_type = value;
    return MHD_YES;
}

/* Whether `host` (a Host header: name or address, with or without a port) names this daemon
 * the way a client on this machine or network would: an IP address, localhost, or this
 * machine's name. A web page that rebinds its own DNS name to 127.0.0.1 sends its own name,
 * and is refused. */
static bool s_host_ok(const char *host, const char *extra)
{
    char name[256];
    size_t n = strlen(host);
    if (n == 0 || n >= sizeof name)
        return false;
    if (host[0] == '[') /* an IPv6 literal, [addr] or [addr]:port */
        return strchr(host, ']') != NULL;
    memcpy(name, host, n + 1);
    char *colon = strchr(name, ':');
    if (colon) {
        if (strchr(colon + 1, ':'))
            return false; /* a bare IPv6 address is not a valid Host */
        *colon = '\0';
    }
    struct in_addr a4;
    if (inet_pton(AF_INET, name, &a4) == 1 || strcasecmp(name, "localhost") == 0)
        return true;
    for (const char *p = extra; p && *p;) { /* http_hosts */
        size_t len = strcspn(p, ",");
        if (len && len == strlen(name) && strncasecmp(p, name, len) == 0)
            return true;
        p += len + (p[len] == ',');
    }
    /* the machine's own name, exactly: a prefix match would let `NAME.evil.example` in */
    char me[256];
    if (gethostname(me, sizeof me) == 0) {
        me[sizeof me - 1] = '\0';
        if (strcasecmp(name, me) == 0)
            return true;
    }
    return false;
}

/* Refuses what a web page in a browser on this machine could make it do, and ambiguous
 * framing: a sentence and the status, or NULL when the request may go on. */
static const char *s_refuse(kvt_http_t *self, struct MHD_Connection *conn, const char *url,
                            bool post, unsigned *status)
{
    s_hdrs_t h = {0};
    MHD_get_connection_values(conn, MHD_HEADER_KIND, s_hdr, &h);
    *status = 400;
    if (h.content_length > 1)
        return "bad request: more than one Content-Length header\n";
    if (h.content_length && h.transfer_encoding)
        return "bad request: both Content-Length and Transfer-Encoding\n";
    if (h.host > 1)
        return "bad request: more than one Host header\n";
    *status = 403;
    /* health probes say nothing and change nothing: any Host (kubelet, load balancers) */
    bool probe = strcmp(url, "/healthz") == 0 || strcmp(url, "/readyz") == 0;
    if (h.host_value && !probe && !s_host_ok(h.host_value, self->cfg->http_hosts))
        return "forbidden: the Host header does not name this daemon (use its IP address, "
               "localhost, this machine's name or a name in http_hosts); a web page that points "
               "its own name at this address is refused\n";
    if (!post)
        return NULL;
    if (h.origin && h.host_value) {
        /* a browser's POST says where the page came from: only this daemon's own page */
        const char *o = h.origin;
        if (strncmp(o, "http://", 7) != 0 || strcmp(o + 7, h.host_value) != 0)
            return "forbidden: a cross-origin POST (a web page's) is refused\n";
    } else if (h.origin) {
        return "forbidden: a cross-origin POST (a web page's) is refused\n";
    }
    if (h.content_type) {
        /* the bodies a page may send anywhere without asking first (CORS "simple" types) */
        static const char *const simple[] = {"application/x-www-form-urlencoded",
                                             "multipart/form-data", "text/plain"};
        for (size_t i = 0; i < sizeof simple / sizeof simple[0]; i++)
            if (strncasecmp(h.content_type, simple[i], strlen(simple[i])) == 0)
                return "forbidden: POST takes no form or text body (what a web page can send "
                       "anywhere); send it without one, e.g. curl -X POST\n";
    }
    return NULL;
}

static enum MHD_Result s_route(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    kvt_http_t *self = cls;
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool post = strcmp(method, "POST") == 0;
    static char refused; /* *con_cls of a request answered by s_refuse: nothing more runs */
    if (*con_cls == &refused) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (*con_cls == NULL) {
        unsigned status;
        const char *why = s_refuse(self, conn, url, post, &status);
        if (why) {
            kvt_errrep_report(&s_rep_refused, KVT_LOG_WARN, "http: %s %s refused: %.*s", method,
                              url, (int)strcspn(why, "\n"), why);
            *con_cls = &refused;
            return s_text(conn, status, why);
        }
    }
    if (post && *con_cls == NULL) {
        /* first call of a POST: headers only; the body (ignored) follows */
        *con_cls = self;
        return MHD_YES;
    }
    if (post && *upload_size) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0) {
        return get ? s_page_send(conn) : s_not_allowed(conn, "GET, HEAD");
    } else if (strcmp(url, "/healthz") == 0) {
        return get ? s_text(conn, 200, "ok\n") : s_not_allowed(conn, "GET, HEAD");
    } else if (strcmp(url, "/readyz") == 0) {
        if (!get)
            return s_not_allowed(conn, "GET, HEAD");
        char why[256], line[300];
        if (s_ready(self, why, sizeof why))
            return s_text(conn, 200, "ready\n");
        snprintf(line, sizeof line, "not ready: %s\n", why);
        return s_text(conn, 503, line);
    } else if (strcmp(url, "/metrics") == 0) {
        if (!get)
            return s_not_allowed(conn, "GET, HEAD");
        size_t len = 0;
        char *text = kvt_metrics_prometheus(self->metrics, &len);
        if (!text)
            return s_text(conn, 500, "cannot render metrics\n");
        return s_send(conn, 200, "text/plain; version=0.0.4; charset=utf-8", text, len, NULL);
    } else if (strcmp(url, "/status") == 0) {
        return get ? s_json(conn, 200, s_status(self)) : s_not_allowed(conn, "GET, HEAD");
    } else if (strcmp(url, "/clear") == 0) {
        return post ? s_clear(self, conn) : s_not_allowed(conn, "POST");
    }
    return s_text(conn, 404, "not found\n");
}

static void *s_run(void *arg)
{
    kvt_http_t *self = arg;
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(self->mhd, MHD_DAEMON_INFO_EPOLL_FD);
    struct pollfd pfd = {info->epoll_fd, POLLIN, 0};
    while (!atomic_load(&self->stop)) {
        if (!kvt_sup_beat(self->beat)) {
            kvt_sup_thread_exit(self->beat, false);
            return NULL;
        }
        MHD_UNSIGNED_LONG_LONG tmo = S_TICK_MS;
        int wait = S_TICK_MS;
        if (MHD_get_timeout(self->mhd, &tmo) == MHD_YES && tmo < (MHD_UNSIGNED_LONG_LONG)wait)
            wait = (int)tmo;
        poll(&pfd, 1, wait);
        MHD_run(self->mhd);
    }
    kvt_sup_thread_exit(self->beat, true);
    return NULL;
}

/* "HOST:PORT" or "[V6]:PORT" -> sockaddr. */
static int s_resolve(const char *spec, struct sockaddr_storage *ss, char *err, size_t errlen)
{
    char host[256];
    const char *colon = strrchr(spec, ':');
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof host) {
        snprintf(err, errlen, "http: '%s' is not ADDR:PORT", spec);
        return KVT_EINVAL;
    }
    memcpy(host, spec, (size_t)(colon - spec));
    host[colon - spec] = '\0';
    char *h = host;
    if (h[0] == '[' && h[strlen(h) - 1] == ']') {
        h[strlen(h) - 1] = '\0';
        h++;
    }
    struct addrinfo hints = {.ai_flags = AI_NUMERICSERV, .ai_socktype = SOCK_STREAM}, *res;
    int rc = getaddrinfo(h, colon + 1, &hints, &res);
    if (rc != 0) {
        snprintf(err, errlen, "http: cannot resolve '%s': %s", spec, gai_strerror(rc));
        return KVT_EINVAL;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

static bool s_is_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)ss)->sin_addr.s_addr) >> 24) == 127;
    return ss->ss_family == AF_INET6 &&
           IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)ss)->sin6_addr);
}

kvt_http_t *kvt_http_new(const kvt_config_t *cfg, kvt_metrics_t *metrics, kvt_sup_t *sup,
                         const kvt_http_hooks_t *hooks, unsigned max_connections, char *err,
                         size_t errlen)
{
    struct sockaddr_storage ss = {0};
    if (s_resolve(cfg->http, &ss, err, errlen))
        return NULL;
    kvt_http_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->cfg = cfg;
    self->metrics = metrics;
    self->sup = sup;
    if (hooks)
        self->hooks = *hooks;
    self->started_wall = kvt_wall_s();
    unsigned flags = MHD_USE_EPOLL | MHD_USE_ERROR_LOG;
    if (ss.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    unsigned limit = max_connections;
    unsigned per_ip = s_is_loopback(&ss) ? 0u : limit / 4; /* 0: no per-address limit */
    self->mhd = MHD_start_daemon(
        flags, 0, NULL, NULL, s_route, self, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
        MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_ip,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)cfg->http_timeout_s, MHD_OPTION_END);
    if (!self->mhd) {
        snprintf(err, errlen, "http: cannot listen on %s (address in use?)", cfg->http);
        goto fail;
    }
    self->beat = kvt_sup_register(sup, "http", 2000);
    if (pthread_create(&self->tid, NULL, s_run, self) != 0) {
        snprintf(err, errlen, "http: cannot start thread");
        goto fail;
    }
    self->started = true;
    char per[48] = "";
    if (per_ip)
        snprintf(per, sizeof per, ", %u per client address", per_ip);
    kvt_log(KVT_LOG_INFO, "http on %s (at most %u connections%s, closed after %u s idle)",
            cfg->http, limit, per, cfg->http_timeout_s);
    return self;
fail:
    kvt_http_destroy(&self);
    return NULL;
}

void kvt_http_destroy(kvt_http_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_http_t *self = *self_p;
    if (self->started) {
        atomic_store(&self->stop, true);
        pthread_join(self->tid, NULL);
    }
    if (self->mhd)
        MHD_stop_daemon(self->mhd);
    free(self);
    *self_p = NULL;
}
