/* DESIGN: kvt_curve holds the ROUTER's CURVE setup so that the server loop only asks, before
 * each bind, for the options of that endpoint (kvt_curve_prepare_bind). Authentication is ZAP:
 * libzmq asks the handler at inproc://zeromq.zap.01 about every CURVE handshake, and the zauth
 * actor (czmq) answers from the certificates in curve.clients (public ones; zcert_save format,
 * as `kvtier keygen` writes them). A client whose key is not there never completes the
 * handshake, so it gets no reply at all, and the daemon spends nothing on it beyond the
 * handshake. Main thread only; zauth runs on its own czmq thread until kvt_curve_destroy. */
#include "kvt_curve.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define S_ZAP_DOMAIN "kvtier"
#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93 /* libzmq >= 4.3 handles it; its header calls it draft */
#endif
#define S_NO_KEY "0000000000000000000000000000000000000000" /* zcert's text for "none" */

struct kvt_curve {
    zcert_t *cert;
    zactor_t *auth;
};

/* Loads curve.server_cert; NULL with err when it cannot be used by a server. */
static zcert_t *s_load_cert(const kvt_config_t *cfg, char *err, size_t errlen)
{
    const char *path = cfg->curve_server_cert;
    char secret[4096];
    snprintf(secret, sizeof secret, "%s_secret", path);
    /* zcert_load reads PATH_secret when it exists, else PATH itself */
    if (access(secret, R_OK) != 0 && access(path, R_OK) != 0) {
        snprintf(err, errlen, "curve.server_cert: cannot read %.160s: %s", path, strerror(errno));
        return NULL;
    }
    zcert_t *cert = zcert_load(path);
    if (!cert) {
        snprintf(err, errlen,
                 "curve.server_cert: %.160s is not a zcert certificate "
                 "(make one with `kvtier keygen`)",
                 path);
        return NULL;
    }
    if (strcmp(zcert_secret_txt(cert), S_NO_KEY) == 0) {
        snprintf(err, errlen,
                 "curve.server_cert: %.160s has no secret key (give the secret "
                 "certificate, or the path its _secret file belongs to)",
                 path);
        zcert_destroy(&cert);
        return NULL;
    }
    return cert;
}

static int s_check_clients(const kvt_config_t *cfg, char *err, size_t errlen)
{
    errno = 0;
    struct stat st;
    const char *dir = cfg->curve_clients;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || access(dir, R_OK | X_OK) != 0) {
        snprintf(err, errlen, "curve.clients: %.160s is not a readable directory%s%s", dir,
                 errno ? ": " : "", errno ? strerror(errno) : "");
        return KVT_EINVAL;
    }
    return 0;
}

int kvt_curve_check(const kvt_config_t *cfg, char *err, size_t errlen)
{
    if (!cfg->curve_server_cert[0])
        return 0;
    errno = 0;
    zcert_t *cert = s_load_cert(cfg, err, errlen);
    if (!cert)
        return KVT_EINVAL;
    zcert_destroy(&cert);
    return s_check_clients(cfg, err, errlen);
}

kvt_curve_t *kvt_curve_new(const kvt_config_t *cfg, char *err, size_t errlen)
{
    kvt_curve_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    errno = 0;
    self->cert = s_load_cert(cfg, err, errlen);
    if (!self->cert || s_check_clients(cfg, err, errlen) != 0)
        goto fail;
    self->auth = zactor_new(zauth, NULL);
    if (!self->auth) {
        snprintf(err, errlen, "curve: cannot start the ZAP handler (zauth)");
        goto fail;
    }
    if (zstr_sendx(self->auth, "CURVE", cfg->curve_clients, NULL) != 0 ||
        zsock_wait(self->auth) != 0) {
        snprintf(err, errlen, "curve: zauth refused the clients directory %.160s",
                 cfg->curve_clients);
        goto fail;
    }
    kvt_log(KVT_LOG_INFO, "curve: tcp endpoints use CURVE, server key %s, clients from %s",
            zcert_public_txt(self->cert), cfg->curve_clients);
    return self;
fail:
    kvt_curve_destroy(&self);
    return NULL;
}

void kvt_curve_destroy(kvt_curve_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_curve_t *self = *self_p;
    zactor_destroy(&self->auth);
    zcert_destroy(&self->cert);
    free(self);
    *self_p = NULL;
}

void kvt_curve_prepare_bind(const kvt_curve_t *self, zsock_t *sock, const char *endpoint)
{
    if (!self)
        return; /* options untouched: no CURVE call on a libzmq that may lack it */
    /* libzmq lets every CURVE client in when no ZAP handler answers, unless the domain is
     * enforced: then a missing zauth closes the door instead of opening it */
    int enforce = strncmp(endpoint, "tcp://", 6) == 0;
    zmq_setsockopt(zsock_resolve(sock), ZMQ_ZAP_ENFORCE_DOMAIN, &enforce, sizeof enforce);
    if (enforce) {
        zcert_apply(self->cert, sock);
        zsock_set_curve_server(sock, 1);
        zsock_set_zap_domain(sock, S_ZAP_DOMAIN);
    } else {
        zsock_set_curve_server(sock, 0); /* back to the NULL mechanism */
        /* libzmq clears a string option only from (NULL, 0); czmq would pass ("", 0) */
        zmq_setsockopt(zsock_resolve(sock), ZMQ_ZAP_DOMAIN, NULL, 0);
    }
}
