"""A hardware profile fitted to timed steps (``jaxpar plan --fit SWEEP.csv``,
:mod:`jaxpar.lab.fit`): the fit recovers a known machine, ranks layouts it was not fitted
on, and writes a profile that loads back."""

import csv
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.lab import fit, hardware


def _machine() -> hardware.Hardware:
    """A made-up machine: 50 GFLOP/s, 20 GB/s for the temporaries and 60 GB/s for the
    state, 2 GB/s between devices, 0.2 ms per device a collective waits for, 3 ms per
    step."""
    base = hardware.get_profile("h100")
    return replace(
        base,
        flops_f32=50e9,
        flops_bf16=50e9,
        hbm_bandwidth=20e9,
        state_bandwidth=60e9,
        link_bandwidth=2e9,
        links=1,
        collective_latency=2e-4,
        latency_per="participant",
        step_overhead=3e-3,
        matmul_efficiency=1.0,
        link_efficiency=1.0,
    )


def _rows(n: int = 24, seed: int = 0) -> list[fit.Timed]:
    """Layouts whose steps are what :func:`_machine` takes: some bound by compute, some
    by memory (a tenth to half of it the state's), with 10-100 collectives of 1-10 arrays
    over groups of 2-8 devices."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ops = float(rng.integers(10, 100))
        traffic = float(rng.uniform(1e8, 8e9))
        row = fit.Timed(
            f"layout{i}",
            float(rng.uniform(1e9, 2e10)),
            traffic,
            traffic * float(rng.uniform(0.1, 0.5)),
            float(rng.uniform(1e6, 1e8)),
            {
                "collective": ops,
                "array": ops * float(rng.integers(1, 10)),
                "participant": ops * float(rng.integers(2, 9)),
            },
            0.0,
        )
        rows.append(row)
    seconds = fit.predicted_seconds(_machine(), rows)
    return [replace(r, seconds=s) for r, s in zip(rows, seconds, strict=True)]


def test_the_fit_recovers_the_machine_that_timed_the_steps():
    """Steps timed by a known machine: the fitted profile predicts each step to 1e-4, pays
    latency per participant as that machine does, and its constants are the machine's
    (the compute and memory rates to 1e-3: each bounds some of the steps)."""
    rows = _rows(32)
    hw = fit.fit_profile(rows, hardware.get_profile("h100"))
    truth = _machine()
    np.testing.assert_allclose(
        fit.predicted_seconds(hw, rows), [r.seconds for r in rows], rtol=1e-4
    )
    assert hw.latency_per == "participant"
    fitted = ("flops_f32", "hbm_bandwidth", "state_bandwidth", "link_bandwidth")
    for field in (*fitted, "collective_latency"):
        assert getattr(hw, field) == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert hw.step_overhead == pytest.approx(truth.step_overhead, rel=1e-3)
    assert fit.held_out(rows, hardware.get_profile("h100")) == pytest.approx((1.0, 1.0))


def test_a_sweep_whose_few_layouts_communicate_still_fits_its_links():
    """A sweep of mostly one-device steps: a third of its layouts run collectives (the
    rest none). The links and latency start from the steps that have them, so the fit
    still recovers the machine's, instead of stopping at a bound below its start."""
    rows = []
    for i, r in enumerate(_rows(36, seed=1)):
        alone = i % 3 != 0
        zero = {k: 0.0 for k in r.calls} if alone else r.calls
        rows.append(replace(r, comm=0.0 if alone else r.comm, calls=zero))
    seconds = fit.predicted_seconds(_machine(), rows)
    rows = [replace(r, seconds=t) for r, t in zip(rows, seconds, strict=True)]
    hw = fit.fit_profile(rows, hardware.get_profile("h100"))
    truth = _machine()
    assert not fit.unseen(rows, "participant")
    assert hw.link_bandwidth == pytest.approx(truth.link_bandwidth, rel=1e-3)
    assert hw.collective_latency == pytest.approx(truth.collective_latency, rel=1e-3)


def test_a_fitted_profile_loads_back_as_a_hardware_file(tmp_path):
    hw = fit.fit_profile(_rows(), hardware.get_profile("h100"))
    path = tmp_path / "mine.yaml"
    path.write_text(fit.profile_yaml(hw))
    assert hardware.get_profile(hw.key, path) == hw


