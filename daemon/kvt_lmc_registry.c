/* DESIGN: the file is one msgpack map followed by 8 bytes, the little-endian XXH3-64 of the
 * map: {format: 1, shm_name, pool_size, dev, ino, chunk_tokens, workers: [bin payload...]}.
 * Unknown keys are ignored (a later format adds fields); a file that does not parse whole is
 * not used at all: a registration restored wrongly would point a worker at the wrong slots,
 * while one not restored costs the worker a re-registration. */
#include "kvt_lmc_registry.h"

#include "kvt_le.h"
#include "kvt_log.h"
#include "kvt_u64map.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define S_FORMAT 1
#define S_MAX_FILE (16u << 20)
#define S_MAX_NAME 255

typedef struct {
    uint64_t id;
    size_t len;
    uint8_t bytes[];
} s_payload_t;

struct kvt_lmc_registry {
    char *path;
    char shm_name[S_MAX_NAME + 1];
    kvt_lmc_arena_t arena; /* shm_name points into the struct */
    kvt_u64map_t *workers; /* s_payload_t by instance_id */
    bool loading;          /* in kvt_lmc_registry_load: sets write nothing yet */
    bool ok;
};

kvt_lmc_registry_t *kvt_lmc_registry_new(const char *path, const kvt_lmc_arena_t *arena)
{
    kvt_lmc_registry_t *self = calloc(1, sizeof *self);
    if (!self)
        return NULL;
    self->path = strdup(path);
    self->workers = kvt_u64map_new();
    if (!self->path || !self->workers) {
        kvt_lmc_registry_destroy(&self);
        return NULL;
    }
    self->arena = *arena;
    snprintf(self->shm_name, sizeof self->shm_name, "%s", arena->shm_name);
    self->arena.shm_name = self->shm_name;
    self->ok = true;
    return self;
}

void kvt_lmc_registry_destroy(kvt_lmc_registry_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_lmc_registry_t *self = *self_p;
    for (s_payload_t *p; self->workers && (p = kvt_u64map_first(self->workers));)
        free(kvt_u64map_remove(self->workers, p->id));
    kvt_u64map_destroy(&self->workers);
    free(self->path);
    free(self);
    *self_p = NULL;
}

static void s_pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

int kvt_lmc_registry_encode(const kvt_lmc_arena_t *arena, const uint8_t *const *payloads,
                            const size_t *lens, size_t n, uint8_t **out, size_t *outlen)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 7);
    s_pack_str(&pk, "format");
    msgpack_pack_uint32(&pk, S_FORMAT);
    s_pack_str(&pk, "shm_name");
    s_pack_str(&pk, arena->shm_name);
    s_pack_str(&pk, "pool_size");
    msgpack_pack_uint64(&pk, arena->pool_size);
    s_pack_str(&pk, "dev");
    msgpack_pack_uint64(&pk, arena->dev);
    s_pack_str(&pk, "ino");
    msgpack_pack_uint64(&pk, arena->ino);
    s_pack_str(&pk, "chunk_tokens");
    msgpack_pack_uint32(&pk, arena->chunk_tokens);
    s_pack_str(&pk, "workers");
    msgpack_pack_array(&pk, n);
    for (size_t i = 0; i < n; i++) {
        msgpack_pack_bin(&pk, lens[i]);
        msgpack_pack_bin_body(&pk, payloads[i], lens[i]);
    }
    uint8_t sum[8];
    kvt_le_put64(sum, XXH3_64bits(sb.data, sb.size));
    msgpack_sbuffer_write(&sb, (const char *)sum, sizeof sum);
    if (!sb.data) {
        msgpack_sbuffer_destroy(&sb);
        return -1;
    }
    *outlen = sb.size; /* before the release, which zeroes it */
    *out = (uint8_t *)msgpack_sbuffer_release(&sb);
    return 0;
}

static bool s_key(const msgpack_object *k, const char *name)
{
    size_t n = strlen(name);
    return k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
           memcmp(k->via.str.ptr, name, n) == 0;
}

static bool s_uint(const msgpack_object *v, uint64_t *out)
{
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return false;
    *out = v->via.u64;
    return true;
}

