"""How large a model fits on one GPU with the training scripts: the memory rule, measured.

    python tests/gpu_memory_estimate.py [--model smollm2-135m] [--gpu-memory-utilization 0.3]

1. Measures, on the CPU, the peak memory of one real training step of the model (forward and
   backward under bf16 autocast, the AdamW step, the gradients freed after it) with torch's memory
   profiler, which files every allocation under a category: the fp32 master weights, AdamW's two
   moments, the gradients, autocast's bf16 copies of the weights (held for the backward pass),
   activations, and the step's temporaries (foreach AdamW allocates one the size of a moment;
   fused AdamW, what the scripts use on a GPU, does not). The peak is printed in bytes per parameter
   for both optimizers, split by category at the moment of the peak.
2. Applies that rule to 24, 80 and 141 GB cards. With --backend vllm the engine takes
   --gpu-memory-utilization of the card while it samples (bf16 weights and KV cache) and sleeps at
   level 2 while the policy trains (its memory handed back), so the policy needs its peak while
   training and its weights and moments (12 bytes per parameter; no gradients) beside the engine.
   --activations-gb is an allowance for activations and the CUDA context (printed with the table).
3. The activations, per token of a row (prompt and completion tokens alike): the bytes the
   autograd graph keeps between forward and backward of token_logprobs under bf16 autocast
   (saved-tensor hooks, each storage once, the weights left out), measured on random models with
   one and two layers of each shape below (the public configs' widths, heads and vocabularies):
   per layer, and the rest (embedding, final norm, the head's hidden states). A micro-batch keeps
   --micro-batch x (prompt + --max-new-tokens) x that, plus, for the length of one chunk of the
   log-prob step, its logits (LOGIT_CHUNK x V fp32, a few times over in its backward pass).
The same step on a GPU is `pytest tests/test_cuda.py -m cuda` (torch.cuda.max_memory_allocated)."""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

CATEGORIES = ["weights", "AdamW moments", "inputs", "temporaries", "activations", "gradients",
              "autograd", "other"]  # the profiler's columns 1..8, in its order (None is last)