def _write(path, rows: list[dict]) -> None:
    """A sweep.csv of ``rows`` (column → value)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, [*fit.NEEDED, "collective_arrays", "collective_participants"])
        writer.writeheader()
        writer.writerows(rows)


def _csv_row(r: fit.Timed) -> dict:
    """``r`` as a sweep.csv writes it (its state split as arguments and outputs)."""
    c = r.calls
    return {
        "layout": r.layout,
        "flops": r.flops,
        "mem_traffic_bytes": r.traffic,
        "mem_args_bytes": r.state / 2,
        "mem_output_bytes": r.state / 2,
        "comm_bytes": r.comm,
        "collective_ops": c["collective"],
        "step_time_s": r.seconds,
        "collective_arrays": c["array"],
        "collective_participants": c["participant"],
    }


def test_a_sweep_reads_back_as_the_rows_it_timed(tmp_path):
    """A sweep.csv's rows are the Timed rows they were written from; one written before
    participants were counted offers no fit per participant."""
    rows = _rows()
    path = tmp_path / "sweep.csv"
    _write(path, [_csv_row(r) for r in rows])
    assert fit.read_sweep(path) == rows
    _write(path, [{**_csv_row(r), "collective_participants": None} for r in rows])
    older = fit.read_sweep(path)
    assert all("participant" not in r.calls for r in older)
    assert fit.fit_profile(older, hardware.get_profile("h100")).latency_per != "participant"


def test_a_sweep_that_timed_nothing_cannot_be_fitted(tmp_path):
    """``sweep --steps 0`` leaves step_time_s empty: one line saying what to run."""
    path = tmp_path / "sweep.csv"
    row = {**_csv_row(_rows(1)[0]), "layout": "data=8", "step_time_s": ""}
    _write(path, [row])
    with pytest.raises(ConfigError, match=r"times 0 layouts.*--steps 5"):
        fit.read_sweep(path)
    with pytest.raises(ConfigError, match="no such file"):
        fit.read_sweep(tmp_path / "none.csv")
    _write(path, [{**row, "step_time_s": "fast"}])
    with pytest.raises(ConfigError, match="layout 'data=8' holds a value that is not a number"):
        fit.read_sweep(path)


def test_plan_fit_predicts_with_the_fitted_profile(tmp_path, capsys):
    """``jaxpar plan --fit SWEEP.csv``: says the held-out ranking, prints the profile as a
    --hardware-file entry, and ranks with it (its step overhead in every predicted step)."""
    from jaxpar.cli import main
    from tests.helpers import GPT_SMALL

    rows = _rows()
    path = tmp_path / "sweep.csv"
    _write(path, [_csv_row(r) for r in rows])
    out = tmp_path / "plan"
    args = ["plan", *GPT_SMALL, "--devices", "8", "--layouts", "data=8", "--fit", str(path)]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Spearman rho 1.00 and 1.00" in printed and "fitted:" in printed
    with open(out / "plan.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["hardware"] == "fitted"
    # the plan predicts with the fitted profile what the fit's own model says of that step
    # (its compiled counts, nothing hidden on a CPU profile)
    timed = fit.Timed(
        "data=8",
        float(row["flops"]),
        float(row["mem_traffic_bytes"]),
        float(row["mem_args_bytes"]) + float(row["mem_output_bytes"]),
        float(row["comm_bytes"]),
        {
            k: float(row[f"collective_{k}s" if k != "collective" else "collective_ops"])
            for k in hardware.LATENCY_PER
        },
        0.0,
    )
    hw = fit.fit_profile(rows, replace(hardware.get_profile("h100"), platform="cpu"))
    (expected,) = fit.predicted_seconds(hw, [timed])
    assert float(row["predicted_step_time_s"]) == pytest.approx(expected, rel=1e-5)


#: ``jaxpar sweep configs/gpt_tiny.yaml --all --devices 8 --steps 10``, run three times on
#: the development machine (2 CPU cores, JAX 0.10; docs/lab.md)
THIS_MACHINE = [
    Path(__file__).resolve().parents[1] / "benchmarks" / f"gpt_tiny_cpu_sweep_{i}.csv"
    for i in (1, 2, 3)
]


def test_several_sweeps_fit_each_layouts_geometric_mean(tmp_path):
    """``--fit A B``: each layout's time the geometric mean of the sweeps' (their counts
    alike; what pays latency as any counted it); a sweep lacking a layout the first timed,
    or counting one differently, is one line naming it; how alike the sweeps rank."""
    rows = _rows()
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    _write(first, [{**_csv_row(r), "collective_participants": None} for r in rows])
    _write(second, [{**_csv_row(r), "step_time_s": 4 * r.seconds} for r in rows])
    both = fit.read_sweeps([first, second])
    assert [r.seconds for r in both] == pytest.approx([2 * r.seconds for r in rows])
    assert [replace(r, seconds=0) for r in both] == [replace(r, seconds=0) for r in rows]
    assert fit.agreement([first, second]) == pytest.approx(1.0)
    _write(second, [{**_csv_row(r), "step_time_s": 1 / r.seconds} for r in rows])
    assert fit.agreement([first, second]) == pytest.approx(-1.0)
    _write(second, [_csv_row(r) for r in rows[1:]])
    with pytest.raises(ConfigError, match=r"b.csv did not time 'layout0', which .*a.csv timed"):
        fit.read_sweeps([first, second])
    _write(second, [{**_csv_row(r), "flops": 2 * r.flops} for r in rows])
    with pytest.raises(ConfigError, match=r"b.csv counts layout 'layout0' differently"):
        fit.read_sweeps([first, second])


def test_a_fit_to_sweeps_of_this_machine_ranks_the_layouts_it_was_not_fitted_on():
    """Issue 45's goal on the steps timed here: fitted on every other layout of three
    sweeps (each layout's time their geometric mean), the profile ranks the rest with
    Spearman's ρ ≥ 0.8, each half in turn — better than one sweep ranks another (their
    noise), and far better than the H100 datasheet profile ranks the same steps."""
    rows = fit.read_sweeps(THIS_MACHINE)
    assert len(rows) >= 60
    cpu = replace(hardware.get_profile("h100"), platform="cpu")
    first, second = fit.held_out(rows, cpu)
    assert first >= 0.8 and second >= 0.8, (first, second)
    assert fit.agreement(THIS_MACHINE) < min(first, second)
    seconds = [r.seconds for r in rows]
    datasheet = fit.predicted_seconds(hardware.get_profile("h100"), rows)
    assert fit.spearman(seconds, datasheet) < min(first, second) - 0.5


#: ``jaxpar sweep configs/gpt2_small.yaml --layouts data=1,train.grad_accum=1,
#: train.batch_size=B,data.seq_len=T,model.remat=R … --steps 5 --hardware h200`` for B in 4,
#: 16, 64, T in 1024, 256 and R in save_dots, none, full: one NVIDIA H200 lent to a session
#: (JAX 0.11.2, CUDA 13; docs/lab.md)
ONE_H200 = Path(__file__).resolve().parents[1] / "benchmarks" / "gpt2_small_h200_sweep.csv"


def test_a_fit_to_one_gpus_sweep_ranks_the_steps_it_was_not_fitted_on():
    """Issue 45's check on a GPU: one H200's steps of one model under three batches, two
    sequence lengths and three recomputation policies (their matmuls counted through
    cuBLAS's and cuDNN's calls), fitted on every other step, rank the rest with ρ ≥ 0.8,
    each half in turn, keeping the datasheet's values of what the steps cannot show."""
    rows = fit.read_sweep(ONE_H200)
    assert len(rows) == 18 and all(r.flops > 0 and r.comm == 0 for r in rows)
    h200 = hardware.get_profile("h200")
    first, second = fit.held_out(rows, h200)
    assert first >= 0.8 and second >= 0.8, (first, second)
    # no collective ran and every step streamed the same state: those constants are the
    # datasheet's, not values the solver left wherever it started (a plan of 8 such GPUs
    # would price a gradient all-reduce at bytes per second)
    assert fit.unseen(rows, "collective") == {"state", "link", "latency"}
    fitted = fit.fit_profile(rows, h200)
    assert fitted.link_rate == h200.link_rate and fitted.network_rate == h200.network_rate
    assert fitted.collective_latency == h200.collective_latency
    assert fitted.state_bandwidth == h200.hbm_bandwidth
    # fitted on all 18, every step within 12% of its time; the datasheet, with no fixed
    # cost a step, prices the smallest at under a quarter of theirs
    fitted_ratios = [p / r.seconds for p, r in zip(fit.predicted_seconds(fitted, rows), rows)]
    assert max(abs(math.log(x)) for x in fitted_ratios) < math.log(1.12)
    datasheet = [p / r.seconds for p, r in zip(fit.predicted_seconds(h200, rows), rows)]
    assert min(datasheet) < 0.25


