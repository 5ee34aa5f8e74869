/* kvt_journal: the daemon-private record of what L1 holds, from which the next daemon adopts
 * the arena after a restart or a crash (issue 30). Clients map the arena read-write, so nothing
 * inside it is believed at adoption; this file (RUN_DIR, mode 0600, opened O_NOFOLLOW and
 * checked to be ours) holds the keys, namespaces, extents, lengths, checksums and commit state.
 *
 * Format: an append-only journal of records, each `u32 len, u16 type, u16 flags, payload[len],
 * zero padding to 8, u64 check` where check is the XXH3-64 of the header, payload and padding,
 * seeded with the journal's salt (0 for the first record, the header, which carries the salt).
 * Flag 1 says the next record belongs to the same write: a reader takes the records of one
 * call (one COMMIT's objects) all or none.
 * A journal rather than a table updated in place: a process can die between any two writes,
 * and with appends the file is then always a valid prefix plus at most one torn record, which
 * the parser stops at (`valid` tells where); in-place updates of a table would need ordered
 * writes and a second copy of each slot for the same guarantee. Records of another journal
 * (other salt) never validate. Records:
 *   HEADER  u32 version, u32 0, u64 salt, u64 arena_size, u64 page_size, u64 arena_dev,
 *           u64 arena_ino, u64 created (CLOCK_REALTIME ns), then the arena path (no NUL);
 *   PUT     u64 seq, u64 offset, u64 length, u64 sum, u8 has_sum, u8 l2_pending, u16 name_len,
 *           u16 salt_len, u16 label_len, key[16], name, salt, label — an object committed (seq:
 *           its identity in this journal, increasing; label: RESERVE/PUT's, version 3; earlier
 *           versions wrote label_len 0);
 *   SUM     u64 seq, u64 sum — its XXH3-64, computed after the commit;
 *   DROP    u64 seq — it left L1 (removed, evicted, cleared, cut off);
 *   CLEAR   (empty) — every object before it left L1;
 *   L2DONE  u64 seq — every L2 adapter has written it (write-behind is done): the next daemon
 *           does not write it again (version 2; version 1 journals, which lack it, are read
 *           too: their objects are written to L2 again).
 * Nothing needs fsync: the arena is RAM, and what the journal survives is the process, whose
 * write()s the kernel keeps. A write of one call's records is one write() before the call
 * returns, so what was acknowledged is in the file.
 *
 * Threads: a writer (kvt_journal_t) serializes its appends with its own mutex; the parser and
 * kvt_journal_live are pure functions of their input (fuzzed: tests/fuzz/fuzz_journal.c). */
#ifndef KVT_JOURNAL_H
#define KVT_JOURNAL_H

#include "kvt_key.h"

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVT_JOURNAL_VERSION 3u /* written; 1 and 2 are read as well */
#define KVT_JOURNAL_VERSION_MIN 1u
#define KVT_JOURNAL_MAX_PATH 1024u

enum {
    KVT_JREC_HEADER = 1,
    KVT_JREC_PUT = 2,
    KVT_JREC_SUM = 3,
    KVT_JREC_DROP = 4,
    KVT_JREC_CLEAR = 5,
    KVT_JREC_L2DONE = 6,
};

typedef struct {
    uint32_t version;
    uint64_t salt;
    uint64_t arena_size, page_size, arena_dev, arena_ino;
    uint64_t created;
    char path[KVT_JOURNAL_MAX_PATH + 1];
} kvt_journal_header_t;

/* One committed object. name/salt/label view the parsed buffer (parse) or the caller's bytes
 * (put). */
typedef struct {
    uint64_t seq, offset, length, sum;
    bool has_sum;
    uint8_t l2_pending;
    kvt_key_t key;
    kvt_ns_t ns;
    kvt_bytes_t label; /* len 0: none */
} kvt_journal_put_t;

typedef struct {
    void (*put)(void *ctx, const kvt_journal_put_t *p);
    void (*sum)(void *ctx, uint64_t seq, uint64_t sum);
    void (*drop)(void *ctx, uint64_t seq);
    void (*clear)(void *ctx);
    void (*l2done)(void *ctx, uint64_t seq);
} kvt_journal_visitor_t;

