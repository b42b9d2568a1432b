/* Types and constants shared by the BPF programs and user space.
 *
 * User space never redeclares these structs: bcc derives the ctypes of map
 * keys, values and ring-buffer events from this header's debug info, and
 * agent/probe.py reads the HW_* defines below from this file.
 */
#ifndef HANGWATCH_H
#define HANGWATCH_H

/* Futex commands that wait (op & FUTEX_CMD_MASK); everything else returns at once. */
#define HW_FUTEX_WAIT 0
#define HW_FUTEX_LOCK_PI 6
#define HW_FUTEX_WAIT_BITSET 9
#define HW_FUTEX_WAIT_REQUEUE_PI 11
#define HW_FUTEX_LOCK_PI2 13
#define HW_FUTEX_CMD_MASK 0x7f

/* Which syscall a wait came through (struct hw_wait.syscall). */
#define HW_SYSCALL_FUTEX 0
#define HW_SYSCALL_FUTEX_WAIT 1  /* futex_wait(2), Linux 6.7+ */
#define HW_SYSCALL_FUTEX_WAITV 2 /* futex_waitv(2), Linux 5.16+: several words */

/* struct hw_wait.flags */
#define HW_WAIT_EDEADLK_ONLY 1 /* a PI lock of an unwatched process: kept only to see an EDEADLK */

/* Ring-buffer event kinds (struct hw_event.kind). */
#define HW_EVENT_LONG_WAIT 1 /* a wait longer than LONG_WAIT_NS ended */
#define HW_EVENT_EDEADLK 2   /* the kernel refused a PI lock that would close a cycle */
#define HW_EVENT_BIND 3      /* a successful bind(2) of an AF_INET/AF_INET6 socket, any process */
#define HW_EVENT_LISTEN 4    /* a successful listen(2), any process */

#define HW_EDEADLK 35
#define HW_AF_INET 2
#define HW_AF_INET6 10

/* One in-flight wait, keyed by TID: a parked thread never reaches sys_exit,
 * so this map, read each tick, says who waits now and on what. */
struct hw_wait {
	u64 start_ns;   /* bpf_ktime_get_ns() at sys_enter (CLOCK_MONOTONIC) */
	u64 uaddr;      /* the futex word (the first one for futex_waitv) */
	u32 tgid;
	u32 op;         /* futex command, flags stripped */
	u32 val;        /* the value the caller expects the word to hold */
	u32 word;       /* the word as read at sys_enter */
	u32 owner_hint; /* the int at uaddr + 8: glibc pthread_mutex_t.__owner */
	u32 syscall;    /* HW_SYSCALL_* */
	u32 read_ok;    /* 1 if both user reads succeeded */
	u32 flags;      /* HW_WAIT_* */
};

/* A PI lock the kernel refused with EDEADLK; glibc then parks the thread
 * forever on a private dummy word, so this is the only trace of what it
 * really waits for. Deleted when the thread's next wait ends. */
struct hw_refusal {
	u64 ts_ns;
	u64 uaddr; /* the PI lock word that was refused */
	u32 tgid;
	u32 pad;
};

struct hw_hist_key {
	u32 tgid;
	u32 slot; /* log2 of the wait time in ns */
};

/* The one ring-buffer record, for every kind: bcc decodes a ring buffer's
 * records as one flat struct, so fields a kind does not use are 0. */
struct hw_event {
	u64 ts_ns;
	u64 uaddr;       /* futex kinds */
	u64 duration_ns; /* futex kinds */
	u32 kind;        /* HW_EVENT_* */
	u32 tgid;
	u32 tid;
	u32 op;      /* futex kinds */
	s32 ret;     /* futex kinds */
	s32 fd;      /* bind, listen: the socket */
	u32 family;  /* bind: HW_AF_INET or HW_AF_INET6; 0 if the address was unreadable */
	u32 port;    /* bind: host byte order, 0 for "any port" */
	s32 backlog; /* listen: as passed, before the kernel caps it at somaxconn */
	u32 pad;
};

/* A bind or listen between sys_enter and sys_exit, keyed by pid_tgid: the
 * exit tracepoint only has the return value. */
struct hw_sock_call {
	u32 kind; /* HW_EVENT_BIND or HW_EVENT_LISTEN */
	s32 fd;
	u32 family;
	u32 port;
	s32 backlog;
	u32 pad;
};

struct hw_fd_key {
	u32 tgid;
	s32 fd;
};

/* Successful write(2), writev(2) and pwrite64(2) calls to one fd. */
struct hw_fd_writes {
	u64 bytes;
	u64 calls;
	u64 last_ns; /* bpf_ktime_get_ns() at the last one's sys_exit */
};

/* Per-CPU counters: every full map and failed reserve is counted. User
 * space sums the fields named *_full into one "maps full" figure. */
struct hw_counters {
	u64 waits_started;    /* watched waits only */
	u64 waits_ended;
	u64 inflight_full;    /* a wait not tracked: in-flight map full */
	u64 hist_full;        /* a wait not counted in the histogram: map full */
	u64 refusals_full;    /* an EDEADLK not kept: refusal map full */
	u64 events_sent;
	u64 events_dropped;   /* ring buffer full: reserve failed */
	u64 sock_calls_full;  /* a bind/listen not reported: sock_calls map full */
	u64 bind_unreadable;  /* a bind whose address could not be read: reported with family 0 */
	u64 write_calls_full; /* a write not counted: write_calls map full */
	u64 fd_writes_full;   /* a write not counted: fd_writes map full */
	u64 accepts_full;     /* an accept not counted: accepts map full */
};

#endif /* HANGWATCH_H */
