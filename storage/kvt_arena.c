/* DESIGN: created once by the main thread at start-up, destroyed at shutdown; in between the
 * mapping never changes, so every thread may use base/size without a lock.
 *
 * The segment name is "kvtier-<run-dir hash>-<64 random bits>-<pid>", in /dev/shm or in a
 * hugetlbfs mount. Clients learn it from HELLO, so it need not be guessable: both directories
 * may be shared by every local user, and a name another user can predict is a name they can take
 * first (the daemon would not start). It is created with O_CREAT|O_EXCL|O_NOFOLLOW, so a file or
 * symlink someone else made is never opened; a taken name means another random one. The run-dir
 * hash and the pid let a later daemon of the same run directory find the segments whose daemon
 * died; it removes only regular files of its own uid in exactly this form (a root daemon could
 * unlink anybody's file in a sticky directory).
 *
 * Where (l1.hugepages): "auto" takes hugetlbfs when a 2 MiB mount exists and the pool has the
 * free pages l1_size needs, else /dev/shm; "on" refuses to start without them, saying why;
 * "off" is /dev/shm without a THP request. A page table of 4 KiB entries costs every client
 * process 2 MiB per GiB mapped and one fault per 4 KiB on first touch; 2 MiB pages cut both by
 * 512. */
#include "kvt_arena.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <mntent.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#define S_SHM_DIR "/dev/shm"
#define S_RAND_HEX 16  /* hex digits of the random part of a name */
#define S_NAME_TRIES 8 /* random names tried before giving up (one taken is already unlikely) */
#define S_HUGE (2ull << 20)
#define S_SMALL 4096ull
#define S_PROBE (4ull << 20)     /* what a reused arena is populated with first */
#define S_PIN_STEP (16ull << 20) /* a reused arena is mlock()ed that much at a time */
#define S_HUGETLBFS_MAGIC 0x958458f6
#define S_POOL "/sys/kernel/mm/hugepages/hugepages-2048kB/"
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL */
#endif

struct kvt_arena {
    char path[PATH_MAX + 64]; /* directory + "/kvtier-<hash>-<random>-<pid>" */
    void *base;
    uint64_t size;
    uint64_t page_size;
    atomic_bool pinned;
    bool pin_owed; /* a reused arena: mlock()ed by the background thread */
    bool started;  /* kvt_arena_background_start was called */
    bool pinning;  /* the background thread `pinner` runs (joined at destroy) */
    pthread_t pinner;
    atomic_bool stop_bg; /* destroy: the background thread returns at its next step */
    atomic_bool warm;    /* every page read once through this mapping */
    bool allow_unpinned;
    bool hugetlb;
    bool unlink;    /* path is ours: unlink it on failure and at destroy */
    bool keep;      /* l1.adopt: left in place at destroy for the next daemon */
    bool reused;    /* the file a previous daemon left (its content is the journal's to judge) */
    bool kept_name; /* the run dir's stable name (l1.adopt), not a private one */
    char why_new[PATH_MAX + 320]; /* why not reused: for the log and /status */
    int fd;         /* kept open: the file's size is restored through it (kvt_arena_check) */
    char pages[80]; /* for the log: "2 MiB pages, hugetlbfs", "4 KiB pages, THP requested" */
};

/* ---- the truncation guard ---------------------------------------------------------------
 * Whoever may write the arena file may truncate it, and every access to the lost part of a
 * mapping is then a SIGBUS. The daemon keeps the file's descriptor and, in its SIGBUS handler,
 * for a fault inside the arena, gives the file its size back (fstat and ftruncate are
 * async-signal-safe) and lets the access run again on a fresh page; the lowest size seen goes
 * to s_cut, for kvt_arena_check's caller to drop the objects whose bytes were lost. A fault
 * elsewhere, or a size that cannot be restored, goes to the handler that was there before
 * (the default: a core). One arena per process. */
static kvt_arena_t *s_guarded;
static struct sigaction s_prev_bus;
static _Atomic uint64_t s_cut = UINT64_MAX;

static void s_cut_note(uint64_t size)
{
    uint64_t cur = atomic_load(&s_cut);
    while (size < cur && !atomic_compare_exchange_weak(&s_cut, &cur, size))
        ;
}