int kvt_lmc_registry_parse(const uint8_t *buf, size_t len, const kvt_lmc_arena_t *arena,
                           kvt_lmc_registry_fn fn, void *ctx, char *why, size_t whylen)
{
    if (len < 9) {
        snprintf(why, whylen, "the file is %zu bytes long, too short", len);
        return -1;
    }
    if (kvt_le_get64(buf + len - 8) != XXH3_64bits(buf, len - 8)) {
        snprintf(why, whylen, "its checksum does not match");
        return -1;
    }
    msgpack_unpacked mp;
    msgpack_unpacked_init(&mp);
    size_t off = 0;
    int rc = -1;
    if (msgpack_unpack_next(&mp, (const char *)buf, len - 8, &off) != MSGPACK_UNPACK_SUCCESS ||
        off != len - 8 || mp.data.type != MSGPACK_OBJECT_MAP) {
        snprintf(why, whylen, "it is not one msgpack map");
        goto out;
    }
    uint64_t format = 0, pool = 0, dev = 0, ino = 0, chunk = 0;
    bool have[7] = {false};
    const msgpack_object *name = NULL, *workers = NULL;
    const msgpack_object_map *m = &mp.data.via.map;
    for (uint32_t i = 0; i < m->size; i++) {
        const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;
        if (s_key(k, "format"))
            have[0] = s_uint(v, &format);
        else if (s_key(k, "shm_name"))
            have[1] = v->type == MSGPACK_OBJECT_STR && (name = v) != NULL;
        else if (s_key(k, "pool_size"))
            have[2] = s_uint(v, &pool);
        else if (s_key(k, "dev"))
            have[3] = s_uint(v, &dev);
        else if (s_key(k, "ino"))
            have[4] = s_uint(v, &ino);
        else if (s_key(k, "chunk_tokens"))
            have[5] = s_uint(v, &chunk);
        else if (s_key(k, "workers"))
            have[6] = v->type == MSGPACK_OBJECT_ARRAY && (workers = v) != NULL;
    }
    static const char *const fields[7] = {"format", "shm_name",     "pool_size", "dev",
                                          "ino",    "chunk_tokens", "workers"};
    for (int i = 0; i < 7; i++) {
        if (!have[i]) {
            snprintf(why, whylen, "its field %s is missing or of the wrong type", fields[i]);
            goto out;
        }
    }
    if (format != S_FORMAT) {
        snprintf(why, whylen, "it is of format %" PRIu64 ", this daemon reads format %d", format,
                 S_FORMAT);
        goto out;
    }
    const msgpack_object_array *w = &workers->via.array;
    for (uint32_t i = 0; i < w->size; i++) {
        if (w->ptr[i].type != MSGPACK_OBJECT_BIN) {
            snprintf(why, whylen, "worker %u is not a bin payload", i);
            goto out;
        }
    }
    size_t nlen = strlen(arena->shm_name);
    if (name->via.str.size != nlen || memcmp(name->via.str.ptr, arena->shm_name, nlen) != 0 ||
        pool != arena->pool_size || dev != arena->dev || ino != arena->ino) {
        snprintf(why, whylen,
                 "it was written for another arena file than this daemon's (the "
                 "workers map the old one: they must register again)");
        goto out;
    }
    if (chunk != arena->chunk_tokens) {
        snprintf(why, whylen, "it was written with chunk_tokens %" PRIu64 ", this daemon has %u",
                 chunk, arena->chunk_tokens);
        goto out;
    }
    for (uint32_t i = 0; i < w->size; i++)
        fn(ctx, (const uint8_t *)w->ptr[i].via.bin.ptr, w->ptr[i].via.bin.size);
    rc = 0;
out:
    msgpack_unpacked_destroy(&mp);
    return rc;
}

/* ---- the file ---------------------------------------------------------------------------- */

