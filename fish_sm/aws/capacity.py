"""Measured capacity per GPU model: how many concurrent real-time streams one GPU of a model
keeps fed under the SLO (p99 first audio <= 500 ms, underrun <= 0.1% of playback), as
`fish-sm capacity` measured it, and where each figure comes from.

`deploy` turns these into its default autoscaling target for the batching server. GPU models
are named as EC2's DescribeInstanceTypes names them (GpuInfo.Gpus[].Name: "H100", "A10G",
"L4", "L40S", "A100", ...); a model without a row has not been measured.
"""

from __future__ import annotations

from dataclasses import dataclass

# Concurrent real-time streams one H100 serves under the SLO: update this (and its row's
# source below) when a new `fish-sm capacity` run on an H100 supersedes it.
H100_STREAMS_PER_GPU = 256
# The same for one H200, measured as a closed loop of listeners (each asks again once its answer
# has played); one engine core per GPU. An instance's figure is this times its GPUs: two H200s
# behind one front end kept 1,280 listeners within the SLO when one kept 640 (docs/benchmarks.md
# "Issue 42").
H200_STREAMS_PER_GPU = 768


@dataclass(frozen=True)
class Measured:
    """One GPU model's capacity and where the figure comes from."""

    streams_per_gpu: int
    device: str  # the machine it was measured on
    date: str
    command: str
    source: str  # where the curve is written down

    def describe(self) -> str:
        return f"`{self.command}` on {self.device}, {self.date}, {self.source}"


MEASURED: dict[str, Measured] = {
    "H100": Measured(
        streams_per_gpu=H100_STREAMS_PER_GPU, device="nvidia-h100-x1", date="2026-11-26",
        command="FISH_SM_BENCHMARK_LENGTHS=true FISH_SM_MAX_SEQ_LEN=2048 fish-sm capacity --local s1-mini "
                "--duration 30",
        source='docs/benchmarks.md "Issue 35"'),
    "H200": Measured(
        streams_per_gpu=H200_STREAMS_PER_GPU, device="nvidia-h200 (one H200)", date="2026-11-29",
        command="FISH_SM_CAPTURE=all FISH_SM_BENCHMARK_LENGTHS=true FISH_SM_MAX_SEQ_LEN=2048 fish-sm capacity "
                "--local s1-mini --listeners 704,768 --duration 30 --keep-going",
        source='docs/benchmarks.md "Issue 43"'),
}


def measured_capacity(gpu_model: str | None) -> Measured | None:
    """The measurement for a GPU model (EC2's name, any case), or None when it has none."""
    if not gpu_model:
        return None
    return MEASURED.get(gpu_model.strip().upper())
