/* hangwatch: the maps, settings and helpers that every program file shares.
 *
 * agent/sources/probe.py builds ONE BPF object from this file followed by
 * futex.bpf.c, io.bpf.c and exec.bpf.c (BPF_SOURCES there), joined as one text with
 * #line directives. They are not #included: bcc rewrites map calls such as
 * watched.lookup() only in its main file, so a map call in an included file
 * compiles to an indirect call the verifier rejects ("unknown opcode 8d").
 *
 * Settings arrive as -D compile-time constants from agent/sources/probe.py. Those it always
 * passes (WATCHED_WORDS, LONG_WAIT_NS, RINGBUF_PAGES, HOST_RINGBUF_PAGES) have no default
 * here, so each value is written in one place; the map sizes, which tests may override,
 * keep theirs.
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
#ifndef MAX_DOOR_WRITES
#define MAX_DOOR_WRITES 4096 /* (watched process, local port it accepted on) */
#endif
#ifndef MAX_ACCEPTS
#define MAX_ACCEPTS 4096
#endif
#ifndef MAX_FILE_READS
#define MAX_FILE_READS 4096 /* watched processes that read a regular file: one entry each */
#endif
/* Each watched process's share of the maps every process shares: an eighth, so one process
 * cannot fill them; beyond its share it loses its own inserts (counted in its hw_share). The
 * histogram (64 slots a process), accepts and file_reads (one entry each) cannot grow within
 * a process. */
#ifndef MAX_THREADS_PER_PROCESS
#define MAX_THREADS_PER_PROCESS (MAX_THREADS / 8)
#endif
#ifndef MAX_FD_WRITES_PER_PROCESS
#define MAX_FD_WRITES_PER_PROCESS (MAX_FD_WRITES / 8)
#endif
#ifndef MAX_DOOR_WRITES_PER_PROCESS
#define MAX_DOOR_WRITES_PER_PROCESS (MAX_DOOR_WRITES / 8)
#endif
#ifndef MAX_REFUSALS_PER_PROCESS
#define MAX_REFUSALS_PER_PROCESS (MAX_REFUSALS / 8)
#endif
#ifndef MAX_SHARES
#define MAX_SHARES 16384 /* watched processes that inserted an entry or sent an event */
#endif
/* Futex events (long waits, EDEADLK) one process may send in a second: a process that
 * refuses itself a PI lock in a loop loses its own events, not the ring buffer. */
#ifndef MAX_EVENTS_PER_PROCESS
#define MAX_EVENTS_PER_PROCESS 256
#endif
#ifndef MAX_CHANGES
#define MAX_CHANGES 8192 /* tasks exec'd or renamed between two reads, host-wide */
#endif
#ifndef LONG_WAIT_NS
#error "LONG_WAIT_NS comes from agent/sources/probe.py (agent/settings.py's LONG_WAIT_S)"
#endif
#ifndef RINGBUF_PAGES
#error "RINGBUF_PAGES comes from agent/sources/probe.py"
#endif
#ifndef HOST_RINGBUF_PAGES
#error "HOST_RINGBUF_PAGES comes from agent/sources/probe.py"
#endif

/* Bit tgid % 64 of word tgid / 64 is set for a watched process, by user space. An
 * array lookup is inlined by the JIT, so the test every program makes first costs a
 * few instructions rather than a hash helper call: what unwatched processes pay. */
BPF_ARRAY(watched, u64, WATCHED_WORDS);
BPF_PERCPU_ARRAY(counters, struct hw_counters, 1);
/* Watched processes' futex events only: nothing another process does can fill it. */
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);                     /* struct hw_event */
BPF_RINGBUF_OUTPUT(host_events, HOST_RINGBUF_PAGES);           /* bind, listen: any process */
BPF_HASH(shares, u32, struct hw_share, MAX_SHARES);            /* tgid -> held, lost */
BPF_HASH(released, u32, struct hw_released, MAX_SHARES);       /* tgid -> deleted by user space */
BPF_HASH(changes, u32, struct hw_change, MAX_CHANGES);         /* tgid or TID -> exec'd, renamed */

