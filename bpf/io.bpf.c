/* hangwatch socket and write probes: serving and progress signals.
 *
 * bind, listen (every process; rare): the arguments are kept per thread at
 *   sys_enter in sock_calls, and a successful call becomes one ring-buffer
 *   event at sys_exit. Only AF_INET/AF_INET6 binds are kept.
 * accept, accept4 (watched processes): successful calls counted per tgid in
 *   accepts, at sys_exit only: a blocked accept is already visible in /proc. The
 *   accepted fd's local port (a TCP socket's) gets an entry in door_writes, within the
 *   process's share of that map: the ports it serves on.
 * write, writev, pwrite64, and the calls that answer over a socket or copy into
 *   an fd without write(2): sendto (send(2) on x86-64 and arm64 is sendto),
 *   sendmsg, sendmmsg, sendfile64, splice (watched processes): the fd written is
 *   kept in the thread's entry in `threads` at sys_enter; at sys_exit the bytes
 *   written, the call and its time go to fd_writes[(tgid, fd)], a new fd within
 *   the process's share of that map (maps.bpf.h). sendmmsg returns
 *   messages, not bytes: each message counts as one byte (the count says only that
 *   something was sent). A write to a TCP socket whose local port has an entry in
 *   door_writes (a connection accepted there) is also counted in that entry, and in
 *   the fd's door_bytes: the kernel names the fd at write time, so an answer on a
 *   connection closed at once is placed all the same. Unwatched processes pay one
 *   inlined bitmap test at each end.
 *
 * read, pread64, readv, preadv, preadv2 (watched processes): bytes read from regular
 *   files of storage per tgid in file_reads; see the comment above read_enter.
 *
 * Part of one object: follows maps.bpf.h (see there). Each tracepoint pair is
 * compiled in only when agent/sources/probe.py found it (-DHAVE_*).
 */

#define SOCKADDR_IN_LEN 16
#define HW_S_IFMT 00170000
#define HW_S_IFSOCK 0140000
#define HW_S_IFREG 0100000
#define HW_IPPROTO_TCP 6

/* One kernel pointer at `base + off`, or 0 where it cannot be read. */
static __always_inline u64 kernel_ptr(u64 base, u32 off)
{
	u64 p = 0;
	if (!base || bpf_probe_read_kernel(&p, sizeof(p), (void *)(base + off)))
		return 0;
	return p;
}

#ifdef HAVE_FD_WALK
/* The file behind the calling thread's fd `fd` and its inode's mode (in *mode), or 0: the fd
 * table walked as the kernel holds it now (task->files->fdt->fd[fd], the fd checked against
 * max_fds, the file's inode), every read bounded and checked. The members' offsets are the
 * running kernel's, read from its BTF by agent/sources/btf.py: no header tree need match the
 * kernel. Shared by the write probe (what a write's fd is) and the read probe (whether a
 * read's fd is a file of storage). */
static __always_inline u64 fd_file(s64 fd, u64 *inode, u16 *mode)
{
	u64 fdt = kernel_ptr(kernel_ptr(bpf_get_current_task(), HW_OFF_TASK_FILES),
			     HW_OFF_FILES_FDT);
	u32 max_fds = 0;
	if (fd < 0 || !fdt ||
	    bpf_probe_read_kernel(&max_fds, sizeof(max_fds), (void *)(fdt + HW_OFF_FDT_MAX_FDS)) ||
	    fd >= max_fds)
		return 0;
	u64 file = kernel_ptr(kernel_ptr(fdt, HW_OFF_FDT_FD), (u32)fd * sizeof(u64));
	*inode = kernel_ptr(file, HW_OFF_FILE_INODE);
	if (!*inode || bpf_probe_read_kernel(mode, sizeof(*mode), (void *)(*inode + HW_OFF_INODE_MODE)))
		return 0;
	return file;
}
#endif

/* The local port of the calling thread's fd `fd` if it is a TCP socket (AF_INET/AF_INET6),
 * else 0; in *is_unix whether it is a unix socket, in *file_ino a regular file's inode
 * number (fd_file's walk, then file->private_data's socket and its sock). */
