/* DESIGN: one sendmsg each way. The answer is a single small message, so one recvmsg takes
 * it whole on a stream socket (the kernel does not split a 201-byte write with its control
 * message); anything else is refused, and descriptors that came with a wrong answer are
 * closed, never leaked. */
#include "kvt_fdpass.h"

#include "kvt_error.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define S_WHY_MAX 200

int kvt_fdpass_send(int sock, const int *fds, int nfds)
{
    if (nfds < 1 || nfds > KVT_FDPASS_MAX_FDS)
        return -EINVAL;
    char k = 'K';
    struct iovec iov = {&k, 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(KVT_FDPASS_MAX_FDS * sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr m = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = ctl.buf,
                       .msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
    memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
    return sendmsg(sock, &m, MSG_NOSIGNAL) == 1 ? 0 : -errno;
}

int kvt_fdpass_refuse(int sock, const char *why)
{
    char buf[1 + S_WHY_MAX];
    size_t n = strnlen(why, S_WHY_MAX);
    buf[0] = 'E';
    memcpy(buf + 1, why, n);
    return send(sock, buf, n + 1, MSG_NOSIGNAL) == (ssize_t)(n + 1) ? 0 : -errno;
}

/* The descriptors a message carried: the first `max` into fds, the rest closed. Their count. */
static int s_take_fds(struct msghdr *m, int *fds, int max)
{
    int n = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
            if (n < max)
                fds[n] = f;
            else
                close(f);
            n++;
        }
    }
    return n;
}

static void s_close_fds(int *fds, int n)
{
    for (int i = 0; i < n; i++) {
        close(fds[i]);
        fds[i] = -1;
    }
}

int kvt_fdpass_fetch(const char *path, const char *ticket, int timeout_ms, int *fds, int maxfds,
                     int *nfds, int *sock, char *err, size_t errlen)
{
    *nfds = 0;
    *sock = -1;
    if (maxfds < 1 || maxfds > KVT_FDPASS_MAX_FDS) {
        snprintf(err, errlen, "at most %d descriptors", KVT_FDPASS_MAX_FDS);
        return KVT_EINVAL;
    }
    for (int i = 0; i < maxfds; i++)
        fds[i] = -1;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(err, errlen, "the handoff socket path is too long for a unix socket");
        return KVT_EUNAVAIL;
    }
    strcpy(sa.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) {
        snprintf(err, errlen, "socket: %s", strerror(errno));
        return KVT_EUNAVAIL;
    }
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    size_t tlen = strlen(ticket);
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        snprintf(err, errlen, "connecting to %s: %s", path, strerror(errno));
        close(s);
        return KVT_EUNAVAIL;
    }
    if (send(s, ticket, tlen, MSG_NOSIGNAL) != (ssize_t)tlen) {
        snprintf(err, errlen, "sending the ticket: %s", strerror(errno));
        close(s);
        return KVT_EUNAVAIL;
    }
    char buf[1 + S_WHY_MAX + 1];
    struct iovec iov = {buf, sizeof buf - 1};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE((KVT_FDPASS_MAX_FDS + 2) * sizeof(int))];
    } ctl;
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t n;
    do
        n = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    int got = n > 0 ? s_take_fds(&m, fds, maxfds) : 0;
    if (n == 1 && buf[0] == 'K' && got >= 1 && got <= maxfds && !(m.msg_flags & MSG_CTRUNC)) {
        *nfds = got;
        *sock = s;
        return 0;
    }
    s_close_fds(fds, got < maxfds ? got : maxfds);
    if (n > 0 && buf[0] == 'E') {
        buf[n] = '\0';
        snprintf(err, errlen, "the daemon refused the ring pair: %s", buf + 1);
    } else if (n < 0) {
        snprintf(err, errlen, "waiting for the ring pair: %s", strerror(errno));
    } else {
        snprintf(err, errlen, "the handoff socket answered no ring pair");
    }
    close(s);
    return KVT_EUNAVAIL;
}

int kvt_fdpass_peer_gone(int sock)
{
    struct pollfd p = {sock, POLLIN | POLLRDHUP, 0};
    int rc = poll(&p, 1, 0);
    return rc > 0 || (rc < 0 && errno != EINTR);
}
