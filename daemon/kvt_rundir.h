/* kvt_rundir: one daemon per run directory, and no endpoint taken from a live process.
 *
 * kvt_rundir_claim() runs first at start-up, once the run directory exists and before anything
 * another daemon could be using is created or bound (the arena, the listen and events sockets,
 * HTTP). It takes an exclusive flock() on RUN_DIR/kvtier.lock, held for the life of the process
 * (the kernel drops it when the process dies, however it dies), writes the daemon's pid into it,
 * then checks that no live process serves any ipc:// endpoint of the configuration: libzmq
 * unlinks an existing socket file when it binds, so binding first would cut the other daemon's
 * clients and subscribers off. The lock file is never removed (unlinking it would let a third
 * daemon lock a new file while a second one waits on the old). Main thread only. */
#ifndef KVT_RUNDIR_H
#define KVT_RUNDIR_H

#include "kvt_config.h"

#include <stddef.h>

#define KVT_RUNDIR_LOCK "kvtier.lock"

typedef struct kvt_rundir kvt_rundir_t;

/* Takes run_dir's lock and checks the ipc endpoints. NULL with one line in err and *rc set:
 * KVT_EBUSY when another daemon holds run_dir or a live process serves an endpoint, KVT_EINVAL
 * when the lock file is not this user's regular file (both configuration problems: exit 2), or
 * KVT_EIO when the lock file cannot be opened or locked. */
kvt_rundir_t *kvt_rundir_claim(const kvt_config_t *cfg, int *rc, char *err, size_t errlen);

/* Drops the lock (after everything the daemon shared is gone). Accepts NULL. */
void kvt_rundir_release(kvt_rundir_t **self_p);

/* For an ipc:// endpoint about to be bound: KVT_EBUSY when a process is listening on its path,
 * else 0 after removing a stale socket file left by a crash. 0 for other transports. */
int kvt_rundir_check_ipc(const char *endpoint, char *err, size_t errlen);

/* A bound ipc socket file (created under umask 077): with shm_group its members may connect,
 * like they may map the arena (0660, that group). 0, or KVT_EINVAL naming `option`. */
int kvt_rundir_share_ipc(const kvt_config_t *cfg, const char *option, const char *path,
                           char *err, size_t errlen);

#endif
