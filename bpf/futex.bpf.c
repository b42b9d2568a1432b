/* hangwatch futex probe: who waits on which futex word, now.
 *
 * For watched processes, each futex wait (WAIT, WAIT_BITSET, LOCK_PI,
 * LOCK_PI2, WAIT_REQUEUE_PI, futex_wait, futex_waitv) marks the thread's entry
 * in `threads` as waiting at sys_enter, with the word, op and start time; at
 * sys_exit the mark is cleared and the wait time goes to a per-process log2
 * histogram. A wait that began before the process was watched is marked by user space
 * (HW_THREAD_SEEDED, set where /proc showed it) and the mark is cleared at its sys_exit, in
 * the lookup that exit makes anyway, so that such a wait costs user space no read a tick.
 * Waits longer than LONG_WAIT_NS and every EDEADLK of a PI lock go
 * to the ring buffer. No user memory is read: the verdict re-reads lock words
 * from /proc/PID/mem for the few threads that stay parked.
 *
 * Cost is what this file is shaped by (docs/performance.md): unwatched
 * processes pay one inlined bitmap test per call; wake ops return before any
 * map access; a watched wait costs one hash lookup at each end, plus the
 * histogram's, and a clock read at each end but for a wait refused at once.
 *
 * PI operations (rare: PI mutexes only) of every process record their word in
 * the LRU map pi_ops, so that a cycle the kernel refuses with EDEADLK is known
 * even if it formed before discovery reached the process: an unwatched thread's
 * refusal is marked there, where nobody can fill a map for others; a watched
 * thread's goes to `refusals` and the ring buffer, within its process's share.
 *
 * Part of one object: follows maps.bpf.h (see there).
 */

static __always_inline int is_wait_cmd(u32 cmd)
{
	return cmd == HW_FUTEX_WAIT || cmd == HW_FUTEX_WAIT_BITSET || cmd == HW_FUTEX_LOCK_PI ||
	       cmd == HW_FUTEX_LOCK_PI2 || cmd == HW_FUTEX_WAIT_REQUEUE_PI;
}

static __always_inline int is_pi_lock(u32 cmd)
{
	return cmd == HW_FUTEX_LOCK_PI || cmd == HW_FUTEX_LOCK_PI2;
}

/* The operations that can return EDEADLK. */
static __always_inline int is_pi_op(u32 cmd)
{
	return is_pi_lock(cmd) || cmd == HW_FUTEX_TRYLOCK_PI || cmd == HW_FUTEX_WAIT_REQUEUE_PI ||
	       cmd == HW_FUTEX_CMP_REQUEUE_PI;
}

static __always_inline void pi_op_enter(u32 tid, u32 tgid, u64 uaddr, u32 cmd)
{
	struct hw_pi_op op = {.start_ns = bpf_ktime_get_ns(), .uaddr = uaddr, .tgid = tgid, .op = cmd};
	/* (refused_ns 0: a refusal this thread had no longer describes it) */
	pi_ops.update(&tid, &op); /* LRU: evicts the oldest rather than failing */
}

static __always_inline int wait_enter(u64 uaddr, u32 cmd, u32 val, u32 syscall)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	u32 tid = (u32)id;

	if (syscall == HW_SYSCALL_FUTEX && is_pi_op(cmd))
		pi_op_enter(tid, tgid, uaddr, cmd);
	if (!is_wait_cmd(cmd) || !is_watched(tgid))
		return 0;

	struct hw_thread *t = thread_entry(tid, tgid, COUNTER(inflight_full));
	if (!t)
		return 0;
	t->start_ns = bpf_ktime_get_ns();
	t->uaddr = uaddr;
	t->op = cmd;
	t->val = val;
	t->syscall = syscall;
	t->flags |= HW_THREAD_WAITING;
	COUNT(waits_started);
	return 0;
}

static __always_inline void send_wait_event(u32 kind, u32 tgid, u32 tid, u64 uaddr, u32 op,
					    u64 now, u64 dur, long ret)
{
	struct hw_event *e = reserve_event(kind, tgid, tid, now);
	if (!e)
		return;
	e->uaddr = uaddr;
	e->duration_ns = dur;
	e->op = op;
	e->ret = ret;
	submit_event(e);
}

/* An EDEADLK (rare) of a watched thread: keep the refused lock for the thread and report
 * it. Returns 1 if kept. */
static __always_inline int refused(u32 tid, u32 tgid, u64 now)
{
	struct hw_pi_op *op = pi_ops.lookup(&tid);
	if (!op || !is_pi_lock(op->op))
		return 0; /* a trylock or requeue refused: no thread blocks on it */
	struct hw_refusal r = {.ts_ns = now, .uaddr = op->uaddr, .tgid = tgid};
	int kept = keep_refusal(tid, &r);
	send_wait_event(HW_EVENT_EDEADLK, tgid, tid, op->uaddr, op->op, now, now - op->start_ns,
			-HW_EDEADLK);
	return kept;
}