/* Walks buf[0..len): the header into *hdr, then each record to `v` (members may be NULL) in
 * order, up to the first record that does not validate (a torn tail, garbage): *valid is the
 * length of the prefix made of whole valid records. 0; KVT_EBADREQ when the header itself does
 * not validate (an empty file, another format or version), with the reason in err. */
int kvt_journal_parse(const uint8_t *buf, size_t len, kvt_journal_header_t *hdr,
                      const kvt_journal_visitor_t *v, void *ctx, size_t *valid, char *err,
                      size_t errlen);

/* What the journal says L1 holds: the objects put and not dropped or cleared since, with the
 * sums recorded for them, in ascending offset order. An object whose extent leaves
 * [0, hdr->arena_size), is not page-aligned or overlaps another live one is left out and
 * counted in *rejected (the file is the daemon's: this is damage, not a client). Returns the
 * count in *n and an array the caller frees (NULL when empty); its ns bytes view `buf`. */
int kvt_journal_live(const uint8_t *buf, size_t len, kvt_journal_header_t *hdr,
                     kvt_journal_put_t **out, size_t *n, uint64_t *rejected, size_t *valid,
                     char *err, size_t errlen);

/* ---- the writer ---- */

typedef struct kvt_journal kvt_journal_t;

/* A new journal at `path` (replacing one there: written to path.new, then renamed over it)
 * with `hdr` (its salt is chosen here and written back) and the PUT records of `live` (the
 * objects carried over: adoption, compaction; their seqs are kept). Mode 0600. NULL with the
 * reason in err. */
kvt_journal_t *kvt_journal_create(const char *path, kvt_journal_header_t *hdr,
                                  const kvt_journal_put_t *live, size_t nlive, char *err,
                                  size_t errlen);

/* Compaction, in two steps. kvt_journal_mark: from now on every appended record is also kept
 * aside. kvt_journal_rewrite: a new file (new salt) holding the PUT records of live[0..n) — a
 * snapshot of L1 taken after the mark, seqs and sums kept — then the records kept aside, in
 * order, replaces the current one (written beside it and renamed over it, so a crash leaves
 * one or the other whole); appends go to it from then on. So a DROP or SUM appended while the
 * snapshot was taken is not lost, whether the snapshot saw its object or not. The caller keeps
 * PUTs from being appended between mark and rewrite (L1's commit_lock). 0, or an error code
 * with the reason in err (the current file stays in use). */
void kvt_journal_mark(kvt_journal_t *self);

/* Ends a capture without a rewrite (the snapshot could not be taken). */
void kvt_journal_unmark(kvt_journal_t *self);

int kvt_journal_rewrite(kvt_journal_t *self, const kvt_journal_put_t *live, size_t n, char *err,
                        size_t errlen);

/* Closes the file (it stays for the next daemon). */
void kvt_journal_destroy(kvt_journal_t **self_p);

/* Appends n PUT records in one write(), giving each object the next seq (into puts[i].seq).
 * 0; KVT_EINVAL (a namespace or label out of bounds: nothing written); KVT_EIO or KVT_ENOMEM (the
 * journal is then broken: every later append fails too, and the caller stops promising
 * adoption). */
int kvt_journal_put(kvt_journal_t *self, kvt_journal_put_t *puts, size_t n);

int kvt_journal_sum(kvt_journal_t *self, uint64_t seq, uint64_t sum);

/* DROP records for seqs[0..n) in one write(). */
int kvt_journal_drop(kvt_journal_t *self, const uint64_t *seqs, size_t n);

int kvt_journal_clear(kvt_journal_t *self);

/* The object `seq` needs no more L2 writes. */
int kvt_journal_l2done(kvt_journal_t *self, uint64_t seq);

/* Bytes written so far (header and carried-over records included): for compaction. */
uint64_t kvt_journal_bytes(kvt_journal_t *self);

const char *kvt_journal_path(const kvt_journal_t *self);

#endif
