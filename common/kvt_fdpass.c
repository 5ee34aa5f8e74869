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

int kvt_fdpass_send(int sock, int fd)
{
    char k = 'K';
    struct iovec iov = {&k, 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
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

/* The descriptors a message carried: the first into *fd, the rest closed. */
static int s_take_fds(struct msghdr *m, int *fd)
{
    int n = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int f;
            memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
            if (n++ == 0)
                *fd = f;
            else
                close(f);
        }
    }
    return n;
}

int kvt_fdpass_fetch(const char *path, const char *ticket, int timeout_ms, int *fd, int *sock,
                     char *err, size_t errlen)
{
    *fd = *sock = -1;
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
        char b[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t n;
    do
        n = recvmsg(s, &m, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    int got = -1;
    int nfds = n > 0 ? s_take_fds(&m, &got) : 0;
    if (n == 1 && buf[0] == 'K' && nfds == 1 && !(m.msg_flags & MSG_CTRUNC)) {
        *fd = got;
        *sock = s;
        return 0;
    }
    if (nfds)
        close(got);
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
