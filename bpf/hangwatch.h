/* Types and constants shared by the BPF programs and user space.
 *
 * User space never redeclares these structs: bcc derives the ctypes of map
 * keys, values and ring-buffer events from this header's debug info, and
 * agent/sources/probe.py reads the HW_* defines below from this file.
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

/* struct hw_thread.flags */
#define HW_THREAD_WAITING 1 /* inside a futex wait: the fields of the wait are this wait's */
#define HW_THREAD_REFUSED 2 /* a refusal for this thread is in the refusals map */
#define HW_THREAD_WRITING 4 /* inside a write: write_fd is this call's */
#define HW_THREAD_READING 8 /* inside a read of a regular file of storage (io.bpf.c) */
/* Set by user space only, on an entry it inserts for a thread /proc showed in a futex wait
 * that began before the process was watched; cleared by the thread's next futex sys_exit.
 * While set, the thread has not left that wait: user space need not read it again. */
#define HW_THREAD_SEEDED 16

/* Futex commands that can be refused with EDEADLK, all PI-only: their word is recorded for
 * every process (pi_ops), the refusal in the refusals map for watched processes only. */
#define HW_FUTEX_TRYLOCK_PI 8
#define HW_FUTEX_CMP_REQUEUE_PI 12

/* Ring-buffer event kinds (struct hw_event.kind). */
#define HW_EVENT_LONG_WAIT 1 /* a wait longer than LONG_WAIT_NS ended */
#define HW_EVENT_EDEADLK 2   /* the kernel refused a PI lock that would close a cycle */
#define HW_EVENT_BIND 3      /* a successful bind(2) of an AF_INET/AF_INET6 socket, any process */
#define HW_EVENT_LISTEN 4    /* a successful listen(2), any process */

/* struct hw_change.kinds: what happened to a task since user space last took the changes map. */
#define HW_CHANGE_EXEC 1   /* an exec, any process (keyed by tgid): discovery reads it again */
#define HW_CHANGE_RENAME 2 /* a task renamed (keyed by its TID), any process: the same */

#define HW_EDEADLK 35
#define HW_EAGAIN 11 /* a futex wait whose word had changed: it returned without sleeping */
#define HW_AF_INET 2
#define HW_AF_INET6 10
#define HW_AF_UNIX 1

/* One thread of a watched process, keyed by TID, updated in place: created at its
 * first futex wait or write, deleted by user space when the thread or the process
 * goes. A parked thread never reaches sys_exit, so the entries flagged
 * HW_THREAD_WAITING, read each tick, say who waits now and on what. Keeping the
 * entry rather than inserting and deleting one per call saves a map update and
 * a delete on every wait and every write. */
struct hw_thread {
	u64 start_ns; /* bpf_ktime_get_ns() at the wait's sys_enter (CLOCK_MONOTONIC) */
	u64 uaddr;    /* the futex word (the first one for futex_waitv) */
	u32 tgid;
	u32 op;       /* futex command, flags stripped */
	u32 val;      /* the value the caller expects the word to hold */
	u32 syscall;  /* HW_SYSCALL_* */
	u32 flags;    /* HW_THREAD_* */
	s32 write_fd; /* the fd of the write in progress (HW_THREAD_WRITING) */
	/* Where the bytes of the write in progress start (a plain buffer: write, sendto,
	 * pwrite64), or end (a vectored call: the last iovec's end); 0: none to read. */
	u64 write_buf;
	/* A vectored call's last iovec length, at most HW_TAIL_LEN (the tail stays inside
	 * it); 0 for a plain buffer. */
	u32 write_last_len;
	/* Its polls that found nothing (poll, select, epoll_wait and kin returning 0), wrapping:
	 * a thread that asks for input many times a second and finds none spins. */
	u32 empty_polls;
};

/* The last PI operation of a thread, any process: an EDEADLK at sys_exit (only PI
 * operations return it) needs the word, and the refusal may come before
 * discovery reaches the process: an unwatched thread's refusal is kept here
 * (refused_ns), in an LRU map nobody can fill for others, never in `refusals`.
 * Overwritten, never deleted, per call. */
