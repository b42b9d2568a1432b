/* hangwatch socket and write probes: serving and progress signals.
 *
 * bind, listen (every process; rare): the arguments are kept per thread at
 *   sys_enter in sock_calls, and a successful call becomes one ring-buffer
 *   event at sys_exit. Only AF_INET/AF_INET6 binds are kept.
 * accept, accept4 (watched processes): successful calls counted per tgid in
 *   accepts, at sys_exit only: a blocked accept is already visible in /proc.
 * write, writev, pwrite64, and the calls that answer over a socket or copy into
 *   an fd without write(2): sendto (send(2) on x86-64 and arm64 is sendto),
 *   sendmsg, sendmmsg, sendfile64, splice (watched processes): the fd written is
 *   kept in the thread's entry in `threads` at sys_enter; at sys_exit the bytes
 *   written, the call and its time go to fd_writes[(tgid, fd)]. sendmmsg returns
 *   messages, not bytes: each message counts as one byte (the count says only that
 *   something was sent). Unwatched processes pay one inlined bitmap test at each
 *   end.
 *
 * Part of one object: follows maps.bpf.h (see there). Each tracepoint pair is
 * compiled in only when agent/probe.py found it (-DHAVE_*).
 */

#define SOCKADDR_IN_LEN 16

static __always_inline int sock_call_enter(struct hw_sock_call *call)
{
	u64 id = bpf_get_current_pid_tgid();
	if (sock_calls.update(&id, call))
		COUNT(sock_calls_full);
	return 0;
}

static __always_inline int sock_call_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	struct hw_sock_call *call = sock_calls.lookup(&id);
	if (!call)
		return 0; /* another family, entered before attach, or sock_calls was full */
	struct hw_sock_call c = *call;
	sock_calls.delete(&id);
	if (ret != 0)
		return 0;

	struct hw_event *e = reserve_event(c.kind, id >> 32, (u32)id, bpf_ktime_get_ns());
	if (!e)
		return 0;
	e->fd = c.fd;
	e->family = c.family;
	e->port = c.port;
	e->backlog = c.backlog;
	submit_event(e);
	return 0;
}

static __always_inline u32 port_from_be(u16 be)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	return __builtin_bswap16(be);
#else
	return be;
#endif
}

/* Counts a successful write of `ret` bytes by this thread, if its fd was kept at sys_enter. */
static __always_inline int write_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_watched(tgid))
		return 0;
	u32 tid = (u32)id;
	struct hw_thread *t = threads.lookup(&tid);
	if (!t || !(t->flags & HW_THREAD_WRITING))
		return 0; /* entered before the process was watched */
	t->flags &= ~HW_THREAD_WRITING;
	if (ret <= 0)
		return 0;

	struct hw_fd_key key = {.tgid = tgid, .fd = t->write_fd};
	struct hw_fd_writes zero = {};
	struct hw_fd_writes *st = fd_writes.lookup_or_try_init(&key, &zero);
	if (!add_or_count_full(st ? &st->bytes : 0, ret, COUNTER(fd_writes_full)))
		return 0;
	__sync_fetch_and_add(&st->calls, 1);
	st->last_ns = bpf_ktime_get_ns(); /* a racing writer may store an older time: harmless */
	return 0;
}

static __always_inline int write_enter(s32 fd)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_watched(tgid))
		return 0;
	struct hw_thread *t = thread_entry((u32)id, tgid);
	if (!t) {
		COUNT(write_calls_full);
		return 0;
	}
	t->write_fd = fd;
	t->flags |= HW_THREAD_WRITING;
	return 0;
}

static __always_inline int accept_exit(long ret)
{
	if (ret < 0)
		return 0; /* EAGAIN from a non-blocking accept is the common case: no map access */
	u32 tgid = bpf_get_current_pid_tgid() >> 32;
	if (!is_watched(tgid))
		return 0;
	u64 zero = 0;
	add_or_count_full(accepts.lookup_or_try_init(&tgid, &zero), 1, COUNTER(accepts_full));
	return 0;
}

#ifdef HAVE_BIND
TRACEPOINT_PROBE(syscalls, sys_enter_bind)
{
	/* The kernel refuses an AF_INET/AF_INET6 bind shorter than sockaddr_in, so
	 * this skips unix autobinds (2 bytes) and netlink (12) without a user read. */
	if (args->addrlen < SOCKADDR_IN_LEN)
		return 0;
	struct hw_sock_call c = {.kind = HW_EVENT_BIND, .fd = (s32)args->fd};
	/* sockaddr_in and sockaddr_in6 both start with u16 family, then the port (big-endian). */
	u16 head[2] = {};
	if (bpf_probe_read_user(head, sizeof(head), (void *)args->umyaddr)) {
		COUNT(bind_unreadable);
		return sock_call_enter(&c); /* reported with family 0: a port may be bound */
	}
	if (head[0] != HW_AF_INET && head[0] != HW_AF_INET6)
		return 0; /* unix, netlink, ...: not a port anyone connects to over TCP/UDP */
	c.family = head[0];
	c.port = port_from_be(head[1]);
	return sock_call_enter(&c);
}

TRACEPOINT_PROBE(syscalls, sys_exit_bind)
{
	return sock_call_exit(args->ret);
}
#endif

#ifdef HAVE_LISTEN
TRACEPOINT_PROBE(syscalls, sys_enter_listen)
{
	struct hw_sock_call c = {
		.kind = HW_EVENT_LISTEN, .fd = (s32)args->fd, .backlog = (s32)args->backlog};
	return sock_call_enter(&c);
}

TRACEPOINT_PROBE(syscalls, sys_exit_listen)
{
	return sock_call_exit(args->ret);
}
#endif

#ifdef HAVE_ACCEPT
TRACEPOINT_PROBE(syscalls, sys_exit_accept)
{
	return accept_exit(args->ret);
}
#endif

#ifdef HAVE_ACCEPT4
TRACEPOINT_PROBE(syscalls, sys_exit_accept4)
{
	return accept_exit(args->ret);
}
#endif

#ifdef HAVE_WRITE
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
	return write_enter((s32)args->fd);
}

TRACEPOINT_PROBE(syscalls, sys_exit_write)
{
	return write_exit(args->ret);
}
#endif

#ifdef HAVE_WRITEV
TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
	return write_enter((s32)args->fd);
}

TRACEPOINT_PROBE(syscalls, sys_exit_writev)
{
	return write_exit(args->ret);
}
#endif

#ifdef HAVE_PWRITE64
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64)
{
	return write_enter((s32)args->fd);
}

TRACEPOINT_PROBE(syscalls, sys_exit_pwrite64)
{
	return write_exit(args->ret);
}
#endif

/* The calls below write to one fd as write(2) does; only the argument naming it differs. */
#define WRITE_PAIR(name, fdarg)                                                       \
	TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return write_enter((s32)args->fdarg); } \
	TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return write_exit(args->ret); }

#ifdef HAVE_SENDTO
WRITE_PAIR(sendto, fd)
#endif
#ifdef HAVE_SENDMSG
WRITE_PAIR(sendmsg, fd)
#endif
#ifdef HAVE_SENDMMSG
WRITE_PAIR(sendmmsg, fd)
#endif
#ifdef HAVE_SENDFILE64
WRITE_PAIR(sendfile64, out_fd)
#endif
#ifdef HAVE_SPLICE
WRITE_PAIR(splice, fd_out)
#endif
