"""GRPO (grpo.py) on TRL 1.16's GRPOTrainer: grpo.py's flags turned into a GRPOConfig, nothing else.

GRPO needs no code inside TRL: TRL's GRPOTrainer samples, rewards, normalises each group and runs
the clipped token loss itself. What has to be right is the mapping of our flags to its settings, and
this file is that mapping as code (grpo_config), with a main() that trains on the built-in task or a
JSONL file. The mapping (tests/test_engines.py checks the loss rows on one fixed batch, within
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

TRL has no --filter-groups (it keeps all-equal groups at A = 0) and no --token-budget: main()
refuses them. The held-out evaluation is grpo.py's own (grpo.evaluate on the final model).

Run (CPU, a quick look):  python tests/engines/trl_grpo.py --steps 2 --prompts-per-step 2 --group-size 4
Run at scale:             accelerate launch --num_processes 8 tests/engines/trl_grpo.py \\
                              --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --backend vllm
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: TRL would look up the processor
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402  (the flags, load_model, evaluate: imported, never copied)
import verifier  # noqa: E402

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
    import torch
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


def verifier_reward(completions, answer, **_):
    """TRL's reward function: verifier.reward of each completion (conversational or plain)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [verifier.reward(text, gold) for text, gold in zip(texts, answer)]


def load_policy(args):
    """grpo.py's loader (the offline default converted once; PAD = EOS), in fp32 master weights."""
    import torch
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
    from trl import GRPOTrainer
    args = grpo.parse_args(argv)
    refuse_unmapped(args, grpo.parse_args([]))
    grpo.check_args(args, "trl_grpo")
    model, tokenizer = load_policy(args)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=verifier_reward,
                          train_dataset=training_dataset(args),
                          args=grpo_config(args, args.output_dir, num_processes()))
    trainer.train()
    if trainer.accelerator.is_main_process:
        print(evaluate_after(trainer.accelerator.unwrap_model(trainer.model), tokenizer, args))


if __name__ == "__main__":
    main()
