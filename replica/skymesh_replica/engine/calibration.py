"""Print each profile's headline figures next to the published ones they are calibrated to.

``python -m skymesh_replica.engine.calibration`` prints the calibration table (the last run is in
docs/notes/lab-diary.md, "Calibration"), so the numbers there always come from the code.
"""

from __future__ import annotations

from skymesh_replica.engine.profiles import PROFILES, Profile

# Mean tokens of prompt (with conversation history) + response over ShareGPT turns,
# tokenised with Qwen2.5 (computed from shared/data/sharegpt_partial).
SHAREGPT_MEAN_FOOTPRINT = 1091

# What the public sources say, per profile; blank where no direct figure exists and the
# profile rests on the datasheet roofline alone.
PUBLISHED: dict[str, tuple[str, str]] = {
    "llama3.1-8b-l4": ("~300 ms (SkyLB sec. 2)", "20-50 (SkyLB sec. 3.3)"),
    "llama3.1-8b-a100": ("", ""),
    "llama3.1-8b-h100": ("", ""),
    "llama3.1-70b-4xh100": ("", ""),
}


def figures(p: Profile) -> dict[str, float]:
    return {
        "ttft_512_ms": p.step_time(512, 512 * 256, 0, 0) * 1e3,
        "ttft_2048_ms": p.step_time(2048, 2048 * 1024, 0, 0) * 1e3,
        "decode_1_ms": p.step_time(0, 0, 1, 1024) * 1e3,
        "decode_32_ms": p.step_time(0, 0, 32, 32 * 1024) * 1e3,
        "prefill_tok_s": p.max_num_batched_tokens / p.step_time(
            p.max_num_batched_tokens, p.max_num_batched_tokens ** 2 / 2, 0, 0),
        "kv_tokens": float(p.kv_capacity_tokens),
        "sharegpt_concurrency": p.kv_capacity_tokens / SHAREGPT_MEAN_FOOTPRINT,
    }


def table() -> str:
    head = ("| profile | TTFT 512 tok (ours) | published | TTFT 2k tok | decode step 1 seq "
            "/ 32 seqs (1k ctx) | prefill tok/s | KV tokens | ShareGPT requests that fit "
            "(ours) | published |")
    lines = [head, "|" + "---|" * 9]
    for name, p in PROFILES.items():
        f = figures(p)
        pub_ttft, pub_conc = PUBLISHED.get(name, ("", ""))
        lines.append(
            f"| `{name}` | {f['ttft_512_ms']:.0f} ms | {pub_ttft or '-'} | "
            f"{f['ttft_2048_ms']:.0f} ms | {f['decode_1_ms']:.1f} / {f['decode_32_ms']:.1f} ms"
            f" | {f['prefill_tok_s']:,.0f} | {f['kv_tokens']:,.0f} | "
            f"{f['sharegpt_concurrency']:.0f} | {pub_conc or '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
