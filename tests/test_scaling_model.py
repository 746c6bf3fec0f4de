"""The scaling model (``benchmarks/scaling_model.py``, docs/scaling.md): its math on hand-computed numbers,
the claims the page makes (NCCL beats staged MPI, bf16 halves the exchange, efficiency ≤ 1 and falling with
nodes), ``--inputs`` overrides and refusals, and the script's smoke mode."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "scaling_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("scaling_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


sm = _load()


def test_ring_allreduce_matches_the_formula_by_hand():
    # 100 MB over 4 ranks at 50 GB/s, 10 µs a hop: 2·3/4 · 100e6 B / 50e9 B/s = 3 ms; 2·3 hops · 10 µs = 60 µs
    assert sm.ring_allreduce_s(100, 4, 50, 10) == pytest.approx(3.060e-3, rel=1e-12)
    # 244.4 MB over 8 GPUs at 370 GB/s, no latency: 1.75 · 244.4 / 370 ms
    assert sm.ring_allreduce_s(244.4, 8, 370, 0) == pytest.approx(1.75 * 244.4 / 370 * 1e-3, rel=1e-12)
    assert sm.ring_allreduce_s(100, 1, 50, 10) == 0.0  # one rank: nothing to exchange


def test_measured_inputs_give_the_per_step_figures_by_hand():
    d = sm.derived(sm.load_inputs(), "alexnet")
    assert d["steps"] == 20  # 5120 / (2 ranks · 128)
    assert d["compute_s"] == pytest.approx(0.23 / 20)
    assert d["comm_s"] == pytest.approx(3.14 / 20)
    assert d["size_mb"] == pytest.approx(244.4)
    assert sm.derived(sm.load_inputs(), "resnet50")["steps"] == 40  # 5120 / (2 ranks · 64)


@pytest.mark.parametrize("model", sm.MODELS)
def test_host_bandwidth_reproduces_the_measured_communication(model):
    """B_host is calibrated so that the staged formula, at the measured job (2 ranks on one GPU sharing
    its PCIe link), gives back the measured communication per step."""
    inputs = sm.load_inputs()
    v = {k: i.value for k, i in inputs.items()}
    d = sm.derived(inputs, model)
    again = d["copies_s"] + sm.ring_allreduce_s(d["size_mb"], 2, d["host_gbps"], v["alpha_host_us"])
    assert again == pytest.approx(d["comm_s"], rel=1e-9)
    assert d["copies_s"] == pytest.approx(2 * 2 * d["size_mb"] / (1e3 * v["pcie_gbps"]))


def test_nccl_on_one_node_is_the_nvlink_ring():
    inputs = sm.load_inputs()
    want = sm.ring_allreduce_s(244.4, 8, 370, 1)
    assert sm.comm_s(inputs, "alexnet", "NCCL fp32", 1) == pytest.approx(want, rel=1e-9)
    # two nodes add an all-reduce of S/8 between 2 nodes over one IB port per GPU: 2·1/2 · 30.55 MB / 50 GB/s
    two = sm.comm_s(inputs, "alexnet", "NCCL fp32", 2)
    assert two - want == pytest.approx(244.4 / 8 / 50e3 + 2 * 5e-6, rel=1e-9)


def test_nccl_beats_staged_for_alexnet_on_8_gpus():
    table = {r["exchange"]: r for r in sm.rows(sm.load_inputs(), ["alexnet"], [1])}
    staged, nccl = table["staged MPI fp32"], table["NCCL fp32"]
    assert nccl["gpus"] == staged["gpus"] == 8
    assert nccl["comm_ms"] * 50 < staged["comm_ms"]
    assert nccl["step_ms_off"] < staged["step_ms_off"] and nccl["step_ms_on"] < staged["step_ms_on"]
    assert nccl["eff_off"] > staged["eff_off"]


@pytest.mark.parametrize("nodes", [1, 2, 64])
@pytest.mark.parametrize("model", sm.MODELS)
def test_bf16_halves_the_communication_term(model, nodes):
    inputs = sm.load_inputs({"alpha_nvlink_us": 0, "alpha_ib_us": 0})  # the latency term does not halve
    fp32 = sm.comm_s(inputs, model, "NCCL fp32", nodes)
    assert sm.comm_s(inputs, model, "NCCL bf16", nodes) == pytest.approx(fp32 / 2, rel=1e-12)


@pytest.mark.parametrize("model", sm.MODELS)
def test_efficiency_at_most_one_and_falling_with_nodes(model):
    table = sm.rows(sm.load_inputs(), [model], list(sm.NODES))
    for exchange in sm.EXCHANGES:
        mine = [r for r in table if r["exchange"] == exchange]
        assert [r["nodes"] for r in mine] == list(sm.NODES)
        for key in ("eff_off", "eff_on"):
            effs = [r[key] for r in mine]
            assert all(0 < e <= 1 for e in effs), (exchange, key, effs)
            assert effs == sorted(effs, reverse=True), (exchange, key, effs)
        off = [r["eff_off"] for r in mine]  # without overlap, strictly
        assert all(a > b for a, b in zip(off[:-1], off[1:], strict=True)), (exchange, off)


def test_a_push_staged_and_on_nccl_by_hand():
    """One push of AlexNet's 244.4 MB: staged, both PCIe copies and the host's 1.76 GB/s; on NCCL, the MPI
    control message, then NVLink (IB across nodes); the ratio is what the hardware page quotes."""
    inputs = sm.load_inputs()
    host = sm.derived(inputs, "alexnet")["host_gbps"]
    rows = {r["where"]: r for r in sm.p2p_rows(inputs, ["alexnet"])}
    staged = 2 * 244.4 / 53 + 244.4 / host + 2e-3  # ms
    assert rows["one node"]["staged_ms"] == pytest.approx(staged, rel=1e-9)
    assert rows["one node"]["nccl_ms"] == pytest.approx(2e-3 + 244.4 / 370 + 1e-3, rel=1e-9)
    assert rows["two nodes"]["nccl_ms"] == pytest.approx(2e-3 + 244.4 / 50 + 5e-3, rel=1e-9)
    assert rows["two nodes"]["staged_ms"] == pytest.approx(staged, rel=1e-9)  # B_host < B_ib: host-bound
    for r in rows.values():
        assert r["nccl_ms"] * 10 < r["staged_ms"] and r["compute_ms"] == pytest.approx(11.5)
    slow_host = sm.load_inputs({"ib_gbps": host / 2})  # a fabric slower than the host: it bounds both
    across = {r["where"]: r for r in sm.p2p_rows(slow_host, ["alexnet"])}["two nodes"]
    assert across["staged_ms"] == pytest.approx(2 * 244.4 / 53 + 244.4 / (host / 2) + 2e-3, rel=1e-9)


def test_overlap_hides_at_most_the_backward():
    assert sm.step_s(0.030, 0.010, 2 / 3, True) == pytest.approx(0.030)  # 10 ms under a 20 ms backward
    assert sm.step_s(0.030, 0.050, 2 / 3, True) == pytest.approx(0.060)  # 30 ms exposed
    assert sm.step_s(0.030, 0.050, 2 / 3, False) == pytest.approx(0.080)


def test_inputs_json_overrides_a_value_and_names_its_source(tmp_path):
    path = tmp_path / "lent.json"
    path.write_text(json.dumps({"pcie_gbps": 26.5, "ib_gbps": {"value": 25, "source": "lent cluster"}}))
    inputs = sm.read_inputs(path)
    assert inputs["pcie_gbps"].value == 26.5 and inputs["pcie_gbps"].source == str(path)
    assert inputs["ib_gbps"] == sm.Input(25.0, "GB/s", "lent cluster")
    assert inputs["nvlink_bus_gbps"] == sm.INPUTS["nvlink_bus_gbps"]
    slower = sm.comm_s(inputs, "alexnet", "NCCL fp32", 2)
    assert slower > sm.comm_s(sm.load_inputs(), "alexnet", "NCCL fp32", 2)


def test_unknown_input_is_refused_with_the_valid_keys(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"pcie_gbs": 26.5}))
    with pytest.raises(ValueError, match="'pcie_gbs'") as err:
        sm.read_inputs(path)
    assert all(key in str(err.value) for key in sm.INPUTS), str(err.value)


@pytest.mark.parametrize("value", [0, -1, "fast", True, None])
def test_an_input_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ValueError, match="pcie_gbps"):
        sm.load_inputs({"pcie_gbps": value})


def test_cli_refuses_an_unknown_key(tmp_path, capsys):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"bogus": 1}))
    assert sm.main(["--inputs", str(path), "--smoke"]) == 2
    assert "unknown input 'bogus'" in capsys.readouterr().err


def test_markdown_tables(capsys):
    assert sm.main(["--nodes", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "| `pcie_gbps` | 53 | GB/s |" in out
    assert re.search(r"^\| resnet50 \| NCCL bf16 \| 2 \| 16 \|", out, re.M)
    assert re.search(r"^\| alexnet \| staged MPI fp32 \| [\d.]+–[\d.]+ \| [\d.]+–[\d.]+ \|$", out, re.M)
    assert "| Horovod |" in out and "| Theano-MPI |" in out


@pytest.mark.slow
def test_smoke_prints_the_alexnet_8_gpu_rows():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    num = r"\d+\.\d+"
    for exchange in sm.EXCHANGES:
        pattern = rf"^\| alexnet \| {exchange} \| 1 \| 8 (\| {num} ){{5}}\| {num} \|$"
        assert re.search(pattern, proc.stdout, re.M), f"no row for {exchange}:\n{proc.stdout}"
    assert "resnet50" not in proc.stdout


@pytest.mark.parametrize(
    "argv",
    [["--tables", t] for t in ("inputs", "scaling", "p2p", "published")]
    + [["--nodes", "1", "--tables", "steps"]],
)
def test_the_page_holds_the_scripts_tables_as_they_are(argv, capsys):
    """docs/scaling.md pastes the script's tables: a change of input or formula that is not pasted fails."""
    assert sm.main(argv) == 0
    table = capsys.readouterr().out.strip()
    assert table in (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8"), f"re-paste {' '.join(argv)}"
