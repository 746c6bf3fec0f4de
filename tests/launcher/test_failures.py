"""How a job that does not end ok is reported: the cause named (a rank's exception, the signal that killed
it), summary.json's status and fields, the exit status, and the run folder's I/O errors; then real jobs
killed, stopped, preempted and failed."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runner.launcher.launch
import runner.run_folder
from runner.launcher.failures import failure_report
from runner.launcher.launch import EXIT, JobEnded, RunFolderError, conclude, prepare, write_atomic
from runner.launcher.supervise import Outcome
from runner.launcher.watchdog import Stall
from tests.conftest import ROOT, compose_config

#: Open MPI 5's report of a rank killed by ``kill -9``, as mpirun.log had it (wrapped before "signal").
KILLED = """--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 4084 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
EXITED = """--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-5536@1,1]
   Exit code:    3
--------------------------------------------------------------------------
"""
ABORTED = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
  Proc: [[50001,1],0]
  Errorcode: 7

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
"""


def run_folder(tmp_path: Path, output: str = "", errors: dict[int, str] | None = None) -> Path:
    """A run folder whose job printed ``output`` and whose ranks left ``errors`` (rank -> first line),
    written in that order a second apart."""
    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "mpirun.log").write_text(output)
    for i, (rank, line) in enumerate((errors or {}).items()):
        path = tmp_path / "logs" / f"rank{rank}.error"
        path.write_text(f"{line}\n\nTraceback (most recent call last):\n  ...\n")
        os.utime(path, (1000 + i, 1000 + i))
    return tmp_path


def test_the_exit_table_in_the_docstring_is_the_one_used():
    rows = re.findall(r"^(\d+)\s+(\w+|\(none\))\s", runner.launcher.launch.__doc__, re.M)
    table = {("invalid" if status == "(none)" else status): int(code) for code, status in rows}
    assert table == EXIT


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    folder = run_folder(tmp_path, "epoch 3\n" + KILLED, {0: "RuntimeError: peer gone (comm.py:1)"})
    failure = failure_report(folder, 137)
    assert failure.message.startswith(
        "rank 1 killed by signal 9 (SIGKILL), pid 4084 on vm (rank 0 failed after it); its output is in"
    )
    assert (failure.rank, failure.cause, failure.status) == (1, "killed by signal 9 (SIGKILL)", "failed")
    resumed = failure_report(folder, 1, log_start=len("epoch 3\n" + KILLED))
    assert resumed.rank == 0, "a previous attempt's output in mpirun.log is not this job's"


def test_the_first_rank_to_raise_is_named_with_its_root_cause(tmp_path):
    folder = run_folder(
        tmp_path,
        ABORTED,
        {
            2: "ValueError: data.root: /d/batch_1 is not a CIFAR-10 batch file (data/cifar10.py:88)",
            0: "X: y",
            1: "Z",
        },
    )
    failure = failure_report(folder, 1)
    assert failure.message == (
        "rank 2 failed: ValueError: data.root: /d/batch_1 is not a CIFAR-10 batch file (data/cifar10.py:88) "
        f"(ranks 0, 1 failed after it); traceback in {folder / 'logs' / 'rank2.log'}"
    )
    assert (failure.rank, failure.status) == (2, "failed")
    diverged = failure_report(
        run_folder(tmp_path / "d", "", {1: "Diverged: non-finite loss nan at step 27"}), 3
    )
    assert (diverged.rank, diverged.status, diverged.cause) == (
        1,
        "diverged",
        "Diverged: non-finite loss nan at step 27",
    )


def test_a_lost_asgd_server_is_the_failed_rank_not_the_worker_that_noticed_it(tmp_path):
    noticed = (
        "ServerLost: server rank 2 (vm) was lost at step 212: it held state no other rank has, so the job "
        "ends; resume=RUN_DIR continues from the last checkpoint (/w/runner/rank/resilience/recovery.py:140)"
    )
    folder = run_folder(tmp_path / "s", "", {0: noticed, 1: noticed})
    failure = failure_report(folder, 1)
    assert (failure.rank, failure.status) == (2, "failed")
    assert failure.message == (
        "server rank 2 (vm) was lost at step 212: it held state no other rank has, so the job ends; "
        f"resume={folder} continues from the last checkpoint (rank 0 noticed it)"
    )


def test_a_cause_the_rank_could_only_print_is_named_rather_than_its_abort(tmp_path):
    """A read-only or full run folder: no error file, but the rank's ``rank N failed:`` line was seen."""
    said = [(1, "OSError: [Errno 30] Read-only file system: '/r/checkpoints' (x.py:9)"), (0, "other")]
    failure = failure_report(run_folder(tmp_path / "ro", ABORTED), 1, said=said)
    assert (failure.rank, failure.cause) == (1, said[0][1]), failure
    assert failure.message.startswith(f"rank 1 failed: {said[0][1]} (rank 0 failed after it)"), failure


