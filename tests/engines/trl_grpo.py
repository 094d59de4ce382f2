"""GRPO (grpo.py) on TRL 1.16's GRPOTrainer: grpo.py's flags as a GRPOConfig, and grpo.py's reward.

GRPO needs almost no code inside TRL: TRL's GRPOTrainer samples, rewards, normalises each group and
runs the clipped token loss itself. What has to be right is the mapping of our flags to its
settings, and this file is that mapping as code (grpo_config), with a main() that trains on the
built-in task or a JSONL file. The mapping (tests/test_engines.py checks the loss rows on one fixed batch, within
1e-6):

    --loss-agg token-mean     loss_type="dapo"      sum over the batch's tokens / their number
    --loss-agg seq-mean       loss_type="grpo"      mean over each sequence, then over sequences
    --loss-agg seq-sum-norm   loss_type="dr_grpo"   sum / (sequences x max_completion_length)
    --beta B                  beta=B, use_bias_correction_kl=False   (TRL's default True multiplies
                              k3 by the ratio pi_theta / pi_old: exactly that factor, tested)
    --eps-low a --eps-high b  epsilon=a, epsilon_high=b
    --scale-rewards group     scale_rewards="group" (TRL's std divides by G - 1: its advantages are
                              sqrt((G - 1) / G) of ours, tested); none: "none"
    --prompts-per-step P, --group-size G, --micro-batch m: num_generations=G, per_device_train_batch_size
                              = m, gradient_accumulation_steps = P G / (m x processes)
    --ppo-epochs E            num_iterations=E
    --lr, --max-grad-norm     learning_rate, max_grad_norm; lr_scheduler_type="constant", no warm-up,
                              weight_decay=0 (TRL's defaults: linear decay, as the Trainer's)
    --backend vllm            use_vllm=True, vllm_mode="colocate"

Two things need code, each in one small piece that the other adapters use too:
  * the reward (reward_function): TRL hands a reward function the completion's decoded text, but
    grpo.py scores completion_text(tokenizer, x, ids), which reads the completion after "<think>"
    where the rendered prompt x leaves a <think> block open (DeepSeek-R1-Distill's template): a
    trace that never closes its thinking has no answer. The reward encodes x as grpo.py does (its
    --system-prompt and --chat-template-kwargs) and reads the completion's ids with it.
  * a step without signal (GRPOTrainerSkippingEmptySteps): when every trained row has A = 0 and
    beta = 0, grpo.train_step forwards no row and takes no optimizer step; TRL would step AdamW on
    zero gradients, and its momentum would still move the weights. The subclass notes in each
    micro-batch whether a row with a trained token has A != 0 (or beta > 0), gathers that from every
    process before the optimizer step, and where no process has one it drops the gradients, so
    AdamW leaves the weights and its state as they were (a parameter without a gradient is skipped).

TRL has no --filter-groups (it keeps all-equal groups at A = 0) and no --token-budget: main()
refuses them. The held-out evaluation is grpo.py's own (grpo.evaluate on the final model).

Run (CPU, a quick look):
    python tests/engines/trl_grpo.py --steps 2 --prompts-per-step 2 --group-size 4
Run at scale:
    accelerate launch --multi_gpu --num_processes 8 tests/engines/trl_grpo.py \\
        --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --backend vllm
"""
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: TRL would look up the processor
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402  (the flags, load_model, evaluate: imported, never copied)
import verifier  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

LOSS_TYPES = {"token-mean": "dapo", "seq-mean": "grpo", "seq-sum-norm": "dr_grpo"}
UNMAPPED = {"filter_groups": "TRL keeps all-equal groups (A = 0) and has no filter",
            "token_budget": "TRL counts optimizer steps only (--steps)"}


def grpo_config(args, output_dir, num_processes=1, **overrides):
    """A GRPOConfig with the meaning of grpo.py's flags `args` (grpo.parse_args), for a run on
    num_processes processes; overrides: further GRPOConfig fields (a method's own)."""
    from trl import GRPOConfig
    rows = args.prompts_per_step * args.group_size  # P x G completions per optimizer step
    per_step = args.micro_batch * num_processes  # completions in one micro-batch on every process
    if rows % per_step:
        grpo.die(f"--prompts-per-step x --group-size ({rows}) must be a multiple of --micro-batch x "
                 f"processes ({per_step})")
    settings = dict(
        output_dir=output_dir, max_steps=args.steps, seed=args.seed, shuffle_dataset=False,
        num_generations=args.group_size, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // per_step,  # one optimizer step per P x G completions
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        loss_type=LOSS_TYPES[args.loss_agg], epsilon=args.eps_low, epsilon_high=args.eps_high,
        beta=args.beta, use_bias_correction_kl=False,  # k3 as ours: not multiplied by the ratio
        scale_rewards=args.scale_rewards, num_iterations=args.ppo_epochs,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,  # 0: no clipping, in both
        bf16=args.dtype == "bfloat16", gradient_checkpointing=False,
        use_vllm=args.backend == "vllm", vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.gpu_memory_utilization or 0.3,
        vllm_max_model_length=args.max_model_len, chat_template_kwargs=args.chat_template_kwargs,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=not _cuda())
    settings.update(overrides)
    return GRPOConfig(**settings)


