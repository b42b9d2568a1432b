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

/* Ring-buffer event kinds (struct hw_event.kind). */
#define HW_EVENT_LONG_WAIT 1 /* a wait longer than LONG_WAIT_NS ended */
#define HW_EVENT_EDEADLK 2   /* the kernel refused a PI lock that would close a cycle */

#define HW_EDEADLK 35

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
	u32 pad;
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

struct hw_event {
	u64 ts_ns;
	u64 uaddr;
	u64 duration_ns;
	u32 kind; /* HW_EVENT_* */
	u32 tgid;
	u32 tid;
	u32 op;
	s32 ret;
	u32 pad;
};

/* Per-CPU counters: every full map and failed reserve is counted. */
struct hw_counters {
	u64 waits_started;
	u64 waits_ended;
	u64 inflight_full;   /* a wait not tracked: in-flight map full */
	u64 hist_full;       /* a wait not counted in the histogram: map full */
	u64 refusals_full;   /* an EDEADLK not kept: refusal map full */
	u64 events_sent;
	u64 events_dropped;  /* ring buffer full: reserve failed */
};

#endif /* HANGWATCH_H */
