"""How large a model fits on one GPU with the training scripts' defaults: the memory rule, checked.

    python tests/gpu_memory_estimate.py [--model smollm2-135m] [--gpu-memory-utilization 0.3]

1. Counts, on the CPU, the bytes a training step keeps per parameter: fp32 master weights (4),
   their gradients (4) and AdamW's two moments (8) = 16 bytes a parameter (tensor sizes summed after one
   real optimizer step of the given model; exact, not an RSS reading).
2. Applies that rule to 24, 80 and 141 GB GPUs. With --backend vllm the engine reserves
   --gpu-memory-utilization of the GPU at start (bf16 weights, 2 bytes a parameter, plus its KV cache);
   with sleep mode (level 1, always on a GPU) it hands that back while the policy trains, and takes it
   again to sample while the policy's weights and optimizer state (12 bytes a parameter) stay resident.
   `activations_gb` is an allowance for activations and the CUDA context (an assumption, printed).
   These are estimates from arithmetic, not measurements on a GPU."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402


def bytes_per_parameter(model_name):
    model, tokenizer = grpo.load_model(model_name, torch.float32, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids, attention, mask = grpo.build_batch([grpo.encode_prompt(tokenizer, "1 + 1?")],
                                            [tokenizer("2", add_special_tokens=False)["input_ids"]],
                                            tokenizer.pad_token_id)
    logp, _ = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, micro_batch=1)
    (-logp.sum()).backward()
    optimizer.step()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return count, weights / count, grads / count, state / count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--activations-gb", type=float, default=4.0,
                        help="allowance for activations (micro-batch 8 of short sequences) and the CUDA context")
    args = parser.parse_args()
    count, w, g, s = bytes_per_parameter(args.model)
    per_param = w + g + s
    print(f"{args.model}: {count / 1e6:.1f}M parameters; bytes a parameter: weights {w:.0f} + gradients {g:.0f} "
          f"+ AdamW state {s:.0f} = {per_param:.0f}")
    u = args.gpu_memory_utilization
    print(f"\nlargest trainable model (billions of parameters), {per_param:.0f} B/param, "
          f"{args.activations_gb:.0f} GB for activations and context:")
    print(f"{'GPU':>6}  {'hf backend':>11}  {'vllm, sleep mode':>17}  {'vllm, no sleep':>17}")
    for gb in (24, 80, 141):
        hf = (gb - args.activations_gb) / per_param
        # sleep: peak while training is all but the engine; while sampling the engine's share is back and the
        # policy keeps weights + AdamW state (the gradients are freed by zero_grad(set_to_none=True)).
        resident = w + s
        sleep = min((gb - args.activations_gb) / per_param, ((1 - u) * gb - 1.0) / resident)
        awake = ((1 - u) * gb - args.activations_gb) / per_param
        print(f"{gb:>4}GB  {hf:>11.1f}  {sleep:>17.1f}  {awake:>17.1f}")
    print(f"\n(the engine's {u:.0%} must also hold its bf16 weights, 2 B/param: e.g. 8B -> 16 GB, and a KV cache; "
          "raise --gpu-memory-utilization for long completions, lower it to give the policy more)")


if __name__ == "__main__":
    main()