def test_a_profile_fitted_to_a_gpus_steps_prices_steps_as_it_was_fitted(tmp_path):
    """The sweep says which machine timed it (``timed_on``: the H200 sweep predates the
    column, added to it by hand), so the fitted profile is a GPU's wherever ``plan --fit``
    runs; it prices a step as the fit modelled one — the roofline on its own counts, no
    kernel model — also once loaded back from its hardware file. Sweeps of two platforms
    are refused in one line."""
    assert fit.timed_on([ONE_H200]) == "gpu"
    fitted = fit.fit_profile(fit.read_sweep(ONE_H200), hardware.get_profile("h200"))
    assert fitted.platform == "gpu" and fitted.as_fitted
    assert not hardware.get_profile("h200").as_fitted
    path = tmp_path / "fitted.yaml"
    path.write_text(fit.profile_yaml(fitted))
    assert hardware.get_profile("fitted", path) == replace(fitted, key="fitted")
    import jaxpar
    from jaxpar.lab import analytic

    config = jaxpar.load_config(
        ["configs/gpt2_small.yaml"], ["train.grad_accum=1", "train.batch_size=16"]
    )
    row = analytic.estimate(config, "data=1", fitted, 1)
    calls = {"collective": 0.0, "array": 0.0, "participant": 0.0}
    own = fit.Timed(
        "data=1", row.flops, row.mem_traffic_bytes, row.state_traffic_bytes, 0.0, calls, 1.0
    )
    assert row.predicted_step_time_s == pytest.approx(fit.predicted_seconds(fitted, [own])[0])
    cpu = tmp_path / "cpu.csv"
    with ONE_H200.open(newline="") as f:
        table = list(csv.DictReader(f))
    with cpu.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(table[0]))
        writer.writeheader()
        writer.writerows({**r, "timed_on": "cpu"} for r in table)
    with pytest.raises(ConfigError, match=r"timed on cpu and gpu; fit a profile to the sweeps"):
        fit.timed_on([ONE_H200, cpu])
    with cpu.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(table[0]))
        writer.writeheader()
        writer.writerows({**r, "timed_on": "h200"} for r in table)
    with pytest.raises(ConfigError, match=r"timed_on='h200' is no JAX platform"):
        fit.timed_on([cpu])
    path.write_text(fit.profile_yaml(fitted).replace("fitted: true", "fitted: 2"))
    with pytest.raises(ConfigError, match=r"fitted=2; write true or false"):
        hardware.get_profile("fitted", path)


def test_a_weak_fit_says_so(tmp_path, capsys):
    """Steps whose times have nothing to do with their counts (shuffled): the held-out
    ranking is poor, and the plan says the fit is weak and what to do; a good fit does not."""
    from jaxpar.cli import main
    from tests.helpers import GPT_SMALL

    rows = _rows()
    shuffled = np.random.default_rng(1).permutation([r.seconds for r in rows])
    args = ["plan", *GPT_SMALL, "--devices", "8", "--layouts", "data=8", "--fit"]
    for times, weak in ((shuffled, True), ([r.seconds for r in rows], False)):
        path = tmp_path / f"{weak}.csv"
        _write(path, [_csv_row(replace(r, seconds=float(t))) for r, t in zip(rows, times)])
        assert main([*args, str(path)]) == 0
        assert ("warning: a weak fit (rho below 0.8)" in capsys.readouterr().out) is weak
