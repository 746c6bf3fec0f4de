"""``hardware.transport``: the workers' tensor collectives on ``torch.distributed`` (NCCL on GPUs; gloo, its
stand-in here, on CPU) give what MPI gives, for every operation and every rule, and how it is chosen."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from runner.comm.dist import NCCL_ERRORS
from runner.hardware.cpu import CPUConfig
from runner.hardware.gpu import GPUConfig
from runner.rank.placement import choose_transport, nccl_shares_gpus
from runner.run_folder import MODEL
from tests.conftest import ROOT, checked_config, mpirun_argv
from tests.helpers.rules import needs, variants

JOB = ROOT / "tests" / "helpers" / "transport_job.py"


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda: CPUConfig(transport="nccl"), "NCCL carries CUDA tensors but hardware.device=cpu"),
        (lambda: GPUConfig(transport="gloo"), "gloo is torch.distributed's CPU backend"),
        (lambda: CPUConfig(transport="gloo", fault_tolerance="heal"), "grows .* keeps its collectives"),
        (lambda: CPUConfig(transport="gloo", fault_tolerance="continue", max_workers=4), "grows"),
        (lambda: CPUConfig(transport="ncll"), "one of"),
    ],
)
def test_transports_that_cannot_run_are_refused_naming_the_key(make, hint):
    with pytest.raises(ValueError, match=rf"transport.*{hint}"):
        make()


class RecordedNCCL:
    """Stands in for ``ProcessGroupNCCL`` (absent from CPU builds of torch): records how it was made."""

    made: list[RecordedNCCL] = []

    def __init__(self, store, rank: int, size: int, options):  # noqa: ANN001
        self.rank, self.size, self.options, self.calls = rank, size, options, []
        self.errors = os.environ.get(NCCL_ERRORS[0])  # as the constructor reads it
        self.store = store
        store.set("made", "1")  # the store works
        RecordedNCCL.made.append(self)

    Options = staticmethod(lambda: SimpleNamespace(_timeout=None, group_name=""))

    def __getattr__(self, name: str):  # noqa: ANN204
        return lambda *args: self.calls.append((name, *args))


@pytest.mark.parametrize("tolerant", [True, False])
def test_an_nccl_group_is_made_and_replaced_as_torch_needs(monkeypatch, tolerant):
    """What the NCCL branch asks of torch, on a stand-in: the timeout, a name per generation, the communicator
    made at once on this rank's GPU; under fault tolerance torch's watchdog may not end the process after
    a failure (NCCL's errors raise in the waiting call); a rebuild aborts the old group and keeps it."""
    from runner.comm import dist

    monkeypatch.setattr(dist.c10d, "ProcessGroupNCCL", RecordedNCCL, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv(NCCL_ERRORS[0], raising=False)
    RecordedNCCL.made = []
    alone = SimpleNamespace(
        rank=0, size=1, tolerant=tolerant, local_size=lambda: 1, broadcast_object=lambda x: x
    )
    transport = dist.Transport(alone, "nccl", timeout_s=42)
    transport.rebuild(alone)
    first, second = RecordedNCCL.made
    assert [g.options.group_name for g in (first, second)] == ["mpitrain1", "mpitrain2"]
    assert first.options._timeout.total_seconds() == 42 and (first.rank, first.size) == (0, 1)
    assert first.errors == second.errors == (NCCL_ERRORS[1] if tolerant else None)
    assert ("eager_connect_single_device", torch.device("cuda", 0)) in first.calls
    assert ("abort",) in first.calls and ("abort",) not in second.calls
    assert transport.retired == [first] and transport.group is second
    assert second.store.get("made") == b"1" and transport.store.check(["mpitrain/2/made"])


def test_nccl_on_the_cpu_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"hardware.transport.*use hardware=gpu"):
        checked_config(["hardware.transport=nccl"])


class _Workers(SimpleNamespace):
    def allgather_object(self, obj):
        raise AssertionError("no collective is needed to choose a CPU transport")


@pytest.mark.parametrize("asked, chosen", [("auto", "mpi"), ("mpi", "mpi"), ("gloo", "gloo")])
def test_the_transport_chosen_on_the_cpu(asked, chosen):
    assert choose_transport(CPUConfig(transport=asked), _Workers(), torch.device("cpu")) == (chosen, None)


def test_several_ranks_share_a_gpu_from_nccl_2_30():
    assert nccl_shares_gpus("2.30.1") and nccl_shares_gpus("3.0.0") and nccl_shares_gpus("2.31")
    assert not nccl_shares_gpus("2.29.7") and not nccl_shares_gpus("2.28.3") and not nccl_shares_gpus("1.31")


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_every_collective_on_gloo_equals_mpi(ranks):
    """All-reduces (sum, max, min; blocking, non-blocking, queued), the 16-bit exchange in bf16 and fp16,
    broadcasts from every root, all-to-all and all-gather: tests/helpers/transport_job.py."""
    proc = subprocess.run(
        mpirun_argv(ranks, sys.executable, "-m", "mpi4py", str(JOB), "gloo"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(f"transport checks passed on {ranks} ranks (gloo)") == ranks


#: Per rule and variant: its overrides. Rules that train on static shards are deterministic, so the model a
#: gloo run ends with must equal the MPI run's: 10 steps, with an exchange every 3 (float32 sums in another
#: order differ in the last bit, and training amplifies that: about 1e-6 after 16 steps, 1e-4 after 46).
#: The asynchronous ones (their exchanges are MPI's point-to-point messages on either transport) train three
#: epochs, their collectives (validation's averages, broadcasts) on gloo; their accuracy depends on timing.
#: What gloo carries is the same for all of them: ASGD and GoSGD (a server; gossip) stand for the others
#: (:data:`ALIKE`). Left out too: DiLoCo, EASGD (sync) and DES-LOC, whose exchanges are float32 all-reduces
#: of whole tensors, as BSP's in both its modes (a job of each is 10-20 s of CI).
SHORT = ["train.max_steps=10"]
ASYNC = ["train.epochs=3"]
RULES = {
    "bsp": {"grads": SHORT, "bf16": [*SHORT, "rule.comm_dtype=bf16"], "params": [*SHORT, "rule.mode=params"]},
    "sparseloco": {"": [*SHORT, "rule.inner_steps=3"]},
    "demo": {"": [*SHORT, *needs("demo")]},
    "asgd": {"": ASYNC},
    "gosgd": {"": ASYNC},
}
ALIKE = ("easgd", "async_diloco", "diloco", "desloc")
COMMON = ["devices=3", "hardware.oversubscribe=true", "train.val_every=1"]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("rule, overrides", variants(RULES, default=SHORT, leave_out=ALIKE))
def test_rules_train_alike_on_gloo_and_on_mpi(cli, rule, overrides):
    gloo = cli(f"rule={rule}", *overrides, *COMMON, "hardware.transport=gloo", timeout=240)
    assert gloo.returncode == 0, gloo.output
    assert gloo.summary["versions"]["transport"] == "gloo"
    if gloo.summary["assignment"] != "static":
        assert gloo.summary["final_val_acc"] > 0.6, gloo.summary  # (10 classes; 0.76-0.97 seen)
        return
    mpi = cli(f"rule={rule}", *overrides, *COMMON, timeout=240)
    assert mpi.returncode == 0, mpi.output
    assert mpi.summary["versions"]["transport"] == "mpi"
    ours = torch.load(gloo.dir / MODEL, weights_only=True)
    theirs = torch.load(mpi.dir / MODEL, weights_only=True)
    ours, theirs = ours.get("model", ours), theirs.get("model", theirs)
    for name, value in theirs.items():
        assert torch.allclose(ours[name].double(), value.double(), rtol=1e-6, atol=1e-6), name
    assert gloo.summary["final_val_loss"] == pytest.approx(mpi.summary["final_val_loss"], rel=1e-6)