struct hw_pi_op {
	u64 start_ns;
	u64 uaddr;
	u64 refused_ns; /* when this lock was refused with EDEADLK (unwatched then); 0: not */
	u32 tgid;
	u32 op;
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

/* What one watched process holds in the maps shared by every process (threads, fd_writes,
 * refusals) and what it lost beyond its share: keyed by tgid, written by the kernel only
 * (user space's deletes are counted apart, in struct hw_released), so that a process that
 * fills its share loses its own entries and events, never another's. */
struct hw_share {
	u32 threads;   /* entries inserted in `threads` */
	u32 fd_writes; /* entries inserted in `fd_writes` */
	u32 door_writes; /* entries inserted in `door_writes` */
	u32 pad;
	u32 refusals;  /* entries inserted in `refusals`, less those the kernel deleted */
	u32 window_events; /* ring-buffer events sent in the window that began at window_ns */
	u64 window_ns;
	u64 refused;        /* inserts refused: the process held its share of that map */
	u64 events_dropped; /* its events lost: over its rate, or the ring buffer full */
};

/* Entries of one process that user space deleted (threads gone): the only writer of this
 * map, so no kernel increment is lost to a user-space read-modify-write. */
struct hw_released {
	u32 threads;
	u32 refusals;
};

/* A task that exec'd or was renamed since user space last took the changes map: coalesced
 * per key, so a rename loop holds one entry and sends nothing. */
struct hw_change {
	u64 ts_ns; /* the first change since user space last took the map */
	u32 kinds; /* HW_CHANGE_* */
	u32 pad;
};

struct hw_hist_key {
	u32 tgid;
	u32 slot; /* log2 of the wait time in ns */
};

/* The one ring-buffer record, for every kind and both rings (events: watched processes'
 * futex kinds; host_events: bind, listen): bcc decodes a ring buffer's records as one
 * flat struct, so fields a kind does not use are 0. */
struct hw_event {
	u64 ts_ns;
	u64 uaddr;       /* futex kinds */
	u64 duration_ns; /* futex kinds */
	u32 kind;        /* HW_EVENT_* */
	u32 tgid;
	u32 tid;
	u32 op;      /* futex kinds */
	s32 ret;     /* futex kinds */
	s32 fd;      /* bind, listen: the socket */
	u32 family;  /* bind: HW_AF_INET or HW_AF_INET6; 0 if the address was unreadable */
	u32 port;    /* bind: host byte order, 0 for "any port" */
	s32 backlog; /* listen: as passed, before the kernel caps it at somaxconn */
	u32 pad;
};

/* A bind or listen between sys_enter and sys_exit, keyed by pid_tgid: the
 * exit tracepoint only has the return value. */
struct hw_sock_call {
	u32 kind; /* HW_EVENT_BIND or HW_EVENT_LISTEN */
	s32 fd;
	u32 family;
	u32 port;
	s32 backlog;
	u32 pad;
};

struct hw_fd_key {
	u32 tgid;
	s32 fd;
};

#define HW_TAIL_LEN 16

/* Successful writes to one fd (write, writev, pwrite64, send*, sendfile, splice). */
struct hw_fd_writes {
	u64 bytes;
	u64 calls;
	u64 last_ns; /* bpf_ktime_get_ns() at the last one's sys_exit */
	/* The last bytes of the last write, where its buffer could be read (tail_len of
	 * them, at most HW_TAIL_LEN): how an HTTP answer ends tells a finished one ("0\r\n\r\n",
	 * the last chunk) from a stream still being sent. 0 for sendfile, splice, sendmmsg. */
	u8 tail[HW_TAIL_LEN];
	u32 tail_len;
	u32 pad;
	/* Of `bytes`, those written while the fd was a TCP socket accepted on a port counted
	 * in door_writes: user space places them by that port, not by the fd's name. */
	u64 door_bytes;
	/* Of `bytes`, those written while the fd was a unix socket (the service's own plumbing,
	 * agent/analysis/outbound.py), seen where the fd was walked: known even once it closed. */
	u64 unix_bytes;
	/* Of `bytes`, those written while the fd was a regular file, and the inode number of the
	 * last one: a file opened, written and closed within a tick is still a named file. */
	u64 file_bytes;
	u64 file_ino;
};

/* TCP writes of one watched process on the connections accepted at one of its local ports
 * (keyed by the port its accept probe saw): counted as they are written, so an answer on a
 * connection closed before user space looks is still placed. */
struct hw_port_key {
	u32 tgid;
	u32 port; /* host byte order */
};

struct hw_port_writes {
	u64 bytes;
	u64 calls;
	u64 last_ns; /* bpf_ktime_get_ns() at the last one's sys_exit */
};

/* Per-CPU counters: every full map and failed reserve is counted. User
 * space sums the fields named *_full into one "maps full" figure. */
struct hw_counters {
	u64 waits_started;    /* watched waits only */
	u64 waits_ended;
	u64 inflight_full;    /* a wait not tracked: threads map full */
	u64 hist_full;        /* a wait not counted in the histogram: map full */
	u64 refusals_full;    /* an EDEADLK not kept: refusal map full */
	u64 events_sent;
	u64 events_dropped;   /* ring buffer full: reserve failed */
	u64 sock_calls_full;  /* a bind/listen not reported: sock_calls map full */
	u64 bind_unreadable;  /* a bind whose address could not be read: reported with family 0 */
	u64 write_calls_full; /* a write not counted: threads map full */
	u64 fd_writes_full;   /* a write not counted: fd_writes map full */
	u64 accepts_full;     /* an accept not counted: accepts map full */
	u64 door_writes_full; /* a door's writes not counted: door_writes map full */
	u64 shares_full;      /* a watched process's insert refused: shares map full */
	/* an exec or rename not kept, the changes map full: not a loss (discovery reads every
	 * process again), so not named *_full, which user space counts as lost evidence */
	u64 changes_overflowed;
	u64 host_events_dropped; /* a bind or listen not reported: host_events ring full */
	u64 read_calls_full;  /* a read of a file not counted: threads map full */
	u64 file_reads_full;  /* a read of a file not counted: file_reads map full */
	u64 poll_calls_full;  /* an empty poll not counted: threads map full */
};

#endif /* HANGWATCH_H */
