"""The deferred ``torch._dynamo``: eager training never imports it and trains exactly as with it, and the
real package takes its place, whole and once, as soon as anything compiles or asks for more."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Each check runs in a fresh interpreter: what is imported is process-wide.
TRAIN = """
import json, sys, torch
from runner.rank import dynamo

def train(opt_cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = opt_cls(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for i in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(8, 5)), torch.arange(8) % 3).backward()
        opt.step()
        sched.step()
    opt.load_state_dict(opt.state_dict())
    return [p.detach().clone() for p in model.parameters()]

deferred = dynamo.defer() if sys.argv[1] == "defer" else None
trained = train(torch.optim.SGD, lr=0.1, momentum=0.9) + train(torch.optim.AdamW, lr=0.01)
out = {"deferred": deferred, "loaded_after_training": dynamo.real() is not None,
       "params": [t.flatten().tolist() for t in trained]}
"""

LATER = {
    # a submodule first: the real package is imported before it, and nothing twice
    "submodule": """
import torch._dynamo.config as config
out["same_config"] = config is torch._dynamo.config is sys.modules["torch._dynamo.config"]
out["real"] = type(sys.modules["torch._dynamo"]).__name__
""",
    "from": """
from torch._dynamo import config
out["same_config"] = config is sys.modules["torch._dynamo.config"] is torch._dynamo.config
out["real"] = type(sys.modules["torch._dynamo"]).__name__
""",
    # compiling after eager steps: the optimizer's methods wrapped while deferred now go through the
    # real disable, and a compiled training step gives the eager step's result
    "compile": """
torch.manual_seed(1)
model = torch.nn.Linear(4, 2)
twin = torch.nn.Linear(4, 2)
twin.load_state_dict(model.state_dict())
x = torch.randn(6, 4)
def step(m, opt):
    opt.zero_grad()
    m(x).square().sum().backward()
    opt.step()
opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
step(model, opt)
torch.compile(step, backend="eager")(twin, twin_opt)
out["compiled_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
out["real"] = type(sys.modules["torch._dynamo"]).__name__
out["defer_again"] = dynamo.defer()
""",
}


def run_all(scripts: dict[str, str]) -> dict[str, dict]:
    """Run each script in its own interpreter, at once; their ``out`` dictionaries by name."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(TRAIN + body + "\nprint(json.dumps(out))"), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (mode, body) in scripts.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


@pytest.mark.slow
def test_deferred_dynamo_trains_exactly_as_torch_does_and_gives_way_to_the_real_one():
    results = run_all(
        {
            "eager": ("plain", ""),
            **{name: ("defer", body) for name, body in LATER.items()},
        }
    )
    eager = results.pop("eager")
    assert eager["deferred"] is None and eager["loaded_after_training"]  # torch alone imports it
    for name, result in results.items():
        assert result["deferred"] is True, name
        assert result["loaded_after_training"] is False, name  # SGD, AdamW, a scheduler: never imported
        assert result["params"] == eager["params"], name  # bit for bit the same training
        assert result["real"] == "module", name  # the real package took the place
    assert results["submodule"]["same_config"] and results["from"]["same_config"]
    assert results["compile"]["compiled_equal"]
    assert results["compile"]["defer_again"] is False  # once real, it stays real
