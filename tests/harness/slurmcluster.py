"""A real SLURM cluster on this one machine, for tests of what the launcher does under
``srun`` and ``sbatch``: one slurmctld and N slurmd, each on a host of its own
(tests/harness/netns.py: network, PID, UTS and mount namespaces on one bridge in 198.18.0.0/24),
so that ``srun -N2 hostname`` runs on two hosts with two hostnames over a real (virtual)
network, and signals, requeue and cancellation are slurm's own, not a simulation.

Everything of a cluster lives in its work folder (config, state, spool, logs, the munge
key) and in namespaces it creates; :meth:`SlurmCluster.close` kills each daemon by PID
(its namespace, and every job step in it, dies with it) and deletes the namespaces.
The filesystem is shared: every host sees the checkout and the work folder at the same
paths. Needs root and Debian's ``slurm-wlm`` and ``munge``; :func:`available` says why
not, for a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.harness import netns
from tests.harness.multinode import Process
from tests.harness.runs import limit

PROGRAMS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol", "sinfo")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
SHORT = 60  # unix sockets (munge, slurmstepd's in the spool) need short paths


def available() -> str | None:
    """None when this machine can run a cluster, else why not."""
    missing = [d for d in PROGRAMS if shutil.which(d) is None
               and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"no {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "slurm daemons here run as root"
    return netns.available()


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def _stop(p: Process, grace: float = 30) -> None:
    """SIGTERM to the daemon, SIGKILL if it lingers: its namespace dies with it."""
    p.signal(signal.SIGTERM)
    try:
        p.proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    p.kill()


def wait_for_text(path: Path, text: str, timeout: float) -> str:
    """Until the file (a job's output, written on its node) holds ``text``; the file."""
    timeout = limit(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = path.read_text(errors="replace")
        except OSError:
            found = ""
        if text in found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {path} within {timeout} s: {found[-2000:]!r}")
        time.sleep(0.2)


def host_env() -> dict:
    """This process's environment without any SLURM_* of an allocation the tests run in."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_",
                                                                     "SRUN_", "SALLOC_"))}


class SlurmCluster:
    """One controller host ``ctl`` and hosts ``node1``..``nodeN``; a context manager."""

    def __init__(self, work: Path, nodes: int = 2, cpus_per_node: int = 2,
                 memory_mb: int = 1024, kill_wait: int = 30, start_timeout: float = 180,
                 requeue_delay: int = 10, extra_conf: str = "") -> None:
        self.work = Path(work)
        self.nnodes, self.cpus, self.memory_mb = nodes, cpus_per_node, memory_mb
        self.kill_wait, self.start_timeout, self.extra_conf = kill_wait, start_timeout, extra_conf
        self.requeue_delay = requeue_delay
        self.net: netns.Network | None = None
        self.ctl: netns.Host | None = None
        self.hosts: list[netns.Host] = []
        self.daemons: list[Process] = []
        self.run_dir = self.work  # sockets: see _short_dir
        self.conf = self.work / "slurm.conf"

    def _short_dir(self) -> Path:
        """Where sockets live: the work folder, or a short folder of its own in /tmp."""
        if len(str(self.work)) <= SHORT:
            return self.work
        return Path(tempfile.mkdtemp(prefix="trn-slurm-"))

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- start-up ---------------------------------------------------------------

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "log"):
            (self.work / sub).mkdir(exist_ok=True)
        self.run_dir = self._short_dir()
        (self.run_dir / "spool").mkdir(exist_ok=True)
        self.net = netns.Network(self.work)
        self.ctl = self.net.host("ctl")
        self.hosts = [self.net.host(f"node{i + 1}") for i in range(self.nnodes)]
        self._start_munge()
        self.conf.write_text(self.slurm_conf())
        self._daemon(self.ctl, "slurmctld", [_binary("slurmctld"), "-D", "-i", "-f",
                                             str(self.conf)])
        for h in self.hosts:
            self._daemon(h, "slurmd", [_binary("slurmd"), "-D", "-N", h.name, "-f",
                                       str(self.conf)])
        self.wait_idle(self.start_timeout)

    def _daemon(self, host: netns.Host, label: str, argv: list[str]) -> Process:
        p = host.process(label, argv, self.env(), self.work / "log").start()
        self.daemons.append(p)
        return p

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge.socket"

    def _start_munge(self) -> None:
        key = self.work / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # --force: the socket's folder is not open to all (pytest's tmp folders are 0700)
        self._daemon(self.ctl, "munged", [
            _binary("munged"), "-F", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.work / 'munged.pid'}",
            f"--seed-file={self.work / 'munged.seed'}", "--num-threads=4"])
        deadline = time.monotonic() + limit(60)
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or not self.daemons[-1].running:
                raise RuntimeError(f"munged did not start:\n{self.daemons[-1].text()[-3000:]}")
            time.sleep(0.1)

    def slurm_conf(self) -> str:
        w, log = self.work, self.work / "log"
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs={self.cpus} "
                        f"RealMemory={self.memory_mb} State=UNKNOWN\n" for h in self.hosts)
        return f"""\
ClusterName=trn
SlurmctldHost={self.ctl.name}({self.ctl.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.requeue_delay}
StateSaveLocation={w / 'state'}
SlurmdSpoolDir={self.run_dir / 'spool'}/%n
SlurmctldPidFile={w / 'slurmctld.pid'}
SlurmdPidFile={w / 'slurmd-%n.pid'}
SlurmctldLogFile={log / 'slurmctld.log'}
SlurmdLogFile={log / 'slurmd-%n.log'}
SlurmctldDebug=info
SlurmdDebug=info
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmctldTimeout=300
SlurmdTimeout=300
MessageTimeout=60
InactiveLimit=120
MinJobAge=3600
KillWait={self.kill_wait}
JobRequeue=1
TmpFS={w}
{self.extra_conf}
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle; raises with the daemons' logs if not in time."""
        timeout = limit(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.name for p in self.daemons if not p.running]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited\n{self.logs()}")
            states = self.node_states()
            if len(states) == self.nnodes and set(states.values()) == {"idle"}:
                return
            time.sleep(0.5)
        raise RuntimeError(f"nodes not idle within {timeout} s: {self.node_states()}\n"
                           f"{self.logs()}")

    def node_states(self) -> dict[str, str]:
        """Node name -> state as sinfo says ("idle", "allocated", "down*"...); {} if no answer."""
        try:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=60)
        except subprocess.TimeoutExpired:
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def logs(self) -> str:
        """The last lines of every daemon's log, for a failure message."""
        parts = [f"--- {p.name} (output)\n{p.text()[-1500:]}" for p in self.daemons]
        parts += [f"--- {f.name}\n{_tail(f)}" for f in sorted((self.work / "log").glob("*.log"))
                  if f.name.startswith("slurm")]
        return "\n".join(parts)

    # ---- using it ---------------------------------------------------------------

    def env(self, extra: dict | None = None) -> dict:
        """What clients and daemons run with (srun passes it on to the tasks)."""
        return {**host_env(), **(extra or {}), "SLURM_CONF": str(self.conf)}

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 120,
            check: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A command on the controller host (slurm's clients: srun, sbatch, scontrol...).
        On timeout the command dies, but a job its srun allocated lives on, up to
        InactiveLimit (120 s)."""
        return subprocess.run([*self.ctl.wrap(), *argv], env=self.env(env),
                              cwd=cwd or self.work, capture_output=True, text=True,
                              timeout=limit(timeout), check=check)

    def sbatch(self, script: Path, *args: str, env: dict | None = None,
               script_args: tuple[str, ...] = ()) -> int:
        """Submits a batch script (``args``: sbatch's options; ``script_args``: the
        script's own); its job id."""
        out = self.run(["sbatch", "--parsable", *args, str(script), *script_args], env=env,
                       timeout=120)
        if out.returncode:
            raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """scontrol's fields of a job ({} once slurm forgot it, MinJobAge after its end)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=60)
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out.stdout)) if out.returncode == 0 \
            else {}

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_job(self, job_id: int, timeout: float, states: set[str] = FINISHED) -> str:
        """Until the job is in one of ``states`` (finished, by default); that state."""
        timeout = limit(timeout)
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state or 'unknown'} after "
                                     f"{timeout} s: {self.job(job_id)}\n{self.logs()}")
            time.sleep(0.3)

    def scontrol(self, *args: str) -> str:
        """``scontrol ARGS`` (e.g. "requeue", "123"); its output, or raises."""
        out = self.run(["scontrol", *args], timeout=60)
        if out.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)} failed: {out.stderr}")
        return out.stdout

    def scancel(self, job_id: int, signal: str | None = None, batch: bool = False,
                full: bool = False) -> None:
        """Cancels the job (SIGCONT+SIGTERM to every process of every step, SIGKILL
        KillWait later), or sends ``signal``: to every process of its srun steps only; with
        ``batch``, to the batch shell only; with ``full``, to the shell's and the steps'."""
        argv = ["scancel", *([f"--signal={signal}"] if signal else []),
                *(["--batch"] if batch else []), *(["--full"] if full else []), str(job_id)]
        out = self.run(argv, timeout=60)
        if out.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed: {out.stderr}")

    # ---- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Kills every daemon by PID (its namespace with it), deletes the namespaces."""
        for p in reversed(self.daemons):
            _stop(p)
        self.daemons = []
        if self.net is not None:
            self.net.close()
            self.net = None
        if self.run_dir != self.work:
            shutil.rmtree(self.run_dir, ignore_errors=True)
