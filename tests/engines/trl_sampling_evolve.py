"""SamplingEvolve, train mode (sampling_evolve.py), on TRL 1.16: a rollout_func that rescues all-wrong groups.

sampling_evolve.py's training is GRPO in which a group with no right sample is evolved: its samples
go into the problem's database D_x, rounds of children are sampled from prompts E(x, S) that show
earlier wrong attempts with their verdicts, and up to --max-evolved right children replace the
group's last samples, trained as answers to the BARE prompt x. TRL's `rollout_func` sees each
prompt's G rows at once, so the whole rescue fits in it: it samples the groups, scores them as
sampling_evolve.py does (completion_text: after "<think>" where the prompt leaves one open), evolves
the all-wrong ones with sampling_evolve.py's own functions (add_attempt, has_right_attempt,
evolve_round, join_evolved, imported as they are) and returns

    prompt_ids      x, for every row (a rescued child too: it is trained as an answer to x)
    completion_ids  the sample, or the rescued child in its place
    logprobs        NaN everywhere: with TRL's vLLM correction on, a ratio of exactly 1 (the child
                    came from pi(.|E), not from the engine's pi(.|x)); without it TRL ignores them
    evolve_reward   the row's reward, read back by the reward function

TRL then computes GRPO's advantage of the rescued groups (A > 0 for each rescued child) and trains
with the settings of trl_grpo.py (and its trainer, which skips a step without signal). The
databases live in the rollout (one per process: a problem that lands on another process later
starts a new one there). What the rescue cost is in `rollout.stats`.
verl would need code between its scoring and its advantage (no hook there takes whole groups).

Run (CPU, a quick look):
    python tests/engines/trl_sampling_evolve.py --steps 2 --prompts-per-step 4 --group-size 4
Run at scale:
    accelerate launch --multi_gpu --num_processes 8 tests/engines/trl_sampling_evolve.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl
"""
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import sampling_evolve as se  # noqa: E402  (the method: imported, never copied)
import trl_grpo  # noqa: E402  (GRPO's settings, which the rescue keeps)
import verifier  # noqa: E402