/* Writes every kept payload to path.new, fsync()s it and renames it over path. */
static int s_write(kvt_lmc_registry_t *self, char *why, size_t whylen)
{
    size_t n = kvt_u64map_size(self->workers), i = 0;
    const uint8_t **ps = calloc(n ? n : 1, sizeof *ps);
    size_t *lens = calloc(n ? n : 1, sizeof *lens);
    uint8_t *buf = NULL;
    size_t len = 0;
    char tmp[4200];
    int rc = -1, fd = -1;
    if (!ps || !lens)
        goto out;
    for (s_payload_t *p = kvt_u64map_first(self->workers); p; p = kvt_u64map_next(self->workers)) {
        ps[i] = p->bytes;
        lens[i++] = p->len;
    }
    if (kvt_lmc_registry_encode(&self->arena, ps, lens, n, &buf, &len) != 0) {
        snprintf(why, whylen, "out of memory");
        goto out;
    }
    snprintf(tmp, sizeof tmp, "%s.new", self->path);
    unlink(tmp); /* a leftover of a crash in the middle of a write */
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(why, whylen, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    for (size_t done = 0; done < len;) {
        ssize_t w = write(fd, buf + done, len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            snprintf(why, whylen, "cannot write %s: %s", tmp, w ? strerror(errno) : "no space");
            goto out;
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0 || rename(tmp, self->path) != 0) {
        snprintf(why, whylen, "cannot put %s in place: %s", self->path, strerror(errno));
        goto out;
    }
    rc = 0;
out:
    if (fd >= 0) {
        close(fd);
        if (rc)
            unlink(tmp);
    }
    free(ps);
    free(lens);
    free(buf);
    return rc;
}

static void s_save(kvt_lmc_registry_t *self)
{
    char why[4400];
    bool ok = s_write(self, why, sizeof why) == 0;
    if (!ok && self->ok)
        kvt_log(KVT_LOG_WARN,
                "lmcache: the workers' registrations are not kept for a restart: "
                "%s",
                why);
    else if (ok && !self->ok)
        kvt_log(KVT_LOG_INFO, "lmcache: the workers' registrations are kept again in %s",
                self->path);
    self->ok = ok;
}

void kvt_lmc_registry_set(kvt_lmc_registry_t *self, uint64_t id, const uint8_t *payload, size_t len)
{
    s_payload_t *old = kvt_u64map_get(self->workers, id);
    if (old && old->len == len && memcmp(old->bytes, payload, len) == 0)
        return;
    s_payload_t *p = malloc(sizeof *p + len);
    if (!p) {
        self->ok = false;
        return;
    }
    p->id = id;
    p->len = len;
    memcpy(p->bytes, payload, len);
    kvt_u64map_set(self->workers, id, p);
    free(old);
    if (!self->loading)
        s_save(self);
}

void kvt_lmc_registry_remove(kvt_lmc_registry_t *self, uint64_t id)
{
    s_payload_t *p = kvt_u64map_remove(self->workers, id);
    if (!p)
        return;
    free(p);
    if (!self->loading)
        s_save(self);
}

size_t kvt_lmc_registry_size(const kvt_lmc_registry_t *self)
{
    return kvt_u64map_size(self->workers);
}

bool kvt_lmc_registry_ok(const kvt_lmc_registry_t *self)
{
    return self->ok;
}

typedef struct {
    kvt_lmc_registry_fn fn;
    void *ctx;
    int n;
} s_load_t;

static void s_loaded(void *arg, const uint8_t *payload, size_t len)
{
    s_load_t *l = arg;
    l->fn(l->ctx, payload, len);
    l->n++;
}

int kvt_lmc_registry_load(kvt_lmc_registry_t *self, kvt_lmc_registry_fn fn, void *ctx, char *why,
                          size_t whylen)
{
    why[0] = '\0';
    int fd = open(self->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return 0;
        snprintf(why, whylen, "cannot open %s: %s", self->path, strerror(errno));
        return -1;
    }
    struct stat st;
    uint8_t *buf = NULL;
    int rc = -1;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & 077)) {
        snprintf(why, whylen, "%s is not a regular file of this user with mode 0600", self->path);
        goto out;
    }
    if (st.st_size > S_MAX_FILE) {
        snprintf(why, whylen, "%s is larger than %u bytes", self->path, S_MAX_FILE);
        goto out;
    }
    size_t len = (size_t)st.st_size, got = 0;
    buf = malloc(len ? len : 1);
    if (!buf) {
        snprintf(why, whylen, "out of memory");
        goto out;
    }
    while (got < len) {
        ssize_t r = read(fd, buf + got, len - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            snprintf(why, whylen, "cannot read %s: %s", self->path, r ? strerror(errno) : "short");
            goto out;
        }
        got += (size_t)r;
    }
    char inner[300];
    s_load_t l = {fn, ctx, 0};
    self->loading = true; /* what fn takes back comes through kvt_lmc_registry_set */
    int prc = kvt_lmc_registry_parse(buf, len, &self->arena, s_loaded, &l, inner, sizeof inner);
    self->loading = false;
    if (prc != 0)
        snprintf(why, whylen, "%s: %s", self->path, inner);
    else
        rc = l.n;
out:
    free(buf);
    close(fd);
    s_save(self); /* the file says what this daemon knows from now on */
    return rc;
}
