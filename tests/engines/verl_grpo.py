"""GRPO (grpo.py) on verl 0.9.1: grpo.py's flags turned into verl's Hydra overrides, nothing else.

verl's built-in GRPO (`algorithm.adv_estimator=grpo`) samples, rewards, normalises each group and
runs the clipped token loss; what has to be right is the mapping of our flags to its settings. This
file is that mapping as code: hydra_overrides() (for `python -m verl.trainer.main_ppo`) and
actor_config() (the actor's part of it as verl's own ActorConfig, which tests/test_engines.py feeds
to verl's actor loss, `verl.workers.utils.losses.ppo_loss`: compute_policy_loss_vanilla, kl_penalty
and agg_loss).

    --loss-agg token-mean     actor.loss_agg_mode=token-mean
    --loss-agg seq-mean       actor.loss_agg_mode=seq-mean-token-mean
    --loss-agg seq-sum-norm   actor.loss_agg_mode=seq-mean-token-sum-norm, loss_scale_factor=N (new tokens)
    --beta B                  actor.use_kl_loss=True, kl_loss_coef=B, kl_loss_type=low_var_kl
    --eps-low a --eps-high b  actor.clip_ratio_low=a, clip_ratio_high=b
    --scale-rewards group     algorithm.norm_adv_by_std_in_grpo=True; none: False
    --group-size G            rollout.n=G;  --prompts-per-step P: data.train_batch_size=P

Where verl differs by design (each tested as exactly this): its group std divides by G - 1 (Bessel's
correction) with 1e-6 added (ours: G, 1e-4); low_var_kl clamps each token's k3 to [-10, 10]; its
"dual clip" (actor.clip_ratio_c, default 3) bounds a token's loss at 3 |A| where A < 0 (ratios above
3); its AdamW weight decay is 0.01 (ours 0: set here). verl refills a batch that --filter-groups
emptied (`algorithm.filter_groups`), ours does not: refused here. (actor. =
actor_rollout_ref.actor.)

Run: python tests/engines/verl_grpo.py --group-size 16 --lr 1e-6     # prints the overrides
At scale (verl's own launcher, its model and data flags added):
    python -m verl.trainer.main_ppo $(python tests/engines/verl_grpo.py --lr 1e-6) \\
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct data.train_files=train.parquet ...
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import grpo  # noqa: E402  (the flags: imported, never copied)

LOSS_AGG_MODES = {"token-mean": "token-mean", "seq-mean": "seq-mean-token-mean",
                  "seq-sum-norm": "seq-mean-token-sum-norm"}
ACTOR = "actor_rollout_ref.actor."


def hydra_overrides(args):
    """{dotted key: value}: verl's settings with the meaning of grpo.py's flags `args`."""
    if args.filter_groups:
        grpo.die("--filter-groups: verl refills a filtered batch (algorithm.filter_groups), ours "
                 "does not; no equivalent")
    settings = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": args.scale_rewards == "group",
        "algorithm.use_kl_in_reward": False,  # ours: KL in the loss only (--beta)
        "data.train_batch_size": args.prompts_per_step,
        "data.max_response_length": args.max_new_tokens,
        "actor_rollout_ref.rollout.n": args.group_size,
        "actor_rollout_ref.rollout.temperature": args.temperature,
        "actor_rollout_ref.rollout.name": "vllm",  # verl always samples with an engine
        ACTOR + "clip_ratio_low": args.eps_low,
        ACTOR + "clip_ratio_high": args.eps_high,
        ACTOR + "loss_agg_mode": LOSS_AGG_MODES[args.loss_agg],
        ACTOR + "use_kl_loss": args.beta > 0,
        ACTOR + "kl_loss_coef": args.beta,
        ACTOR + "kl_loss_type": "low_var_kl",  # k3, clamped to [-10, 10]
        ACTOR + "ppo_epochs": args.ppo_epochs,
        ACTOR + "ppo_mini_batch_size": args.prompts_per_step,  # one optimizer step per batch
        ACTOR + "ppo_micro_batch_size_per_gpu": args.micro_batch,
        ACTOR + "entropy_coeff": 0.0,
        ACTOR + "grad_clip": args.max_grad_norm,
        ACTOR + "optim.lr": args.lr,
        ACTOR + "optim.weight_decay": 0.0,  # verl's default is 0.01
        "trainer.total_training_steps": args.steps,
    }
    if args.loss_agg == "seq-sum-norm":  # Dr. GRPO's constant: the longest completion allowed
        settings[ACTOR + "loss_scale_factor"] = args.max_new_tokens
    return settings


def actor_config(args):
    """verl's FSDPActorConfig for the actor settings of hydra_overrides(args): what verl's actor
    loss reads (clip ratios, aggregation, KL), built by verl's own dataclass."""
    from verl.workers.config import FSDPActorConfig
    fields = {key[len(ACTOR):]: value for key, value in hydra_overrides(args).items()
              if key.startswith(ACTOR) and "." not in key[len(ACTOR):]}
    return FSDPActorConfig(rollout_n=args.group_size, **fields)


def main(argv=None):
    args = grpo.parse_args(argv)
    print(" ".join(f"{key}={value}" for key, value in hydra_overrides(args).items()))


if __name__ == "__main__":
    main()