class EvolveRollout:
    """TRL's rollout_func: P x G conversations (each prompt G times in a row) -> G rows per prompt,
    all-wrong groups evolved and their right children put in (sampling_evolve.main's steps 1 to 2c)."""

    def __init__(self, args, tokenizer, answers):
        self.args, self.tokenizer, self.answers = args, tokenizer, answers  # question -> gold
        self.databases = {}  # question -> D_x, across steps
        self.stats = []  # per call: what the rescue found and cost

    def sampler(self, trainer):
        """pi_theta's sampler: Hugging Face generate with the trained model's current weights."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        return se.Sampler("hf", model, self.tokenizer, None, getattr(torch, self.args.dtype))

    def __call__(self, prompts, trainer):
        args, G, tokenizer = self.args, self.args.group_size, self.tokenizer
        if len(prompts) % G or any(prompts[i] != prompts[i - i % G] for i in range(len(prompts))):
            se.die("the rescue needs each prompt's G rows on one process: per_device_train_batch_size "
                   "x steps_per_generation must be a multiple of --group-size")
        step = trainer.state.global_step + 1
        problems = [{"question": p[-1]["content"], "answer": self.answers[p[-1]["content"]]}
                    for p in prompts[::G]]
        xs = [se.encode_prompt(tokenizer, p["question"], args.system_prompt, args.chat_template_kwargs)
              for p in problems]  # x, as sampling_evolve.py encodes it
        model = trainer.accelerator.unwrap_model(trainer.model)
        training = model.training  # the sampler switches to eval(); TRL reads .training afterwards
        sampler = self.sampler(trainer)
        # (1) y_1..y_G ~ pi_theta(.|x) for each prompt, scored
        samples = sampler.generate(xs, G, args.max_new_tokens, args.temperature)  # P * G
        texts = [se.completion_text(tokenizer, xs[i // G], s["ids"])  # as the verifier reads them
                 for i, s in enumerate(samples)]
        golds = [p["answer"] for p in problems for _ in range(G)]
        rewards = torch.tensor([verifier.reward(t, g) for t, g in zip(texts, golds)])  # [P * G]
        # (2a) each all-wrong group is evolved: its G samples are this visit's round 0 of D_x
        all_wrong = [p for p in range(len(problems)) if rewards[p * G: (p + 1) * G].max() < 1]
        dbs = {p: self.databases.setdefault(problems[p]["question"], []) for p in all_wrong}
        since = {p: len(dbs[p]) for p in all_wrong}  # where this visit's attempts start in D_x
        for p in all_wrong:
            for k in range(p * G, (p + 1) * G):
                se.add_attempt(dbs[p], texts[k], golds[k], samples[k]["ids"],
                               samples[k]["truncated"], xs[p], step, 0, [])
        # (2b) rounds 1..--rounds for the evolved groups still without a right attempt
        read = written = 0  # evolution's tokens
        for round_ in range(1, args.rounds + 1):
            active = [p for p in all_wrong if not se.has_right_attempt(dbs[p], since[p])]
            if not active:
                break
            r, w = se.evolve_round(sampler, tokenizer, [problems[p] for p in active],
                                   [dbs[p] for p in active], step, round_, args)
            read, written = read + r, written + w
        # (2c) right children replace wrong samples, as answers to the bare prompt x
        samples, rewards, rescues = se.join_evolved(samples, rewards, all_wrong, dbs, since, G,
                                                    args.max_evolved)  # rescues: [(row, child)]
        model.train(training)
        rescued = [{"row": row, "ids": child.ids, "prompt": xs[row // G]} for row, child in rescues]
        for db in dbs.values():  # D_x keeps no ids after the step (later ones read texts, verdicts)
            for attempt in db:
                attempt.ids = attempt.prompt = None
        self.stats.append({"step": step, "all_wrong_groups": len(all_wrong),
                           "rescued": rescued,  # each rescued row: its child's ids, under x
                           "rescued_groups": sum(se.has_right_attempt(dbs[p], since[p])
                                                 for p in all_wrong),
                           "evolve_tokens_read": read, "evolve_tokens_written": written})
        return {"prompt_ids": [xs[row // G] for row in range(len(samples))],  # x, rescued rows too
                "completion_ids": [s["ids"] for s in samples],
                "logprobs": [[math.nan] * len(s["ids"]) for s in samples],
                "evolve_reward": rewards.tolist()}


def evolve_reward(completions, evolve_reward, **_):
    """TRL's reward function: the rewards the rollout scored (a rescued row's is its child's)."""
    return list(evolve_reward)


def build_trainer(args, trainer_class=trl_grpo.GRPOTrainerSkippingEmptySteps):
    """The trainer and its rollout for sampling_evolve.py's flags `args` (--mode train)."""
    if args.mode != "train":
        se.die("--mode search is inference only: run sampling_evolve.py against vLLM servers")
    trl_grpo.refuse_unmapped(args, se.parse_args([]))
    config = trl_grpo.grpo_config(args, args.output_dir, trl_grpo.num_processes())  # before models
    model, tokenizer = trl_grpo.load_policy(args)
    dataset = trl_grpo.training_dataset(args)
    rollout = EvolveRollout(args, tokenizer,
                            {row["prompt"][-1]["content"]: row["answer"] for row in dataset})
    trainer = trainer_class(model=model, processing_class=tokenizer, reward_funcs=evolve_reward,
                            train_dataset=dataset, rollout_func=rollout, args=config)
    return trainer, rollout


def main(argv=None):
    args = se.parse_args(argv)
    se.check_args(args, "trl_sampling_evolve")
    trainer, rollout = build_trainer(args)
    trainer.train()
    if trainer.accelerator.is_main_process:
        print({"rescue": rollout.stats,
               "evaluation": trl_grpo.evaluate_after(trainer.accelerator.unwrap_model(trainer.model),
                                                     trainer.processing_class, args)})


if __name__ == "__main__":
    main()
