"""The `hangwatch` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import buildinfo
from .config import DEFAULT_STATUS_GROUP, DEFAULT_STATUS_SOCKET
from .errors import EXIT_USAGE, HangwatchError
from .settings import DURATION, INTERVAL, PARK_THRESHOLD, STACKS_BUDGET_S

DESCRIPTION = """\
hangwatch tells whether a process that looks hung (GPU memory held, 0% utilisation,
no answer, every thread in futex) is deadlocked, stalled, idle or progressing.

states:
  deadlocked   a wait-for cycle among its threads (locks held in a ring), stable across two reads
  stalled      no progress past the threshold, and not idle: work waits for it, or it has no
               front door (a distributed job, a batch process)
  idle         no progress, and nothing waits for it: a front door (a listener that clients
               outside the service connect to) with an empty accept queue
  progressing  it did work that reaches outside the service in the window (CPU, writes to
               files or clients, GPU), or it waits without a front door under the threshold
"""

DIAGNOSE_EPILOG = """\
examples:
  hangwatch diagnose --pid 4242
  hangwatch diagnose --pid 4242 --pid 4343 --duration 10 --json

where threads wait: each process is shown by its Python stacks, grouped by the line of its own
code ("2000 threads at `Queue.get` (pool.py:24) in `serve`"), read with py-spy --nonblocking:
the process is never stopped or signalled (a blocking py-spy dump or gdb -p stops every
thread while it reads). Lock words are named by ELF symbol, native waits by their first caller
outside libc, fd waits by what the fd is (a socket and its peer, a pipe, an eventfd).

with a daemon: at the end of its window, diagnose asks the daemon's status socket (--socket)
for the service holding each --pid, and reports what the daemon saw that its window cannot
(an answer begun before it attached and never finished, a request older than its window);
without one, it says that such work is not seen.

exit codes: 0 ok, 2 bad input (names it), 3 missing privilege or kernel feature (says how to fix)
"""

STATUS_EPILOG = f"""\
examples:
  hangwatch status
  hangwatch status --pid 4242 --json

the daemon's verdicts in diagnose's words, with since when each service is in its state,
its last changes, the evidence the daemon carries across ticks and where the threads waited
at its last change to stalled or deadlocked. Read from the daemon's unix socket (config key
status_socket, default {DEFAULT_STATUS_SOCKET}): root, and the members of the group
status_group (default {DEFAULT_STATUS_GROUP}), may ask; no BPF, no root needed.

exit codes: 0 ok, 2 bad input or a --pid the daemon does not watch (lists what it watches),
3 refused (says how to get access), 4 no daemon answers (says how to start it)
"""


RUN_EPILOG = f"""\
config (YAML; unknown keys are errors):
  listen: "0.0.0.0:9817"
  interval_seconds: {INTERVAL.default:g}            # {INTERVAL.range_text}
  park_threshold_seconds: {PARK_THRESHOLD.default:g}     # {PARK_THRESHOLD.range_text}
  targets:
    - name: sglang
      cmdline: "sglang\\\\.launch_server"   # regex on the space-joined command line
      front_door_ports: [30000]         # optional; front_door: false for none
    - name: workers
      comm: "python3?"                  # regex matched in full against the process name
    - name: any-gpu
      gpu: true                         # any process that holds GPU memory
    - name: pinned
      pids: [1234]

web config (--web-config FILE; a restart, not SIGHUP, applies a change):
  tls_server_config: {{cert_file: tls.crt, key_file: tls.key}}
  basic_auth_users: {{prometheus: "$2b$10$..."}}   # a bcrypt hash: docs/security.md

exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad config, web config or listen address (names
the key), 3 missing privilege or kernel feature (names it)
"""


JOB_EPILOG = """\
examples:
  hangwatch job --prometheus http://prometheus:9090
  hangwatch job --prometheus http://prometheus:9090 --job run-7
  hangwatch job --prometheus https://USER:PASSWORD@prom.example.com/prometheus --job 81234 --json

a job: the ranks (processes with RANK) that share a service and a job_key, which hangwatch
reads from what the launcher gives every rank: torchrun's --rdzv_id, else the Slurm job and
step, else the rendezvous endpoint (MASTER_ADDR:MASTER_PORT/WORLD_SIZE), else the MPI job.
--job takes the id (run-7, 81234.0 or 81234, 10.0.0.1:29500/4) or the whole key
(tcp:10.0.0.1:29500/4), alone or after SERVICE@. Ranks without a key: those of one host,
--job SERVICE@INSTANCE/SERVICE_PID. The list of jobs prints each job's shortest name.
Without --job: the only job, else the only stalled one, else the list.

