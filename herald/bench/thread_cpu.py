"""CPU seconds per thread of this process and of a peer process, and of the whole machine,
read from /proc: what ``herald bench dispatcher`` (:mod:`herald.bench.capacity`) reports per
thread. Threads are named (psutil lists a thread's times but not its name)."""

from __future__ import annotations

import os
import threading


def thread_cpu_seconds(peers_pid: int | None) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by thread name (Python
    threads by their ``name``, native ones such as ZeroMQ's I/O thread by their OS name),
    and of the process ``peers_pid`` as ``"peers"``; empty where /proc is not readable."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}

    def read(path: str) -> tuple[str, float] | None:
        try:
            with open(path) as f:
                raw = f.read()
        except OSError:
            return None
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        return comm, (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        got = read(f"/proc/self/task/{tid}/stat")
        if got is not None:
            name = names.get(int(tid), got[0])
            out[name] = out.get(name, 0.0) + got[1]
    if peers_pid is not None:
        try:
            ptids = os.listdir(f"/proc/{peers_pid}/task")
        except OSError:
            ptids = []
        for tid in ptids:  # the fake workers' Python thread and ZeroMQ I/O thread
            got = read(f"/proc/{peers_pid}/task/{tid}/stat")
            if got is not None:
                name = "peers" if got[0] == "python" or tid == str(peers_pid) else f"peers {got[0]}"
                out[name] = out.get(name, 0.0) + got[1]
    try:  # every process of the machine (user + nice + system + irq + softirq + steal)
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        out["(machine)"] = (sum(cpu[:3]) + sum(cpu[5:8])) / tick
    except (OSError, ValueError):
        pass
    return out
