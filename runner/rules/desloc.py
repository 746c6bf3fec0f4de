"""DES-LOC: local adaptive steps; parameters, first and second moments averaged on periods of their own.

Desynced Low Communication adaptive optimizers (Iacob et al., ICLR 2026, arXiv 2505.22549). Every worker
runs the loop's optimizer (``optim=``) on its own batches; its state is the parameters x, the first moment
u (Adam's ``exp_avg``, SGD's ``momentum_buffer``) and the second moment v (Adam's ``exp_avg_sq``, and
``max_exp_avg_sq`` under amsgrad; SGD has none). After local step t (t = 1, 2, ...; the loop's optimizer step
taken), with K_x = ``param_period``, K_u = ``momentum_period``, K_v = ``variance_period``:

    x ← (1/N) Σ_i x_i   if t mod K_x = 0
    u ← (1/N) Σ_i u_i   if t mod K_u = 0
    v ← (1/N) Σ_i v_i   if t mod K_v = 0

and every other tensor stays the worker's own. K_x = K_u = K_v = K is Local Adam (all state averaged every K
steps); with SGD and K_x = 1 the parameters follow ``rule=bsp rule.mode=params rule.avg_freq=1`` whatever K_u
(SGD's step is linear in the buffer, so averaging it does not move the mean); with K_u, K_v beyond the run,
``avg_freq=K_x``. The periods need not divide each other (the paper's own toy problem runs K_x = K_u = 192,
K_v = 692); K_x <= K_u <= K_v is required: a moment drifts slower than the parameters, which is the paper's
reason to average it less often, so a shorter moment period is a mistake in the settings (K_u = K_x is
allowed). BatchNorm statistics are averaged with the parameters.

Defaults: K_x = 10, K_u = 30, K_v = 60, the paper's ratios K_u = 3·K_x and K_v = 6·K_x at the period that
DiLoCo's defaults use for short jobs (digits, 10 epochs: 120 steps on 4 workers, 12 parameter averages;
final accuracy 0.95-0.97 with the MLP and SGD over seeds 0-2, where BSP ends at 0.95; 0.99 with the CNN).
The paper's runs take much longer periods for much longer jobs.

Bytes per step and worker, each average one all-reduce of a flat buffer (2(N−1)/N of it sent), P float32
parameters: 2(N−1)/N · 4P · (w/K_x + 1/K_u + a/K_v), where w = 1 (½ with ``comm_dtype: bf16|fp16``, which
sends the parameters in 16 bits as DiLoCo does), a = 1 for Adam (2 with amsgrad), and SGD has no v term
(nor a u term without momentum). The moments always travel in float32: a squared gradient underflows
fp16's range, and they are sent 3-6 times less often anyway. The defaults with Adam: 0.15 of a float32
all-reduce of the model per step, 1.5 times DiLoCo's at H = 10 (0.1), half of Local Adam's at K = 10 (0.3),
1/6.7 of DDP's (1). Besides: worker 0's model broadcast at build (all workers start from it, whatever
``train.same_init``), and mid-period validations (a float32 mean of the parameters).

Validation at a step where the parameters were just averaged reports the workers' (identical) model;
mid-period, a copy set to the workers' mean parameters and statistics, so that validating does not change
training. Checkpoints: the step count and sync counts; the local parameters and moments are saved with the
model and the optimizer, so a resume is exact. Lost workers (``hardware.fault_tolerance=continue``): the
survivors take worker 0's step count and average parameters, statistics and moments over themselves (an
average may have completed on some of them only; the mean keeps every survivor's progress, where worker
0's would drop N−2 workers' steps since the last average). New workers (``heal``) join where the
parameters were just averaged (t mod K_x = 0): they take worker 0's model (the workers' mean), optimizer
state and step count, and their moments are worker 0's until the next moment average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.flat import FlatTensors, float_buffers, message_buffer
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

#: The optimizer state each period averages, by the names torch's optimizers give it.
MOMENTS = ("exp_avg", "momentum_buffer")
VARIANCES = ("exp_avg_sq", "max_exp_avg_sq")
#: The optimizers whose state those names cover (``optim=custom`` may name them too).
KNOWN = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.SGD")
OPTIM_HINT = (
    "rule=desloc averages the optimizer's moments by their names (Adam's exp_avg and exp_avg_sq, SGD's "
    "momentum_buffer) and cannot name this optimizer's: use optim=adam, optim=adamw or optim=sgd (or "
    "optim=custom with optim._target_=" + "|".join(KNOWN) + "), or a rule that keeps the optimizer's state "
    "local (rule=diloco, rule=bsp rule.mode=params)"
)


@dataclass
class DesLocConfig(RuleConfig):
    param_period: int = 10
    momentum_period: int = 30
    variance_period: int = 60

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.param_period >= 1,
            "param_period",
            self.param_period,
            "steps between averages of the parameters (K_x), >= 1 (e.g. 10 for short jobs)",
        )
        require(
            self.momentum_period >= max(1, self.param_period),
            "momentum_period",
            self.momentum_period,
            f"steps between averages of the first moment (K_u), >= rule.param_period={self.param_period} "
            f"(the paper: 3 times it, e.g. {3 * max(1, self.param_period)})",
        )
        require(
            self.variance_period >= max(1, self.momentum_period),
            "variance_period",
            self.variance_period,
            f"steps between averages of the second moment (K_v), >= rule.momentum_period="
            f"{self.momentum_period} (the paper: 6 times rule.param_period, e.g. "
            f"{6 * max(1, self.param_period)})",
        )

    def check_optim(self, optim: Any) -> None:
        """Only optimizers whose state :data:`MOMENTS` and :data:`VARIANCES` name."""
        from runner.optim.adam import AdamConfig
        from runner.optim.sgd import SGDConfig
        from runner.schema.target import Target

        if isinstance(optim, Target):
            require(optim.path in KNOWN, "optim._target_", optim.path, OPTIM_HINT)
        else:
            name = type(optim).__name__
            require(isinstance(optim, AdamConfig | SGDConfig), "optim", name, OPTIM_HINT)

    def build(self, ctx: RuleContext) -> DesLoc:
        return DesLoc(self, ctx)


def known_optimizer(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer``'s state is named by :data:`MOMENTS` and :data:`VARIANCES` (None: no state)."""
    return optimizer is None or isinstance(optimizer, torch.optim.Adam | torch.optim.SGD)


