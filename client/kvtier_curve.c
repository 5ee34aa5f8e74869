/* DESIGN: CURVE for libkvtier without czmq. A daemon with curve.server_cert authenticates
 * clients by public key (zauth over the curve.clients directory), so a client needs the
 * daemon's public key and a key pair of its own whose public half the operator put in that
 * directory. Both live in czmq's zcert text format (ZPL: a `curve` section with `public-key`
 * and, in the PATH_secret file, `secret-key`, each 40 Z85 characters in quotes); this file reads
 * and writes that format directly, so the client library depends on libzmq alone. Stateless:
 * any thread. */
#include "kvtier_curve.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#define S_Z85_LEN 40
#define S_MAX_CERT 65536

static bool s_is_z85(const char *s, size_t n)
{
    uint8_t bin[32];
    char buf[S_Z85_LEN + 1];
    if (n != S_Z85_LEN)
        return false;
    memcpy(buf, s, n);
    buf[n] = '\0';
    return zmq_z85_decode(bin, buf) != NULL;
}

/* One ZPL line `name = "VALUE"` (or unquoted): copies a 40-char Z85 value. */
static bool s_zpl_line(const char *line, const char *name, char out[S_Z85_LEN + 1])
{
    size_t nl = strlen(name);
    const char *p = line + strspn(line, " \t");
    if (strncmp(p, name, nl) != 0)
        return false;
    p += nl;
    p += strspn(p, " \t");
    if (*p++ != '=')
        return false;
    p += strspn(p, " \t");
    char quote = (*p == '"' || *p == '\'') ? *p++ : '\0';
    size_t n = quote ? strcspn(p, quote == '"' ? "\"\n" : "'\n") : strcspn(p, " \t\r\n");
    if (!s_is_z85(p, n))
        return false;
    memcpy(out, p, S_Z85_LEN);
    out[S_Z85_LEN] = '\0';
    return true;
}

static bool s_zpl_key(const char *text, const char *name, char out[S_Z85_LEN + 1])
{
    for (const char *line = text; line;) {
        if (s_zpl_line(line, name, out))
            return true;
        line = strchr(line, '\n');
        line = line ? line + 1 : NULL;
    }
    return false;
}

static char *s_slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    char *buf = malloc(S_MAX_CERT + 1);
    size_t n = buf ? fread(buf, 1, S_MAX_CERT, f) : 0;
    fclose(f);
    if (buf)
        buf[n] = '\0';
    return buf;
}

/* Like zcert_load: PATH_secret when it exists (both keys), else PATH. want_secret: the secret
 * key is required. */
static int s_load_cert(const char *path, bool want_secret, char pub[S_Z85_LEN + 1],
                       char sec[S_Z85_LEN + 1], char *err, size_t errlen)
{
    char secret_path[4096];
    snprintf(secret_path, sizeof secret_path, "%s_secret", path);
    char *text = s_slurp(secret_path);
    if (!text)
        text = s_slurp(path);
    if (!text) {
        snprintf(err, errlen, "cannot read the certificate %.200s: %s", path, strerror(errno));
        return KVTIER_EINVAL;
    }
    bool ok = s_zpl_key(text, "public-key", pub);
    bool has_sec = s_zpl_key(text, "secret-key", sec);
    free(text);
    if (!ok || (want_secret && !has_sec)) {
        snprintf(err, errlen, "%.200s is not a zcert %scertificate (make one with `kvtier keygen`)",
                 path, want_secret ? "secret " : "");
        return KVTIER_EINVAL;
    }
    return 0;
}

int kvt__curve_setup(void *sock, const char *endpoint, const kvtier_curve_t *curve, bool *used,
                     char *err, size_t errlen)
{
    *used = false;
    kvtier_curve_t env = {getenv("KVTIER_CURVE_SERVERKEY"), getenv("KVTIER_CURVE_CERT")};
    if (!curve)
        curve = &env;
    if (strncmp(endpoint, "tcp://", 6) != 0 || !curve->server_key || !*curve->server_key)
        return 0;
    char server[S_Z85_LEN + 1], pub[S_Z85_LEN + 1], sec[S_Z85_LEN + 1], unused[S_Z85_LEN + 1];
    int rc;
    if (s_is_z85(curve->server_key, strlen(curve->server_key)))
        snprintf(server, sizeof server, "%s", curve->server_key);
    else if ((rc = s_load_cert(curve->server_key, false, server, unused, err, errlen)) != 0)
        return rc;
    if (curve->client_cert && *curve->client_cert) {
        if ((rc = s_load_cert(curve->client_cert, true, pub, sec, err, errlen)) != 0)
            return rc;
    } else if (zmq_curve_keypair(pub, sec) != 0) { /* a daemon accepting any key only */
        snprintf(err, errlen, "cannot make a CURVE key pair: %s", zmq_strerror(zmq_errno()));
        return KVTIER_EINVAL;
    }
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server, S_Z85_LEN) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, pub, S_Z85_LEN) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, S_Z85_LEN) != 0) {
        snprintf(err, errlen, "this libzmq cannot do CURVE: %s", zmq_strerror(zmq_errno()));
        return KVTIER_EINVAL;
    }
    *used = true;
    return 0;
}

static int s_write_cert(const char *path, const char *pub, const char *sec, char *err,
                        size_t errlen)
{
    /* O_EXCL: a key pair is never overwritten by accident */
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, sec ? 0600 : 0644);
    if (fd < 0) {
        snprintf(err, errlen, "cannot create %.200s: %s", path, strerror(errno));
        return KVTIER_EINVAL;
    }
    char buf[1024];
    int n = snprintf(buf, sizeof buf,
                     "#   ****  Generated by kvtier keygen  ****\n"
                     "#   ZeroMQ CURVE %s Certificate\n"
                     "#   %s\n"
                     "\n"
                     "metadata\n"
                     "curve\n"
                     "    public-key = \"%s\"\n"
                     "%s%s%s",
                     sec ? "**Secret**" : "Public",
                     sec ? "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
                         : "Give this file to the peer that must trust this key.",
                     pub, sec ? "    secret-key = \"" : "", sec ? sec : "", sec ? "\"\n" : "");
    bool ok = n > 0 && write(fd, buf, (size_t)n) == n;
    if (close(fd) != 0 || !ok) {
        snprintf(err, errlen, "cannot write %.200s: %s", path, strerror(errno));
        unlink(path);
        return KVTIER_EINVAL;
    }
    return 0;
}

int kvtier_curve_keygen(const char *path, char *public_key, char *err, size_t errlen)
{
    char pub[S_Z85_LEN + 1], sec[S_Z85_LEN + 1], secret_path[4096];
    if (!path || !*path ||
        snprintf(secret_path, sizeof secret_path, "%s_secret", path) >= (int)sizeof secret_path) {
        snprintf(err, errlen, "no usable certificate path given");
        return KVTIER_EINVAL;
    }
    if (zmq_curve_keypair(pub, sec) != 0) {
        snprintf(err, errlen, "cannot make a CURVE key pair: %s", zmq_strerror(zmq_errno()));
        return KVTIER_EINVAL;
    }
    int rc = s_write_cert(secret_path, pub, sec, err, errlen);
    if (rc == 0 && (rc = s_write_cert(path, pub, NULL, err, errlen)) != 0)
        unlink(secret_path);
    if (rc == 0 && public_key)
        memcpy(public_key, pub, S_Z85_LEN + 1);
    memset(sec, 0, sizeof sec);
    return rc;
}
