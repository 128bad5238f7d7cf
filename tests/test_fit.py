"""A hardware profile fitted to timed steps (``jaxpar plan --fit SWEEP.csv``,
:mod:`jaxpar.lab.fit`): the fit recovers a known machine, ranks layouts it was not fitted
on, and writes a profile that loads back."""

import csv
from dataclasses import replace

import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.lab import fit, hardware


def _machine() -> hardware.Hardware:
    """A made-up machine: 50 GFLOP/s, 20 GB/s memory, 2 GB/s between devices, 0.2 ms per
    array of a collective, 3 ms per step."""
    base = hardware.get_profile("h100")
    return replace(
        base,
        flops_f32=50e9,
        flops_bf16=50e9,
        hbm_bandwidth=20e9,
        link_bandwidth=2e9,
        links=1,
        collective_latency=2e-4,
        latency_per="array",
        step_overhead=3e-3,
        matmul_efficiency=1.0,
    )


def _rows(n: int = 24, seed: int = 0) -> list[fit.Timed]:
    """Layouts whose steps are what :func:`_machine` takes: some bound by compute, some
    by memory, with 10-100 collectives of 1-10 arrays."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ops = float(rng.integers(10, 100))
        row = fit.Timed(
            f"layout{i}",
            float(rng.uniform(1e9, 2e10)),
            float(rng.uniform(1e8, 8e9)),
            float(rng.uniform(1e6, 1e8)),
            {"collective": ops, "array": ops * float(rng.integers(1, 10))},
            0.0,
        )
        rows.append(row)
    seconds = fit.predicted_seconds(_machine(), rows)
    return [replace(r, seconds=s) for r, s in zip(rows, seconds, strict=True)]


def test_the_fit_recovers_the_machine_that_timed_the_steps():
    """Steps timed by a known machine: the fitted profile predicts each step to 1e-4, pays
    latency per array as that machine does, and its constants are the machine's (the
    compute and memory rates to 1e-3: each bounds some of the steps)."""
    rows = _rows()
    hw = fit.fit_profile(rows, hardware.get_profile("h100"))
    truth = _machine()
    np.testing.assert_allclose(
        fit.predicted_seconds(hw, rows), [r.seconds for r in rows], rtol=1e-4
    )
    assert hw.latency_per == "array"
    for field in ("flops_f32", "hbm_bandwidth", "link_bandwidth", "collective_latency"):
        assert getattr(hw, field) == pytest.approx(getattr(truth, field), rel=1e-3), field
    assert hw.step_overhead == pytest.approx(truth.step_overhead, rel=1e-3)
    assert fit.held_out(rows, hardware.get_profile("h100")) == pytest.approx((1.0, 1.0))


def test_a_fitted_profile_loads_back_as_a_hardware_file(tmp_path):
    hw = fit.fit_profile(_rows(), hardware.get_profile("h100"))
    path = tmp_path / "mine.yaml"
    path.write_text(fit.profile_yaml(hw))
    assert hardware.get_profile(hw.key, path) == hw


def test_a_sweep_that_timed_nothing_cannot_be_fitted(tmp_path):
    """``sweep --steps 0`` leaves step_time_s empty: one line saying what to run."""
    path = tmp_path / "sweep.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*fit.NEEDED, "collective_arrays"])
        writer.writerow(["data=8", "1e9", "1e8", "1e6", "10", "", "10"])
    with pytest.raises(ConfigError, match=r"times 0 layouts.*--steps 5"):
        fit.read_sweep(path)
    with pytest.raises(ConfigError, match="no such file"):
        fit.read_sweep(tmp_path / "none.csv")
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*fit.NEEDED, "collective_arrays"])
        writer.writerow(["data=8", "1e9", "1e8", "1e6", "10", "fast", "10"])
    with pytest.raises(ConfigError, match="layout 'data=8' holds a value that is not a number"):
        fit.read_sweep(path)


def test_plan_fit_predicts_with_the_fitted_profile(tmp_path, capsys):
    """``jaxpar plan --fit SWEEP.csv``: says the held-out ranking, prints the profile as a
    --hardware-file entry, and ranks with it (its step overhead in every predicted step)."""
    from jaxpar.cli import main
    from tests.helpers import GPT_SMALL

    rows = _rows()
    path = tmp_path / "sweep.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*fit.NEEDED, "collective_arrays"])
        for r in rows:
            c = r.calls
            writer.writerow(
                [r.layout, r.flops, r.traffic, r.comm, c["collective"], r.seconds, c["array"]]
            )
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
        float(row["comm_bytes"]),
        {"collective": float(row["collective_ops"]), "array": float(row["collective_arrays"])},
        0.0,
    )
    hw = fit.fit_profile(rows, replace(hardware.get_profile("h100"), platform="cpu"))
    (expected,) = fit.predicted_seconds(hw, [timed])
    assert float(row["predicted_step_time_s"]) == pytest.approx(expected, rel=1e-5)
