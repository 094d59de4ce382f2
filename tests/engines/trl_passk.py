"""Pass@k Training (passk.py) on TRL 1.16: a GRPOTrainer whose advantage is passk.py's.

Only the advantage changes between GRPO and Pass@k Training. TRL computes GRPO's advantage inside
`_generate_and_score_completions`, from the rewards of every process (gathered, so that a group
whose completions sit on two processes is normalised as one), and keeps this process's slice. The
subclass below lets TRL do all of that, then replaces the slice with passk.py's
`passk_training_advantages` of the same gathered rewards. Everything else (sampling, the clipped
loss, the optimizer, many processes through accelerate) is TRL's, with the settings, the reward
and the skipped steps without signal of trl_grpo.py.

Two things are needed that passk.py's one process does not: the gathered rewards, which TRL computes
in `_calculate_rewards` and does not keep (the subclass keeps them), and the same random k-subsets
on every process for --passk-mode bootstrap, which draws from torch's generator: TRL seeds each
process differently, so the draw runs in a forked generator seeded by (--seed, step), the same
everywhere. --mix adaptive needs each problem's mean token entropy: passk.problem_entropy on TRL's
batch (below).

--check-updates FILE (diagnostics): each process appends, per optimizer step, the rows it trained
(reward, the advantage TRL's loss used, the prompt) and how the update moved the log-probs of the
tokens with A > 0 and A < 0 (mean change in nats, measured on that batch before and after the step).

Run (CPU, two processes over gloo, what tests/test_engines.py runs; --cpu would start one):
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no tests/engines/trl_passk.py --seed 2 --steps 2 --prompts-per-step 2 \\
        --group-size 8 --k 4 --micro-batch 8 --eval-problems 1 --eval-samples 1 --eval-k 1
Run at scale:
    accelerate launch --multi_gpu --num_processes 8 tests/engines/trl_passk.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --k 4 --backend vllm
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import passk  # noqa: E402  (the method: imported, never copied)
import trl_grpo  # noqa: E402  (GRPO's settings, which Pass@k keeps)


class PassKTrainer(trl_grpo.GRPOTrainerSkippingEmptySteps):
    """TRL's GRPOTrainer with passk.py's advantage (passk_args: passk.parse_args's namespace)."""

    def __init__(self, *args, passk_args, check_updates=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.passk_args = passk_args
        self.check_updates = check_updates  # a path: log each update (see the module docstring)
        self._pending = []  # this step's micro-batches, for --check-updates

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process's completions [N, functions], kept for the advantage."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions,
                                                      completion_ids_list)
        weights = self.reward_weights.to(rewards_per_func.device)  # [functions]
        self._gathered_rewards = (rewards_per_func * weights).nansum(dim=1)  # [N]: all processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)  # TRL's GRPO advantage, replaced:
        rewards = self._gathered_rewards.cpu()  # [N]: G consecutive completions per prompt
        entropy = None
        if self.passk_args.mix == "adaptive":  # each problem's mean token entropy, on this batch
            entropy = self._problem_entropy(output)
        with torch.random.fork_rng(devices=[]):  # bootstrap's subsets: the same on every process
            torch.manual_seed(self.passk_args.seed * 1_000_003 + self.state.global_step)
            advantages = passk.passk_training_advantages(rewards, self.passk_args, entropy)  # [N]
        local = len(output["advantages"])  # this process's rows: its slice of the N
        start = self.accelerator.process_index * local
        output["advantages"] = advantages[start: start + local].to(output["advantages"])
        output["rewards"] = rewards[start: start + local].to(output["advantages"])  # for the log
        return output

    def _problem_entropy(self, output):
        """--mix adaptive: passk.problem_entropy needs every problem's G rows on this process."""
        G = self.passk_args.group_size  # one process (main checks): every problem's G rows here
        prompts = [row[mask.bool()].tolist() for row, mask in
                   zip(output["prompt_ids"][::G], output["prompt_mask"][::G])]
        samples = [{"ids": row[mask.bool()].tolist()} for row, mask in
                   zip(output["completion_ids"], output["completion_mask"])]
        model = self.accelerator.unwrap_model(self.model)
        return passk.problem_entropy(model, prompts, samples, self.passk_args).cpu()  # [P]

    def _compute_loss(self, model, inputs):
        if self.check_updates and self.model.training:
            self._pending.append(dict(inputs, before=self._token_logprobs(inputs)))
        return super()._compute_loss(model, inputs)

    @torch.no_grad()
    def _token_logprobs(self, inputs):
        """TRL's own log-probs of the batch's completion tokens [B, T], with the current weights."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        model = self.accelerator.unwrap_model(self.model)
        return self._get_per_token_logps_and_entropies(model, ids, mask,
                                                       inputs["completion_ids"].size(1))[0]

    def log_update(self):
        """After the optimizer step: how the step moved the trained batch's log-probs."""
        ups, downs, rows = [], [], []
        for batch in self._pending:
            change = self._token_logprobs(batch) - batch["before"]  # [b, T]: nats
            mask = batch["completion_mask"].bool()
            signs = batch["advantages"][:, None].expand_as(change)  # [b, T]: each token's A
            ups.append(change[mask & (signs > 0)])
            downs.append(change[mask & (signs < 0)])
            rows += [{"prompt": p[m.bool()].tolist(), "reward": r.item(), "advantage": a.item()}
                     for p, m, r, a in zip(batch["prompt_ids"], batch["prompt_mask"],
                                           batch["rewards"], batch["advantages"])]
        self._pending = []
        up, down = torch.cat(ups), torch.cat(downs)  # [tokens]
        record = {"step": self.state.global_step, "process": self.accelerator.process_index,
                  "up": up.mean().item() if len(up) else None,
                  "down": down.mean().item() if len(down) else None, "rows": rows}
        with open(self.check_updates, "a") as f:
            print(json.dumps(record), file=f)


def main(argv=None):
    from transformers import TrainerCallback
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--check-updates", metavar="FILE", help="append each update's rows and moves")
    known, rest = extra.parse_known_args(argv)
    args = passk.parse_args(rest)
    trl_grpo.refuse_unmapped(args, passk.parse_args([]))
    if args.mix == "adaptive" and trl_grpo.num_processes() > 1:
        passk.die("--mix adaptive: run it on one process (each problem's G rows in one place)")
    passk.check_args(args, "trl_passk")
    model, tokenizer = trl_grpo.load_policy(args)
    trainer = PassKTrainer(model=model, processing_class=tokenizer,
                           reward_funcs=trl_grpo.reward_function(tokenizer, args),
                           train_dataset=trl_grpo.training_dataset(args),
                           args=trl_grpo.grpo_config(args, args.output_dir, trl_grpo.num_processes()),
                           passk_args=args, check_updates=known.check_updates)

    class AfterStep(TrainerCallback):
        def on_step_end(self, *_, **__):
            trainer.log_update()

    if known.check_updates:
        trainer.add_callback(AfterStep())
    trainer.train()
    if trainer.accelerator.is_main_process and args.eval_problems:
        model = trainer.accelerator.unwrap_model(trainer.model)
        print(json.dumps({"evaluation": trl_grpo.evaluate_after(model, tokenizer, args)}))


if __name__ == "__main__":
    main()