def test_ranks_that_exited_or_aborted_without_a_word_are_named(tmp_path):
    assert failure_report(run_folder(tmp_path / "a", EXITED), 3)[1:] == (1, "exited with status 3", "failed")
    assert failure_report(run_folder(tmp_path / "b", ABORTED), 7)[1:3] == (
        0,
        "called MPI_Abort (error code 7)",
    )
    unknown = failure_report(run_folder(tmp_path / "c"), 1)
    assert unknown.rank is None and "exited with status 1 and no rank reported a cause" in unknown.message
    assert failure_report(run_folder(tmp_path / "d"), -9).cause == "mpirun was killed by signal 9 (SIGKILL)"


#: Open MPI's signal handler's report of a crashed rank (pid 4242), as mpirun.log has it under ULFM, where
#: no "noticed that process rank" line follows.
CRASHED = """epoch 0: val_loss 2.1
[vm:4242] *** Process received signal ***
[vm:4242] Signal: Segmentation fault (11)
[vm:4242] Signal code:  (0)
[vm:4242] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7fdf80200050]
[vm:4242] *** End of error message ***
"""


def test_a_rank_that_crashed_is_named_by_its_pid_unless_the_job_went_on_without_it(tmp_path):
    folder = run_folder(tmp_path / "a", CRASHED, errors={0: "RuntimeError: peer gone (x.py:1)"})
    ranks = [{"rank": 0, "pid": 100, "host": "vm"}, {"rank": 2, "pid": 4242, "host": "vm"}]
    (folder / "bindings.json").write_text(json.dumps({"ranks": ranks}))
    failure = failure_report(folder, 0)
    assert failure.rank == 2 and failure.cause == "crashed: Segmentation fault (11)", failure
    assert "pid 4242 on vm (rank 0 failed after it)" in failure.message
    (folder / "logs" / "lost.json").write_text(json.dumps({"lost": [2]}))
    assert failure_report(folder, 0).rank == 0, "a tolerated crash is not the job's cause"


def test_an_end_no_rank_explains_quotes_open_mpis_last_lines_not_the_ranks(tmp_path):
    folder = run_folder(tmp_path, "epoch 0: val_loss 2.1\nNBC_Progress: an error 75\n\nLAUNCHER JOB GONE\n")
    (folder / "logs" / "rank0.log").write_text("epoch 0: val_loss 2.1\n")
    cause = failure_report(folder, 255).cause
    assert cause.endswith("Open MPI's last lines: NBC_Progress: an error 75 | LAUNCHER JOB GONE"), cause


#: What Open MPI 5's mpirun printed when a killed mpirun's session files were in its way (exit 213).
NOT_STARTED = """--------------------------------------------------------------------------
The PMIx server's listener thread failed to start. We cannot
continue.
--------------------------------------------------------------------------
"""


def test_an_mpirun_that_did_not_start_is_named_with_open_mpis_message_and_a_hint(tmp_path):
    failure = failure_report(run_folder(tmp_path / "a", "some line\n" + NOT_STARTED), 213)
    said = "The PMIx server's listener thread failed to start. We cannot continue."
    assert failure.rank is None and failure.cause.startswith(f"mpirun exited with status 213: {said}")
    assert "ompi.<pid> folder" in failure.cause and str(tmp_path / "a" / "mpirun.log") in failure.message
    assert "no rank reported a cause" in failure_report(run_folder(tmp_path / "b", NOT_STARTED), 0).cause


@pytest.fixture
def cfg():
    return compose_config()


