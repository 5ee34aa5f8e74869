/* DESIGN: created once by the main thread at start-up, destroyed at shutdown; in between the
 * mapping never changes, so every thread may use base/size without a lock. The segment name
 * carries a hash of the run directory and the pid: clients learn the path from HELLO, and a
 * later daemon of the same run directory can find and remove segments whose owner died. */
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
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#define S_SHM_DIR "/dev/shm"

struct kvt_arena {
    char name[64]; /* shm_open name, "/kvtier-<hash>-<pid>" */
    char path[96]; /* S_SHM_DIR + name */
    void *base;
    uint64_t size;
    bool pinned;
    bool huge;
};

/* Removes segments of this run dir whose daemon is gone (a crash leaves them behind, holding
 * memory until someone unlinks them). */
static void s_remove_stale(const char *prefix)
{
    DIR *d = opendir(S_SHM_DIR);
    if (!d)
        return;
    size_t plen = strlen(prefix);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, plen) != 0)
            continue;
        char *end = NULL;
        long pid = strtol(e->d_name + plen, &end, 10);
        if (!end || *end || pid <= 0 || pid == getpid())
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno == EPERM)
            continue; /* still alive */
        char name[NAME_MAX + 2];
        snprintf(name, sizeof name, "/%s", e->d_name);
        if (shm_unlink(name) == 0)
            kvt_log(KVT_LOG_WARN, "l1: removed shared memory %s%s left by a stopped daemon",
                    S_SHM_DIR, name);
    }
    closedir(d);
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
    snprintf(self->name, sizeof self->name, "/%s%d", prefix, (int)getpid());
    snprintf(self->path, sizeof self->path, "%s%s", S_SHM_DIR, self->name);

    fd = shm_open(self->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "l1: cannot create shared memory %s: %s", self->path,
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
