/* hangwatch: the maps, settings and helpers that every program file shares.
 *
 * agent/probe.py builds ONE BPF object from this file followed by
 * futex.bpf.c and io.bpf.c (BPF_SOURCES there), joined as one text with
 * #line directives. They are not #included: bcc rewrites map calls such as
 * watched.lookup() only in its main file, so a map call in an included file
 * compiles to an indirect call the verifier rejects ("unknown opcode 8d").
 *
 * Settings arrive as -D compile-time constants from agent/probe.py.
 */
#include "hangwatch.h"

#ifndef MAX_WATCHED
#define MAX_WATCHED 4096
#endif
#ifndef MAX_INFLIGHT
#define MAX_INFLIGHT 65536
#endif
#ifndef MAX_HIST
#define MAX_HIST 32768
#endif
#ifndef MAX_REFUSALS
#define MAX_REFUSALS 4096
#endif
#ifndef MAX_SOCK_CALLS
#define MAX_SOCK_CALLS 1024 /* binds and listens in progress at one instant, host-wide */
#endif
#ifndef MAX_WRITE_CALLS
#define MAX_WRITE_CALLS 16384 /* threads of watched processes inside a write at one instant */
#endif
#ifndef MAX_FD_WRITES
#define MAX_FD_WRITES 16384
#endif
#ifndef MAX_ACCEPTS
#define MAX_ACCEPTS MAX_WATCHED
#endif
#ifndef LONG_WAIT_NS
#define LONG_WAIT_NS 1000000000ULL
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif

BPF_HASH(watched, u32, u8, MAX_WATCHED);                       /* tgid -> 1, filled by user space */
BPF_PERCPU_ARRAY(counters, struct hw_counters, 1);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);                     /* struct hw_event */

/* futex.bpf.c */
BPF_HASH(inflight, u32, struct hw_wait, MAX_INFLIGHT);         /* tid -> current wait */
BPF_HASH(refusals, u32, struct hw_refusal, MAX_REFUSALS);      /* tid -> refused PI lock */
BPF_HASH(wait_hist, struct hw_hist_key, u64, MAX_HIST);        /* (tgid, log2 ns) -> count */

/* io.bpf.c */
BPF_HASH(sock_calls, u64, struct hw_sock_call, MAX_SOCK_CALLS); /* pid_tgid -> bind/listen */
BPF_HASH(write_calls, u64, s32, MAX_WRITE_CALLS);               /* pid_tgid -> fd written */
BPF_HASH(fd_writes, struct hw_fd_key, struct hw_fd_writes, MAX_FD_WRITES);
BPF_HASH(accepts, u32, u64, MAX_ACCEPTS);                       /* tgid -> accepts */

static __always_inline struct hw_counters *this_cpu_counters(void)
{
	u32 zero = 0;
	return counters.lookup(&zero);
}

/* Per-CPU, so a plain increment is safe. (bcc forbids map calls inside macros.) */
#define COUNT(field)                                                                               \
	do {                                                                                       \
		struct hw_counters *c_ = this_cpu_counters();                                      \
		if (c_)                                                                            \
			c_->field++;                                                               \
	} while (0)

static __always_inline int is_watched(u32 tgid)
{
	return watched.lookup(&tgid) != 0;
}

/* A zeroed ring-buffer record (reserved memory is not zeroed), or NULL, counted.
 * The only reserve in the object: bcc takes the record type from it. */
static __always_inline struct hw_event *reserve_event(u32 kind, u32 tgid, u32 tid, u64 now)
{
	struct hw_event *e = events.ringbuf_reserve(sizeof(struct hw_event));
	if (!e) {
		COUNT(events_dropped);
		return 0;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = now;
	e->kind = kind;
	e->tgid = tgid;
	e->tid = tid;
	return e;
}

static __always_inline void submit_event(struct hw_event *e)
{
	events.ringbuf_submit(e, 0);
	COUNT(events_sent);
}
