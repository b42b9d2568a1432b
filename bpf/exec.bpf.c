/* hangwatch exec probe: which processes exec'd or were renamed, so discovery
 * matches them again.
 *
 * Discovery reads a process's command line once. A process it saw between fork
 * and exec (a launcher starting the server) would keep the launcher's command
 * line forever; its comm often changes at exec, but not when python execs
 * python. So every exec, of any process (the launcher is not watched yet), is
 * one ring-buffer event with its tgid, submitted without waking the reader: a
 * wakeup per exec cost 20 times the rest of this program and woke the agent at
 * every exec (docs/how-it-works.md); user space takes the events at its next read.
 *
 * A rename (prctl(PR_SET_NAME), a write to /proc/PID/comm, and each exec too)
 * is an event too, naming the renamed task's TID: with both, discovery
 * need not read again a process it saw (docs/how-it-works.md). Only a main
 * thread's name is its process's comm; a TID that is no PID is left alone there.
 *
 * Part of one object: follows maps.bpf.h (see there). Compiled in only where
 * the kernel has the tracepoint (-DHAVE_SCHED_PROCESS_EXEC, -DHAVE_TASK_RENAME).
 */

#ifdef HAVE_SCHED_PROCESS_EXEC
TRACEPOINT_PROBE(sched, sched_process_exec)
{
	/* After the exec: a thread that was not the leader now has the tgid as its TID. */
	u64 id = bpf_get_current_pid_tgid();
	struct hw_event *e = reserve_event(HW_EVENT_EXEC, id >> 32, (u32)id, bpf_ktime_get_ns());
	if (e)
		submit_event_lazily(e);
	return 0;
}
#endif

#ifdef HAVE_TASK_RENAME
TRACEPOINT_PROBE(task, task_rename)
{
	struct hw_event *e = reserve_event(HW_EVENT_RENAME, args->pid, args->pid, bpf_ktime_get_ns());
	if (e)
		submit_event_lazily(e);
	return 0;
}
#endif