/* futex.bpf.c */
BPF_HASH(threads, u32, struct hw_thread, MAX_THREADS);         /* tid -> wait, write in progress */
BPF_TABLE("lru_hash", u32, struct hw_pi_op, pi_ops, MAX_PI_OPS); /* tid -> last PI operation */
BPF_HASH(refusals, u32, struct hw_refusal, MAX_REFUSALS);      /* tid -> refused PI lock */
BPF_HASH(wait_hist, struct hw_hist_key, u64, MAX_HIST);        /* (tgid, log2 ns) -> count */

/* io.bpf.c */
BPF_HASH(sock_calls, u64, struct hw_sock_call, MAX_SOCK_CALLS); /* pid_tgid -> bind/listen */
BPF_HASH(fd_writes, struct hw_fd_key, struct hw_fd_writes, MAX_FD_WRITES);
BPF_HASH(accepts, u32, u64, MAX_ACCEPTS);                       /* tgid -> accepts */
BPF_HASH(file_reads, u32, u64, MAX_FILE_READS);                 /* tgid -> bytes read from files */
BPF_HASH(door_writes, struct hw_port_key, struct hw_port_writes, MAX_DOOR_WRITES);

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

/* A watched process's share (created at its first insert or event), or NULL, counted. */
static __always_inline struct hw_share *share_of(u32 tgid)
{
	struct hw_share zero = {};
	struct hw_share *s = shares.lookup_or_try_init(&tgid, &zero);
	if (!s)
		COUNT(shares_full);
	return s;
}

/* Which field of struct hw_share (and of struct hw_released) claim() counts in. */
#define SHARE(field) __builtin_offsetof(struct hw_share, field)
#define RELEASED(field) __builtin_offsetof(struct hw_released, field)
#define NOT_RELEASED 0xffffffff /* fd_writes: user space deletes them only with the share */

/* Takes one entry of `tgid`'s share of a shared map before it inserts one: 1 if it may,
 * 0 (counted against the process) if it holds `quota` already. `held` and `freed` are
 * offsets of the counts in struct hw_share and struct hw_released. Two CPUs inserting at
 * once may both pass: the share is exceeded by at most the CPUs, never without bound.
 * Only a first insert (a new thread, a new fd) pays this. */
static __always_inline int claim(u32 tgid, u32 held, u32 freed, u32 quota)
{
	struct hw_share *s = share_of(tgid);
	if (!s)
		return 0;
	u32 gone = 0;
	if (freed != NOT_RELEASED) {
		struct hw_released *r = released.lookup(&tgid);
		if (r)
			gone = *(u32 *)((char *)r + freed);
	}
	u32 *n = (u32 *)((char *)s + held);
	/* Signed: a TID reused by another process may leave a count below what was released. */
	if ((s32)(*n - gone) >= (s32)quota) {
		__sync_fetch_and_add(&s->refused, 1);
		return 0;
	}
	__sync_fetch_and_add(n, 1);
	return 1;
}

/* Gives back what claim() took, when the insert that followed failed (the map full). */
static __always_inline void unclaim(u32 tgid, u32 held)
{
	struct hw_share *s = shares.lookup(&tgid);
	if (s)
		__sync_fetch_and_add((u32 *)((char *)s + held), -1);
}

/* Keeps a refusal of a watched thread, within its process's share. Returns 1 if kept. */
static __always_inline int keep_refusal(u32 tid, struct hw_refusal *r)
{
	struct hw_refusal *old = refusals.lookup(&tid);
	if (old) {
		*old = *r; /* the thread's entry already counted: replaced, not claimed again */
		return 1;
	}
	if (!claim(r->tgid, SHARE(refusals), RELEASED(refusals), MAX_REFUSALS_PER_PROCESS))
		return 0;
	if (refusals.update(&tid, r) == 0)
		return 1;
	unclaim(r->tgid, SHARE(refusals));
	COUNT(refusals_full);
	return 0;
}

