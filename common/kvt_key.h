/* kvt_key: the identity of a stored object below the wire: a 16-byte key inside a namespace
 * (a name and an optional salt), and the wire sizes of the GPU requests. Shared by protocol/
 * (which decodes them), storage/ (which checks and uses them), l2/ and the daemon, so the
 * lengths and the two types are spelled once. Pure data; any thread. */
#ifndef KVT_KEY_H
#define KVT_KEY_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define KVT_KEY_LEN 16   /* bytes of a key (the wire's bin16) */
#define KVT_MAX_NS 256   /* bytes of a namespace name */
#define KVT_MAX_SALT 128 /* bytes of a salt */

#define KVT_IPC_HANDLE_LEN 64   /* cudaIpcMemHandle_t / cudaIpcEventHandle_t, as bytes */
#define KVT_MAX_GPU_LAYERS 4096 /* entries of `handles` (a layer = one device buffer) */
#define KVT_MAX_DTYPE 32        /* bytes of a dtype name */
#define KVT_MAX_LABEL 255       /* bytes of an object's label (RESERVE/PUT `labels`) */

/* A key by value: a struct rather than a bare array, so that a batch of keys is a plain
 * `const kvt_key_t *keys` and a key can be assigned and returned. Layout is exactly the wire's
 * 16 bytes (a run of bin16 payloads can be viewed as kvt_key_t[n]). */
typedef struct {
    uint8_t b[KVT_KEY_LEN];
} kvt_key_t;

_Static_assert(sizeof(kvt_key_t) == KVT_KEY_LEN, "kvt_key_t is the 16 wire bytes, no padding");

static inline bool kvt_key_eq(const kvt_key_t *a, const kvt_key_t *b)
{
    return memcmp(a->b, b->b, KVT_KEY_LEN) == 0;
}

/* A borrowed run of bytes (a decoded string, an object's label; len 0: none). */
typedef struct {
    const uint8_t *ptr;
    uint32_t len;
} kvt_bytes_t;

/* A namespace: a non-empty name and an optional salt (salt_len 0; salt may then be NULL).
 * Borrowed view: it owns none of its bytes, which belong to whoever built it (the decoded
 * request, an L1 interned namespace, a queued job) and must outlive every use of the view.
 * Whoever keeps a namespace past the call that handed it over copies the bytes (see
 * kvt_ns_copy) and points a kvt_ns_t at the copy. */
typedef struct {
    const uint8_t *name;
    uint32_t name_len;
    const uint8_t *salt;
    uint32_t salt_len;
} kvt_ns_t;

/* Bytes kvt_ns_copy needs for `ns`. */
static inline size_t kvt_ns_size(const kvt_ns_t *ns)
{
    return (size_t)ns->name_len + ns->salt_len;
}

/* Copies the bytes of `ns` to buf (kvt_ns_size(ns) bytes, name then salt) and returns a view
 * of the copy, valid as long as buf. */
static inline kvt_ns_t kvt_ns_copy(const kvt_ns_t *ns, uint8_t *buf)
{
    if (ns->name_len)
        memcpy(buf, ns->name, ns->name_len);
    if (ns->salt_len)
        memcpy(buf + ns->name_len, ns->salt, ns->salt_len);
    return (kvt_ns_t){buf, ns->name_len, buf + ns->name_len, ns->salt_len};
}

#endif
