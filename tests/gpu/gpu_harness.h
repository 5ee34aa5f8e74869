/* gpu_harness: what the GPU test (kvt_test_gpu.c) and benchmark (kvt_bench_gpu.c) share —
 * a private kvtierd they start and stop, the device probe that decides whether to skip, and
 * the engine child process. Header-only (static functions): each program includes it once.
 *
 * CUDA and fork: the parent never calls CUDA. The probe and the engine each run in a forked
 * child, so a CUDA context is only ever created in a process that was never forked after it;
 * and the daemon is another process, as CUDA IPC requires (a process cannot open its own
 * handles). */
#ifndef KVT_GPU_HARNESS_H
#define KVT_GPU_HARNESS_H

#include "kvtier.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define H_SKIP 77

typedef struct {
    char dir[256];
    char endpoint[300];
    char log[300];
    pid_t pid;
} h_daemon_t;

static inline double h_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Fails the engine child with a message (exit 1). */
#define H_CUDA(call)                                                                           \
    do {                                                                                       \
        cudaError_t h_e = (call);                                                              \
        if (h_e != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                      \
                    cudaGetErrorString(h_e));                                                  \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define H_CHECK(cond, ...)                                                                     \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);          \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* Forks a child that asks CUDA for devices: 0 when there is one, else H_SKIP with the
 * reason in why. */
static inline int h_probe(char *why, size_t len)
{
    int fds[2];
    if (pipe(fds) != 0)
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        char msg[200];
        if (e != cudaSuccess || n == 0) {
            snprintf(msg, sizeof msg, "%s", e != cudaSuccess ? cudaGetErrorString(e)
                                                             : "no devices");
            if (write(fds[1], msg, strlen(msg)) < 0)
                _exit(2);
            _exit(H_SKIP);
        }
        _exit(0);
    }
    close(fds[1]);
    ssize_t r = read(fds[0], why, len - 1);
    why[r > 0 ? r : 0] = '\0';
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}

static inline kvtier_t *h_connect(const h_daemon_t *d, const char *instance, int timeout_ms)
{
    char err[256];
    return kvtier_connect(d->endpoint, "kvt-gpu", instance, timeout_ms, err, sizeof err);
}

/* Starts `daemon` on a private run dir (ipc only, no L2, no HTTP) with an L1 of l1_size;
 * copy_mode, when not NULL, is its KVT_GPU_COPY (auto, direct or staged). */
static inline bool h_daemon_start(h_daemon_t *d, const char *daemon, const char *l1_size,
                                  const char *copy_mode)
{
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/kvt-gpu-XXXXXX");
    if (!mkdtemp(d->dir)) {
        perror("mkdtemp");
        return false;
    }
    char data[300];
    snprintf(data, sizeof data, "%s/data", d->dir);
    mkdir(data, 0700);
    snprintf(d->endpoint, sizeof d->endpoint, "ipc://%s/kvtier.sock", d->dir);
    snprintf(d->log, sizeof d->log, "%s/kvtierd.log", d->dir);
    char *argv[] = {(char *)daemon,
                    "--run-dir",
                    d->dir,
                    "--data-dir",
                    data,
                    "--listen",
                    d->endpoint,
                    "--http",
                    "",
                    "--l1-size",
                    (char *)l1_size,
                    "--l2",
                    "none",
                    "--log-level",
                    "info",
                    "--lease-ms",
                    "10000",
                    "--allow-unpinned",
                    "--l1-adopt=false", /* nothing kept in /dev/shm after the test */
                    NULL};
    d->pid = fork();
    if (d->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (copy_mode)
            setenv("KVT_GPU_COPY", copy_mode, 1);
        int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (double end = h_now() + 60; h_now() < end; usleep(50000)) {
        if (waitpid(d->pid, NULL, WNOHANG) == d->pid) {
            fprintf(stderr, "kvtierd exited at start; see %s\n", d->log);
            d->pid = 0;
            return false;
        }
        kvtier_t *c = h_connect(d, "probe", 300);
        if (c) {
            kvtier_close(&c);
            return true;
        }
    }
    fprintf(stderr, "kvtierd not ready in 60 s; see %s\n", d->log);
    return false;
}

/* SIGTERM (SIGKILL after 10 s); returns the exit status, -1 when killed. */
static inline int h_daemon_stop(h_daemon_t *d)
{
    if (d->pid <= 0)
        return -1;
    kill(d->pid, SIGTERM);
    int st = 0;
    for (int i = 0; i < 1000; i++) {
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        usleep(10000);
    }
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
    return -1;
}

/* True when the daemon's log contains `s`. */
static inline bool h_log_has(const h_daemon_t *d, const char *s)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, s) != NULL;
    fclose(f);
    return found;
}

/* Lines of the daemon's log that contain `s`. */
static inline int h_log_count(const h_daemon_t *d, const char *s)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return 0;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f))
        n += strstr(line, s) != NULL;
    fclose(f);
    return n;
}

/* Forks fn(arg) as a child (an engine) and returns its pid without waiting. */
static inline pid_t h_spawn(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int rc = fn(arg);
        fflush(stdout);
        _exit(rc);
    }
    return pid;
}

/* The exit status of child pid (-1: killed by a signal). */
static inline int h_wait(pid_t pid)
{
    int st = 0;
    if (waitpid(pid, &st, 0) != pid)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Runs fn(arg) in a forked child (the engine); returns its exit status (-1: killed). */
static inline int h_run_child(int (*fn)(void *), void *arg)
{
    return h_wait(h_spawn(fn, arg));
}

/* Shuffles a[0..n) with a fixed-seed xorshift (reproducible runs). */
static inline void h_shuffle(uint64_t *a, uint32_t n, uint64_t seed)
{
    uint64_t x = seed | 1;
    for (uint32_t i = n; i > 1; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t j = (uint32_t)(x % i);
        uint64_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

#endif
