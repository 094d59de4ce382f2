"""Benchmark: selective log-softmax (grpo.token_logprobs' inner step) vs a naive full
fp32 log_softmax + gather, on a 49,152-token vocabulary (SmolLM2's), same logits.

    python tests/bench_logprobs.py [--batch 16] [--tokens 256] [--repeats 3]

Prints the peak memory each needs beyond the logits (growth of peak RSS, each method in
its own fresh process) and the time of both, measured side by side in one run, and their ratios."""
import argparse
import multiprocessing
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def selective(logits, targets, temperature):
    """What token_logprobs does: one row at a time, logit - logsumexp in fp32."""
    out = []
    for row_logits, row_targets in zip(logits, targets):
        scaled = row_logits.float() / temperature  # [T, V]
        out.append(scaled.gather(-1, row_targets[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(out)  # [B, T]


def naive(logits, targets, temperature):
    """The textbook way: full fp32 log_softmax over the whole batch, then gather."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def make_logits(batch, tokens, vocab, dtype):
    """[B, T, V] random logits, filled one row at a time so that making them leaves no
    larger temporary behind in the peak RSS."""
    torch.manual_seed(0)
    logits = torch.empty(batch, tokens, vocab, dtype=dtype)
    for row in logits:
        row.copy_(torch.randn(tokens, vocab))
    return logits


def measure(name, batch, tokens, vocab, dtype, repeats, queue):
    """In a fresh process: peak RSS growth and best time of one method."""
    logits = make_logits(batch, tokens, vocab, dtype)
    targets = torch.randint(0, vocab, (batch, tokens))
    fn = {"selective": selective, "naive": naive}[name]
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(logits, targets, 0.7)
        times.append(time.perf_counter() - start)
    queue.put(((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) * 1024, min(times)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    results = {}
    context = multiprocessing.get_context("spawn")
    for name in ("selective", "naive"):
        queue = context.Queue()
        worker = context.Process(target=measure, args=(name, args.batch, args.tokens, args.vocab, dtype,
                                                       args.repeats, queue))
        worker.start()
        results[name] = queue.get()
        worker.join()
    # Same answer (checked after the measurements: a child process inherits its parent's peak RSS).
    logits = make_logits(args.batch, args.tokens, args.vocab, dtype)
    targets = torch.randint(0, args.vocab, (args.batch, args.tokens))
    torch.testing.assert_close(selective(logits, targets, 0.7), naive(logits, targets, 0.7), atol=1e-4, rtol=0)
    print(f"logits [{args.batch}, {args.tokens}, {args.vocab}] {args.dtype} ({logits.numel() * logits.element_size() / 2**20:.0f} MiB)")
    for name, (peak, seconds) in results.items():
        print(f"{name:>9}: peak extra memory {peak / 2**20:8.1f} MiB   time {seconds * 1000:8.1f} ms")
    (sel_mem, sel_t), (naive_mem, naive_t) = results["selective"], results["naive"]
    print(f"ratio selective/naive: memory {sel_mem / naive_mem:.3f}   time {sel_t / naive_t:.2f}")


if __name__ == "__main__":
    main()
