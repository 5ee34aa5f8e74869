/* kvt_lmc_registry: the LMCache workers' registrations, kept in a daemon-private file of the
 * run dir (RUN_DIR/kvtier-lmcache.workers, mode 0600) so that a restarted daemon still knows
 * them (issue 30): LMCache's worker registers once at start and never again while its daemon
 * answers, so a daemon that forgot it would refuse every store of a worker that believes all is
 * well.
 *
 * What is kept is each registration's payload as the worker sent it (re-read at start by the
 * same decoder as the wire, kvt_lmc_decode_ctx, which is fuzzed), with the arena the worker was
 * told to map: its shm name, size, device and inode, and chunk_tokens. A worker holds a mapping
 * of that very file, so its registration is only good again when the next daemon serves the
 * same file (l1.adopt); otherwise the worker must register again and learn the new one.
 *
 * The file is rewritten whole (a few hundred bytes per worker) at each change, to a temporary
 * file, fsync()ed and renamed over the old one: a crash leaves the old file or the new one. It
 * ends with the XXH3-64 of what precedes it. Owned and called by the LMCache door's thread
 * (and its constructor before the thread starts). */
#ifndef KVT_LMC_REGISTRY_H
#define KVT_LMC_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The file in the run dir. */
#define KVT_LMC_REGISTRY_FILE "kvtier-lmcache.workers"

typedef struct kvt_lmc_registry kvt_lmc_registry_t;

/* The arena the registrations are good for. */
typedef struct {
    const char *shm_name;
    uint64_t pool_size;
    uint64_t dev, ino;
    uint32_t chunk_tokens;
} kvt_lmc_arena_t;

/* path: the file; arena: what the registrations made now refer to (copied). */
kvt_lmc_registry_t *kvt_lmc_registry_new(const char *path, const kvt_lmc_arena_t *arena);
void kvt_lmc_registry_destroy(kvt_lmc_registry_t **self_p);

typedef void (*kvt_lmc_registry_fn)(void *ctx, const uint8_t *payload, size_t len);

/* Reads the file the previous daemon left and calls fn for each payload, when it was written
 * for this very arena. Returns the number of payloads handed to fn; 0 with why set when none
 * ("no file": why is empty), -1 when the file is not ours or does not validate (why says
 * which). The payloads given to fn are also kept, as if set (the caller removes those it does
 * not take). */
int kvt_lmc_registry_load(kvt_lmc_registry_t *self, kvt_lmc_registry_fn fn, void *ctx, char *why,
                          size_t whylen);

/* The registration of `id` is `payload` now (copied). The file is rewritten when it changed;
 * a failure to write is logged (the registration stands: it is only not kept). */
void kvt_lmc_registry_set(kvt_lmc_registry_t *self, uint64_t id, const uint8_t *payload,
                          size_t len);

/* `id` is no longer registered. */
void kvt_lmc_registry_remove(kvt_lmc_registry_t *self, uint64_t id);

/* Registrations kept; whether the last write of the file worked. */
size_t kvt_lmc_registry_size(const kvt_lmc_registry_t *self);
bool kvt_lmc_registry_ok(const kvt_lmc_registry_t *self);

/* The file's encoding of `n` payloads for `arena` (out owned by the caller, free()); what
 * kvt_lmc_registry_parse reads. For the fuzzer and unit tests. */
int kvt_lmc_registry_encode(const kvt_lmc_arena_t *arena, const uint8_t *const *payloads,
                            const size_t *lens, size_t n, uint8_t **out, size_t *outlen);

/* Parses a file's bytes: 0 and fn called per payload when valid and written for `arena`; -1
 * with why otherwise (nothing handed to fn then). */
int kvt_lmc_registry_parse(const uint8_t *buf, size_t len, const kvt_lmc_arena_t *arena,
                           kvt_lmc_registry_fn fn, void *ctx, char *why, size_t whylen);

#endif
