/* DESIGN: created once by the main thread at start-up, destroyed at shutdown; in between the
 * mapping never changes, so every thread may use base/size without a lock.
 *
 * The segment name is "kvtier-<run-dir hash>-<64 random bits>-<pid>". Clients learn it from
 * HELLO, so it need not be guessable: /dev/shm is shared by every local user, and a name another
 * user can predict is a name they can take first (the daemon would not start). It is created
 * with O_CREAT|O_EXCL|O_NOFOLLOW, so a file or symlink someone else made is never opened; a taken
 * name means another random one. The run-dir hash and the pid let a later daemon of the same run
 * directory find the segments whose daemon died; it removes only regular files of its own uid in
 * exactly this form (a root daemon could unlink anybody's file in the sticky /dev/shm). */
#include "kvt_arena.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#define S_SHM_DIR "/dev/shm"
#define S_RAND_HEX 16  /* hex digits of the random part of a name */
#define S_NAME_TRIES 8 /* random names tried before giving up (one taken is already unlikely) */

struct kvt_arena {
    char name[96];  /* shm_open name, "/kvtier-<hash>-<random>-<pid>" */
    char path[112]; /* S_SHM_DIR + name */
    void *base;
    uint64_t size;
    bool pinned;
    bool huge;
};

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
static void s_remove_stale(const char *prefix)
{
    DIR *d = opendir(S_SHM_DIR);
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
        char name[NAME_MAX + 2];
        snprintf(name, sizeof name, "/%s", e->d_name);
        if (shm_unlink(name) == 0)
            kvt_log(KVT_LOG_WARN, "l1: removed shared memory %s%s left by a stopped daemon",
                    S_SHM_DIR, name);
    }
    closedir(d);
}

/* Creates a new segment under a fresh random name; the fd, or -1 with errno. */
static int s_create(kvt_arena_t *self, const char *prefix)
{
    for (int i = 0; i < S_NAME_TRIES; i++) {
        uint64_t r;
        ssize_t n;
        while ((n = getrandom(&r, sizeof r, 0)) < 0 && errno == EINTR)
            ;
        if (n != (ssize_t)sizeof r)
            return -1;
        snprintf(self->name, sizeof self->name, "/%s%0*llx-%d", prefix, S_RAND_HEX,
                 (unsigned long long)r, (int)getpid());
        snprintf(self->path, sizeof self->path, "%s%s", S_SHM_DIR, self->name);
        int fd = shm_open(self->name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd >= 0 || errno != EEXIST)
            return fd;
        kvt_log(KVT_LOG_WARN, "l1: %s exists already (made by someone else?): trying another name",
                self->path);
    }
    return -1;
}

kvt_arena_t *kvt_arena_new(const kvt_config_t *cfg, char *err, size_t errlen)
{
    kvt_arena_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->base = MAP_FAILED;
    self->size = cfg->l1_size;
    int fd = -1;

    char real[PATH_MAX];
    const char *dir = realpath(cfg->run_dir, real) ? real : cfg->run_dir;
    char prefix[48];
    snprintf(prefix, sizeof prefix, "kvtier-%016llx-",
             (unsigned long long)XXH3_64bits(dir, strlen(dir)));
    s_remove_stale(prefix);
    fd = s_create(self, prefix);
    if (fd < 0) {
        snprintf(err, errlen, "l1: cannot create shared memory %s/%s...: %s", S_SHM_DIR, prefix,
                 strerror(errno));
        goto fail_nounlink;
    }
    gid_t gid;
    int grc = kvt_config_shm_gid(cfg, &gid);
    if (grc < 0) {
        snprintf(err, errlen, "shm_group: no group '%s'", cfg->shm_group);
        goto fail;
    }
    if (grc == 0) {
        if (fchown(fd, (uid_t)-1, gid) != 0 || fchmod(fd, 0660) != 0) {
            snprintf(err, errlen, "shm_group: cannot give %s to group %s: %s", self->path,
                     cfg->shm_group, strerror(errno));
            goto fail;
        }
    }
    /* reserve the tmpfs space now: a short /dev/shm fails here, not later with SIGBUS */
    int rc = posix_fallocate(fd, 0, (off_t)self->size);
    if (rc != 0) {
        snprintf(err, errlen,
                 "l1: cannot reserve %llu bytes in %s: %s (is /dev/shm large enough? see "
                 "docs/operations.md)",
                 (unsigned long long)self->size, S_SHM_DIR, strerror(rc));
        goto fail;
    }
    self->base = mmap(NULL, self->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (self->base == MAP_FAILED) {
        snprintf(err, errlen, "l1: cannot map %llu bytes: %s", (unsigned long long)self->size,
                 strerror(errno));
        goto fail;
    }
    close(fd);
    fd = -1;
    self->huge = madvise(self->base, self->size, MADV_HUGEPAGE) == 0;
    /* the raw system call: sanitizer runtimes intercept mlock() and turn it into a no-op, and a
     * test build must pin (and fail to pin) exactly like the release build */
    if (syscall(SYS_mlock, self->base, (size_t)self->size) == 0) {
        self->pinned = true;
    } else {
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
            goto fail;
        }
        kvt_log(KVT_LOG_WARN,
                "l1: running unpinned: mlock of %llu bytes failed (%s; RLIMIT_MEMLOCK is %s)",
                (unsigned long long)self->size, strerror(e), limit);
    }
    kvt_log(KVT_LOG_INFO, "l1: %llu bytes of shared memory at %s (%s, %s)",
            (unsigned long long)self->size, self->path, self->pinned ? "pinned" : "unpinned",
            self->huge ? "huge pages requested" : "4 KiB pages");
    return self;
fail:
    shm_unlink(self->name);
fail_nounlink:
    if (fd >= 0)
        close(fd);
    if (self->base != MAP_FAILED)
        munmap(self->base, self->size);
    free(self);
    return NULL;
}

void kvt_arena_destroy(kvt_arena_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    kvt_arena_t *self = *self_p;
    munmap(self->base, self->size);
    shm_unlink(self->name);
    free(self);
    *self_p = NULL;
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
    return self->pinned;
}

bool kvt_arena_huge(const kvt_arena_t *self)
{
    return self->huge;
}
