"""GPU datasheets: the two numbers a roofline needs (peak dense 16-bit tensor throughput, memory bandwidth),
memory size, and the GPU-to-GPU link an all-reduce crosses under tensor parallelism.

Every figure is the vendor's datasheet number (dense, i.e. *without* 2:4 sparsity, which the datasheets quote
first and no LLM serving engine uses), cited in ``source``. Memory is in GiB as the device reports it (an
"80 GB" H100 shows 80 GiB to ``torch.cuda.mem_get_info``). Peak numbers are never reached; the clock applies
stated efficiency factors (:class:`~minienv.sim.roofline.RooflineClock`).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class GPUSpec:
    """One GPU. ``peak_tflops``: dense BF16/FP16 tensor-core TFLOP/s; ``bandwidth_gbs``: memory GB/s (1e9);
    ``link_gbs``: per-GPU bandwidth of the interconnect tensor parallelism all-reduces over (one direction)."""

    name: str
    peak_tflops: float
    bandwidth_gbs: float
    memory_gib: float
    link_gbs: float
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity where compute and memory take equal time: below it a kernel is memory-bound."""
        return self.peak_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (BF16 tensor 312 TFLOPS dense / 624 sparse; NVLink 600 GB/s "
         "bidirectional): https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")

GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("A100-40GB", 312.0, 1555.0, 40.0, 300.0, _A100 + " (40GB SXM: 1,555 GB/s)"),
    GPUSpec("A100-80GB", 312.0, 2039.0, 80.0, 300.0, _A100 + " (80GB SXM: 2,039 GB/s)"),
    GPUSpec("H100-SXM", 989.4, 3350.0, 80.0, 450.0,
            "NVIDIA H100 product page / datasheet (SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, 3.35 TB/s, "
            "NVLink 900 GB/s bidirectional): https://www.nvidia.com/en-us/data-center/h100/"),
    GPUSpec("H200", 989.4, 4800.0, 141.0, 450.0,
            "NVIDIA H200 product page (SXM: BF16 1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e, 4.8 TB/s, "
            "NVLink 900 GB/s): https://www.nvidia.com/en-us/data-center/h200/"),
    GPUSpec("L4", 121.0, 300.0, 24.0, 32.0,
            "NVIDIA L4 datasheet (FP16/BF16 tensor 242 TFLOPS with sparsity = 121 dense, 24 GB GDDR6, 300 GB/s; "
            "PCIe Gen4 x16 64 GB/s bidirectional): https://www.nvidia.com/en-us/data-center/l4/"),
    GPUSpec("RTX-4090", 165.2, 1008.0, 24.0, 32.0,
            "NVIDIA Ada Lovelace architecture whitepaper v2.1, Appendix A (RTX 4090: BF16 tensor with FP32 "
            "accumulate 165.2 TFLOPS dense, 1,008 GB/s GDDR6X, 24 GB; no NVLink, PCIe Gen4): https://images."
            "nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
)}

_ALIASES = {"a100": "A100-80GB", "h100": "H100-SXM", "h100-sxm5": "H100-SXM", "4090": "RTX-4090",
            "rtx4090": "RTX-4090"}


def get_gpu(name: str) -> GPUSpec:
    """The GPU called ``name`` (case-insensitive; a few aliases), or a ``ValueError`` listing the known ones."""
    if isinstance(name, GPUSpec):
        return name
    key = {k.lower(): k for k in GPUS}.get(str(name).lower()) or _ALIASES.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
