"""W2SPO's update as w2spo.py runs it (each state forwarded once, its branches after its KV cache:
state_logprobs) against the same update on whole rows (state + branch, each row forwarded whole:
token_logprobs), side by side in one run.

Both run w2spo.train_step itself on the same batch; for the whole rows its state_logprobs is
swapped for token_logprobs on the rows (this benchmark's only change), so the loss, the gradient
norm and the optimizer step are the script's. The batch has the default's shapes: 8 prompts of
arith-steps (chat template) + a 20-token prefix (the state), G = 8 branches of L = 8 tokens each
(B_a = 4 auxiliary), --micro-batch 8, fp32, SmolLM2-135M-Instruct; --prompt-tokens N adds N
tokens to every prompt (a real task's prompt is hundreds of tokens long). Each way --repeats
times, alternating; the best of each is printed, and the ratio.

    python tests/bench_w2spo_prefix.py
    python tests/bench_w2spo_prefix.py --prompt-tokens 300
"""
import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifier  # noqa: E402
import w2spo  # noqa: E402


def whole_rows(net, states, branches, temperature, micro_batch, with_entropy=False,
               compute_dtype=torch.float32):
    """state_logprobs' numbers from whole rows: token_logprobs on state + branch."""
    ids, attention, mask = w2spo.build_batch(states, branches, 0)
    return w2spo.token_logprobs(net, ids.to(net.device), attention.to(net.device), mask.shape[1],
                                temperature, micro_batch, with_entropy, compute_dtype)


def make_batch(tokenizer, args):
    """8 groups of G = 8 branches after a state each, half of them the auxiliary's; mixed rewards."""
    rng = random.Random(0)
    problems = verifier.load_problems("arith-steps", "train", None, 0)[:8]
    branches = []
    for problem in problems:
        prompt = w2spo.encode_prompt(tokenizer, problem["question"])
        prompt = [rng.randrange(1000, 5000) for _ in range(args.prompt_tokens)] + prompt
        state = prompt + [rng.randrange(1000, 5000) for _ in range(20)]
        for j in range(8):
            ids = [rng.randrange(1000, 5000) for _ in range(8)]
            by_aux = j >= 4
            branches.append(w2spo.Branch(state=state, branch_point=20, ids=ids, by_aux=by_aux,
                                         continuation=[], truncated=False,
                                         aux_logprobs=[-rng.random() - 1 for _ in ids] if by_aux
                                         else None, reward=float(rng.random() < 0.4)))
    rewards = torch.tensor([b.reward for b in branches])
    rewards.view(-1, 8)[:, 0] = 1.0  # at least one right and one wrong branch per group: A != 0
    rewards.view(-1, 8)[:, 1] = 0.0
    advantages = w2spo.group_advantages(rewards, 8)
    return {"prompts": [b.state for b in branches], "samples": branches, "advantages": advantages}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="tokens added to each prompt")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = w2spo.load_model("smollm2-135m", torch.float32, "cpu")
    model.train()
    args = w2spo.parse_args(["--max-grad-norm", "1.0"])
    batch = make_batch(tokenizer, options)
    shared = w2spo.state_logprobs
    ways = {"whole rows": whole_rows, "shared state (w2spo.py)": shared}
    seconds, stats = {name: [] for name in ways}, {}
    for _ in range(options.repeats):
        for name, logprobs in ways.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: same batch
            w2spo.state_logprobs = logprobs
            start = time.perf_counter()
            stats[name] = w2spo.train_step(model, optimizer, batch, args)
            seconds[name].append(time.perf_counter() - start)
    w2spo.state_logprobs = shared
    state_len = len(batch["prompts"][0])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 8 states of "
          f"{state_len} tokens x 8 branches of 8 tokens, --micro-batch 8, fp32")
    for name in ways:
        s = stats[name]
        print(f"{name:>24}: {min(seconds[name]):6.2f} s per update (best of {options.repeats}); "
              f"loss {s['loss']:.6f}, grad norm {s['grad_norm']:.6f}")
    ratio = min(seconds["whole rows"]) / min(seconds["shared state (w2spo.py)"])
    print(f"whole rows / shared state: {ratio:.2f}x")


if __name__ == "__main__":
    main()
