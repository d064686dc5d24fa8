"""Built-in models, the GPU catalog and interconnect presets.

Figures are vendor datasheet numbers (dense, i.e. without 2:4 sparsity). Memory is what the
device reports to the framework, in GiB. Link bandwidths are per GPU and per direction, in GB/s
(1e9 bytes/s): an inter-node link is one GPU's share of its node's NICs (the node aggregate is
gpus_per_node times it; see cost.Fabric for how collectives use it).

GPUs not in the catalog (another memory size, a power-limited part) are described with
``gpu_from_dict``/``load_gpu_spec`` (``--gpu-spec FILE``) or ``customize_gpu``
(``--gpu-memory-gib``, ``--gpu-tflops``).
"""

from __future__ import annotations

import functools
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError, unknown_choice
from shardwise.models.gpt_config import GPT_PRESETS
from shardwise.plan.spec import ModelSpec, from_gpt2_like, from_gpt_config, from_llama_like, moe_llama_spec


def _gpt_preset(size: str) -> Callable[[], ModelSpec]:
    def build() -> ModelSpec:
        return from_gpt_config(GPT_PRESETS[size], name=f"gpt-{size}")

    return build


# Hyper-parameters from each model's published config.json (Hugging Face hub copies).
MODEL_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    "gpt2": lambda: from_gpt2_like("gpt2", n_layers=12, hidden=768, n_heads=12, act_extra=3),  # 124M
    "gpt2-medium": lambda: from_gpt2_like("gpt2-medium", n_layers=24, hidden=1024, n_heads=16, act_extra=3),  # 355M
    "gpt2-large": lambda: from_gpt2_like("gpt2-large", n_layers=36, hidden=1280, n_heads=20, act_extra=3),  # 774M
    "gpt2-xl": lambda: from_gpt2_like("gpt2-xl", n_layers=48, hidden=1600, n_heads=25, act_extra=3),  # 1.56B
    "llama-2-7b": lambda: from_llama_like("llama-2-7b", n_layers=32, hidden=4096, n_heads=32, ffn_hidden=11008,
                                          vocab=32000, max_seq=4096),
    "llama-2-13b": lambda: from_llama_like("llama-2-13b", n_layers=40, hidden=5120, n_heads=40, ffn_hidden=13824,
                                           vocab=32000, max_seq=4096),
    "llama-2-70b": lambda: from_llama_like("llama-2-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8,
                                           ffn_hidden=28672, vocab=32000, max_seq=4096),
    "llama-3-8b": lambda: from_llama_like("llama-3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                                          ffn_hidden=14336, vocab=128256, max_seq=8192),
    "llama-3-70b": lambda: from_llama_like("llama-3-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8,
                                           ffn_hidden=28672, vocab=128256, max_seq=8192),
    "llama-3-405b": lambda: from_llama_like("llama-3-405b", n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8,
                                            ffn_hidden=53248, vocab=128256, max_seq=8192),
    "mistral-7b": lambda: from_llama_like("mistral-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                                          ffn_hidden=14336, vocab=32000, max_seq=32768),
    # shardwise's own Tiny Shakespeare GPTs (shardwise.models.gpt.GPT_PRESETS).
    "gpt-nano": _gpt_preset("nano"),
    "gpt-tiny": _gpt_preset("tiny"),
    "gpt-small": _gpt_preset("small"),
    "gpt-lab": _gpt_preset("lab"),
    "gpt-moe-nano": _gpt_preset("moe-nano"),
    "gpt-moe-lab": _gpt_preset("moe-lab"),
    # Hugging Face MoE (MOE_SPECS below, exact published totals; built by model.hf_config).
    "mixtral-8x7b": lambda: _moe_spec("mixtral-8x7b"),
    "qwen3-30b-a3b": lambda: _moe_spec("qwen3-30b-a3b"),
}


# Published MoE architectures, sized exactly as transformers 5.x builds them (the bundled configs
# ``mixtral-8x7b`` / ``qwen3-30b-a3b`` build the same models); ``plan.presets.MODEL_PRESETS`` lists them.
MOE_SPECS = {
    # 46.7B total, 12.9B active.
    "mixtral-8x7b": lambda: moe_llama_spec("mixtral-8x7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                                           vocab=32000, n_experts=8, top_k=2, moe_ffn=14336, max_seq=32768),
    # 128 experts, top-8: 30.5B total, 3.3B active.
    "qwen3-30b-a3b": lambda: moe_llama_spec("qwen3-30b-a3b", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4,
                                            head_dim=128, vocab=151936, n_experts=128, top_k=8, moe_ffn=768,
                                            max_seq=40960, family="qwen3_moe", qk_norm=True),
}


def _moe_spec(name: str) -> ModelSpec:
    return MOE_SPECS[name]()

MODEL_ALIASES: dict[str, str] = {
    "gpt2-124m": "gpt2", "gpt2-350m": "gpt2-medium", "gpt2-355m": "gpt2-medium", "gpt2-774m": "gpt2-large",
    "gpt2-1.5b": "gpt2-xl", "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b",
    "llama-3.1-405b": "llama-3-405b", "llama2-7b": "llama-2-7b", "llama3-8b": "llama-3-8b",
    "nano": "gpt-nano", "tiny": "gpt-tiny", "small": "gpt-small", "lab": "gpt-lab",
}


def model_preset(name: str) -> ModelSpec:
    """The built-in ModelSpec called ``name`` (case-insensitive, aliases accepted)."""
    key = MODEL_ALIASES.get(name.lower(), name.lower())
    if key not in MODEL_PRESETS:
        raise unknown_choice("model preset", name, [*MODEL_PRESETS, *MODEL_ALIASES])
    return _built_preset(key)


@functools.cache
def _built_preset(key: str) -> ModelSpec:
    # Specs are frozen: build each one once per process (405B has 1,100+ parameter tensors).
    return MODEL_PRESETS[key]()


@dataclass(frozen=True)
class GPU:
    """One accelerator: memory, dense 16-bit tensor peak, memory bandwidth, default links.

    ``calibration`` names the fitted constants (``cost.CALIBRATIONS``) that apply: the GPU
    generation whose published runs calibrate it, or "" for none (the default constants).
    ``intra_gbs``/``inter_gbs`` override the link presets (GB/s per GPU per direction).
    """

    name: str
    memory_gib: float
    bf16_tflops: float  # dense bf16/fp16 tensor-core peak with fp32 accumulation
    mem_bw_tbs: float  # HBM/GDDR bandwidth, TB/s
    intra_link: str  # default intra-node link preset
    inter_link: str  # default inter-node link preset
    host_ram_gib: float = 1024.0  # typical host RAM per node in servers carrying this GPU
    calibration: str = ""
    intra_gbs: float | None = None
    inter_gbs: float | None = None
    # The KERNEL_CEILINGS row whose published kernel measurements apply ("": none published; the
    # planner then uses UNMEASURED_CEILINGS and says so).
    ceilings: str = ""

    @property
    def tf32_tflops(self) -> float:
        # fp32 training runs on TF32 tensor cores at half the 16-bit rate (NVIDIA and AMD alike).
        return self.bf16_tflops / 2

    def peak_tflops(self, precision: str) -> float:
        """The dense peak a run of ``precision`` computes at: TF32 for "fp32", the 16-bit peak else."""
        return self.tf32_tflops if precision == "fp32" else self.bf16_tflops


GPUS: dict[str, GPU] = {
    "h100-sxm": GPU("h100-sxm", 80, 989, 3.35, "nvlink4", "ib-ndr", 2048, "h100", ceilings="h100-sxm"),
    # Same Hopper architecture at 350 W: the H100 constants are applied to its own datasheet peak,
    # and so is the H100 SXM's measured fraction of peak (no PCIe measurement is published).
    "h100-pcie": GPU("h100-pcie", 80, 756, 2.0, "pcie5", "ib-ndr", 1024, "h100", ceilings="h100-sxm"),
    # Same GH100 compute as the H100 SXM (989 TFLOPS), more and faster memory: no published bf16
    # run without float8/compile to fit on, so it uses the H100 constants (see docs/planner.md);
    # the MAMF table measures it at the H100's rate ("H200 is the same").
    "h200": GPU("h200", 141, 989, 4.8, "nvlink4", "ib-ndr", 2048, "h100", ceilings="h100-sxm"),
    "a100-40gb": GPU("a100-40gb", 40, 312, 1.555, "nvlink3", "ib-hdr", 1024, "a100", ceilings="a100-sxm"),
    "a100-80gb": GPU("a100-80gb", 80, 312, 2.039, "nvlink3", "ib-hdr", 2048, "a100", ceilings="a100-sxm"),
    "l40s": GPU("l40s", 48, 362, 0.864, "pcie4", "ethernet-100g", 512),
    "rtx-4090": GPU("rtx-4090", 24, 165, 1.008, "pcie4", "ethernet-100g", 256),
    "mi300x": GPU("mi300x", 192, 1307, 5.3, "infinity-fabric", "ib-ndr", 2048, ceilings="mi300x"),
}


# ------------------------------------------------------------------------------ kernel ceilings
# What the best published kernels reach on each GPU, per op kind, as a fraction of the dense peak of
# the precision they ran in. The planner's achieved rate is ceiling x a fitted factor
# (cost.Calibration.matmul_factor / attention_factor, confined to cost.FACTOR_BANDS), so a fit on
# training runs can lower a rate but never raise it above what the hardware was measured to do.
#
# Precisions: "bf16" is the 16-bit tensor rate (bf16 and fp16 share it; FlashAttention-3's figures
# are FP16); "tf32" (fp32 training) has no published measurement: the bf16 fraction is applied to
# the TF32 peak (see ceiling()).
MAMF_URL = ("https://github.com/stas00/ml-engineering/blob/7bc7c3054eb93c277a4755c597ae0864d77a63f1/"
            "compute/accelerator/README.md#maximum-achievable-matmul-flops-comparison-table")


def training_attention_fraction(forward: float, backward: float) -> float:
    """A flash kernel's measured forward and backward fractions of peak as one training rate, in the
    planner's attention convention (cost.attention_flops_per_token).

    The FlashAttention papers count a backward pass as 2.5 forward passes of FLOPs (5 matmuls
    against 2) and benchmark without a causal mask; the planner counts 3 forward passes (backward =
    2 x forward) and the unhalved causal FLOPs, of which a causal kernel runs half. So the time of
    one planner "forward FLOP unit" is (1/f + 2.5/b) / 3 at the peak, halved for the mask.
    """
    return 2 * 3 / (1 / forward + 2.5 / backward)


@dataclass(frozen=True)
class KernelCeiling:
    """The best published rate of one op kind on one accelerator, as a fraction of its dense peak."""

    fraction: float
    source: str  # where the figure is published (a pinned URL or a paper's table/figure)


KERNEL_CEILINGS: dict[str, dict[tuple[str, str], KernelCeiling]] = {
    # Matmul: Stas Bekman's Maximum Achievable Matmul FLOPS (MAMF) table, BF16, best shape found by
    # mamf-finder.py (mean of 100 iterations after 50 warm-up ones): MAMF / spec peak.
    # Attention: FlashAttention-2 (Dao 2023, arXiv:2307.08691, sections 1 and 4: "up to 73 % of the
    # theoretical max throughput in the forward pass, and up to 63 % ... in the backward pass", A100)
    # and FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608: abstract, FP16 forward up to 740
    # TFLOPs/s = 75 % of the H100 SXM5's 989; Figure "Attention backward speed, head dim 128 (H100
    # 80GB SXM5)": up to 561 TFLOPs/s at 16k), non-causal, head dim 128.
    "a100-sxm": {
        ("matmul", "bf16"): KernelCeiling(271.2 / 312, f"MAMF, NVIDIA A100 SXM: 271.2 of 312 TFLOPS ({MAMF_URL})"),
        ("attention", "bf16"): KernelCeiling(training_attention_fraction(0.73, 0.63),
                                             "FlashAttention-2 on A100 (arXiv:2307.08691 sec. 4): forward 73 %, "
                                             "backward 63 % of peak"),
    },
    "h100-sxm": {
        ("matmul", "bf16"): KernelCeiling(794.5 / 989, f"MAMF, NVIDIA H100 SXM: 794.5 of 989 TFLOPS ({MAMF_URL})"),
        ("attention", "bf16"): KernelCeiling(training_attention_fraction(740 / 989, 561 / 989),
                                             "FlashAttention-3 on H100 SXM5, FP16 (arXiv:2407.08608): forward "
                                             "740, backward 561 of 989 TFLOPS"),
        # FlashAttention-2 on the same GPU: "only 35 % utilization on H100" against FlashAttention-3's
        # 75 % (arXiv:2407.08608, abstract), applied to both passes (the paper's backward figure for
        # FA2 is a plot). Measured again by tritonbench on H100 with torch 2.6's SDPA, whose flash
        # backend is FlashAttention-2: 329 against cuDNN's 631 and FA3's 632 TFLOPS at (1, 24, 4608,
        # 128) (pytorch/pytorch#142132): 0.52 of FA3 where the abstract gives 0.47.
        ("attention-flash2", "bf16"): KernelCeiling(training_attention_fraction(740 / 989, 561 / 989)
                                                    * 0.35 / (740 / 989),
                                                    "FlashAttention-2 on H100 SXM5: 35 % of peak against "
                                                    "FlashAttention-3's 75 % (arXiv:2407.08608, abstract)"),
    },
    "mi300x": {
        ("matmul", "bf16"): KernelCeiling(668.4 / 1300, f"MAMF, AMD MI300X: 668.4 of 1300 TFLOPS ({MAMF_URL})"),
    },
}

# GPUs (or op kinds) with no published measurement (L40S, RTX 4090, MI300X's attention, a
# --gpu-spec without ``ceilings``): the mean of the A100 and H100 rows, the two generations the
# published training runs calibrate (the same rule as cost.DEFAULT_CALIBRATION); `plan` says so.
UNMEASURED_CEILINGS: dict[str, float] = {
    op: sum(KERNEL_CEILINGS[row][(op, "bf16")].fraction for row in ("a100-sxm", "h100-sxm")) / 2
    for op in ("matmul", "attention")
}


# FlashAttention-1's class (FlashAttention, its Triton port -- MPT's attn_impl "triton" --, xformers'
# memory-efficient kernel) against FlashAttention-2's on the same GPU: "about 2x speedup compared to
# FlashAttention" (Dao 2023, arXiv:2307.08691, abstract; FlashAttention at "25-40 % of the
# theoretical maximum FLOPs/s" of the A100 there, which half of FlashAttention-2's 1.124 lies in).
FLASH1_OF_FLASH2 = 0.5


def attention_ceiling(g: GPU, kernel: str, precision: str) -> tuple[float, str]:
    """The ceiling of attention kernel class ``kernel`` (memory.ATTENTION_KERNELS) on ``g``: its
    own row, or for "flash1" FlashAttention-2's times FLASH1_OF_FLASH2."""
    if kernel == "flash1":
        fraction, source = ceiling(g, "attention-flash2", precision)
        return fraction * FLASH1_OF_FLASH2, (f"{source}; x {FLASH1_OF_FLASH2} for FlashAttention-1's class "
                                             "(arXiv:2307.08691, abstract)" if source else "")
    return ceiling(g, attention_op(kernel), precision)


def attention_op(kernel: str) -> str:
    """The KERNEL_CEILINGS op key of an attention kernel class (memory.ATTENTION_KERNELS): "flash3"
    rates at each GPU's best published attention kernel ("attention": FlashAttention-3 / cuDNN on
    Hopper, FlashAttention-2 where nothing newer runs), "flash2" at FlashAttention-2's own figure
    ("flash1": FlashAttention-2's row too, scaled by attention_ceiling)."""
    return "attention" if kernel == "flash3" else "attention-flash2"


def ceiling(g: GPU, op: str, precision: str) -> tuple[float, str]:
    """``op``'s ceiling on ``g`` in ``precision`` (a planner precision name): the fraction of the
    peak the planner rates that precision at, and where it comes from ("" when nothing is published).
    An attention kernel's own row ("attention-flash2") falls back to the GPU's best attention row,
    which on a GPU without a newer kernel (the A100) is that kernel's."""
    row = KERNEL_CEILINGS.get(g.ceilings, {})
    if op.startswith("attention-") and not any(k == op for k, _ in row):
        op = "attention"
    # fp32 trains on TF32 tensor cores: with no TF32 row, the 16-bit fraction of the TF32 peak (the
    # same tensor cores at half the rate).
    measured = row.get((op, "tf32" if precision == "fp32" else "bf16")) or row.get((op, "bf16"))
    if measured is None:
        return UNMEASURED_CEILINGS[op.split("-")[0]], ""
    return measured.fraction, measured.source


GPU_ALIASES: dict[str, str] = {
    "h100": "h100-sxm", "h100-80gb": "h100-sxm", "a100": "a100-80gb", "a100-40": "a100-40gb",
    "a100-80": "a100-80gb", "4090": "rtx-4090", "h200-sxm": "h200",
}


def gpu(name: str) -> GPU:
    """The catalog GPU called ``name`` (case-insensitive, aliases accepted)."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise unknown_choice("GPU kind", name, [*GPUS, *GPU_ALIASES])
    return GPUS[key]


# Keys a --gpu-spec file may hold, with what each means (also the error message's list).
GPU_SPEC_KEYS = {
    "base": "a catalog GPU whose values the others override (e.g. \"h100-sxm\")",
    "name": "a label for the output",
    "memory_gib": "memory the framework can use, GiB",
    "bf16_tflops": "dense bf16 tensor-core peak, TFLOPS",
    "mem_bw_tbs": "memory bandwidth, TB/s",
    "intra_link": "intra-node link preset", "inter_link": "inter-node link preset",
    "intra_gbs": "intra-node GB/s per GPU per direction",
    "inter_gbs": "inter-node (NIC) GB/s per GPU per direction",
    "host_ram_gib": "host RAM per node, GiB",
    "calibration": "whose fitted constants apply: a100, h100, or \"\" for the defaults",
    "ceilings": "whose published kernel measurements apply: a100-sxm, h100-sxm, mi300x, or \"\" for none",
}


def gpu_from_dict(raw: dict[str, Any], where: str) -> GPU:
    """A GPU described by a dict (a --gpu-spec file): ``base`` plus overrides, or every field."""
    unknown = sorted(set(raw) - set(GPU_SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}. Allowed: "
                          + "; ".join(f"{k} ({v})" for k, v in GPU_SPEC_KEYS.items()) + ".")
    values = {k: v for k, v in raw.items() if k != "base"}
    for key in ("memory_gib", "bf16_tflops", "mem_bw_tbs", "intra_gbs", "inter_gbs", "host_ram_gib"):
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int | float)
                              or values[key] <= 0):
            raise ConfigError(f"{where}: {key} must be a positive number ({GPU_SPEC_KEYS[key]}), "
                              f"got {values[key]!r}.")
    for key in ("intra_link", "inter_link"):
        if key in values:
            link(str(values[key]))  # raises with the list of presets
    if "calibration" in values and values["calibration"] not in ("", *CALIBRATION_KEYS):
        raise ConfigError(f"{where}: calibration must be one of {', '.join(CALIBRATION_KEYS)} or \"\" "
                          f"(default constants), got {values['calibration']!r}.")
    if "ceilings" in values and values["ceilings"] not in ("", *KERNEL_CEILINGS):
        raise ConfigError(f"{where}: ceilings must be one of {', '.join(KERNEL_CEILINGS)} or \"\" "
                          f"(no published measurement), got {values['ceilings']!r}.")
    if "base" in raw:
        base = gpu(str(raw["base"]))
        values.setdefault("name", f"{base.name}-custom")
        return replace(base, **values)
    missing = [k for k in ("memory_gib", "bf16_tflops", "mem_bw_tbs") if k not in values]
    if missing:
        raise ConfigError(f"{where}: without 'base' a GPU needs {', '.join(missing)} "
                          f"({'; '.join(GPU_SPEC_KEYS[k] for k in missing)}), or name a catalog GPU as "
                          f"base = one of {', '.join(GPUS)}.")
    values.setdefault("name", "custom-gpu")
    values.setdefault("intra_link", "pcie5")
    values.setdefault("inter_link", "ethernet-100g")
    return GPU(**values)


def load_gpu_spec(path: str | Path) -> GPU:
    """The GPU described by a small TOML or JSON file (keys: GPU_SPEC_KEYS)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--gpu-spec: no file at {str(p)!r}; pass a .toml or .json file describing the GPU.")
    try:
        text = p.read_text(encoding="utf-8")
        raw = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--gpu-spec: cannot read {str(p)!r} as {'JSON' if p.suffix == '.json' else 'TOML'} "
                          f"({e}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--gpu-spec: {str(p)!r} must hold a table/object of GPU fields.")
    return gpu_from_dict(raw, f"--gpu-spec {p.name}")


def customize_gpu(base: GPU, *, memory_gib: float | None = None, tflops: float | None = None) -> GPU:
    """``base`` with its memory and/or dense bf16 peak replaced (``--gpu-memory-gib``, ``--gpu-tflops``)."""
    for flag, value in (("--gpu-memory-gib", memory_gib), ("--gpu-tflops", tflops)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be a positive number, got {value}.")
    if memory_gib is None and tflops is None:
        return base
    parts = [base.name]
    if memory_gib is not None:
        parts.append(f"{memory_gib:g}gib")
    if tflops is not None:
        parts.append(f"{tflops:g}tf")
    return replace(base, name="-".join(parts), memory_gib=memory_gib or base.memory_gib,
                   bf16_tflops=tflops or base.bf16_tflops)


@dataclass(frozen=True)
class Link:
    """An interconnect: bandwidth per direction in GB/s, per GPU or shared by the node's GPUs."""

    name: str
    gbs: float
    per_node: bool = False  # True: one NIC shared by every GPU of the node

    def per_gpu_gbs(self, gpus_per_node: int) -> float:
        return self.gbs / gpus_per_node if self.per_node else self.gbs


LINKS: dict[str, Link] = {
    "nvlink4": Link("nvlink4", 450),  # H100/H200 SXM: 900 GB/s bidirectional
    "nvlink3": Link("nvlink3", 300),  # A100 SXM: 600 GB/s bidirectional
    "infinity-fabric": Link("infinity-fabric", 448),  # MI300X: 7 links x 64 GB/s
    "pcie5": Link("pcie5", 64),
    "pcie4": Link("pcie4", 32),
    "ib-ndr": Link("ib-ndr", 50),  # one 400 Gb/s NIC per GPU (rail-optimised)
    "ib-hdr": Link("ib-hdr", 25),  # one 200 Gb/s NIC per GPU
    "roce-400g": Link("roce-400g", 50),
    "efa-3200": Link("efa-3200", 400, per_node=True),  # AWS p5: 3200 Gb/s per node
    "ethernet-100g": Link("ethernet-100g", 12.5, per_node=True),
    "ethernet-25g": Link("ethernet-25g", 3.125, per_node=True),
}


# Fitted constant sets in cost.CALIBRATIONS (kept here as names so a GPU spec can be checked
# without importing the cost model).
CALIBRATION_KEYS = ("a100", "h100")


def link(name: str) -> Link:
    """The link preset called ``name``."""
    key = name.lower()
    if key not in LINKS:
        raise unknown_choice("link preset", name, LINKS)
    return LINKS[key]
