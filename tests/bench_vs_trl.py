"""grpo.py against TRL's GRPOTrainer: same model, task, batch, loss and schedule, side by side.

    python tests/bench_vs_trl.py                      # grpo.py's default run (12 steps, 8 x 8, 32 tokens) for both
    python tests/bench_vs_trl.py --steps 1 --prompts-per-step 2 --group-size 4 --max-new-tokens 16 \
        --eval-problems 4 --eval-samples 4            # a quick look (a minute or two on 2 cores)

Flags: --model --steps --prompts-per-step --group-size --max-new-tokens --lr --micro-batch --seed
--eval-problems --eval-samples --eval-k (defaults: grpo.py's). TRL is optional (pip install trl).

Runs grpo.py's default run (HF generate, fp32, its defaults otherwise: beta 0, eps 0.2/0.28, token-mean
loss, group-std advantages, temperature 1) in a process of its own (`--ours-worker`: grpo.main with the
flags `python grpo.py` would get, its sampler timed from outside), then TRL in its own process
(`--trl-worker`), one after the other, so each ru_maxrss peak is its own. Prints seconds per step (and of
them sampling), peak memory, held-out pass@1 (and pass@k) before and after for both, then the TRL / ours
ratios and a JSON line.

Matched: the model and its fp32 weights; the arith train split in grpo.py's order
(np.random.default_rng(seed).permutation, P prompts per step, shuffle_dataset=False); the prompt tokens
(TRL renders the conversational prompt with the same chat template, default system prompt included:
checked at run time); P x G completions per step in micro-batches of --micro-batch; max completion length,
temperature 1, top_p 1, top_k 0; the reward (verifier.reward on the decoded completion); the clipped
token loss with eps 0.2 / 0.28, no KL, loss_type="dapo" (= token-mean, see below); AdamW (torch, betas
0.9/0.999, eps 1e-8), weight decay 0 (grpo.py's), constant lr, no warmup, grad-norm clip 1.0; fp32, no
gradient checkpointing; the evaluation (grpo.evaluate and grpo.Sampler on the same held-out problems).

Not matched exactly: TRL's group std is Bessel-corrected (G - 1), ours is the population std, so TRL's
advantages are sqrt((G-1)/G) of ours (0.94 at G = 8; AdamW and the grad-norm clip mostly absorb a
uniform scale). The random streams: both seed, but draw in another order, so the samples differ.
The generation code path (TRL repeats each prompt G times in one generate call; ours asks generate for G
return sequences), TRL's shuffle of completions across micro-batches (the sum is the same), ours
skipping the forward/backward of zero-advantage completions (exact with beta 0; TRL forwards them all),
and TRL's own bookkeeping (entropies, metric gathering) inside its step. Seconds per step: ours from
metrics.jsonl; TRL from on_step_begin to on_step_end (generation, rewards, every micro-batch and the
optimizer step; its per-step logging after on_step_end is left out). Sampling seconds (grpo.py logs none):
ours the training steps' Sampler.generate calls, timed around them by --ours-worker (the evaluations'
calls left out); TRL _generate_and_score_completions (generate, rewards, advantages). The 'after'
evaluations draw from different RNG states (each process's state after training); the 'before' ones
should be equal. Time it on a quiet machine: two processes sharing the 2 cores slow each other many-fold.
"""
import argparse
import importlib.util
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402
import verifier  # noqa: E402

FLAGS = ["model", "steps", "prompts_per_step", "group_size", "max_new_tokens", "lr", "micro_batch", "seed",
         "eval_problems", "eval_samples", "eval_k"]