static void s_on_sigbus(int sig, siginfo_t *si, void *uc)
{
    /* the address this thread last let run again: a second fault there with the file whole
     * is not a truncation (a full /dev/shm, a lost hugetlbfs reservation): not retried */
    static __thread void *t_retried;
    kvt_arena_t *a = s_guarded;
    uint8_t *p = si ? (uint8_t *)si->si_addr : NULL;
    struct stat st;
    if (a && si && si->si_code == BUS_ADRERR && p >= (uint8_t *)a->base &&
        p < (uint8_t *)a->base + a->size && fstat(a->fd, &st) == 0) {
        if ((uint64_t)st.st_size < a->size) {
            s_cut_note((uint64_t)st.st_size);
            if (ftruncate(a->fd, (off_t)a->size) == 0) {
                t_retried = p;
                return;
            }
        } else if (t_retried != p) {
            t_retried = p; /* restored meanwhile (another thread, kvt_arena_check): once more */
            return;
        }
    }
    t_retried = NULL;
    sigaction(SIGBUS, &s_prev_bus, NULL);
    if (s_prev_bus.sa_flags & SA_SIGINFO) {
        if (s_prev_bus.sa_sigaction)
            s_prev_bus.sa_sigaction(sig, si, uc);
    } else if (s_prev_bus.sa_handler != SIG_DFL && s_prev_bus.sa_handler != SIG_IGN) {
        s_prev_bus.sa_handler(sig);
    } /* SIG_DFL: returning faults again, now to the default action */
}

static void s_guard(kvt_arena_t *self)
{
    if (s_guarded)
        return;
    struct sigaction sa = {.sa_sigaction = s_on_sigbus, .sa_flags = SA_SIGINFO | SA_NODEFER};
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &s_prev_bus) == 0)
        s_guarded = self;
}

/* The pid in a segment name "<prefix><16 hex>-<pid>", or 0 when the name is not in that form. */
static long s_name_pid(const char *name, size_t plen)
{
    const char *p = name + plen;
    if (strspn(p, "0123456789abcdef") != S_RAND_HEX || p[S_RAND_HEX] != '-')
        return 0;
    p += S_RAND_HEX + 1;
    size_t digits = strspn(p, "0123456789");
    if (digits == 0 || digits > 9 || p[digits] != '\0')
        return 0;
    return strtol(p, NULL, 10);
}

/* Removes segments of this run dir whose daemon is gone (a crash leaves them behind, holding
 * memory until someone unlinks them): regular files of our own uid named in our form only. */
static void s_remove_stale(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    size_t plen = strlen(prefix);
    uid_t me = geteuid();
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, plen) != 0)
            continue;
        long pid = s_name_pid(e->d_name, plen);
        struct stat st;
        if (pid <= 0 || pid == getpid() ||
            fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
            st.st_uid != me)
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue; /* still alive, or not ours to judge */
        if (unlinkat(dirfd(d), e->d_name, 0) == 0)
            kvt_log(KVT_LOG_WARN, "l1: removed shared memory %s/%s left by a stopped daemon", dir,
                    e->d_name);
    }
    closedir(d);
}

/* The stable name of this run dir's arena in dir (l1.adopt): "<prefix>l1", which the stale
 * sweep's "<prefix><16 hex>-<pid>" never matches. */
static void s_kept_path(char *out, size_t outlen, const char *dir, const char *prefix)
{
    snprintf(out, outlen, "%s/%sl1", dir, prefix);
}

/* Removes this run dir's kept arena in dir when it is ours (l1.adopt is off now, or the arena
 * moves to the other kind of pages: the old one would hold its memory for nothing). */
static void s_remove_kept(const char *dir, const char *prefix)
{
    char path[PATH_MAX + 64];
    s_kept_path(path, sizeof path, dir, prefix);
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && unlink(path) == 0)
        kvt_log(KVT_LOG_WARN, "l1: removed %s, the arena an earlier daemon kept: not adopted",
                path);
}

/* The mode an arena of this configuration has. */
static mode_t s_mode(const kvt_config_t *cfg, gid_t *gid, bool *grouped)
{
    *grouped = kvt_config_shm_gid(cfg, gid) == 0;
    return *grouped ? 0660 : 0600;
}

/* l1.adopt: opens the arena a previous daemon of this run dir left in dir when it is one this
 * daemon may reuse (a regular file of ours, of self->size bytes, with the mode this
 * configuration gives), else makes a new one under the stable name (removing an unusable one
 * of ours first). The fd, or -1 with errno (a name someone else holds: the caller falls back
 * to a random name). self->why_new says why a new one was made. */