/* An EDEADLK of an unwatched thread: marked in its pi_ops entry only (an LRU map: a
 * process that refuses itself locks in a loop evicts old entries, never refuses others'). */
static __always_inline void refused_unwatched(u32 tid)
{
	struct hw_pi_op *op = pi_ops.lookup(&tid);
	if (op && is_pi_lock(op->op))
		op->refused_ns = bpf_ktime_get_ns();
}

static __always_inline int wait_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	u32 tid = (u32)id;

	if (!is_watched(tgid)) {
		if (ret == -HW_EDEADLK)
			refused_unwatched(tid);
		return 0;
	}
	struct hw_thread *t = threads.lookup(&tid);
	if (!t || !(t->flags & HW_THREAD_WAITING)) {
		/* A wait seen from /proc ended (or a wake op after it): no write where none is
		 * needed, so a wake op does not dirty the entry's cache line. */
		if (t && (t->flags & HW_THREAD_SEEDED))
			t->flags &= ~HW_THREAD_SEEDED;
		if (ret == -HW_EDEADLK && refused(tid, tgid, bpf_ktime_get_ns()) && t)
			t->flags |= HW_THREAD_REFUSED;
		return 0; /* a wake op, or a wait that began before the process was watched */
	}

	t->flags &= ~(HW_THREAD_WAITING | HW_THREAD_SEEDED); /* one mask, as cheap as one */
	/* A wait refused at once (the word had changed: a contended lock's usual case) never
	 * slept: it goes to the first slot without a clock read, a third of what a watched
	 * wait that returns at once costs here (docs/performance.md). */
	u64 now = 0, dur = 0;
	if (ret != -HW_EAGAIN) {
		now = bpf_ktime_get_ns();
		dur = now - t->start_ns;
	}

	struct hw_hist_key key = {.tgid = tgid, .slot = dur ? bpf_log2l(dur) : 0};
	u64 zero = 0;
	add_or_count_full(wait_hist.lookup_or_try_init(&key, &zero), 1, COUNTER(hist_full));

	/* Any wait that ends means an earlier refusal no longer describes the thread. */
	if (t->flags & HW_THREAD_REFUSED) {
		if (refusals.delete(&tid) == 0)
			unclaim(tgid, SHARE(refusals));
		t->flags &= ~HW_THREAD_REFUSED;
	}
	if (ret == -HW_EDEADLK) {
		if (refused(tid, tgid, now))
			t->flags |= HW_THREAD_REFUSED;
	} else if (dur >= LONG_WAIT_NS) {
		send_wait_event(HW_EVENT_LONG_WAIT, tgid, tid, t->uaddr, t->op, now, dur, ret);
	}
	COUNT(waits_ended);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_futex)
{
	u32 cmd = args->op & HW_FUTEX_CMD_MASK;
	if (!is_wait_cmd(cmd) && !is_pi_op(cmd))
		return 0; /* wakes, requeues, unlocks: most futex calls end here */
	return wait_enter((u64)args->uaddr, cmd, (u32)args->val, HW_SYSCALL_FUTEX);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex)
{
	return wait_exit(args->ret);
}

#ifdef HAVE_FUTEX_WAIT
TRACEPOINT_PROBE(syscalls, sys_enter_futex_wait)
{
	return wait_enter((u64)args->uaddr, HW_FUTEX_WAIT_BITSET, (u32)args->val,
			  HW_SYSCALL_FUTEX_WAIT);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex_wait)
{
	return wait_exit(args->ret);
}
#endif

#ifdef HAVE_FUTEX_WAITV
TRACEPOINT_PROBE(syscalls, sys_enter_futex_waitv)
{
	/* struct futex_waitv { u64 val; u64 uaddr; u32 flags; u32 __reserved; }:
	 * record the first word; a vector wait never yields an owner edge. */
	if (!is_watched(bpf_get_current_pid_tgid() >> 32))
		return 0; /* before the user read: not a PI op, nothing else to record */
	u64 first[2] = {};
	if (bpf_probe_read_user(first, sizeof(first), (void *)args->waiters))
		return 0;
	return wait_enter(first[1], HW_FUTEX_WAIT, (u32)first[0], HW_SYSCALL_FUTEX_WAITV);
}

TRACEPOINT_PROBE(syscalls, sys_exit_futex_waitv)
{
	return wait_exit(args->ret);
}
#endif
