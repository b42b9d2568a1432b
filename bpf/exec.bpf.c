/* hangwatch exec probe: which processes exec'd or were renamed, so discovery
 * matches them again.
 *
 * Discovery reads a process's command line once. A process it saw between fork
 * and exec (a launcher starting the server) would keep the launcher's command
 * line forever; its comm often changes at exec, but not when python execs
 * python. So every exec, of any process (the launcher is not watched yet), marks
 * its tgid in the `changes` map, which user space takes (and empties) at each read.
 *
 * A rename (prctl(PR_SET_NAME), a write to /proc/PID/comm, and each exec too)
 * marks the renamed task's TID the same way: with both, discovery need not read
 * again a process it saw (docs/how-it-works.md). Only a main thread's name is its
 * process's comm; a TID that is no PID is left alone there.
 *
 * A map, not the ring buffer: any process can rename itself in a loop, and a mark
 * already there costs one lookup and sends nothing, so no loop can crowd out the
 * ring buffer's futex events. When the map is full (more distinct tasks changed
 * between two reads than it holds), changes_overflowed says so and discovery reads
 * every process again.
 *
 * Part of one object: follows maps.bpf.h (see there). Compiled in only where
 * the kernel has the tracepoint (-DHAVE_SCHED_PROCESS_EXEC, -DHAVE_TASK_RENAME).
 */

/* A mark already there is left as it is but for a new kind: a rename loop costs a lookup
 * and a load, no clock read and no store. Its time is the first change since the last read. */
static __always_inline void mark_changed(u32 id, u32 kind)
{
	struct hw_change *c = changes.lookup(&id);
	if (c) {
		if (!(c->kinds & kind))
			c->kinds |= kind; /* a racing mark of the other kind may be lost: both re-read */
		return;
	}
	struct hw_change fresh = {.ts_ns = bpf_ktime_get_ns(), .kinds = kind};
	if (changes.update(&id, &fresh))
		COUNT(changes_overflowed);
}

#ifdef HAVE_SCHED_PROCESS_EXEC
TRACEPOINT_PROBE(sched, sched_process_exec)
{
	/* After the exec: a thread that was not the leader now has the tgid as its TID. */
	mark_changed(bpf_get_current_pid_tgid() >> 32, HW_CHANGE_EXEC);
	return 0;
}
#endif

#ifdef HAVE_TASK_RENAME
TRACEPOINT_PROBE(task, task_rename)
{
	mark_changed(args->pid, HW_CHANGE_RENAME);
	return 0;
}
#endif