static __always_inline u32 fd_socket(s32 fd, u32 *is_unix, u64 *file_ino)
{
#ifdef HAVE_FD_WALK
	u64 inode = 0;
	u16 mode = 0;
	u64 file = fd_file(fd, &inode, &mode);
	if (!file)
		return 0;
	if ((mode & HW_S_IFMT) == HW_S_IFREG) {
		*file_ino = kernel_ptr(inode, HW_OFF_INODE_INO); /* an unsigned long, as a pointer */
		return 0;
	}
	if ((mode & HW_S_IFMT) != HW_S_IFSOCK)
		return 0;
	u64 sk = kernel_ptr(kernel_ptr(file, HW_OFF_FILE_PRIVATE), HW_OFF_SOCKET_SK);
	u16 family = 0, protocol = 0, port = 0;
	if (!sk || bpf_probe_read_kernel(&family, sizeof(family), (void *)(sk + HW_OFF_SK_FAMILY)))
		return 0;
	*is_unix = family == HW_AF_UNIX;
	if ((family != HW_AF_INET && family != HW_AF_INET6) ||
	    bpf_probe_read_kernel(&protocol, sizeof(protocol), (void *)(sk + HW_OFF_SK_PROTOCOL)) ||
	    protocol != HW_IPPROTO_TCP ||
	    bpf_probe_read_kernel(&port, sizeof(port), (void *)(sk + HW_OFF_SK_NUM)))
		return 0;
	return port;
#else
	return 0; /* no BTF: fds are named by user space only, as before */
#endif
}

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

	struct hw_event *e = reserve_host_event(c.kind, id >> 32, (u32)id);
	if (!e)
		return 0;
	e->fd = c.fd;
	e->family = c.family;
	e->port = c.port;
	e->backlog = c.backlog;
	submit_host_event(e);
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

/* Keeps the last bytes of a write that succeeded: from its buffer's start and `ret` for a
 * plain buffer, from the end of its last iovec for a vectored call (a partial vectored write
 * then shows the end of what it meant to send; rare on sockets, and harmless: only the
 * ending of HTTP answers is read from it). */
static __always_inline void keep_tail(struct hw_fd_writes *st, struct hw_thread *t, long ret)
{
	u64 end = t->write_buf;
	if (!t->write_last_len)
		end += ret; /* a plain buffer */
	else if (t->write_last_len < ret)
		ret = t->write_last_len; /* the bytes of the last iovec only */
	u32 n;
	long err;
	if (!t->write_buf || end < HW_TAIL_LEN || ret <= 0) {
		st->tail_len = 0;
		return;
	}
	if (ret >= HW_TAIL_LEN) {
		n = HW_TAIL_LEN;
		err = bpf_probe_read_user(st->tail, HW_TAIL_LEN, (void *)(end - HW_TAIL_LEN));
	} else {
		n = (u32)ret & (HW_TAIL_LEN - 1); /* 1..15: a bound the verifier can see */
		err = bpf_probe_read_user(st->tail, n, (void *)(end - n));
	}
	st->tail_len = err ? 0 : n;
}

/* At a sys_exit: the calling thread's entry if its sys_enter marked it with `flag` (now
 * cleared), else NULL (an unwatched process, a call the enter program left alone, or one
 * entered before the process was watched). */
static __always_inline struct hw_thread *leave_marked(u64 id, u32 flag)
{
	if (!is_watched(id >> 32))
		return 0;
	u32 tid = (u32)id;
	struct hw_thread *t = threads.lookup(&tid);
	if (!t || !(t->flags & flag))
		return 0;
	t->flags &= ~flag;
	return t;
}

