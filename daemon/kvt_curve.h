/* kvt_curve: CURVE encryption and client authentication for the client-facing ROUTER.
 *
 * Owns the daemon's certificate (czmq zcert, loaded from curve.server_cert) and the zauth actor
 * (a czmq thread) that answers the ZAP requests of new CURVE connections against the directory
 * curve.clients of allowed client public certificates (re-read by zauth when it changes). tcp://
 * listen endpoints are bound with CURVE; ipc:// endpoints stay plain, guarded by file
 * permissions. Main thread only (start-up and shutdown). */
#ifndef KVT_CURVE_H
#define KVT_CURVE_H

#include "kvt_config.h"

#include <czmq.h>
#include <stddef.h>

typedef struct kvt_curve kvt_curve_t;

/* Checks what kvt_curve_new will load: the certificate has a secret key, the clients path is a
 * readable directory. 0 when CURVE is not configured or all is well; KVT_EINVAL with one line
 * in err otherwise (a configuration error: exit status 2). */
int kvt_curve_check(const kvt_config_t *cfg, char *err, size_t errlen);

/* Loads the certificate and starts zauth. Call only when cfg->curve_server_cert is set. NULL
 * with a sentence in err on failure. */
kvt_curve_t *kvt_curve_new(const kvt_config_t *cfg, char *err, size_t errlen);

/* Stops zauth (new CURVE connections are then refused) and frees. Accepts NULL. */
void kvt_curve_destroy(kvt_curve_t **self_p);

/* Sets the security options the next zsock_bind(sock, endpoint) takes (libzmq copies a
 * socket's options into each listener at bind time): CURVE server with this certificate for
 * tcp://, plain (NULL mechanism, no ZAP) for anything else; nothing when self is NULL. */
void kvt_curve_prepare_bind(const kvt_curve_t *self, zsock_t *sock, const char *endpoint);

#endif
