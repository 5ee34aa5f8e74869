/* kvt_notify: tells the service manager how the daemon is doing (sd_notify(3), Type=notify).
 *
 * READY=1 once every socket is bound and the arena is pinned, STATUS= lines a person reads in
 * `systemctl status`, STOPPING=1 when shutdown begins, and WATCHDOG=1 keep-alives that the
 * supervisor sends only while every internal thread is healthy. Without NOTIFY_SOCKET in the
 * environment (not started by systemd, or by a test) every call is a cheap no-op. Any thread may
 * call any function; the state kept here is the process's, like NOTIFY_SOCKET itself. */
#ifndef KVT_NOTIFY_H
#define KVT_NOTIFY_H

#include <stdbool.h>
#include <stdint.h>

/* READY=1 with STATUS=status. `status` is remembered: kvt_notify_health() shows it again when
 * the daemon recovers. Main thread, once, after every thread has started. */
void kvt_notify_ready(const char *status);

/* STOPPING=1 with STATUS=stopping. Main thread, when the server loop has ended. */
void kvt_notify_stopping(void);

/* STATUS=<formatted text> (one line; newlines are replaced). */
void kvt_notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Reports a change of health as a STATUS= line: "not ready: <why>" when !healthy, the status
 * given to kvt_notify_ready() when healthy again. Sends nothing before READY=1. */
void kvt_notify_health(bool healthy, const char *why);

/* How often to send WATCHDOG=1, in ms (half of WATCHDOG_USEC, as sd_watchdog_enabled(3) asks),
 * or 0 when the service manager wants no keep-alives (or WATCHDOG_PID names another process).
 * Reads the environment; call at start-up. */
uint64_t kvt_notify_watchdog_interval_ms(void);

/* WATCHDOG=1. The caller decides that the daemon is healthy. */
void kvt_notify_watchdog(void);

#endif