def training_step(model, optimizer, batch, compute_dtype):
    """Forward and backward of one micro-batch under autocast, the optimizer step, the gradients
    freed: what train_step does per batch."""
    ids, attention, mask = batch
    logp, _ = grpo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, len(ids),
                                  compute_dtype=compute_dtype)
    (-logp.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_bytes_per_parameter(model, fused, compute_dtype=torch.bfloat16, rows=2):
    """(peak bytes per parameter, {category: bytes per parameter at the peak}) of one CPU step."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused, foreach=not fused)
    prompt, completion = [1, 2, 3, 4], [5, 6, 7, 8]
    batch = grpo.build_batch([prompt] * rows, [completion] * rows, pad_id=0)
    training_step(model, optimizer, batch, compute_dtype)  # the moments exist from the first step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as profiler:
        training_step(model, optimizer, batch, compute_dtype)
    timeline = MemoryProfileTimeline(profiler._memory_profile())
    _, sizes = timeline._coalesce_timeline("cpu")  # [times, 1 + categories] bytes alive
    sizes = np.array(sizes)[:, 1:]
    peak = sizes.sum(axis=1).argmax()
    count = sum(p.numel() for p in model.parameters())
    return sizes[peak].sum() / count, dict(zip(CATEGORIES, sizes[peak] / count))


# (hidden size, MLP width, attention heads, key-value heads, head size, vocabulary, layers)
SHAPES = {"SmolLM2-135M": (576, 1536, 9, 3, 64, 49152, 30),
          "Qwen2.5-0.5B": (896, 4864, 14, 2, 64, 151936, 24),
          "Qwen2.5-1.5B": (1536, 8960, 12, 2, 128, 151936, 28),
          "Qwen3-4B": (2560, 9728, 32, 8, 128, 151936, 36),
          "Qwen2.5-7B": (3584, 18944, 28, 4, 128, 152064, 28)}


def kept_bytes_per_token(shape, layers, tokens=(48, 112)):
    """Bytes the graph keeps for the backward pass of token_logprobs per token of one row (bf16
    autocast, fp32 weights), on a random Llama of `shape` with `layers` layers: the slope between
    two lengths, so that what does not grow with the row cancels. The vocabulary is 1,024: the
    log-prob step keeps no logits, so the vocabulary changes nothing kept."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, mlp, heads, kv_heads, head_size, _, _ = shape
    vocab = 1024
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_size, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []
    for length in tokens:
        ids = torch.randint(0, vocab, (1, length))
        storages = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in weights:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor.detach()  # the tensor itself: a reference cycle, never freed
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            grpo.token_logprobs(model, ids, torch.ones_like(ids), length - 16, 1.0, 1,
                                compute_dtype=torch.bfloat16)
        kept.append(sum(storages.values()))
    return (kept[1] - kept[0]) / (tokens[1] - tokens[0])


def activations_table():
    """Per shape: bytes kept per token per layer, the rest, the model's total per token."""
    print("\nactivations kept for the backward pass per token of a row (bf16 autocast), from "
          "random 1- and 2-layer models of each shape:")
    print(f"{'shape':>14} {'layers':>6} {'per layer':>10} {'rest':>8} {'per token':>10} "
          f"{'8 x 4,352 tokens':>17} {'one chunk of logits':>20}")
    for name, shape in SHAPES.items():
        one, two = kept_bytes_per_token(shape, 1), kept_bytes_per_token(shape, 2)
        per_layer, rest = two - one, 2 * one - two
        total = shape[-1] * per_layer + rest
        chunk = grpo.LOGIT_CHUNK * shape[5] * 4  # fp32 logits of one chunk
        print(f"{name:>14} {shape[-1]:>6} {per_layer / 1e3:>8.1f}KB {rest / 1e3:>6.1f}KB "
              f"{total / 1e6:>8.2f}MB {8 * 4352 * total / 2**30:>15.1f}GB {chunk / 2**30:>18.2f}GB",
              flush=True)
    print("(8 x 4,352 tokens: --micro-batch 8 of a 256-token prompt and --max-new-tokens 4096)")


def largest_models(per_parameter, card_gb, share, activations_gb):
    """Billions of parameters that fit: HF backend; vLLM asleep (level 2) while training, awake
    with its share beside the weights and moments (12 bytes per parameter) while sampling."""
    training = (card_gb - activations_gb) / per_parameter
    sampling = ((1 - share) * card_gb - 1.0) / 12  # 1 GB: the CUDA context
    return training, min(training, sampling)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--activations-gb", type=float, default=4.0,
                        help="allowance for activations (micro-batch 8 of short sequences) and "
                             "the CUDA context")
    parser.add_argument("--skip-activations", action="store_true", help="only parts 1 and 2")
    args = parser.parse_args()
    model, _ = grpo.load_model(args.model, torch.float32, "cpu")
    count = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {count / 1e6:.1f}M parameters; peak of one training step, bytes per "
          "parameter (bf16 autocast, fp32 master weights), split at the peak:")
    peaks = {}
    for name, fused in (("foreach AdamW (CPU)", False), ("fused AdamW (GPU)", True)):
        peak, split = peak_bytes_per_parameter(model, fused)
        peaks[fused] = peak
        parts = ", ".join(f"{key} {value:.1f}" for key, value in split.items() if value >= 0.05)
        print(f"  {name:>20}: {peak:.1f} = {parts}")
    per_parameter = peaks[True]
    u = args.gpu_memory_utilization
    print(f"\nlargest trainable model on one GPU (billions of parameters), fused AdamW "
          f"({per_parameter:.1f} bytes per parameter), {args.activations_gb:.0f} GB for "
          f"activations and context; vLLM at {u:.0%} while it samples:")
    print(f"{'GPU':>6}  {'hf backend':>11}  {'vllm (sleeps at level 2)':>25}")
    for gb in (24, 80, 141):
        hf, vllm = largest_models(per_parameter, gb, u, args.activations_gb)
        print(f"{gb:>4}GB  {hf:>11.1f}  {vllm:>25.1f}")
    print(f"\n(vLLM's {u:.0%} must also hold its bf16 weights, 2 bytes per parameter: 8B -> 16 GB, "
          "and a KV cache; raise --gpu-memory-utilization for long completions)")
    if not args.skip_activations:
        activations_table()


if __name__ == "__main__":
    main()