static int s_open_kept(kvt_arena_t *self, const kvt_config_t *cfg, const char *dir,
                       const char *prefix)
{
    s_kept_path(self->path, sizeof self->path, dir, prefix);
    /* a name someone else took is given up without opening what is there (the fstat below
     * checks again, for a file swapped in between) */
    struct stat pre;
    if (lstat(self->path, &pre) == 0 && (!S_ISREG(pre.st_mode) || pre.st_uid != geteuid())) {
        snprintf(self->why_new, sizeof self->why_new, "the arena %s left there: %s", self->path,
                 S_ISREG(pre.st_mode) ? "another user owns it" : "it is not a regular file");
        errno = EEXIST;
        return -1;
    }
    int fd = open(self->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) {
        /* another live process holds it (a daemon without the run dir's lock: a test) */
        snprintf(self->why_new, sizeof self->why_new, "the arena %s is in use", self->path);
        close(fd);
        errno = EEXIST;
        return -1;
    }
    if (fd >= 0) {
        struct stat st;
        gid_t gid;
        bool grouped;
        mode_t want = s_mode(cfg, &gid, &grouped);
        const char *bad = NULL;
        if (fstat(fd, &st) != 0) {
            st.st_uid = (uid_t)-1; /* not judged ours: left alone */
            st.st_mode = 0;
            bad = "cannot stat it";
        } else if (!S_ISREG(st.st_mode))
            bad = "it is not a regular file";
        else if (st.st_uid != geteuid())
            bad = "another user owns it";
        else if ((st.st_mode & 07777) != want || (grouped && st.st_gid != gid))
            bad = "its mode or group is not this configuration's";
        else if ((uint64_t)st.st_size != self->size)
            bad = "its size is not l1_size";
        if (!bad) {
            self->unlink = self->kept_name = self->reused = true;
            return fd;
        }
        snprintf(self->why_new, sizeof self->why_new, "the arena %s left there: %s", self->path,
                 bad);
        close(fd);
        if (st.st_uid != geteuid() || !S_ISREG(st.st_mode)) {
            errno = EEXIST; /* not ours to remove */
            return -1;
        }
        unlink(self->path);
    } else if (errno == ENOENT) {
        snprintf(self->why_new, sizeof self->why_new, "no arena left by a previous daemon");
    } else {
        snprintf(self->why_new, sizeof self->why_new, "the arena %s: %s", self->path,
                 strerror(errno));
        if (errno == ELOOP)
            errno = EEXIST;
        return -1;
    }
    fd = open(self->path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) { /* made by us a moment ago: cannot be */
        close(fd);
        unlink(self->path);
        errno = EEXIST;
        return -1;
    }
    if (fd >= 0)
        self->unlink = self->kept_name = true;
    return fd;
}

/* Creates a new segment under a fresh random name; the fd, or -1 with errno. */
static int s_create(kvt_arena_t *self, const char *dir, const char *prefix)
{
    for (int i = 0; i < S_NAME_TRIES; i++) {
        uint64_t r;
        ssize_t n;
        while ((n = getrandom(&r, sizeof r, 0)) < 0 && errno == EINTR)
            ;
        if (n != (ssize_t)sizeof r)
            return -1;
        snprintf(self->path, sizeof self->path, "%s/%s%0*llx-%d", dir, prefix, S_RAND_HEX,
                 (unsigned long long)r, (int)getpid());
        /* what shm_open does for /dev/shm, for any directory */
        int fd = open(self->path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0)
            self->unlink = true;
        if (fd >= 0 || errno != EEXIST)
            return fd;
        kvt_log(KVT_LOG_WARN, "l1: %s exists already (made by someone else?): trying another name",
                self->path);
    }
    return -1;
}

/* The arena's file in dir: the kept one (l1.adopt) when that name can be used, else a new one
 * under a fresh random name; the fd, or -1 with errno. */
static int s_open(kvt_arena_t *self, const kvt_config_t *cfg, const char *dir, const char *prefix)
{
    if (cfg->l1_adopt) {
        int fd = s_open_kept(self, cfg, dir, prefix);
        if (fd >= 0 || errno != EEXIST)
            return fd;
        kvt_log(KVT_LOG_WARN, "l1: %s: using a private name (this arena cannot be adopted)",
                self->why_new);
    }
    return s_create(self, dir, prefix);
}

/* A number from a one-line sysfs file, or 0. */
static uint64_t s_read_u64(const char *file)
{
    FILE *f = fopen(file, "re");
    unsigned long long v = 0;
    if (f) {
        if (fscanf(f, "%llu", &v) != 1)
            v = 0;
        fclose(f);
    }
    return v;
}

/* A hugetlbfs mount whose pages are 2 MiB. */
static bool s_is_huge_mount(const char *dir, struct statfs *st)
{
    return statfs(dir, st) == 0 && (unsigned long)st->f_type == S_HUGETLBFS_MAGIC &&
           (uint64_t)st->f_bsize == S_HUGE;
}

