/* kvt_arena: the L1 shared-memory segment that clients map.
 *
 * A POSIX shared-memory object (/dev/shm/kvtier-<run-dir hash>-<random>-<pid>: not guessable by
 * other local users, created exclusively, never a file someone else made), mode 0600, or 0660
 * owned by `shm_group`; space reserved with fallocate (a full /dev/shm fails at start, not later
 * with SIGBUS), mapped MAP_SHARED with MAP_POPULATE, transparent huge pages requested with
 * madvise(MADV_HUGEPAGE), and mlock()ed unless allow_unpinned lets it start unpinned. Segments
 * left by crashed daemons of the same run dir and user are removed at start. No CUDA context is
 * created here. Created and destroyed by the main thread; the mapping is read-only state
 * afterwards. */
#ifndef KVT_ARENA_H
#define KVT_ARENA_H

#include "kvt_config.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvt_arena kvt_arena_t;

/* NULL with a sentence in err when the segment cannot be created, sized, mapped or pinned. */
kvt_arena_t *kvt_arena_new(const kvt_config_t *cfg, char *err, size_t errlen);

/* Unmaps and unlinks the segment. */
void kvt_arena_destroy(kvt_arena_t **self_p);

void *kvt_arena_base(const kvt_arena_t *self);
uint64_t kvt_arena_size(const kvt_arena_t *self);

/* The path clients open and mmap (reported by HELLO as shm.path). */
const char *kvt_arena_path(const kvt_arena_t *self);

bool kvt_arena_pinned(const kvt_arena_t *self);
bool kvt_arena_huge(const kvt_arena_t *self); /* THP requested successfully */

#endif