class _Packed:
    """Tensors of one kind copied into one flat buffer per dtype and device, all-reduced and written back.

    Copies, not views: the optimizer's ``load_state_dict`` replaces its state tensors."""

    def __init__(self, tensors: list[torch.Tensor]):
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        self.groups = []
        for (dtype, device), ts in groups.items():
            flat = message_buffer(sum(t.numel() for t in ts), dtype, device)
            torch.cat([t.reshape(-1) for t in ts], out=flat)
            self.groups.append((flat, ts))

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [flat for flat, _ in self.groups]

    def write_back(self) -> None:
        for flat, ts in self.groups:
            offset = 0
            for t in ts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class DesLoc(Rule):
    """Local steps; parameters, first moments and second moments averaged every K_x, K_u, K_v steps."""

    def __init__(self, cfg: DesLocConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        if not known_optimizer(self.optimizer):
            raise ValueError(f"optim: {type(self.optimizer).__name__} is invalid: {OPTIM_HINT}")
        self.cfg = cfg
        self.periods = (cfg.param_period, cfg.momentum_period, cfg.variance_period)
        self.flat = FlatTensors(p for p in self.model.parameters() if p.requires_grad)
        self._take_worker_0_model()
        self.local_steps = 0
        self.syncs = [0, 0, 0]  # averages of the parameters, first moments, second moments so far

    @no_grad
    def _take_worker_0_model(self) -> None:
        """All workers start from worker 0's parameters and buffers."""
        if self.workers.size > 1 and not self.joined:  # joined: worker 0's model comes with the state
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.workers.broadcast(t.data, root=0)

    def _state(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        """The optimizer's state tensors called ``names``, in the order of its parameters."""
        if self.optimizer is None:
            return []
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                out += [state[name] for name in names if torch.is_tensor(state.get(name))]
        return out

    def after_step(self, step: int) -> None:
        self.local_steps += 1
        due = [self.local_steps % k == 0 for k in self.periods]
        if any(due):
            self.average(*due)

    @no_grad
    def average(self, params: bool, moments: bool, variances: bool) -> None:
        """Set the kinds of state asked for to the workers' mean.

        All communication first, then the writes, so that a failed all-reduce (a lost worker) leaves every
        tensor as it was."""
        xs = [*self.flat.buffers, *float_buffers(self.model)] if params else []
        k = len(self.flat.buffers) if params else 0
        asked = ((MOMENTS, moments), (VARIANCES, variances))
        kinds = [_Packed(self._state(names) if due else []) for names, due in asked]
        if self.workers.size > 1:
            means = self._mean_of_workers(xs[:k], self.wire) + self._mean_of_workers(xs[k:])
            for packed in kinds:
                for flat in packed.buffers:
                    self.workers.allreduce(flat).div_(self.workers.size)
            for x, mean in zip(xs, means, strict=True):
                x.copy_(mean)
            for packed in kinds:
                packed.write_back()
        self.syncs[0] += int(params)
        for i, packed in enumerate(kinds, start=1):
            self.syncs[i] += int(bool(packed.groups))

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """Where the parameters were just averaged the workers' model; mid-period the workers' mean.

        The mean is a copy (parameters and statistics, in float32)."""
        if self.local_steps % self.cfg.param_period == 0 or self.workers.size == 1:
            return {"": self.model}
        return {"": self._workers_mean_copy(self.flat)[0]}

    def metrics(self) -> dict[str, float]:
        """The averages of each kind so far (equal on all workers)."""
        x, u, v = self.syncs
        return {"param_syncs": x, "momentum_syncs": u, "variance_syncs": v}

    def final_metrics(self) -> dict[str, object]:
        return {**self.metrics(), "local_steps": self.local_steps}

    def state_dict(self) -> dict[str, Any]:
        """The step count and the averages so far.

        The local parameters and moments are saved with the model and the optimizer."""
        return {"local_steps": self.local_steps, "syncs": list(self.syncs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local_steps, self.syncs = state["local_steps"], list(state["syncs"])

    @property
    def ready_to_grow(self) -> bool:
        """New workers join where the parameters were just averaged (they take worker 0's, the mean)."""
        return self.local_steps % self.cfg.param_period == 0

    def recover(self) -> None:
        """The survivors take worker 0's step count and average every kind of state over themselves.

        An average may have completed on some of them only; the extra average is not counted."""
        self.local_steps, self.syncs = self.workers.broadcast_object((self.local_steps, self.syncs), root=0)
        syncs = list(self.syncs)
        self.average(True, True, True)
        self.syncs = syncs