def summary(folder: Path) -> dict:
    text = (folder / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text, "strict JSON"
    return json.loads(text)


def test_an_ok_job_gets_its_summary_completed_in_strict_json(cfg, tmp_path):
    (tmp_path / "summary.json").write_text('{"status": "ok", "final_val_acc": 0.9, "final_val_loss": NaN}')
    result = conclude(cfg, tmp_path, Outcome(0), 12.5)
    assert result == summary(tmp_path)
    assert (result["exit_status"], result["wall_time_s"], result["final_val_loss"]) == (0, 12.5, None)


def test_an_interrupted_job_names_the_checkpoint_it_wrote_after_the_first_signal(cfg, tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoints").mkdir()
    entry = {"step": 20, "seq": 2, "dir": "00002-step20", "world_size": 2, "time": 1000.0}
    (tmp_path / "checkpoints" / "checkpoint.json").write_text(json.dumps({"checkpoints": [entry]}))
    for stop, expected in [
        (
            990.0,
            "its checkpoint 00002-step20 was written after the stop request: continue with resume="
            + str(tmp_path),
        ),
        (1010.0, "ended without a final checkpoint"),  # the checkpoint is older than the signal
    ]:
        with pytest.raises(JobEnded, match=re.escape(f"a second signal (SIGINT); {expected}")):
            conclude(cfg, tmp_path, Outcome(-9, "SIGINT", "a second signal (SIGINT)", stop_time=stop), 3.0)


@pytest.mark.parametrize(
    "job,outcome,status,expected",
    [
        (
            {"status": "preempted", "checkpoint": "00003-step40", "steps": 40},
            Outcome(0, "SIGTERM"),
            "preempted",
            "by SIGTERM: checkpoint 00003-step40 written after step 40; continue with: python -m runner",
        ),
        (
            {"status": "diverged", "error": "non-finite loss at step 3"},
            Outcome(0),
            "diverged",
            "non-finite loss",
        ),
        (
            None,
            Outcome(-9, "SIGINT", interrupted="a second signal (SIGINT)"),
            "interrupted",
            "a second signal (SIGINT); ended without a final checkpoint",
        ),
        (
            None,
            Outcome(-15, stall=Stall([1], "rank 1 (host h, pid 5) not responding since step 7")),
            "stalled",
            "rank 1 (host h, pid 5) not responding since step 7",
        ),
        (  # a server's process ended and no worker said so: the launcher ended the job
            None,
            Outcome(
                -15, lost=Stall([4], "server rank 4 (host h, pid 9) was lost at step 7: its process ended")
            ),
            "failed",
            "server rank 4 (host h, pid 9) was lost at step 7: its process ended; it wrote no checkpoint",
        ),
        ({"status": "ok"}, Outcome(1), "failed", "exited with status 1"),
        (None, Outcome(0), "failed", "the job exited 0 but wrote no summary.json"),
        (  # scancel: Slurm's SIGTERM reaches mpirun as well as the launcher; it was recorded failed
            None,
            Outcome(1, "SIGTERM", stop_time=0.0),
            "interrupted",
            "SIGTERM reached the job's own processes too (as Slurm's scancel and time limit send it)",
        ),
    ],
    ids=[
        "preempted",
        "diverged",
        "interrupted",
        "stalled",
        "lost",
        "failed",
        "no-summary",
        "signal-and-failed",
    ],
)
def test_each_way_a_job_ends_has_its_status_and_exit_status(cfg, tmp_path, job, outcome, status, expected):
    (tmp_path / "logs").mkdir()
    if job is not None:
        (tmp_path / "summary.json").write_text(json.dumps(job))
    with pytest.raises(JobEnded) as ended:
        conclude(cfg, tmp_path, outcome, 3.0)
    assert (ended.value.status, ended.value.code) == (status, EXIT[status])
    assert expected in str(ended.value)
    written = summary(tmp_path)
    assert (written["status"], written["exit_status"]) == (status, EXIT[status])
    if status == "stalled":
        assert written["stalled_ranks"] == [1] and written["cause"] == expected
    if outcome.lost:
        assert written["failed_rank"] == 4 and written["cause"] == outcome.lost.message
    if outcome.signal:
        assert written["signal"] == outcome.signal


class FullDisk(io.StringIO):
    """A file on a full disk: every write fails."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_a_summary_that_cannot_be_written_is_one_clear_line_and_loses_nothing(cfg, tmp_path, monkeypatch):
    """A full disk (every write of the temporary file fails): the ranks' summary.json stays as it was."""
    monkeypatch.setattr(runner.run_folder, "create_new", lambda path, binary=False: FullDisk())
    ranks = '{"status": "ok", "final_val_acc": 0.9}'
    (tmp_path / "summary.json").write_text(ranks)
    with pytest.raises(RunFolderError) as failed:
        conclude(cfg, tmp_path, Outcome(0), 1.0)
    assert str(failed.value) == (
        f"cannot write {tmp_path / 'summary.json'}: No space left on device; free space on its disk "
        f"(df -h {tmp_path}); the job itself ended ok"
    )
    assert failed.value.code == 1 and (tmp_path / "summary.json").read_text() == ranks
    (tmp_path / "summary.json").unlink()
    with pytest.raises(
        RunFolderError,
        match=r"No space left on device; free space .*; the job itself: failed: the job exited 0",
    ):
        conclude(cfg, tmp_path, Outcome(0), 1.0)


def test_a_run_folder_that_cannot_be_made_is_one_clear_line(cfg, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        RunFolderError, match=r"cannot write the run folder .*/file/run: (Not a directory|File exists)"
    ):
        prepare(cfg, tmp_path / "file" / "run")
    with pytest.raises(RunFolderError, match=r"cannot write .*/x\.json: Is a directory"):
        (tmp_path / ".x.json.tmp").mkdir()
        write_atomic(tmp_path / "x.json", "{}")


# Real jobs: launcher, mpirun and ranks.


class Job:
    """``python -m runner`` started in the background, with the run folder ``dir``."""

    def __init__(self, run_dir: Path, *overrides: str):
        self.dir = run_dir
        argv = [
            sys.executable,
            "-m",
            "runner",
            f"hydra.run.dir={run_dir}",
            "train.progress=false",
            *overrides,
        ]
        self.out = open(run_dir.parent / f"{run_dir.name}.out", "w+")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT, env=env)

    def rank_pid(self, rank: int, timeout: float = 90) -> int:
        """The pid of ``rank`` once the ranks are training (after their first validation)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            metrics = self.dir / "metrics.jsonl"
            if metrics.exists() and '"kind": "val"' in metrics.read_text():
                ranks = json.loads((self.dir / "bindings.json").read_text())["ranks"]
                return next(b["pid"] for b in ranks if b["rank"] == rank)
            assert self.proc.poll() is None, self.output()
            time.sleep(0.2)
        raise AssertionError("the job did not start training:\n" + self.output())

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def start(*overrides: str) -> Job:
        jobs.append(Job(tmp_path / f"run{len(jobs)}", *overrides))
        return jobs[-1]

    yield start
    for j in jobs:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()


LONG = ["train.epochs=200", "model=mlp"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_rank_killed_by_a_signal_is_named(job):
    run = job(*LONG)
    os.kill(run.rank_pid(1), signal.SIGKILL)
    assert run.wait() == 1, run.output()
    last = run.output().strip().splitlines()[-1]
    assert "job failed: rank 1 killed by signal 9 (SIGKILL), pid" in last, last
    s = run.summary
    assert (s["status"], s["failed_rank"], s["cause"]) == ("failed", 1, "killed by signal 9 (SIGKILL)")
    assert "noticed that process rank 1" not in run.output(), "the banner stays in mpirun.log"
    assert "noticed that process rank 1" in (run.dir / "mpirun.log").read_text()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_stopped_rank_ends_the_job_as_stalled_naming_it(job):
    """At half the timeout (6.5 s) the stopped rank's heartbeat may still be fresh (< 10 s), so the warning
    may name rank 0, waiting at the same step, beside it; at the timeout only the silent rank is named."""
    run = job(*LONG, "train.stall_timeout=13")
    pid = run.rank_pid(1)
    beat = run.dir / "logs" / "rank1.beat"
    while json.loads(beat.read_text())["step"] < 0:  # its heartbeat has seen it train
        time.sleep(0.1)
    os.kill(pid, signal.SIGSTOP)
    start = time.time()
    try:
        assert run.wait(timeout=60) == 4, run.output()
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert time.time() - start < 25
    output = run.output()
    lines = output.splitlines()
    warning = next((line for line in lines if "warning: " in line and "without progress" in line), "")
    assert f"rank 1 (host {os.uname().nodename}, pid {pid})" in warning, f"at half the timeout: {output}"
    assert f"job stalled: rank 1 (host {os.uname().nodename}, pid {pid}) not responding for " in output
    assert "(its last heartbeat: step " in output, "it had trained: its beat said so"
    assert "(where the ranks still running wait: logs/rank0.stacks, logs/rank1.stacks)" in output, output
    assert "worker.py" in (run.dir / "logs" / "rank0.stacks").read_text(), "rank 0's stack, in the runner"
    s = run.summary
    assert (s["status"], s["exit_status"], s["stalled_ranks"]) == ("stalled", 4, [1])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_checkpoints_and_exits_5(job, signum):
    run = job(*LONG)
    run.rank_pid(0)
    run.proc.send_signal(signum)
    assert run.wait() == 5, run.output()
    name = signal.Signals(signum).name
    assert (run.dir / "STOP").read_text().strip() == name
    s = run.summary
    assert (s["status"], s["exit_status"], s["signal"]) == ("preempted", 5, name)
    assert s["checkpoint"] and f"continue with: python -m runner resume={run.dir}" in run.output()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_failing_rank_shows_its_cause_once_on_the_console(job):
    run = job(f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]", "model=exploding", "train.epochs=3")
    assert run.wait() == 1
    output = run.output()
    cause = "RuntimeError: injected failure at forward call 5"
    assert output.count(cause) == 1, output
    faulty = Path("tests") / "helpers" / "faulty.py"  # the user's own code, from its working folder
    assert f"job failed: rank 1 failed: {cause} ({faulty}:" in output.splitlines()[-1]
    assert "MPI_ABORT" not in output and "Traceback" not in output and "prterun" not in output, output
    assert run.summary["failed_rank"] == 1 and run.summary["cause"].startswith(cause)


def test_job_ended_survives_pickling_as_a_sweep_point_sends_it_back():
    import pickle

    from runner.launcher.launch import JobEnded, RunFolderError

    for err in (JobEnded("diverged at step 3", "diverged"), RunFolderError("disk full")):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.status, back.code) == (type(err), str(err), err.status, err.code)


def test_a_finite_loss_that_exploded_is_a_divergence_named_with_its_rule():
    from runner.rank.guard import collapse

    assert collapse(50.0, 1.0, 100.0) is None and collapse(1e9, 1.0, None) is None
    why = collapse(212.4, 1.093, 100.0)
    assert why is not None and "212.4" in why and "194x" in why and "train.diverge_at=100" in why, why
    assert collapse(float("inf"), 1.0, None) == "validation loss inf"
    assert "nan" in collapse(float("nan"), 1.0, 100.0)
    assert collapse(5.0, 0.0, 100.0) is None, "a first loss of 0 gives no scale"


def test_a_refusal_of_the_runners_names_no_internal_line_a_users_error_its_own():
    """A ValueError the runner raises (its message names the key and the fix) gets no file:line of the
    runner's; an error in the user's code gets the user's line; a bug elsewhere its innermost frame."""
    from runner.rank.records.output import root_cause
    from runner.schema import require

    try:
        require(False, "root", "/x", "a folder holding input.txt")
    except ValueError as err:
        assert root_cause(err) == "ValueError: root='/x' is invalid: a folder holding input.txt"
    try:
        {}["missing"]
    except KeyError as err:
        assert root_cause(err).startswith("KeyError: 'missing' (tests/launcher/test_failures.py:")
    try:
        import json

        json.loads("{")
    except ValueError as err:  # passed through the user's code (this test): its line, not json's
        assert "(tests/launcher/test_failures.py:" in root_cause(err)


def test_the_faults_line_says_who_was_lost_and_joined_and_how_the_job_ended():
    from runner.launcher.echo import faults_line

    lost = [{"rank": 2, "step": 19}, {"rank": 0, "step": 30}]
    healed = {"status": "ok", "failures": lost, "joins": [{"rank": 4, "step": 20}], "workers_at_end": 3}
    assert faults_line({**healed, "recovery_time_s": 0.034}) == (
        "faults: lost rank 2 at step 19, rank 0 at step 30; joined rank 4 at step 20; survived with 3 "
        "workers at the end (recovering took 0.03 s)"
    )
    ended = faults_line({"status": "failed", "failures": lost[:1], "workers_at_end": 3})
    assert ended.startswith("faults: lost rank 2 at step 19; ended failed with 3 workers"), ended
    assert faults_line({"status": "ok", "failures": [], "joins": []}) is None
