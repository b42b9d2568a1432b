/* hangwatch: the maps, settings and helpers that every program file shares.
 *
 * agent/sources/probe.py builds ONE BPF object from this file followed by
 * futex.bpf.c, io.bpf.c and exec.bpf.c (BPF_SOURCES there), joined as one text with
 * #line directives. They are not #included: bcc rewrites map calls such as
 * watched.lookup() only in its main file, so a map call in an included file
 * compiles to an indirect call the verifier rejects ("unknown opcode 8d").
 *
 * Settings arrive as -D compile-time constants from agent/sources/probe.py. Those it always
 * passes (WATCHED_WORDS, LONG_WAIT_NS, RINGBUF_PAGES) have no default here, so each value is
 * written in one place; the map sizes, which tests may override, keep theirs.
 */
#include "hangwatch.h"

#ifndef WATCHED_WORDS
#error "WATCHED_WORDS (pid_max / 64 + 1) comes from agent/sources/probe.py"
#endif
#ifndef MAX_THREADS
#define MAX_THREADS 65536 /* threads of watched processes that waited or wrote */
#endif
#ifndef MAX_PI_OPS
#define MAX_PI_OPS 4096 /* threads that did a PI futex operation, host-wide; LRU */
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
#ifndef MAX_FD_WRITES
#define MAX_FD_WRITES 16384
#endif
#ifndef MAX_ACCEPTS
#define MAX_ACCEPTS 4096
#endif
#ifndef LONG_WAIT_NS
#error "LONG_WAIT_NS comes from agent/sources/probe.py (agent/settings.py's LONG_WAIT_S)"
#endif
#ifndef RINGBUF_PAGES
#error "RINGBUF_PAGES comes from agent/sources/probe.py"
#endif

/* Bit tgid % 64 of word tgid / 64 is set for a watched process, by user space. An
 * array lookup is inlined by the JIT, so the test every program makes first costs a
 * few instructions rather than a hash helper call: what unwatched processes pay. */
BPF_ARRAY(watched, u64, WATCHED_WORDS);
BPF_PERCPU_ARRAY(counters, struct hw_counters, 1);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);                     /* struct hw_event */

/* futex.bpf.c */
BPF_HASH(threads, u32, struct hw_thread, MAX_THREADS);         /* tid -> wait, write in progress */
BPF_TABLE("lru_hash", u32, struct hw_pi_op, pi_ops, MAX_PI_OPS); /* tid -> last PI operation */
BPF_HASH(refusals, u32, struct hw_refusal, MAX_REFUSALS);      /* tid -> refused PI lock */
BPF_HASH(wait_hist, struct hw_hist_key, u64, MAX_HIST);        /* (tgid, log2 ns) -> count */

/* io.bpf.c */
BPF_HASH(sock_calls, u64, struct hw_sock_call, MAX_SOCK_CALLS); /* pid_tgid -> bind/listen */
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

/* Which counter add_or_count_full() bumps: a byte offset into struct hw_counters. */
#define COUNTER(field) __builtin_offsetof(struct hw_counters, field)

/* libbpf-tools' "lookup_or_try_init, then add", for bcc, where a map cannot be passed to
 * a function: `slot` is what X.lookup_or_try_init() returned (NULL when the map is full,
 * counted in the counter at `full`). Returns 1 if `delta` was added. */
static __always_inline int add_or_count_full(u64 *slot, u64 delta, u32 full)
{
	if (!slot) {
		struct hw_counters *c = this_cpu_counters();
		if (c)
			(*(u64 *)((char *)c + full))++; /* per-CPU: a plain increment is safe */
		return 0;
	}
	__sync_fetch_and_add(slot, delta);
	return 1;
}

static __always_inline int is_watched(u32 tgid)
{
	u32 word = tgid / 64;
	u64 *bits = watched.lookup(&word);
	return bits && (*bits >> (tgid % 64)) & 1;
}

/* This thread's entry, created if it has none (NULL, counted by the caller, if the
 * map is full). Called for watched processes only. */
static __always_inline struct hw_thread *thread_entry(u32 tid, u32 tgid)
{
	struct hw_thread *t = threads.lookup(&tid);
	if (t) {
		t->tgid = tgid; /* the TID may have been reused by another process */
		return t;
	}
	struct hw_thread fresh = {.tgid = tgid, .write_fd = -1};
	/* A refusal kept before the process was watched still describes the thread. */
	if (refusals.lookup(&tid))
		fresh.flags = HW_THREAD_REFUSED;
	if (threads.update(&tid, &fresh))
		return 0;
	return threads.lookup(&tid);
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

/* For frequent events that nobody waits for (execs): a wakeup of the reader costs an
 * interrupt here and a wakeup of the agent per event; the record waits for its next read. */
static __always_inline void submit_event_lazily(struct hw_event *e)
{
	events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
	COUNT(events_sent);
}
