"""What sharing the state's forward pass would save W2SPO's update, side by side in one run.

w2spo.py forwards every (state, branch) row whole (token_logprobs), so a state shared by G branches
is computed G times. The alternative, written here only to measure it, forwards each distinct state
once and lets its branches read its KV cache (HF's Cache.batch_select_indices: an internal of the
cache classes, which is why w2spo.py does not use it). Both compute the same log-probs (checked);
this prints the seconds of forward + backward for the default's shapes (8 prompts x G = 8 branches of
L = 8 tokens after a state of prompt + 20 tokens), each variant twice, alternating.

    python tests/bench_w2spo_prefix.py
"""
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifier  # noqa: E402
import w2spo  # noqa: E402


def shared_state_logprobs(net, states, branches):
    """log pi(y_t | s, y_<t) [b, T], each distinct state forwarded once, its cache shared."""
    unique = list(dict.fromkeys(map(tuple, states)))
    which = torch.tensor([unique.index(tuple(s)) for s in states])  # [b]
    state, seen = w2spo.pad([list(s) for s in unique], 0, left=True)  # [u, S]
    branch, mask = w2spo.pad(branches, 0)  # [b, T]
    first = net(input_ids=state, attention_mask=seen, logits_to_keep=1, use_cache=True,
                position_ids=(seen.cumsum(dim=1) - 1).clamp(min=0))
    first.past_key_values.batch_select_indices(which)  # [b, ...]: a state's cache per branch
    positions = seen[which].sum(1, keepdim=True) + torch.arange(branch.shape[1])  # [b, T]
    rest = net(input_ids=branch, past_key_values=first.past_key_values,
               attention_mask=torch.cat([seen[which], mask], dim=1), position_ids=positions)
    logits = torch.cat([first.logits[which], rest.logits[:, :-1]], dim=1).float()  # [b, T, V]
    return logits.gather(-1, branch[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)


def main():
    random.seed(0)
    torch.manual_seed(0)
    model, tokenizer = w2spo.load_model("smollm2-135m", torch.float32, "cpu")
    problems = verifier.load_problems("arith-steps", "train", None, 0)[:8]
    states, branches = [], []
    for problem in problems:
        state = w2spo.encode_prompt(tokenizer, problem["question"])
        state = state + [random.randrange(1000, 5000) for _ in range(20)]
        for _ in range(8):
            states.append(state)
            branches.append([random.randrange(1000, 5000) for _ in range(8)])
    args = w2spo.parse_args([])

    def whole(rows):  # as train_step forwards its rows
        ids, attention, mask = w2spo.build_batch([states[i] for i in rows],
                                                 [branches[i] for i in rows], 0)
        return w2spo.token_logprobs(model, ids, attention, mask.shape[1], 1.0, args.micro_batch)[0]

    def shared(rows):
        return shared_state_logprobs(model, [states[i] for i in rows], [branches[i] for i in rows])

    with torch.no_grad():
        torch.testing.assert_close(whole(range(8)), shared(range(8)), atol=1e-4, rtol=1e-4)
    seconds = {"whole rows (w2spo.py)": [], "shared state": []}
    for _ in range(2):
        for name, logprobs in zip(seconds, (whole, shared)):
            start = time.time()
            for group in range(8):  # one micro-batch of 8 rows = one state's branches
                logprobs(range(group * 8, group * 8 + 8)).sum().backward()
            model.zero_grad(set_to_none=True)
            seconds[name].append(time.time() - start)
    for name, values in seconds.items():
        print(f"{name:24s} {min(values):6.1f} s for 64 rows, forward + backward (best of 2)")
    ratio = min(seconds["whole rows (w2spo.py)"]) / min(seconds["shared state"])
    print(f"whole / shared: {ratio:.2f}x")


if __name__ == "__main__":
    main()
