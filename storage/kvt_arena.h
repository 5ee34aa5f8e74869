/* kvt_arena: the L1 shared-memory segment that clients map.
 *
 * With l1.adopt (the default) a file named kvtier-<run-dir hash>-l1, left in place at stop and
 * reused by the next daemon of the run dir when it is a regular file of ours with this
 * configuration's size, mode and kind of pages (removed and made again otherwise; never one
 * someone else made: that name is then given up; the file is flock()ed while in use, so two
 * live processes never share it). Without l1.adopt, or when that name is another user's or
 * in use, a file named kvtier-<run-dir hash>-<random>-<pid> (not guessable by other
 * local users, created exclusively), removed at stop. Mode 0600, or 0660 owned by
 * `shm_group`, in one of two places (l1.hugepages):
 * - a hugetlbfs mount (2 MiB pages from the kernel's reserved pool): sized with ftruncate and
 *   rounded up to 2 MiB, mapped MAP_SHARED|MAP_POPULATE (the pages are reserved at mmap, so a
 *   short pool fails at start, not later with SIGBUS); never swapped, so not mlock()ed;
 * - /dev/shm (a POSIX shared-memory object): space reserved with fallocate, transparent huge
 *   pages requested with madvise(MADV_HUGEPAGE) unless l1.hugepages is off, pre-faulted, and
 *   mlock()ed unless allow_unpinned lets it start unpinned.
 * The page size the mapping really got is read back from /proc/self/smaps. Segments left by
 * crashed daemons of the same run dir and user are removed at start. No CUDA context is
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

/* Unmaps the segment and unlinks it, unless l1.adopt keeps it for the next daemon. */
void kvt_arena_destroy(kvt_arena_t **self_p);

void *kvt_arena_base(const kvt_arena_t *self);
uint64_t kvt_arena_size(const kvt_arena_t *self);

/* The path clients open and mmap (reported by HELLO as shm.path). */
const char *kvt_arena_path(const kvt_arena_t *self);

/* Starts the arena's background thread (a no-op the second time): a reused arena
 * (kvt_arena_reused) is mlock()ed by it, 16 MiB at a time, instead of before the adoption (its
 * failure is logged: the daemon before pinned the same file under the same limits); then, at
 * SCHED_IDLE, it reads a byte of every page of the daemon's mapping. Under a hypervisor that
 * shadows the guest's page tables the first access to each page of a mapping exits to it
 * (about 5 us a page on the development VM, however the pages were populated), which the
 * daemon's first pass over an object's bytes (l1_checksum, the journal's checksums, L2 writes)
 * would pay otherwise: 1.6 GB/s instead of 10. Destroy stops it. */
void kvt_arena_background_start(kvt_arena_t *self);

/* Whether the background thread has read every page (false until then, or when stopped). */
bool kvt_arena_warm(const kvt_arena_t *self);

/* Locked in memory: mlock()ed, or on hugetlbfs pages, which are never swapped. */
bool kvt_arena_pinned(const kvt_arena_t *self);

/* The page size the kernel maps the arena with: 2097152 on hugetlbfs, or in /dev/shm when
 * transparent huge pages cover all of it; 4096 otherwise. */
uint64_t kvt_arena_page_size(const kvt_arena_t *self);

/* l1.adopt: the file is the one the previous daemon of this run dir left (same size, owner,
 * mode and kind of pages); whether its content is served is the journal's decision (kvt_l1).
 * False for a new one, kvt_arena_why_new saying why ("no arena left by a previous daemon",
 * "... its size is not l1_size", "l1.adopt is off"). */
bool kvt_arena_reused(const kvt_arena_t *self);
const char *kvt_arena_why_new(const kvt_arena_t *self);

/* The content will not be adopted after all (kvt_arena_reused answers false from now on). */
void kvt_arena_forget(kvt_arena_t *self);

/* Whether destroy leaves the file for the next daemon (l1.adopt sets it; L1 clears it when
 * it has no journal to go with it). */
void kvt_arena_keep(kvt_arena_t *self, bool keep);

/* The file's device and inode (what the journal's header records), 0 when unknown. */
void kvt_arena_ident(const kvt_arena_t *self, uint64_t *dev, uint64_t *ino);

/* The arena really is on 2 MiB (or larger) pages. */
bool kvt_arena_huge(const kvt_arena_t *self);

/* Another process truncated the arena file (anyone who may write it can): its size is given
 * back here, or already was by the SIGBUS guard when the daemon touched the lost part (see
 * kvt_arena.c). Returns the lowest size the file was seen cut to since the last call (bytes
 * past it are zeros now), or UINT64_MAX when it was never cut. Any thread; cheap (one fstat). */
uint64_t kvt_arena_check(kvt_arena_t *self);

#endif