def parse_args():
    defaults = grpo.parse_args([])  # the bench's defaults are grpo.py's, so a plain run is its default run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in FLAGS:
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value,
                            help=f"as grpo.py's (default {value})")
    parser.add_argument("--trl-worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)  # internal: the TRL side
    parser.add_argument("--ours-worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)  # internal: grpo.py's side
    return parser.parse_args()


def grpo_flags(args):
    """The shared flags, as grpo.py takes them. HF generate and fp32 are explicit: TRL samples with HF generate
    (use_vllm=False) in fp32 here, and grpo.py's 'auto' would pick vLLM / bf16 on a GPU."""
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in FLAGS]
    return flags + ["--backend=hf", "--dtype=float32"]


def ours_worker(args):
    """grpo.py's run in this process: grpo.main with grpo_flags, as `python grpo.py` runs it (grpo.run_cli), with
    each Sampler.generate call of a training step timed around it (grpo.py logs no sampling time; the calls inside
    evaluate() are not counted). Writes the sampling seconds of each step as JSON."""
    seconds, evaluating, generate, evaluate = [], [False], grpo.Sampler.generate, grpo.evaluate

    def timed_generate(self, *a, **k):
        t0 = time.time()
        samples = generate(self, *a, **k)
        if not evaluating[0]:
            seconds.append(time.time() - t0)
        return samples

    def marked_evaluate(*a, **k):
        evaluating[0] = True
        try:
            return evaluate(*a, **k)
        finally:
            evaluating[0] = False

    grpo.Sampler.generate, grpo.evaluate = timed_generate, marked_evaluate  # Run looks evaluate up at call time
    out = Path(args.ours_worker).parent / "grpo"
    grpo.run_cli(lambda: grpo.main([*grpo_flags(args), f"--output-dir={out}"]))
    Path(args.ours_worker).write_text(json.dumps({"sample_seconds": seconds}))


def run_ours(args, folder):
    result_file, out = Path(folder) / "ours.json", Path(folder) / "grpo"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--ours-worker", str(result_file)],
                   check=True, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sample_seconds = json.loads(result_file.read_text())["sample_seconds"]
    if len(sample_seconds) != len(steps):  # grpo.main samples once per step
        sys.exit(f"bench_vs_trl.py: {len(sample_seconds)} timed sampler calls for {len(steps)} steps of grpo.py")
    return {"seconds_per_step": summary["seconds_per_step"], "peak_memory_gb": summary["peak_memory_gb"],
            "sample_seconds": sum(sample_seconds) / len(sample_seconds),
            "pass@1_before": summary["pass@1_before"], "pass@1_after": summary["pass@1_after"],
            "pass@k_before": summary["pass@k_before"], "pass@k_after": summary["pass@k_after"],
            "reward_mean": [r["reward_mean"] for r in steps], "frac_zero_std": [r["frac_zero_std"] for r in steps],
            "trained_sequences": [r.get("trained_sequences", 0) for r in steps]}


def trl_worker(args):
    """Train with GRPOTrainer in this process, evaluate with grpo.py's evaluate(), write the result as JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: no telemetry ping, no processor look-up
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    gargs = grpo.parse_args(grpo_flags(args))
    grpo.check_args(gargs, "grpo")
    P, G, mb = gargs.prompts_per_step, gargs.group_size, gargs.micro_batch
    # As grpo.Run: seed, data, model, then the 'before' evaluation (so it draws the same samples as ours).
    random.seed(gargs.seed), np.random.seed(gargs.seed), torch.manual_seed(gargs.seed)
    train = verifier.load_problems(gargs.dataset, "train", None, gargs.seed)
    held_out = verifier.load_problems(gargs.dataset, "test", None, gargs.seed)[: gargs.eval_problems]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = grpo.load_model(gargs.model, torch.float32, device)  # fp32, pad = eos, as ours
    before = grpo.evaluate(grpo.Sampler("hf", model, tokenizer), tokenizer, held_out, gargs)

    # The prompts in grpo.py's order, one row per prompt per step: with shuffle_dataset=False TRL's RepeatSampler
    # takes them in order, P at a time, each repeated G times.
    order = np.random.default_rng(gargs.seed).permutation(len(train))
    picks = [train[order[i % len(order)]] for i in range(gargs.steps * P)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
                                 for p in picks])
    seen = defaultdict(list)  # optimizer step -> the questions of every completion scored in it

    def arith_reward(prompts, completions, answer, trainer_state, **_):
        seen[trainer_state.global_step] += [p[-1]["content"] for p in prompts]
        return [verifier.reward(c[0]["content"], gold) for c, gold in zip(completions, answer)]

    class StepTimer(TrainerCallback):  # one optimizer step: generation, rewards, all micro-batches, AdamW
        def __init__(self):
            self.seconds = []

        def on_step_begin(self, *_, **__):
            self.t0 = time.time()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.time() - self.t0)

    class BenchTrainer(GRPOTrainer):  # records what each step really did: sampling time, micro-batch sizes
        sample_seconds, micro_batches = [], defaultdict(list)

        def _generate_and_score_completions(self, inputs):
            t0 = time.time()
            out = super()._generate_and_score_completions(inputs)
            self.sample_seconds.append(time.time() - t0)
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.micro_batches[self.state.global_step].append(len(inputs["completion_ids"]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = GRPOConfig(
        output_dir=str(Path(args.trl_worker).parent / "trl"), use_cpu=device == "cpu", bf16=False, fp16=False,
        seed=gargs.seed, max_steps=gargs.steps, num_generations=G, max_completion_length=gargs.max_new_tokens,
        # micro-batches of mb; mb x accumulation = P x G completions an optimizer step. steps_per_generation
        # defaults to gradient_accumulation_steps, so generation_batch_size = P x G: one generation per step.
        per_device_train_batch_size=mb, gradient_accumulation_steps=P * G // mb, num_iterations=1,
        shuffle_dataset=False, temperature=gargs.temperature, top_p=1.0, top_k=0,
        learning_rate=gargs.lr, lr_scheduler_type="constant", warmup_steps=0,  # TRL's default decays linearly
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=gargs.max_grad_norm,  # grpo.Run's AdamW
        beta=gargs.beta, epsilon=gargs.eps_low, epsilon_high=gargs.eps_high, scale_rewards="group",
        # "dapo": each micro-batch's token-loss sum / num_items_in_batch, the completion tokens of the whole
        # generation batch; summed over the micro-batches = one global token mean = grpo.py's token-mean.
        # ("bnpo" divides by each micro-batch's own token count and averages those: unequal weights.)
        loss_type="dapo", mask_truncated_completions=False,  # ours trains truncated completions too
        gradient_checkpointing=False,  # GRPOConfig defaults to True; grpo.py does not checkpoint
        report_to="none", save_strategy="no", logging_steps=1)
    trainer = BenchTrainer(model=model, reward_funcs=arith_reward, args=config, train_dataset=dataset,
                           processing_class=tokenizer, callbacks=[timer := StepTimer()])
    trl_prompt = trainer._tokenize_prompts([dataset[0]["prompt"]])[0][0]
    prompt_tokens_match = list(trl_prompt) == grpo.encode_prompt(tokenizer, picks[0]["question"])
    t0 = time.time()
    trainer.train()
    train_wall = time.time() - t0
    after = grpo.evaluate(grpo.Sampler("hf", trainer.model, tokenizer), tokenizer, held_out, gargs)

    expected = [[p["question"] for p in picks[s * P:(s + 1) * P] for _ in range(G)] for s in range(gargs.steps)]
    result = {
        "seconds_per_step": sum(timer.seconds) / len(timer.seconds), "step_seconds": timer.seconds,
        "train_wall_per_step": train_wall / gargs.steps,  # includes TRL's logging between steps
        "sample_seconds": sum(BenchTrainer.sample_seconds) / len(BenchTrainer.sample_seconds),
        "peak_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # as grpo.py: process RSS
        "pass@1_before": before["pass@1"], "pass@1_after": after["pass@1"],
        "pass@k_before": before["pass@k"], "pass@k_after": after["pass@k"],
        "reward_mean": [log["reward"] for log in trainer.state.log_history if "reward" in log],
        "frac_zero_std": [log["frac_reward_zero_std"] for log in trainer.state.log_history if "reward" in log],
        "config": {k: getattr(config, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                    "steps_per_generation", "generation_batch_size",
                                                    "num_generations", "loss_type", "lr_scheduler_type")},
        "completions_per_step": [len(seen[s]) for s in range(gargs.steps)],
        "micro_batches_per_step": [BenchTrainer.micro_batches[s] for s in range(gargs.steps)],
        "prompt_order_matches": [seen[s] for s in range(gargs.steps)] == expected,
        "prompt_tokens_match": prompt_tokens_match}
    Path(args.trl_worker).write_text(json.dumps(result))


def main():
    args = parse_args()
    if args.trl_worker:
        return trl_worker(args)
    if args.ours_worker:
        return ours_worker(args)
    if importlib.util.find_spec("trl") is None:
        sys.exit("bench_vs_trl.py compares against TRL, an optional dependency: pip install trl")
    with tempfile.TemporaryDirectory() as folder:
        ours = run_ours(args, folder)
        result_file = Path(folder) / "trl.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--trl-worker",
                        str(result_file)], check=True, cwd=ROOT)
        trl = json.loads(result_file.read_text())

    P, G, c = args.prompts_per_step, args.group_size, trl["config"]
    print(f"\nP {P} x G {G} = {P * G} completions per step, up to {args.max_new_tokens} tokens, lr {args.lr}, "
          f"{args.steps} steps, seed {args.seed}; eval {args.eval_problems} problems x {args.eval_samples}")
    print(f"TRL batch: per_device_train_batch_size {c['per_device_train_batch_size']} x gradient_accumulation_steps "
          f"{c['gradient_accumulation_steps']} = {c['per_device_train_batch_size'] * c['gradient_accumulation_steps']}"
          f" completions an optimizer step; generation_batch_size {c['generation_batch_size']} = "
          f"{c['generation_batch_size'] // c['num_generations']} prompts x num_generations {c['num_generations']}, "
          f"steps_per_generation {c['steps_per_generation']} (one generation per step); loss_type {c['loss_type']}, "
          f"lr schedule {c['lr_scheduler_type']}")
    print(f"TRL observed: completions scored per step {trl['completions_per_step']}, micro-batch sizes "
          f"{trl['micro_batches_per_step']}; prompt order as grpo.py: {trl['prompt_order_matches']}; "
          f"prompt tokens as grpo.encode_prompt: {trl['prompt_tokens_match']}")
    print(f"forward/backward per step: ours {ours['trained_sequences']} of {P * G} (zero-advantage completions skipped), "
          f"TRL all {P * G}; groups with equal rewards: ours {ours['frac_zero_std']}, TRL {trl['frac_zero_std']}")
    k = args.eval_k
    print(f"{'method':<8}{'s/step':>9}{'sample s':>10}{'peak GB':>9}{'pass@1 before':>15}{'pass@1 after':>14}"
          f"{f'pass@{k} before':>15}{f'pass@{k} after':>14}")
    for name, r in (("ours", ours), ("TRL", trl)):
        print(f"{name:<8}{r['seconds_per_step']:>9.2f}{r['sample_seconds']:>10.2f}{r['peak_memory_gb']:>9.2f}"
              f"{r['pass@1_before']:>15.3f}{r['pass@1_after']:>14.3f}{r['pass@k_before']:>15.3f}"
              f"{r['pass@k_after']:>14.3f}")
    same_start = abs(ours["pass@1_before"] - trl["pass@1_before"]) < 1e-9
    print(f"ratios TRL/ours: s/step {trl['seconds_per_step'] / ours['seconds_per_step']:.2f}, sampling "
          f"{trl['sample_seconds'] / ours['sample_seconds']:.2f}, peak memory "
          f"{trl['peak_memory_gb'] / ours['peak_memory_gb']:.2f}; pass@1 gain ours "
          f"{ours['pass@1_after'] - ours['pass@1_before']:+.3f}, TRL {trl['pass@1_after'] - trl['pass@1_before']:+.3f}"
          f"; same 'before' evaluation: {same_start}")
    print(json.dumps({"ours": ours, "trl": trl}))


if __name__ == "__main__":
    main()
