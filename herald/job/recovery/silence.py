"""Who a failed job was waiting on: its headline names the worker that went silent, not
the one that noticed (NOTE [silent workers]).

NOTE [silent workers]
~~~~~~~~~~~~~~~~~~~~~
A worker that stops answering (stopped by SIGSTOP or a debugger, hung, starved) reports
nothing itself: the first failure the job sees is a symptom. A healthy worker's
all-reduce or PS step reply times out waiting on the silent one, and it reports the
error to the dispatcher or exits with it; or the dispatcher's own wait for acks times
out. Headlining that symptom blames the healthy worker. So the dispatcher keeps, for the
wait it is in, the ranks it waits on, and when each rank last sent it a message; when
the wait fails it notes the ranks silent for at least half of ``--timeout-ms`` (awaited
or not: the one that noticed may have acked the step the wait is for, and be stuck in
the next) and those that reported an error (:class:`~herald.dispatch.peers.Silence`,
:meth:`Dispatcher.silence() <herald.dispatch.dispatcher.Dispatcher.silence>`). The job
(:func:`herald.job.recovery.failure.raise_job_failure`) then names as the cause the silent workers
whose process still runs and that reported nothing (:func:`silent_culprits`), provided the
failure is one of waiting on them: a silent worker failed (reported an error, or exited
with an error code) after its own long silence, so it had been waiting, not working.

What keeps its precedence: a worker killed by a signal (dead, not silent), a lost PS
shard (NOTE [ps liveness]), a diverged loss. What blames nobody: a worker that failed
without a long silence first (it crashed in a step: its own error), the handshake
(workers still starting are silent too), workers not started by this job (``herald serve
dispatcher``: their processes are not ours to look at). Half of ``--timeout-ms``: a
worker that noticed a timeout has waited a whole ``--timeout-ms`` since its last
message, and so has the one it waited on; a healthy worker sends one every step.
Tests: tests/job/test_silence.py (the rule), tests/dispatch/test_dispatcher_peers.py
(the dispatcher's side), tests/integration/test_faults_workers.py (a SIGSTOPped worker).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from herald.dispatch.peers import Silence


def merge_silences(silences: Sequence[Silence | None], offsets: Sequence[int]) -> Silence | None:
    """One :class:`Silence` of several dispatchers' (one per group, NOTE [independent
    groups]), their ranks shifted by ``offsets`` (dispatcher ``g``'s rank ``r`` is worker
    ``offsets[g] + r``); None when none has one."""
    quiet: dict[int, float] = {}
    awaited: set[int] = set()
    reported: set[int] = set()
    waits, min_s = [], 0.0
    for s, off in zip(silences, offsets):
        if s is None:
            continue
        quiet.update({off + r: t for r, t in s.quiet.items()})
        awaited.update(off + r for r in s.awaited)
        reported.update(off + r for r in s.reported)
        waits.append(s.waiting_for)
        min_s = max(min_s, s.min_s)
    return Silence(quiet, frozenset(awaited), frozenset(reported), "; ".join(waits), min_s) if waits else None


def silent_culprits(silence: Silence | None, exit_codes: Mapping[int, int | None] | None) -> list[int]:
    """The silent workers to name as the job's cause (NOTE [silent workers]), ascending;
    [] when the rule names none.

    Args:
        silence: the dispatchers' view at the failure (None: no wait on named workers failed).
        exit_codes: each worker's exit code by rank, None while it runs, negative when a
            signal killed it; None: the processes are not known here.
    """
    if silence is None or exit_codes is None:
        return []
    if any(code is not None and code < 0 for code in exit_codes.values()):
        return []  # a killed worker is dead, not silent: it is the cause
    # a worker that failed after a long silence of its own had been waiting: it noticed
    noticed = [r for r in silence.quiet if r in silence.reported or (exit_codes.get(r) or 0) > 0]
    if not noticed:
        return []
    return sorted(r for r in silence.silent if r not in silence.reported and r in exit_codes and exit_codes[r] is None)


def killed_ranks(exit_codes: Mapping[int, int | None] | None) -> list[int]:
    """The workers a signal ended (negative exit code), ascending: dead, not failed (NOTE
    [worker failover] in herald/job/recovery/rollback.py). Read before the job stops its workers (its
    own SIGTERM would count); ``exit_codes`` as :func:`silent_culprits` takes them (None: [])."""
    return sorted(r for r, code in (exit_codes or {}).items() if code is not None and code < 0)


def silent_headline(ranks: Sequence[int], silence: Silence, describe: Callable[[int], str]) -> str:
    """The first line of the job's error naming the silent ``ranks`` (:func:`silent_culprits`),
    e.g. ``worker-0 went silent (pid 7, stopped (SIGSTOP or a debugger); log run/worker-0.log):
    it sent the dispatcher nothing for 20.4 s while the job waited for ack of step 11 from
    workers [0, 1], and the workers waiting on it gave up; ...``. ``describe(rank)`` gives
    its process and log."""
    who = ", ".join(f"worker-{r} ({describe(r)})" for r in ranks)
    it, they = ("it", "it") if len(ranks) == 1 else ("they", "them")
    longest = max(silence.silent[r] for r in ranks)
    return (
        f"{who} went silent: {it} sent the dispatcher nothing for {longest:.1f} s while the job waited for "
        f"{silence.waiting_for}, and the workers waiting on {they} gave up; a stopped, hung or CPU-starved "
        "process (its log says what it was doing; raise --timeout-ms if it was only slow)"
    )


def process_state(pid: int) -> str:
    """What ``/proc/<pid>/stat`` says of process ``pid``: ``"stopped (SIGSTOP or a
    debugger)"``, ``"in uninterruptible I/O"``, ``"running"`` or ``"sleeping"``;
    ``"state unknown"`` when it cannot be read (not Linux, gone)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, ValueError):
        return "state unknown"
    return {
        "T": "stopped (SIGSTOP or a debugger)",
        "t": "stopped (SIGSTOP or a debugger)",
        "D": "in uninterruptible I/O",
        "R": "running",
    }.get(state, "sleeping")
