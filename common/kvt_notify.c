/* DESIGN: a thin layer over libsystemd's sd_notify(). sd_notify() opens, sends on and closes its
 * own datagram socket per call and reads NOTIFY_SOCKET each time, so it is safe from any thread
 * and a no-op without the variable; nothing here holds a socket. The one piece of state is the
 * status text given with READY=1 (and whether READY=1 was sent), so that the supervisor can put
 * it back after "not ready: ..."; a mutex guards it because main and the supervisor thread both
 * get here. The environment is never unset: the daemon spawns no children that could inherit
 * it, and the watchdog and STOPPING=1 still need it after READY=1. */
#include "kvt_notify.h"

#include "kvt_log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#define S_STATUS_LEN 256

static pthread_mutex_t s_lock = PTHREAD_MUTEX_INITIALIZER;
static char s_ready_status[S_STATUS_LEN];
static bool s_ready;

/* A STATUS= value must stay one line of the notification: sd_notify parses the datagram as
 * newline-separated assignments. */
static void s_one_line(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r')
            *s = ' ';
}

static void s_send(const char *state)
{
    int rc = sd_notify(0, state);
    if (rc < 0)
        kvt_log(KVT_LOG_DEBUG, "sd_notify: cannot send '%.40s': %s", state, strerror(-rc));
}

void kvt_notify_ready(const char *status)
{
    char msg[S_STATUS_LEN + 32];
    pthread_mutex_lock(&s_lock);
    snprintf(s_ready_status, sizeof s_ready_status, "%s", status);
    s_one_line(s_ready_status);
    s_ready = true;
    snprintf(msg, sizeof msg, "READY=1\nSTATUS=%s", s_ready_status);
    pthread_mutex_unlock(&s_lock);
    s_send(msg);
}

void kvt_notify_stopping(void)
{
    pthread_mutex_lock(&s_lock);
    s_ready = false; /* no "ready again" status once stopping */
    pthread_mutex_unlock(&s_lock);
    s_send("STOPPING=1\nSTATUS=stopping");
}

void kvt_notify_status(const char *fmt, ...)
{
    char msg[S_STATUS_LEN + 8] = "STATUS=";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + 7, sizeof msg - 7, fmt, ap);
    va_end(ap);
    s_one_line(msg);
    s_send(msg);
}

void kvt_notify_health(bool healthy, const char *why)
{
    char status[S_STATUS_LEN];
    pthread_mutex_lock(&s_lock);
    bool ready = s_ready;
    snprintf(status, sizeof status, "%s", s_ready_status);
    pthread_mutex_unlock(&s_lock);
    if (!ready)
        return;
    if (healthy)
        kvt_notify_status("%s", status);
    else
        kvt_notify_status("not ready: %s", why);
}

uint64_t kvt_notify_watchdog_interval_ms(void)
{
    uint64_t usec = 0;
    /* > 0 only when WATCHDOG_USEC is set and WATCHDOG_PID, if set, is this process */
    if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0)
        return 0;
    uint64_t ms = usec / 2000;
    return ms ? ms : 1;
}

void kvt_notify_watchdog(void)
{
    s_send("WATCHDOG=1");
}
