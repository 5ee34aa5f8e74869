/* DESIGN: the run directory's lock is an flock() on a file that stays: a process that dies
 * releases it with its descriptors, so there is nothing stale to clean up, and two daemons
 * started at the same moment cannot both get it (the socket check alone leaves a window in
 * which both see a free path and both bind). The winner writes its pid into the file for the
 * loser's message; a loser reading in between the winner's lock and write retries briefly.
 * Main thread only, at start-up and exit. */
#include "kvt_rundir.h"

#include "kvt_error.h"
#include "kvt_log.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define S_PID_TRIES 40 /* x 5 ms: how long a loser waits for the winner's pid to appear */

struct kvt_rundir {
    int fd;
};

int kvt_rundir_check_ipc(const char *endpoint, char *err, size_t errlen)
{
    if (strncmp(endpoint, "ipc://", 6) != 0)
        return 0;
    const char *path = endpoint + strlen("ipc://");
    struct stat st;
    if (stat(path, &st) != 0)
        return 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(err, errlen, "ipc path %s is too long", path);
        return KVT_EINVAL;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return 0;
    int live = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    close(fd);
    if (live) {
        snprintf(err, errlen, "another process is already serving %s", endpoint);
        return KVT_EBUSY;
    }
    unlink(path);
    return 0;
}

/* The pid the lock's holder wrote, once it is there and alive; 0 when unknown. */
static long s_holder(int fd)
{
    for (int i = 0; i < S_PID_TRIES; i++) {
        char buf[32];
        ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
        buf[n > 0 ? n : 0] = '\0';
        char *end = NULL;
        long pid = strtol(buf, &end, 10);
        if (pid > 0 && end != buf && *end == '\n' && (kill((pid_t)pid, 0) == 0 || errno == EPERM))
            return pid;
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int s_lock(int fd, const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
        snprintf(err, errlen,
                 "run_dir: %s is not a regular file of this user (uid %u): remove it or use "
                 "another run_dir",
                 path, (unsigned)geteuid());
        return KVT_EINVAL;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) {
            snprintf(err, errlen, "run_dir: cannot lock %s: %s", path, strerror(errno));
            return KVT_EIO;
        }
        long pid = s_holder(fd);
        char who[32] = "pid unknown";
        if (pid)
            snprintf(who, sizeof who, "pid %ld", pid);
        snprintf(err, errlen, "run_dir is in use by another kvtierd (%s; lock %s)", who, path);
        return KVT_EBUSY;
    }
    char line[32];
    int n = snprintf(line, sizeof line, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)n, 0) != n)
        kvt_log(KVT_LOG_WARN, "run_dir: cannot write the pid into %s: %s", path, strerror(errno));
    return 0;
}

kvt_rundir_t *kvt_rundir_claim(const kvt_config_t *cfg, int *rc, char *err, size_t errlen)
{
    char path[4096];
    size_t n = strlen(cfg->run_dir);
    while (n > 1 && cfg->run_dir[n - 1] == '/')
        n--;
    if (snprintf(path, sizeof path, "%.*s/%s", (int)n, cfg->run_dir, KVT_RUNDIR_LOCK) >=
        (int)sizeof path) {
        snprintf(err, errlen, "run_dir: path too long");
        *rc = KVT_EINVAL;
        return NULL;
    }
    /* O_NOFOLLOW: a symlink planted in a shared run_dir is refused, not followed */
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "run_dir: cannot open the lock file %s: %s", path, strerror(errno));
        *rc = KVT_EIO;
        return NULL;
    }
    *rc = s_lock(fd, path, err, errlen);
    for (int i = 0; *rc == 0 && i < cfg->n_listen; i++)
        *rc = kvt_rundir_check_ipc(cfg->listen[i], err, errlen);
    if (*rc == 0)
        *rc = kvt_rundir_check_ipc(cfg->events, err, errlen);
    if (*rc == 0)
        *rc = kvt_rundir_check_ipc(cfg->lmcache_listen, err, errlen);
    if (*rc != 0) {
        close(fd); /* releases the lock when we held it */
        return NULL;
    }
    kvt_rundir_t *self = calloc(1, sizeof *self);
    kvt_assert(self);
    self->fd = fd;
    return self;
}

void kvt_rundir_release(kvt_rundir_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    close((*self_p)->fd);
    free(*self_p);
    *self_p = NULL;
}

int kvt_rundir_share_ipc(const kvt_config_t *cfg, const char *option, const char *path,
                           char *err, size_t errlen)
{
    gid_t gid;
    int rc = kvt_config_shm_gid(cfg, &gid);
    if (rc > 0)
        return 0;
    if (rc < 0 || chown(path, (uid_t)-1, gid) != 0 || chmod(path, 0660) != 0) {
        snprintf(err, errlen, "%s: cannot give %s to group %s: %s", option, path,
                 cfg->shm_group, rc < 0 ? "no such group" : strerror(errno));
        return KVT_EINVAL;
    }
    return 0;
}
