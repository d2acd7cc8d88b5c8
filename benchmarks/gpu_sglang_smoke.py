"""GPU smoke test of the SGLang rollout engine, for a cluster node with SGLang 0.5.23 installed.

    python benchmarks/gpu_sglang_smoke.py --model-path /models/Qwen3-30B-A3B --tp-size 2

Launches one server on the HF model directory (or attaches with --url), then:
  1. generates greedy and sampled responses (tokens/s, log-probs finite, routed experts shape),
  2. syncs the model's own weights back by `disk`, `tensor` and, when a GPU outside the server is
     free, `distributed` (NCCL), checking that greedy outputs are unchanged after each sync (at
     least half identical: batching can make a few differ),
  3. releases and resumes the server's GPU memory (needs --enable-memory-saver, on by default),
and prints a table. Exit code 1 if any step failed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_megatron.rollout.base import SamplingParams  # noqa: E402
from gspo_megatron.rollout.sglang.config import ServerLaunchConfig, SGLangEngineConfig  # noqa: E402
from gspo_megatron.rollout.sglang.engine import SGLangEngine  # noqa: E402
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess  # noqa: E402


class HFWeightSource:
    """The model directory's safetensors as HF-named buckets on `device` (a WeightSource)."""

    def __init__(self, model_dir: str, device: str) -> None:
        self.files = sorted(Path(model_dir).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self.device = device
        self.total_bytes = 0

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        from safetensors import safe_open

        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        self.total_bytes = 0
        for f in self.files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                    t = st.get_tensor(name).to(self.device)
                    nbytes = t.numel() * t.element_size()
                    if bucket and size + nbytes > bucket_bytes:
                        yield bucket
                        bucket, size = [], 0
                    bucket.append((name, t))
                    size += nbytes
                    self.total_bytes += nbytes
        if bucket:
            yield bucket

    def is_sender(self) -> bool:
        return True


def make_prompts(model_path: str, count: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of a few short prompts (the model's tokenizer if it loads) and stop ids."""
    texts = [
        "Question: What is 17 * 23? Answer:",
        "Write a haiku about mixture-of-experts models.",
        "The capital of France is",
        "def fibonacci(n):",
    ]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        ids = [tok(texts[i % len(texts)])["input_ids"] for i in range(count)]
        if not all(ids):
            raise ValueError("the tokenizer gives empty prompts")
        return ids, [tok.eos_token_id] if tok.eos_token_id is not None else []
    except Exception as e:  # noqa: BLE001 - fall back to token ids
        print(f"(tokenizer unavailable: {e}; using fixed token ids)")
        return [[100 + 7 * i + j for j in range(12)] for i in range(count)], []


def moe_shape(model_path: str) -> tuple[int, int] | None:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except OSError:
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("num_experts_per_tok"):
        return int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF model directory (safetensors)")
    p.add_argument("--url", default=None, help="attach to a running server instead of launching")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mem-fraction-static", type=float, default=0.6)
    p.add_argument("--modes", default="disk,tensor,distributed")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--health-timeout-s", type=float, default=1200)
    p.add_argument("--log-dir", default="sglang_smoke_logs")
    args = p.parse_args()

    rows: list[tuple[str, str, str]] = []
    failed = False

    def step(name: str, fn) -> object:
        nonlocal failed
        t0 = time.perf_counter()
        try:
            result, note = fn()
            rows.append((name, f"{time.perf_counter() - t0:8.2f}", note))
            return result
        except Exception as e:  # noqa: BLE001 - report and go on
            failed = True
            traceback.print_exc()
            rows.append((name, f"{time.perf_counter() - t0:8.2f}", f"FAILED: {e}"[:120]))
            return None

    shape = moe_shape(args.model_path)
    server = None
    if args.url is None:
        cfg = ServerLaunchConfig(
            model_path=args.model_path,
            port=args.port,
            tp_size=args.tp_size,
            ep_size=args.ep_size,
            mem_fraction_static=args.mem_fraction_static,
            enable_memory_saver=True,
            enable_return_routed_experts=shape is not None,
        )
        server = SGLangServerProcess(cfg, Path(args.log_dir) / "server.log")
        server.start()
        step("launch + /health", lambda: (server.wait_healthy(args.health_timeout_s), "healthy"))
        url = cfg.url
    else:
        url = args.url

    prompts, stops = make_prompts(args.model_path, args.prompts)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens,
                            stop_token_ids=tuple(stops))  # fmt: skip
    sampled = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=args.max_new_tokens,
                             stop_token_ids=tuple(stops), seed=1234)  # fmt: skip
    common = dict(urls=[url], bucket_bytes=args.bucket_mb << 20, health_timeout_s=60.0,
                  return_routed_experts=shape is not None,
                  routed_experts_layers=shape[0] if shape else None,
                  routed_experts_top_k=shape[1] if shape else None)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="sglang_smoke_"))
    engines: dict[str, SGLangEngine] = {}
    try:
        base_engine = SGLangEngine(
            SGLangEngineConfig(
                weight_sync="disk",
                disk_dir=str(workdir),
                disk_base_model_path=args.model_path,
                **common,
            )  # fmt: skip
        )
        engines["disk"] = base_engine

        def gen(params: SamplingParams, n: int):
            def run():
                t0 = time.perf_counter()
                groups = base_engine.generate(prompts, n, params)
                dt = time.perf_counter() - t0
                samples = [s for g in groups for s in g]
                toks = sum(len(s.response_ids) for s in samples)
                assert all(math.isfinite(x) for s in samples for x in s.logprobs)
                note = f"{len(samples)} samples, {toks} tokens, {toks / dt:,.0f} tok/s"
                if shape is not None:
                    s = samples[0]
                    assert s.routed_experts is not None
                    assert s.routed_experts.shape == (
                        len(s.prompt_ids) + len(s.response_ids) - 1,
                        *shape,
                    )
                    note += f", routes {tuple(s.routed_experts.shape)}"
                finish = {r: sum(s.finish_reason == r for s in samples) for r in ("stop", "length")}
                return groups, note + f", finish {finish}"

            return run

        reference = step("generate greedy", gen(greedy, 1))
        step(f"generate sampled x{args.samples}", gen(sampled, args.samples))

        def check_same(label: str):
            def run():
                groups = base_engine.generate(prompts, 1, greedy)
                same = sum(a[0].response_ids == b[0].response_ids
                           for a, b in zip(reference, groups, strict=True))  # fmt: skip
                note = f"greedy after {label}: {same}/{len(prompts)} identical"
                if 2 * same < len(prompts):  # a few may differ by batch nondeterminism
                    raise AssertionError(note + " (same weights: the sync is broken)")
                return None, note

            return run

        modes = [m for m in args.modes.split(",") if m]
        version = 0
        for mode in modes:
            if mode == "distributed" and torch.cuda.device_count() <= args.tp_size:
                rows.append((f"sync {mode}", "       -", "skipped: needs a GPU outside the server"))
                continue
            device = f"cuda:{args.tp_size}" if mode == "distributed" else "cuda:0"
            if mode != "disk":
                extra = {"group_backend": "nccl"} if mode == "distributed" else {}
                engines[mode] = SGLangEngine(
                    SGLangEngineConfig(weight_sync=mode, **common, **extra)
                )
            version += 1
            source = HFWeightSource(args.model_path, "cpu" if mode == "disk" else device)

            def sync(eng=engines[mode], src=source, v=version):
                t0 = time.perf_counter()
                eng.update_weights(src, version=v)
                dt = time.perf_counter() - t0
                gb = src.total_bytes / 1e9
                return None, f"{gb:.2f} GB at {gb / dt:.2f} GB/s, version {v}"

            step(f"sync {mode}", sync)
            if reference is not None:
                step(f"check after {mode}", check_same(mode))

        def memory_cycle():
            t0 = time.perf_counter()
            base_engine.release_memory()
            t1 = time.perf_counter()
            base_engine.resume_memory()
            t2 = time.perf_counter()
            return None, f"release {t1 - t0:.2f} s, resume {t2 - t1:.2f} s"

        step("release/resume memory", memory_cycle)
        if reference is not None:
            step("check after resume", check_same("resume"))
    finally:
        for eng in engines.values():
            eng.close()
        if server is not None:
            server.stop()

    width = max(len(r[0]) for r in rows)
    print(f"\n{'step'.ljust(width)} | seconds  | result")
    print(f"{'-' * width}-+----------+-{'-' * 60}")
    for name, secs, note in rows:
        print(f"{name.ljust(width)} | {secs} | {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
