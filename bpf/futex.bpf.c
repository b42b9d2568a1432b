/* hangwatch futex probe: who waits on which futex word, now.
 *
 * For watched processes, each futex wait (WAIT, WAIT_BITSET, LOCK_PI,
 * LOCK_PI2, WAIT_REQUEUE_PI, futex_wait, futex_waitv) gets one in-flight entry
 * per thread at sys_enter, removed at sys_exit into a per-process log2
 * histogram of wait time. Waits longer than LONG_WAIT_NS and every EDEADLK
 * from a PI lock go to the ring buffer. Wake ops return before any map access.
 *
 * A PI lock of an unwatched process gets a minimal entry flagged
 * HW_WAIT_EDEADLK_ONLY, so that a cycle the kernel refuses is known even if
 * it formed before discovery reached the process; it feeds nothing else.
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

static __always_inline void init_wait(struct hw_wait *w, u64 uaddr, u32 tgid, u32 cmd, u32 val,
				      u32 syscall)
{
	w->start_ns = bpf_ktime_get_ns();
	w->uaddr = uaddr;
	w->tgid = tgid;
	w->op = cmd;
	w->val = val;
	w->syscall = syscall;
}

/* Only the EDEADLK of this lock will be reported: no user reads, no histogram. */
static __always_inline int pi_enter_unwatched(u32 tid, u32 tgid, u64 uaddr, u32 cmd, u32 val)
{
	struct hw_wait w = {};
	init_wait(&w, uaddr, tgid, cmd, val, HW_SYSCALL_FUTEX);
	w.flags = HW_WAIT_EDEADLK_ONLY;
	if (inflight.update(&tid, &w))
		COUNT(inflight_full);
	return 0;
}

static __always_inline int wait_enter(u64 uaddr, u32 cmd, u32 val, u32 syscall)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	u32 tid = (u32)id;

	if (!is_watched(tgid))
		return is_pi_lock(cmd) ? pi_enter_unwatched(tid, tgid, uaddr, cmd, val) : 0;

	struct hw_wait w = {};
	init_wait(&w, uaddr, tgid, cmd, val, syscall);
	int err = bpf_probe_read_user(&w.word, sizeof(w.word), (void *)uaddr);
	/* The owner hint only means something for glibc mutexes (plain waits);
	 * a PI word carries its owner itself. */
	if (!err && !is_pi_lock(cmd))
		err = bpf_probe_read_user(&w.owner_hint, sizeof(w.owner_hint), (void *)(uaddr + 8));
	w.read_ok = err == 0;

	if (inflight.update(&tid, &w))
		COUNT(inflight_full);
	else
		COUNT(waits_started);
	return 0;
}

static __always_inline void send_wait_event(u32 kind, struct hw_wait *w, u32 tid, u64 now,
					    u64 dur, long ret)
{
	struct hw_event *e = reserve_event(kind, w->tgid, tid, now);
	if (!e)
		return;
	e->uaddr = w->uaddr;
	e->duration_ns = dur;
	e->op = w->op;
	e->ret = ret;
	submit_event(e);
}

static __always_inline int wait_exit(long ret)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct hw_wait *w = inflight.lookup(&tid);
	if (!w)
		return 0; /* not watched, not a wait, or not tracked */

	u64 now = bpf_ktime_get_ns();
	u64 dur = now - w->start_ns;
	int watched_wait = !(w->flags & HW_WAIT_EDEADLK_ONLY);

	if (watched_wait) {
		struct hw_hist_key key = {.tgid = w->tgid, .slot = bpf_log2l(dur)};
		u64 zero = 0;
		u64 *n = wait_hist.lookup_or_try_init(&key, &zero);
		if (n)
			__sync_fetch_and_add(n, 1);
		else
			COUNT(hist_full);
	}

	/* Any wait that ends means an earlier refusal no longer describes the thread. */
	refusals.delete(&tid);

	if (is_pi_lock(w->op) && ret == -HW_EDEADLK) {
		struct hw_refusal r = {.ts_ns = now, .uaddr = w->uaddr, .tgid = w->tgid};
		if (refusals.update(&tid, &r))
			COUNT(refusals_full);
		send_wait_event(HW_EVENT_EDEADLK, w, tid, now, dur, ret);
	} else if (watched_wait && dur >= LONG_WAIT_NS) {
		send_wait_event(HW_EVENT_LONG_WAIT, w, tid, now, dur, ret);
	}

	inflight.delete(&tid);
	if (watched_wait)
		COUNT(waits_ended);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_futex)
{
	u32 cmd = args->op & HW_FUTEX_CMD_MASK;
	if (!is_wait_cmd(cmd))
		return 0;
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