/* Counts a successful write of `ret` bytes by this thread, if its fd was kept at sys_enter. */
static __always_inline int write_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	struct hw_thread *t = leave_marked(id, HW_THREAD_WRITING);
	if (!t || ret <= 0)
		return 0;

	struct hw_fd_key key = {.tgid = tgid, .fd = t->write_fd};
	struct hw_fd_writes *st = fd_writes.lookup(&key);
	if (!st) {
		/* A new fd: within the process's share (a process that writes to every fd it
		 * can open fills its own share, not the map). */
		if (!claim(tgid, SHARE(fd_writes), NOT_RELEASED, MAX_FD_WRITES_PER_PROCESS))
			return 0;
		struct hw_fd_writes zero = {};
		int failed = fd_writes.insert(&key, &zero);
		if (failed)
			unclaim(tgid, SHARE(fd_writes)); /* the map full, or another CPU's insert */
		st = fd_writes.lookup(&key);
		if (!st) {
			if (failed)
				COUNT(fd_writes_full);
			return 0;
		}
	}
	u64 now = bpf_ktime_get_ns();
	__sync_fetch_and_add(&st->bytes, ret);
	__sync_fetch_and_add(&st->calls, 1);
	st->last_ns = now; /* a racing writer may store an older time: harmless */
	keep_tail(st, t, ret);
	/* What the fd is, now, while it still names it: a short connection (an answer, an
	 * event loop's self-pipe socketpair) is closed before user space can look. */
	u32 is_unix = 0;
	u64 file_ino = 0;
	struct hw_port_key door = {.tgid = tgid, .port = fd_socket(key.fd, &is_unix, &file_ino)};
	if (is_unix)
		__sync_fetch_and_add(&st->unix_bytes, ret); /* the service's plumbing */
	if (file_ino) {
		__sync_fetch_and_add(&st->file_bytes, ret);
		st->file_ino = file_ino;
	}
	if (!door.port)
		return 0;
	struct hw_port_writes *pw = door_writes.lookup(&door);
	if (!pw)
		return 0; /* an outbound connection, or accepted before the process was watched */
	__sync_fetch_and_add(&pw->bytes, ret);
	__sync_fetch_and_add(&pw->calls, 1);
	pw->last_ns = now;
	__sync_fetch_and_add(&st->door_bytes, ret);
	return 0;
}

/* struct iovec and the head of struct user_msghdr on 64-bit Linux, spelled out so the
 * object needs no socket headers. */
struct hw_iovec {
	u64 base;
	u64 len;
};
struct hw_msghdr_head {
	u64 name;
	s32 namelen;
	u32 pad;
	u64 iov;
	u64 iovlen;
};

/* The last of `n` iovecs at `iov` ({0, 0} when it cannot be read). */
static __always_inline struct hw_iovec iov_last(u64 iov, u64 n)
{
	struct hw_iovec last = {};
	if (n == 0 || n > 1024 ||
	    bpf_probe_read_user(&last, sizeof(last), (void *)(iov + (n - 1) * sizeof(last))))
		last.base = last.len = 0;
	return last;
}

static __always_inline struct hw_iovec msg_last(u64 msg)
{
	struct hw_msghdr_head m = {};
	if (bpf_probe_read_user(&m, sizeof(m), (void *)msg)) {
		struct hw_iovec none = {};
		return none;
	}
	return iov_last(m.iov, m.iovlen);
}

/* How the bytes of a write are given: where write_enter finds the ones to keep a tail of. */
#define HW_BUF_NONE 0  /* none of its own: sendfile, splice; sendmmsg (many messages) */
#define HW_BUF_PLAIN 1 /* `buf` is the buffer: write, pwrite64, sendto */
#define HW_BUF_IOV 2   /* `buf` is an iovec array of `n`: writev */
#define HW_BUF_MSG 3   /* `buf` is a struct user_msghdr: sendmsg */

/* Keeps the fd of the write this thread enters, and where its bytes are, for write_exit.
 * Nothing of the caller's memory is read before the watched test: unwatched processes pay
 * that test only. */
