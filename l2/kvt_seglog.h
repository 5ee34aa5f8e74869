/* kvt_seglog: the record log under the fs L2 adapter's `layout=segments` — objects appended to
 * a few large segment files instead of one file each.
 *
 * Why: creating, renaming and deleting one file per object is what held the fs tier to 0.15–0.3x
 * the disk's rate for 64 KiB objects (the filesystem's inode allocation and directory updates,
 * not the data); appending to an open file costs the data only.
 *
 * Layout: DIR/seg/NNNNNNNNNNNNNNNN (hex sequence number, ascending in time). A segment starts
 * with a 4 KiB header page (magic, sequence, a random nonce) followed by records, each a whole
 * number of 4 KiB pages:
 *     payload | zero padding | name | footer (64 bytes, at the end of the record's last page)
 * The payload starts on a page boundary, so the daemon's page-aligned arena bytes go to and come
 * from the disk with O_DIRECT and no copy; only the last page (payload tail, name, footer) goes
 * through a small bounce buffer. A footer carries the payload and name lengths, the record's
 * page count and an XXH3 of itself and the name seeded with the segment's nonce: a payload can
 * never pass for a footer, since no client knows the nonce. A tombstone record (no payload)
 * marks a removal.
 *
 * Order: sixteen segments take appends at once (streams); a name always goes to the same stream,
 * and each append reserves its range under the log's lock, so a name's records lie in
 * (segment, offset) order: the open replays every record in that order (a later record of a name
 * replaces an earlier one; a tombstone removes it). Segments go
 * only from the oldest end (reclaim, or once empty): a tombstone is never needed after its
 * segment went, since every older record of its name was in that segment or an older one.
 * Torn records: the open scans each segment backwards from its end, footer to footer; a page
 * that ends in no valid footer (a write a crash cut short, a failed write's hole) is skipped a
 * page at a time. A record whose footer made it but not all its payload is the daemon's trailer
 * check's job (never served).
 *
 * Threads: append, tombstone, read, dead, hold/put, bytes from any number of threads; scan and
 * the reclaim calls under the caller's own serialisation (the fs adapter's); new/destroy alone.
 * No lock is held across data I/O except a segment's creation. */
#ifndef KVT_SEGLOG_H
#define KVT_SEGLOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

typedef struct kvt_seglog kvt_seglog_t;
typedef struct kvt_seg kvt_seg_t; /* one segment file; owned by the log */

/* Where a record lies. */
typedef struct {
    kvt_seg_t *seg;
    uint64_t off;   /* of the record (= of its payload) in the segment file */
    uint64_t bytes; /* record length, a multiple of 4 KiB */
} kvt_segloc_t;

#define KVT_SEGLOG_DIR "seg"
#define KVT_SEGLOG_SYNC_NONE 0
#define KVT_SEGLOG_SYNC_OBJECT 1 /* fdatasync every record before its append returns */

/* Opens DIR/seg under dirfd (created if missing) with segments of about seg_size bytes. Returns
 * NULL with a message in err. */
kvt_seglog_t *kvt_seglog_new(int dirfd, const char *path, uint64_t seg_size, int sync, bool direct,
                             char *err, size_t errlen);
void kvt_seglog_destroy(kvt_seglog_t **self_p);

/* Calls visit for every record found, in append order (see above); tombstone records have
 * size 0 and tombstone true. Returns 0 or a positive errno. Every segment found is closed for
 * appends. `skipped` gets the number of pages that held no record (torn or unwritten). */
typedef void kvt_seglog_visit_fn(void *arg, const char *name, size_t nlen, uint64_t size,
                                 bool tombstone, const kvt_segloc_t *loc);
int kvt_seglog_scan(kvt_seglog_t *self, kvt_seglog_visit_fn *visit, void *arg, uint64_t *skipped);

/* Appends a record of the bytes in iov under `name`; 0 or a positive errno. The record counts as
 * live until kvt_seglog_dead. On success its segment cannot be handed out for reclaim until
 * kvt_seglog_done: the caller indexes the record in between, so a reclaim finds it. */
int kvt_seglog_append(kvt_seglog_t *self, const char *name, size_t nlen, const struct iovec *iov,
                      int iovcnt, kvt_segloc_t *loc);
void kvt_seglog_done(kvt_seglog_t *self, const kvt_segloc_t *loc);
/* Appends a tombstone for `name`. */
int kvt_seglog_tombstone(kvt_seglog_t *self, const char *name, size_t nlen);

/* The record at loc is no longer wanted (replaced, removed, evicted). */
void kvt_seglog_dead(kvt_seglog_t *self, const kvt_segloc_t *loc);

/* hold keeps loc's segment readable (even if reclaimed meanwhile) until put. */
void kvt_seglog_hold(kvt_seglog_t *self, kvt_seg_t *seg);
void kvt_seglog_put(kvt_seglog_t *self, kvt_seg_t *seg);
/* Reads the first `size` bytes of the record's payload into iov (which holds at least that). */
int kvt_seglog_read(kvt_seglog_t *self, const kvt_segloc_t *loc, uint64_t size,
                    const struct iovec *iov, int iovcnt);

/* Bytes of segment files (the disk the log takes) and how many segments there are. */
void kvt_seglog_usage(kvt_seglog_t *self, uint64_t *bytes, uint64_t *segments);
/* The oldest segment, closed for appends (an appending one with none in flight is closed now),
 * or NULL; *bytes gets its length. For the caller's reclaim: it moves or drops its index entries
 * in that segment, then calls kvt_seglog_reclaim (or kvt_seglog_unclaim to leave it). */
kvt_seg_t *kvt_seglog_oldest(kvt_seglog_t *self, uint64_t *bytes);
/* The oldest segment if it is closed and less than a quarter of it is live, or less than half of
 * all segments is; else NULL. Without a capacity nothing else would ever free dead space
 * (compaction: the caller moves what is live, then reclaims it). */
kvt_seg_t *kvt_seglog_sparse(kvt_seglog_t *self);
/* Gives back a segment from kvt_seglog_oldest or _sparse without reclaiming it. */
void kvt_seglog_unclaim(kvt_seglog_t *self, kvt_seg_t *seg);
/* Deletes seg's file (readers holding it finish first); its records are all dead. */
void kvt_seglog_reclaim(kvt_seglog_t *self, kvt_seg_t *seg);

#endif