def _cuda():
    return torch.cuda.is_available()


def refuse_unmapped(args, defaults):
    """A flag TRL has no setting for is a one-line error, never silently dropped."""
    for name, why in UNMAPPED.items():
        if getattr(args, name) != getattr(defaults, name):
            grpo.die(f"--{name.replace('_', '-')} has no TRL equivalent: {why}")


def training_dataset(args):
    """The training problems as TRL rows, in grpo.py's order (one fixed shuffle, cycled): a
    conversational "prompt" (TRL applies the chat template) and the gold "answer"."""
    import numpy as np
    from datasets import Dataset
    try:
        problems = verifier.load_problems(args.dataset, "train", None, args.seed,
                                          question_field=args.question_field,
                                          answer_field=args.answer_field)
    except (ValueError, OSError) as err:
        grpo.die(str(err))
    order = np.random.default_rng(args.seed).permutation(len(problems))
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    needed = args.steps * args.prompts_per_step  # every prompt the run will see
    picks = [problems[order[i % len(order)]] for i in range(needed)]
    return Dataset.from_list([{"prompt": system + [{"role": "user", "content": p["question"]}],
                               "answer": p["answer"]} for p in picks])


def reward_function(tokenizer, args):
    """TRL's reward function for grpo.py's flags `args`: verifier.reward of each completion, read
    as grpo.py reads it (completion_text after the prompt x as encode_prompt renders it)."""
    def verifier_reward(prompts, completion_ids, answer, **_):
        rewards = []
        for prompt, ids, gold in zip(prompts, completion_ids, answer):
            x = grpo.encode_prompt(tokenizer, prompt[-1]["content"], args.system_prompt,
                                   args.chat_template_kwargs)  # x, as grpo.py encodes it
            rewards.append(verifier.reward(grpo.completion_text(tokenizer, x, ids), gold))
        return rewards
    return verifier_reward


class GRPOTrainerSkippingEmptySteps(GRPOTrainer):
    """TRL's GRPOTrainer without the optimizer steps that grpo.train_step skips: those in which no
    row has a gradient (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_has_signal = False  # this step trained a row with A != 0 (or beta > 0)
        self.add_callback(SkipEmptySteps(self))

    def _compute_loss(self, model, inputs):
        if self.model.training:
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)  # [b, T]: trained tokens
            advantages = inputs["advantages"].view(len(mask), -1)  # [b, 1] or [b, T]
            signal = (advantages != 0).any(dim=1) | (self.beta != 0)  # [b]: a row with a gradient
            self.step_has_signal |= bool(((mask.sum(dim=1) > 0) & signal).any())
        return super()._compute_loss(model, inputs)


class SkipEmptySteps(TrainerCallback):
    """Before each optimizer step: without signal on every process, the gradients are dropped."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, *_, **__):
        trainer = self.trainer
        flag = torch.tensor([float(trainer.step_has_signal)], device=trainer.accelerator.device)
        trainer.step_has_signal = False
        if not trainer.accelerator.gather(flag).any():  # the same answer on every process
            for p in trainer.model.parameters():
                p.grad = None  # AdamW steps only parameters with a gradient: none here


def load_policy(args):
    """grpo.py's loader (the offline default converted once; PAD = EOS), in fp32 master weights."""
    return grpo.load_model(args.model, torch.float32, "cuda" if _cuda() else "cpu")


def num_processes():
    """The processes accelerate launched (1 when run with python)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def evaluate_after(model, tokenizer, args):
    """grpo.py's held-out evaluation of the trained model (pass@1, pass@k)."""
    problems = verifier.load_problems(args.eval_dataset or args.dataset, "test", None, args.seed)
    sampler = grpo.Sampler("hf", model, tokenizer)
    return grpo.evaluate(sampler, tokenizer, problems[: args.eval_problems], args)


def main(argv=None):
    args = grpo.parse_args(argv)
    refuse_unmapped(args, grpo.parse_args([]))
    grpo.check_args(args, "trl_grpo")
    model, tokenizer = load_policy(args)
    config = grpo_config(args, args.output_dir, num_processes())
    trainer = GRPOTrainerSkippingEmptySteps(model=model, processing_class=tokenizer,
                                            reward_funcs=reward_function(tokenizer, args),
                                            train_dataset=training_dataset(args), args=config)
    trainer.train()
    if trainer.accelerator.is_main_process:
        print(evaluate_after(trainer.accelerator.unwrap_model(trainer.model), tokenizer, args))


if __name__ == "__main__":
    main()