/* The hugetlbfs directory into dir: 0, or KVT_EUNAVAIL with the reason in why (a sentence that
 * can follow "l1.hugepages is on but"). */
static int s_find_hugetlbfs(const kvt_config_t *cfg, char *dir, size_t dirlen, char *why,
                            size_t whylen)
{
    struct statfs st;
    if (cfg->lmcache_listen[0]) {
        snprintf(why, whylen, "lmcache.listen needs the arena in /dev/shm");
        return KVT_EUNAVAIL;
    }
    if (cfg->l1_hugepages_dir[0]) {
        if (!s_is_huge_mount(cfg->l1_hugepages_dir, &st)) {
            snprintf(why, whylen,
                     "l1.hugepages_dir %.300s is not a hugetlbfs mount with 2 MiB pages",
                     cfg->l1_hugepages_dir);
            return KVT_EUNAVAIL;
        }
        snprintf(dir, dirlen, "%s", cfg->l1_hugepages_dir);
    } else {
        bool found = false;
        FILE *m = setmntent("/proc/mounts", "re");
        struct mntent *e;
        while (m && !found && (e = getmntent(m)) != NULL)
            if (strcmp(e->mnt_type, "hugetlbfs") == 0 && s_is_huge_mount(e->mnt_dir, &st) &&
                strlen(e->mnt_dir) < dirlen) {
                snprintf(dir, dirlen, "%s", e->mnt_dir);
                found = true;
            }
        if (m)
            endmntent(m);
        if (!found) {
            snprintf(why, whylen,
                     "no hugetlbfs with 2 MiB pages is mounted (mount -t hugetlbfs -o pagesize=2M "
                     "none /dev/hugepages, or set l1.hugepages_dir)");
            return KVT_EUNAVAIL;
        }
    }
    return 0;
}

/* Whether dir's pool has the pages for `size` bytes: 0, or KVT_EUNAVAIL with the reason. Called
 * after the stale files of crashed daemons were removed from dir (they hold pages). */
static int s_hugetlbfs_room(const char *dir, uint64_t size, char *why, size_t whylen)
{
    struct statfs st;
    if (statfs(dir, &st) != 0) {
        snprintf(why, whylen, "%.300s: %s", dir, strerror(errno));
        return KVT_EUNAVAIL;
    }
    /* free pages not promised to other mappings already; a mount with size= has its own cap */
    uint64_t need = size / S_HUGE;
    uint64_t nr = s_read_u64(S_POOL "nr_hugepages");
    uint64_t free_pages = s_read_u64(S_POOL "free_hugepages");
    uint64_t resv = s_read_u64(S_POOL "resv_hugepages");
    uint64_t avail = free_pages > resv ? free_pages - resv : 0;
    if (st.f_blocks > 0 && (uint64_t)st.f_bavail < avail)
        avail = (uint64_t)st.f_bavail;
    if (avail < need) {
        snprintf(why, whylen,
                 "%.300s has %llu free 2 MiB pages and the arena needs %llu (reserve them: sysctl "
                 "vm.nr_hugepages=%llu, or hugepages=N on the kernel command line)",
                 dir, (unsigned long long)avail, (unsigned long long)need,
                 (unsigned long long)(nr + need - avail));
        return KVT_EUNAVAIL;
    }
    return 0;
}

/* From /proc/self/smaps, the mapping at base: its kernel page size and how much of it is
 * mapped by PMD (transparent huge pages), both in bytes. 0 when it cannot be read. */
static int s_smaps(const void *base, uint64_t *page, uint64_t *pmd)
{
    FILE *f = fopen("/proc/self/smaps", "re");
    if (!f)
        return -1;
    char want[32], line[512];
    snprintf(want, sizeof want, "%lx-", (unsigned long)(uintptr_t)base);
    bool in = false;
    int rc = -1;
    *page = *pmd = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (!in) {
            in = strncmp(line, want, strlen(want)) == 0;
            continue;
        }
        if (sscanf(line, "KernelPageSize: %llu kB", &kb) == 1) {
            *page = kb << 10;
            rc = 0;
        } else if (sscanf(line, "ShmemPmdMapped: %llu kB", &kb) == 1 ||
                   sscanf(line, "FilePmdMapped: %llu kB", &kb) == 1) {
            *pmd += kb << 10;
        } else if (strncmp(line, "VmFlags:", 8) == 0) {
            break; /* the last field of a mapping */
        }
    }
    fclose(f);
    return rc;
}