static __always_inline int write_enter(s32 fd, u32 kind, u64 buf, u64 n)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_watched(tgid))
		return 0;
	struct hw_thread *t = thread_entry((u32)id, tgid, COUNTER(write_calls_full));
	if (!t)
		return 0;
	t->write_fd = fd;
	t->write_buf = kind == HW_BUF_PLAIN ? buf : 0;
	t->write_last_len = 0; /* 0: write_buf is a plain buffer's start */
	if (kind == HW_BUF_IOV || kind == HW_BUF_MSG) {
		struct hw_iovec last = kind == HW_BUF_IOV ? iov_last(buf, n) : msg_last(buf);
		if (last.base && last.len) {
			t->write_buf = last.base + last.len;
			t->write_last_len = last.len > HW_TAIL_LEN ? HW_TAIL_LEN : (u32)last.len;
		}
	}
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
	/* The port it accepted on: its writes on such connections are counted per port. */
	u32 is_unix = 0;
	u64 file_ino = 0;
	struct hw_port_key door = {.tgid = tgid, .port = fd_socket((s32)ret, &is_unix, &file_ino)};
	if (!door.port || door_writes.lookup(&door))
		return 0;
	if (!claim(tgid, SHARE(door_writes), NOT_RELEASED, MAX_DOOR_WRITES_PER_PROCESS))
		return 0;
	struct hw_port_writes none = {};
	if (door_writes.insert(&door, &none)) {
		unclaim(tgid, SHARE(door_writes)); /* the map full, or another CPU's insert */
		if (!door_writes.lookup(&door))
			COUNT(door_writes_full);
	}
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

/* Every call that writes to one fd: only where its fd and its bytes are differs. */
#define WRITE_PAIR(name, fd, kind, buf, n)                                               \
	TRACEPOINT_PROBE(syscalls, sys_enter_##name)                                     \
	{                                                                                \
		return write_enter((s32)args->fd, kind, (u64)(buf), (u64)(n));         \
	}                                                                                \
	TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return write_exit(args->ret); }

#ifdef HAVE_WRITE
WRITE_PAIR(write, fd, HW_BUF_PLAIN, args->buf, 0)
#endif
#ifdef HAVE_WRITEV
WRITE_PAIR(writev, fd, HW_BUF_IOV, args->vec, args->vlen)
#endif
#ifdef HAVE_PWRITE64
WRITE_PAIR(pwrite64, fd, HW_BUF_PLAIN, args->buf, 0)
#endif
#ifdef HAVE_SENDTO
WRITE_PAIR(sendto, fd, HW_BUF_PLAIN, args->buff, 0)
#endif
#ifdef HAVE_SENDMSG
WRITE_PAIR(sendmsg, fd, HW_BUF_MSG, args->msg, 0)
#endif
#ifdef HAVE_SENDMMSG
WRITE_PAIR(sendmmsg, fd, HW_BUF_NONE, 0, 0)
#endif
#ifdef HAVE_SENDFILE64
WRITE_PAIR(sendfile64, out_fd, HW_BUF_NONE, 0, 0)
#endif
#ifdef HAVE_SPLICE
WRITE_PAIR(splice, fd_out, HW_BUF_NONE, 0, 0)
#endif

/* Reads of regular files (read, pread64, readv, preadv, preadv2; watched processes): the
 * bytes each successful call returned, per tgid in file_reads. Only where the offsets of
 * the fd-table walk came from the running kernel's BTF (-DHAVE_FD_WALK, agent/sources/btf.py):
 * the headers bcc compiles against may be another kernel's. At sys_enter the fd's file is
 * looked up in the task's fd table; a regular file outside the pseudo file systems (whose
 * files are views of the kernel, read every second by monitoring agents) flags the thread
 * (HW_THREAD_READING, in its `threads` entry, within its process's share), and sys_exit
 * adds what the call returned. Unwatched processes pay one inlined bitmap test at each end.
 * The page cache, network and FUSE file systems do no block I/O: this is the count that
 * sees their reads. */
#ifdef HAVE_FD_WALK
static __always_inline int pseudo_fs(u64 magic)
{
	switch (magic) {
	case 0x9fa0:     /* proc */
	case 0x62656572: /* sysfs */
	case 0x27e0eb:   /* cgroup */
	case 0x63677270: /* cgroup2 */
	case 0x64626720: /* debugfs */
	case 0x74726163: /* tracefs */
	case 0x73636673: /* securityfs */
	case 0xcafe4a11: /* bpf */
	case 0x62656570: /* configfs */
	case 0xde5e81e4: /* efivarfs */
	case 0x6165676c: /* pstore */
	case 0xf97cff8c: /* selinuxfs */
		return 1;
	}
	return 0;
}