odd ranks out of a stalled job, first in the table: "not parked" (it works while the others
wait), "other site" (it waits where fewer ranks wait than at the job's commonest site; a tie
names nobody), "missing" (seen in the last 15 minutes, gone now: named with its last host) and
"never seen" (below the job's world size). Read from the daemon's own series: Prometheus need
not load hangwatch's rules.

exit codes: 0 every rank visible, stalled or not (the table says), 1 ranks not visible (their
hosts' hangwatch may be down or not scraped; says which), 2 bad input, an unknown --job or
several jobs to pick from (lists them), 4 Prometheus unreachable or answering an error (names
the URL)
"""


def _seconds(text: str) -> float:
    """A number; its range is checked with the other input (agent.settings, one range per
    setting for flags and config keys alike)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _pid(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a PID: {text!r}") from None


class _Version(argparse.Action):
    """--version, with the commit looked up only when asked (it may run git, in a checkout)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"hangwatch {buildinfo.describe()}")  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hangwatch",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="print the version and the commit, and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_diagnose(sub)
    _add_run(sub)
    _add_job(sub)
    _add_status(sub)
    return parser


def _add_diagnose(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "diagnose",
        help="observe processes for a few seconds and give each service a verdict",
        description="Attach the futex probe, read /proc, observe for --duration seconds and\n"
        "report each service (a PID and its descendants) with its state and evidence.\n"
        "Needs root, or CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH.",
        epilog=DIAGNOSE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument(
        "--pid",
        type=_pid,
        action="append",
        required=True,
        metavar="PID",
        help="root of a service to diagnose (repeatable); its descendants are included",
    )
    d.add_argument(
        "--threshold",
        type=_seconds,
        default=PARK_THRESHOLD.default,
        metavar="S",
        help="seconds every thread must be parked before a service is called stalled "
        f"(default {PARK_THRESHOLD.default:g}; {PARK_THRESHOLD.range_text})",
    )
    d.add_argument(
        "--duration",
        type=_seconds,
        default=DURATION.default,
        metavar="S",
        help=f"seconds to observe (default {DURATION.default:g}; {DURATION.range_text}; "
        "at least two reads are taken); longer, up to --threshold, for a service that did "
        "nothing in that time but has no evidence as old as the threshold",
    )
    d.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    d.add_argument(
        "--no-stacks",
        dest="stacks",
        action="store_false",
        help="skip the Python stacks. By default they are read with py-spy --nonblocking, which "
        f"reads the process's memory and never stops it (at most {STACKS_BUDGET_S:g} s for all "
        "processes)",
    )
    d.add_argument(
        "--socket",
        default=DEFAULT_STATUS_SOCKET,
        metavar="PATH",
        help="the daemon's status socket, asked for its history of each service (default "
        f"{DEFAULT_STATUS_SOCKET}; none there: the report says what it could not see)",
    )


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    st = sub.add_parser(
        "status",
        help="the running daemon's verdicts and history, from its status socket",
        description="Ask the running daemon (hangwatch run) for each service's state, since\n"
        "when, its recent changes and the evidence it carries across ticks.",
        epilog=STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    st.add_argument("--pid", type=_pid, metavar="PID", help="only the service holding PID")
    st.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    st.add_argument(
        "--socket",
        default=DEFAULT_STATUS_SOCKET,
        metavar="PATH",
        help=f"the daemon's status socket (default {DEFAULT_STATUS_SOCKET})",
    )
    st.add_argument(
        "--timeout",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds to wait for the daemon's answer (default 5; at most 600)",
    )


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "run",
        help="the daemon: watch inference services and serve Prometheus metrics",
        description="Watch every process that a target selects (and its descendants), give each\n"
        "service a verdict every interval, log state changes, and serve /metrics.\n"
        "Without --config: the built-in default (processes holding GPU memory, and the\n"
        "command lines of SGLang, vLLM, TensorRT-LLM, Triton, TGI and torchrun).\n"
        "SIGHUP reloads the config (a bad one is logged, the old one kept); SIGTERM stops.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in one)")
    r.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address for /metrics, overriding the config (default 0.0.0.0:9817)",
    )
    r.add_argument(
        "--web-config",
        metavar="FILE",
        help="TLS and basic auth for /metrics: a web config file in the Prometheus exporter "
        "format (tls_server_config, basic_auth_users); see docs/security.md",
    )
    r.add_argument(
        "--print-default-config",
        action="store_true",
        help="print the built-in config and exit (a starting point for --config)",
    )


def _add_job(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    j = sub.add_parser(
        "job",
        help="a distributed job's ranks side by side, from Prometheus: which rank holds it up",
        description="Ask Prometheus for the ranks of a multi-host job that hangwatch watches on\n"
        "each host, and print them side by side: rank, host, PID, state, where it waits and\n"
        "for how long; the odd ranks out (stragglers, missing ranks) first, with why.",
        epilog=JOB_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    j.add_argument(
        "--prometheus",
        required=True,
        metavar="URL",
        help="base URL of the Prometheus that scrapes the hosts' hangwatch, such as "
        "http://prometheus:9090 (user:password@ for basic auth)",
    )
    j.add_argument("--job", metavar="NAME", help="the job: its id, as the list of jobs shows it")
    j.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    j.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds to wait for each of Prometheus's answers (default 10; at most 600)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a one-line reason on bad flags
    try:
        if args.command == "diagnose":
            from .diagnose import DiagnoseOptions, run

            return run(
                DiagnoseOptions(
                    pids=args.pid,
                    threshold_s=args.threshold,
                    duration_s=args.duration,
                    as_json=args.json,
                    stacks=args.stacks,
                    socket_path=args.socket,
                )
            )
        if args.command == "run":
            if args.print_default_config:
                from .config import default_text

                sys.stdout.write(default_text())
                return 0
            from .daemon import run as run_daemon

            return run_daemon(args.config, args.listen, args.web_config)
        if args.command == "job":
            from .jobs.command import JobOptions
            from .jobs.command import run as run_job

            return run_job(JobOptions(args.prometheus, args.job, args.json, args.timeout))
        if args.command == "status":
            from .status import StatusOptions
            from .status import run as run_status

            return run_status(StatusOptions(args.pid, args.json, args.socket, args.timeout))
    except HangwatchError as e:
        print(f"hangwatch: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