/* The hugetlbfs half: ftruncate (fallocate may be unsupported) and a populated mapping, which
 * fails with ENOMEM when the pool cannot reserve the pages. */
static int s_map_hugetlbfs(kvt_arena_t *self, int fd, const char *dir, char *why, size_t whylen)
{
    if (ftruncate(fd, (off_t)self->size) != 0) {
        snprintf(why, whylen, "cannot size %.300s: %s", self->path, strerror(errno));
        return KVT_EUNAVAIL;
    }
    self->base = mmap(NULL, self->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (self->base == MAP_FAILED) {
        snprintf(why, whylen,
                 "cannot reserve %llu 2 MiB pages in %.300s: %s (taken by another "
                 "process since they were counted?)",
                 (unsigned long long)(self->size / S_HUGE), dir, strerror(errno));
        return KVT_EUNAVAIL;
    }
    /* hugetlb pages are never swapped; mlock() would skip them and yet charge them against
     * RLIMIT_MEMLOCK, so a memlock limit below the arena would fail for nothing */
    atomic_store(&self->pinned, true);
    self->hugetlb = true;
    uint64_t page = 0, pmd = 0;
    self->page_size = s_smaps(self->base, &page, &pmd) == 0 && page ? page : S_HUGE;
    snprintf(self->pages, sizeof self->pages, "%llu %s pages, hugetlbfs",
             (unsigned long long)(self->page_size >= S_HUGE ? self->page_size >> 20
                                                            : self->page_size >> 10),
             self->page_size >= S_HUGE ? "MiB" : "KiB");
    return 0;
}

/* The /dev/shm half. THP is asked for (madvise) before the first page is allocated (fallocate
 * first would allocate them small), then every page is faulted in (start-up pays, not the first
 * request), which is also where a short /dev/shm fails (an error, not a later SIGBUS). Whether
 * the pages are huge is the /dev/shm mount's huge= option's decision: read back from smaps. */
static int s_map_shm(kvt_arena_t *self, const kvt_config_t *cfg, int fd, char *err, size_t errlen)
{
    if (ftruncate(fd, (off_t)self->size) != 0) {
        snprintf(err, errlen, "l1: cannot size %s: %s", self->path, strerror(errno));
        return KVT_ENOSPC;
    }
    self->base = mmap(NULL, self->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (self->base == MAP_FAILED) {
        snprintf(err, errlen, "l1: cannot map %llu bytes: %s", (unsigned long long)self->size,
                 strerror(errno));
        return KVT_ENOMEM;
    }
    bool thp = strcmp(cfg->l1_hugepages, "off") != 0 &&
               madvise(self->base, self->size, MADV_HUGEPAGE) == 0;
    int rc = 0;
    /* A file a previous daemon left has its pages already: on 4 KiB pages, faulting all of
     * them in here (2 million for 8 GiB, seconds) is left to mlock (s_pin_later, after the
     * start) and to the first touches. Whether the pages are huge is seen on a first few MiB:
     * on huge pages the whole populate is cheap, and it tells smaps what the mapping is. */
    bool full = true;
    if (self->reused) {
        uint64_t probe = self->size < S_PROBE ? self->size : S_PROBE, page = 0, pmd = 0;
        full = madvise(self->base, probe, MADV_POPULATE_WRITE) != 0 ||
               s_smaps(self->base, &page, &pmd) != 0 || pmd > 0;
    }
    if (full && madvise(self->base, self->size, MADV_POPULATE_WRITE) != 0) {
        rc = errno;
        /* a page tmpfs cannot allocate is a SIGBUS on access, which MADV_POPULATE_WRITE
         * reports as EFAULT ("Bad address"): what it means here is a full /dev/shm */
        if (rc == EFAULT)
            rc = ENOSPC;
        if (rc == EINVAL) { /* before Linux 5.14: reserve, then touch every page */
            rc = posix_fallocate(fd, 0, (off_t)self->size);
            for (uint64_t off = 0; rc == 0 && off < self->size; off += S_SMALL)
                ((volatile char *)self->base)[off] = 0;
        }
    }
    if (rc != 0) {
        struct statvfs vfs;
        char room[96] = "";
        if (statvfs(S_SHM_DIR, &vfs) == 0)
            snprintf(room, sizeof room, "; the file system holds %llu bytes in all",
                     (unsigned long long)vfs.f_blocks * vfs.f_frsize);
        snprintf(err, errlen,
                 "l1: cannot reserve %llu bytes in %s: %s%s (make l1_size smaller or %s "
                 "larger: see docs/operations.md)",
                 (unsigned long long)self->size, S_SHM_DIR, strerror(rc), room, S_SHM_DIR);
        return KVT_ENOSPC;
    }
    uint64_t page = 0, pmd = 0;
    bool known = s_smaps(self->base, &page, &pmd) == 0;
    self->page_size = known && pmd >= self->size ? S_HUGE : S_SMALL;
    if (self->page_size == S_HUGE)
        snprintf(self->pages, sizeof self->pages, "2 MiB pages, transparent huge pages");
    else if (thp && pmd)
        snprintf(self->pages, sizeof self->pages, "4 KiB pages, THP requested (%llu MiB granted)",
                 (unsigned long long)(pmd >> 20));
    else
        snprintf(self->pages, sizeof self->pages, "4 KiB pages%s", thp ? ", THP requested" : "");
    return 0;
}

static void s_pin_run(kvt_arena_t *self)
{
    /* in pieces: mlock faults its range in holding the process's mmap lock, and the serving
     * threads' own mmap()s (malloc of a large buffer) must not wait for all of the arena */
    uint64_t off = 0;
    while (off < self->size && !atomic_load(&self->stop_bg)) {
        uint64_t n = self->size - off < S_PIN_STEP ? self->size - off : S_PIN_STEP;
        if (syscall(SYS_mlock, (char *)self->base + off, (size_t)n) != 0)
            break;
        off += n;
    }
    if (off == self->size) {
        atomic_store(&self->pinned, true);
        kvt_log(KVT_LOG_INFO, "l1: the adopted arena is pinned (mlock)");
    } else {
        kvt_log(self->allow_unpinned ? KVT_LOG_WARN : KVT_LOG_ERROR,
                "l1: the adopted arena runs unpinned: mlock of %llu bytes failed (%s; the daemon "
                "before pinned it: did RLIMIT_MEMLOCK change?)",
                (unsigned long long)self->size, strerror(errno));
    }
}

/* A byte of every page read, 16 MiB between looks at the stop flag, with CPU time nobody else
 * wants (SCHED_IDLE): on bare metal a cache miss a page, under shadow paging the exits the hot
 * path would pay otherwise. The reads race with clients' and loads' writes by design (the value
 * is dropped): not instrumented under TSan. */
__attribute__((no_sanitize("thread"))) static void s_warm_run(kvt_arena_t *self)
{
    struct sched_param sp = {0};
    (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
    uint64_t t0 = kvt_now_ns();
    for (uint64_t off = 0; off < self->size; off += S_PIN_STEP) {
        if (atomic_load(&self->stop_bg))
            return;
        uint64_t end = self->size - off < S_PIN_STEP ? self->size : off + S_PIN_STEP;
        for (uint64_t p = off; p < end; p += self->page_size)
            (void)((volatile const char *)self->base)[p];
    }
    atomic_store(&self->warm, true);
    kvt_log(KVT_LOG_DEBUG, "l1: every page of the arena read once, in %lld ms",
            (long long)((kvt_now_ns() - t0) / 1000000));
}

static void *s_background_run(void *arg)
{
    kvt_arena_t *self = arg;
    if (self->pin_owed)
        s_pin_run(self);
    s_warm_run(self);
    return NULL;
}

/* A reused arena is pinned after the start (kvt_arena_background_start), by a thread of its
 * own: its pages are faulted in on the way, seconds for a large arena on 4 KiB pages, which
 * neither the adoption nor the first requests need wait for. */
static int s_pin_later(kvt_arena_t *self, const kvt_config_t *cfg)
{
    self->allow_unpinned = cfg->allow_unpinned;
    self->pin_owed = true;
    return 0;
}

void kvt_arena_background_start(kvt_arena_t *self)
{
    if (self->started)
        return;
    self->started = true;
    sigset_t all, old;
    sigfillset(&all); /* signals stay with the threads that handle them; a SIGBUS of its own
                       * reads (the file cut by another process) is the arena's guard's */
    sigdelset(&all, SIGBUS);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    self->pinning = pthread_create(&self->pinner, NULL, s_background_run, self) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!self->pinning && self->pin_owed)
        s_pin_run(self); /* no thread: pinned now, and never warmed */
}

bool kvt_arena_warm(const kvt_arena_t *self)
{
    return atomic_load(&self->warm);
}

/* mlock, or the reason it failed: KVT_ENOMEM with err set unless allow_unpinned. */
static int s_pin(kvt_arena_t *self, const kvt_config_t *cfg, char *err, size_t errlen)
{
    /* the raw system call: sanitizer runtimes intercept mlock() and turn it into a no-op, and a
     * test build must pin (and fail to pin) exactly like the release build */
    if (syscall(SYS_mlock, self->base, (size_t)self->size) == 0) {
        atomic_store(&self->pinned, true);
        return 0;
    }
    int e = errno;
    struct rlimit rl = {0, 0};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    char limit[32];
    if (rl.rlim_cur == RLIM_INFINITY)
        snprintf(limit, sizeof limit, "unlimited");
    else
        snprintf(limit, sizeof limit, "%llu", (unsigned long long)rl.rlim_cur);
    if (!cfg->allow_unpinned) {
        snprintf(err, errlen,
                 "l1: cannot mlock %llu bytes (%s; RLIMIT_MEMLOCK is %s): raise the memlock "
                 "limit (LimitMEMLOCK=infinity, ulimit -l) or start with --allow-unpinned",
                 (unsigned long long)self->size, strerror(e), limit);
        return KVT_ENOMEM;
    }
    kvt_log(KVT_LOG_WARN,
            "l1: running unpinned: mlock of %llu bytes failed (%s; RLIMIT_MEMLOCK is %s)",
            (unsigned long long)self->size, strerror(e), limit);
    return 0;
}

/* Gives the segment to shm_group (mode 0660) when one is configured. */
static int s_share(const kvt_arena_t *self, const kvt_config_t *cfg, int fd, char *err,
                   size_t errlen)
{
    gid_t gid;
    int grc = kvt_config_shm_gid(cfg, &gid);
    if (grc < 0) {
        snprintf(err, errlen, "shm_group: no group '%s'", cfg->shm_group);
        return KVT_EINVAL;
    }
    if (grc == 0 && (fchown(fd, (uid_t)-1, gid) != 0 || fchmod(fd, 0660) != 0)) {
        snprintf(err, errlen, "shm_group: cannot give %s to group %s: %s", self->path,
                 cfg->shm_group, strerror(errno));
        return KVT_EIO;
    }
    return 0;
}

/* Drops a half-made segment: the mapping, the descriptor, the file. */
static void s_undo(kvt_arena_t *self, int *fd)
{
    if (self->base != MAP_FAILED)
        munmap(self->base, self->size);
    self->base = MAP_FAILED;
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
    if (self->unlink)
        unlink(self->path);
    self->unlink = false;
}

kvt_arena_t *kvt_arena_new(const kvt_config_t *cfg, char *err, size_t errlen)
{
    kvt_arena_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->base = MAP_FAILED;
    int fd = -1;

    char real[PATH_MAX];
    const char *rdir = realpath(cfg->run_dir, real) ? real : cfg->run_dir;
    char prefix[48];
    snprintf(prefix, sizeof prefix, "kvtier-%016llx-",
             (unsigned long long)XXH3_64bits(rdir, strlen(rdir)));

    /* hugetlbfs first, unless off; every reason not to use it is a sentence for the log */
    char hdir[PATH_MAX] = "", why[KVT_ERR_LEN * 2] = "";
    bool want = strcmp(cfg->l1_hugepages, "off") != 0;
    bool must = strcmp(cfg->l1_hugepages, "on") == 0;
    /* L1's objects only: the fast path's rings are private memfds (daemon/kvt_fastpath) */
    uint64_t want_size = cfg->l1_size;
    uint64_t hsize = (want_size + S_HUGE - 1) / S_HUGE * S_HUGE;
    /* segments of crashed daemons of this run dir go first, wherever they are: they hold
     * memory (in hugetlbfs, the very pages about to be counted) */
    s_remove_stale(S_SHM_DIR, prefix);
    if (!cfg->l1_adopt) /* one kept by an earlier run that adopted: nobody will use it now */
        s_remove_kept(S_SHM_DIR, prefix);
    if (want && s_find_hugetlbfs(cfg, hdir, sizeof hdir, why, sizeof why) == 0) {
        s_remove_stale(hdir, prefix);
        if (!cfg->l1_adopt)
            s_remove_kept(hdir, prefix);
        if (s_hugetlbfs_room(hdir, hsize, why, sizeof why) == 0) {
            self->size = hsize;
            fd = s_open(self, cfg, hdir, prefix);
            if (fd < 0)
                snprintf(why, sizeof why, "cannot create %.300s/%s...: %s", hdir, prefix,
                         strerror(errno));
            else if (s_share(self, cfg, fd, err, errlen) != 0)
                goto fail;
            else if (s_map_hugetlbfs(self, fd, hdir, why, sizeof why) == 0)
                why[0] = '\0';
            if (why[0])
                s_undo(self, &fd);
        }
    }
    if (why[0] && must) {
        snprintf(err, errlen, "l1.hugepages is on but %s", why);
        goto fail;
    }
    if (self->base == MAP_FAILED) {
        if (why[0])
            kvt_log(KVT_LOG_INFO, "l1: the arena goes to %s: %s", S_SHM_DIR, why);
        self->size = want_size;
        if (hdir[0])
            s_remove_kept(hdir, prefix);
        fd = s_open(self, cfg, S_SHM_DIR, prefix);
        if (fd < 0) {
            snprintf(err, errlen, "l1: cannot create shared memory %s/%s...: %s", S_SHM_DIR, prefix,
                     strerror(errno));
            goto fail;
        }
        if (s_share(self, cfg, fd, err, errlen) != 0 ||
            s_map_shm(self, cfg, fd, err, errlen) != 0 ||
            (self->reused ? s_pin_later(self, cfg) : s_pin(self, cfg, err, errlen)) != 0)
            goto fail;
    }
    if (self->hugetlb)
        s_remove_kept(S_SHM_DIR, prefix);
    self->fd = fd;
    fd = -1;
    self->keep = cfg->l1_adopt && self->kept_name; /* a private name: nobody would find it */
    if (!self->reused && !self->why_new[0])
        snprintf(self->why_new, sizeof self->why_new, "l1.adopt is off");
    s_guard(self);
    if (self->size != want_size)
        kvt_log(KVT_LOG_INFO, "l1: l1_size %llu rounded up to %llu, a multiple of the page size",
                (unsigned long long)want_size, (unsigned long long)self->size);
    kvt_log(KVT_LOG_INFO, "l1: %llu bytes of shared memory at %s (%s, %s)",
            (unsigned long long)self->size, self->path,
            atomic_load(&self->pinned) ? "pinned"
            : self->pin_owed           ? "pinned after the start"
                                       : "unpinned",
            self->pages);
    return self;
fail:
    s_undo(self, &fd);
    free(self);
    return NULL;
}

void kvt_arena_destroy(kvt_arena_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_arena_t *self = *self_p;
    atomic_store(&self->stop_bg, true);
    if (self->pinning)
        pthread_join(self->pinner, NULL);
    if (s_guarded == self) {
        sigaction(SIGBUS, &s_prev_bus, NULL);
        s_guarded = NULL;
    }
    close(self->fd);
    munmap(self->base, self->size);
    if (!self->keep)
        unlink(self->path);
    free(self);
    *self_p = NULL;
}

uint64_t kvt_arena_check(kvt_arena_t *self)
{
    struct stat st;
    if (fstat(self->fd, &st) == 0 && (uint64_t)st.st_size < self->size) {
        s_cut_note((uint64_t)st.st_size);
        if (ftruncate(self->fd, (off_t)self->size) != 0)
            kvt_log(KVT_LOG_ERROR, "l1: cannot restore the size of %s: %s", self->path,
                    strerror(errno));
        else if (!self->hugetlb)
            /* the lost pages come back as new ones: allocate them now, not at a fault */
            (void)madvise(self->base, self->size, MADV_POPULATE_WRITE);
    }
    return atomic_exchange(&s_cut, UINT64_MAX);
}

void *kvt_arena_base(const kvt_arena_t *self)
{
    return self->base;
}

uint64_t kvt_arena_size(const kvt_arena_t *self)
{
    return self->size;
}

const char *kvt_arena_path(const kvt_arena_t *self)
{
    return self->path;
}

bool kvt_arena_pinned(const kvt_arena_t *self)
{
    return atomic_load(&self->pinned);
}

uint64_t kvt_arena_page_size(const kvt_arena_t *self)
{
    return self->page_size;
}

bool kvt_arena_reused(const kvt_arena_t *self)
{
    return self->reused;
}

const char *kvt_arena_why_new(const kvt_arena_t *self)
{
    return self->reused ? "" : self->why_new;
}

void kvt_arena_forget(kvt_arena_t *self)
{
    self->reused = false;
}

void kvt_arena_keep(kvt_arena_t *self, bool keep)
{
    self->keep = keep;
}

void kvt_arena_ident(const kvt_arena_t *self, uint64_t *dev, uint64_t *ino)
{
    struct stat st;
    *dev = *ino = 0;
    if (fstat(self->fd, &st) == 0) {
        *dev = (uint64_t)st.st_dev;
        *ino = (uint64_t)st.st_ino;
    }
}

bool kvt_arena_huge(const kvt_arena_t *self)
{
    return self->page_size >= S_HUGE;
}