/* Whether `fd` of the current task is a regular file of storage: fd_file's walk, then the
 * inode's super block magic. */
static __always_inline int storage_file(s64 fd)
{
	u64 inode = 0, magic = 0;
	u16 mode = 0;
	if (!fd_file(fd, &inode, &mode) || (mode & HW_S_IFMT) != HW_S_IFREG)
		return 0;
	u64 sb = kernel_ptr(inode, HW_OFF_INODE_SB);
	if (!sb || bpf_probe_read_kernel(&magic, sizeof(magic), (void *)(sb + HW_OFF_SB_MAGIC)))
		return 0;
	return !pseudo_fs(magic);
}

static __always_inline int read_enter(s64 fd)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_watched(tgid) || !storage_file(fd))
		return 0;
	struct hw_thread *t = thread_entry((u32)id, tgid, COUNTER(read_calls_full));
	if (t)
		t->flags |= HW_THREAD_READING;
	return 0;
}

static __always_inline int read_exit(long ret)
{
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!leave_marked(id, HW_THREAD_READING) || ret <= 0)
		return 0; /* not a file of storage, or nothing read */
	u64 zero = 0;
	add_or_count_full(file_reads.lookup_or_try_init(&tgid, &zero), ret,
			  COUNTER(file_reads_full));
	return 0;
}

#define READ_PAIR(name)                                                                  \
	TRACEPOINT_PROBE(syscalls, sys_enter_##name) { return read_enter((s64)args->fd); } \
	TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return read_exit(args->ret); }

#ifdef HAVE_READ
READ_PAIR(read)
#endif
#ifdef HAVE_PREAD64
READ_PAIR(pread64)
#endif
#ifdef HAVE_READV
READ_PAIR(readv)
#endif
#ifdef HAVE_PREADV
READ_PAIR(preadv)
#endif
#ifdef HAVE_PREADV2
/* Its flags' type, which the generated argument struct names and no header bcc includes
 * defines (the kernel's own typedef is the same int: a C11 redefinition is allowed). */
typedef int rwf_t;
READ_PAIR(preadv2)
#endif
#endif /* HAVE_FD_WALK */

/* A poll that found nothing: the call returned 0 (no fd ready before its timeout, or at
 * once with a timeout of 0). Counted per thread of watched processes only; a blocking
 * wait that ends with input (the common case) returns more than 0 and costs one compare
 * and the watched check. The count tells a thread that burns CPU asking for input that is
 * not there (a poll loop) from one that computes (agent.analysis.progress). */
static __always_inline int poll_exit(long ret)
{
	if (ret != 0)
		return 0;
	u64 id = bpf_get_current_pid_tgid();
	u32 tgid = id >> 32;
	if (!is_watched(tgid))
		return 0;
	struct hw_thread *t = thread_entry((u32)id, tgid, COUNTER(poll_calls_full));
	if (t)
		t->empty_polls++; /* only this thread updates its entry */
	return 0;
}

#define POLL_EXIT(name) \
	TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return poll_exit(args->ret); }

#ifdef HAVE_POLL
POLL_EXIT(poll)
#endif
#ifdef HAVE_PPOLL
POLL_EXIT(ppoll)
#endif
#ifdef HAVE_SELECT
POLL_EXIT(select)
#endif
#ifdef HAVE_PSELECT6
POLL_EXIT(pselect6)
#endif
#ifdef HAVE_EPOLL_WAIT
POLL_EXIT(epoll_wait)
#endif
#ifdef HAVE_EPOLL_PWAIT
POLL_EXIT(epoll_pwait)
#endif
#ifdef HAVE_EPOLL_PWAIT2
POLL_EXIT(epoll_pwait2)
#endif