/* This thread's entry, created if it has none; NULL if the map is full (counted in the
 * counter at offset `full`) or its process holds its share (counted against the process).
 * Called for watched processes only. */
static __always_inline struct hw_thread *thread_entry(u32 tid, u32 tgid, u32 full)
{
	struct hw_thread *t = threads.lookup(&tid);
	if (t) {
		t->tgid = tgid; /* the TID may have been reused by another process */
		return t;
	}
	if (!claim(tgid, SHARE(threads), RELEASED(threads), MAX_THREADS_PER_PROCESS))
		return 0;
	struct hw_thread fresh = {.tgid = tgid, .write_fd = -1};
	/* A refusal kept before the process was watched (in pi_ops) still describes the
	 * thread: it moves to the refusals map, where the thread's next wait deletes it. */
	struct hw_pi_op *op = pi_ops.lookup(&tid);
	if (op && op->refused_ns && op->tgid == tgid) {
		struct hw_refusal r = {.ts_ns = op->refused_ns, .uaddr = op->uaddr, .tgid = tgid};
		op->refused_ns = 0;
		if (keep_refusal(tid, &r))
			fresh.flags = HW_THREAD_REFUSED;
	}
	if (threads.update(&tid, &fresh)) {
		unclaim(tgid, SHARE(threads));
		struct hw_counters *c = this_cpu_counters();
		if (c)
			(*(u64 *)((char *)c + full))++; /* per-CPU: a plain increment is safe */
		return 0;
	}
	return threads.lookup(&tid);
}

/* Whether a watched process may send one more futex event now (at most
 * MAX_EVENTS_PER_PROCESS a second); one it may not is counted against it. */
static __always_inline struct hw_share *event_allowed(u32 tgid, u64 now)
{
	struct hw_share *s = share_of(tgid);
	if (!s)
		return 0;
	if (now - s->window_ns >= 1000000000ULL) {
		s->window_ns = now; /* racing CPUs may each start a window: a few events more */
		s->window_events = 0;
	}
	if (s->window_events >= MAX_EVENTS_PER_PROCESS) {
		__sync_fetch_and_add(&s->events_dropped, 1);
		return 0;
	}
	__sync_fetch_and_add(&s->window_events, 1);
	return s;
}

/* A reserved event, zeroed (the ring's memory is not) and stamped with who and when. */
static __always_inline struct hw_event *fill_event(struct hw_event *e, u64 ts, u32 kind,
						   u32 tgid, u32 tid)
{
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = ts;
	e->kind = kind;
	e->tgid = tgid;
	e->tid = tid;
	return e;
}

/* A zeroed record of a watched process's futex event (reserved memory is not zeroed), or
 * NULL, counted against the process (and in events_dropped where the ring was full).
 * The only reserve of `events`: bcc takes the record type from it. */
static __always_inline struct hw_event *reserve_event(u32 kind, u32 tgid, u32 tid, u64 now)
{
	struct hw_share *s = event_allowed(tgid, now);
	if (!s)
		return 0;
	struct hw_event *e = events.ringbuf_reserve(sizeof(struct hw_event));
	if (!e) {
		__sync_fetch_and_add(&s->events_dropped, 1);
		COUNT(events_dropped);
		return 0;
	}
	return fill_event(e, now, kind, tgid, tid);
}

static __always_inline void submit_event(struct hw_event *e)
{
	events.ringbuf_submit(e, 0);
	COUNT(events_sent);
}

/* The same for bind and listen events, of any process, in their own ring buffer: a
 * listen() loop fills that one, never the one of watched processes' futex events. */
static __always_inline struct hw_event *reserve_host_event(u32 kind, u32 tgid, u32 tid)
{
	struct hw_event *e = host_events.ringbuf_reserve(sizeof(struct hw_event));
	if (!e) {
		COUNT(host_events_dropped);
		return 0;
	}
	return fill_event(e, bpf_ktime_get_ns(), kind, tgid, tid);
}

static __always_inline void submit_host_event(struct hw_event *e)
{
	host_events.ringbuf_submit(e, 0);
	COUNT(events_sent);
}
