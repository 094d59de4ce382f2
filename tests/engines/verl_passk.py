"""Pass@k Training (passk.py) on verl 0.9.1: an advantage estimator registered with verl, nothing else.

Only the advantage changes between GRPO and Pass@k Training, and verl looks advantages up by name:
`@register_adv_est(NAME)` (verl.trainer.ppo.core_algos) adds a function to the table that verl's own
`compute_advantage` (verl.trainer.ppo.ray_trainer) dispatches to when
`algorithm.adv_estimator=NAME`. The function registered below calls passk.py's
`passk_training_advantages` as it is; everything else (clipped loss, aggregation, KL, batches) is
verl's GRPO machinery with the settings of verl_grpo.py.

verl hands an estimator the batch's token-level rewards [B, T], the response mask [B, T], each row's
`uid` (rows of one prompt share it; verl keeps them together, the function below does not rely on
it) and the `algorithm` config. passk.py wants rewards [P * G] with each group's G rows consecutive,
so the rows are gathered by uid (first seen, first), given passk.py's advantage, and put back.
verl's default trainer (v1) pads a batch that is not a multiple of its data-parallel and mini-batch
sizes with synthetic rows (verl/trainer/ppo/padding_utils.py, upsample_batch_to_divisible_size),
all under one new uid, "pad" + uuid4().hex, with response mask and reward 0; their "is_padding" tag
does not reach an estimator, their uid does (its own uids are str(uuid4()), which never start with
"pad"). Those rows are no group: they get A = 0, as verl's GRPO gives them, and the others form the
groups.

The settings ride in the algorithm config as new keys (Hydra's "+"): passk_k, passk_mode (analytic,
full, bootstrap), passk_bootstrap_average, passk_mix (none, combination); --scale-rewards (A_pass1 of
--mix) is algorithm.norm_adv_by_std_in_grpo. --mix adaptive cannot be carried: it needs each
problem's mean token entropy under the policy, and verl gives an estimator rewards, masks, uids and
the config only. verl's own `grpo_passk` is another method (arXiv 2503.19595: only each group's best
response).

Run: python tests/engines/verl_passk.py --k 4 --group-size 8          # prints the overrides
At scale: verl imports this file in its driver through VERL_USE_EXTERNAL_MODULES (read at `import
verl`, in verl/__init__.py), so the name is registered before the first step:
    PYTHONPATH=$PWD:$PWD/tests/engines VERL_USE_EXTERNAL_MODULES=verl_passk \\
        python -m verl.trainer.main_ppo $(python tests/engines/verl_passk.py --k 4) \\
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct data.train_files=train.parquet ...
"""
import re
import sys
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import passk  # noqa: E402  (the method: imported, never copied)
import verl_grpo  # noqa: E402  (GRPO's settings, which Pass@k keeps)

NAME = "passk_training"  # algorithm.adv_estimator=passk_training
PADDING_UID = re.compile(r"pad[0-9a-f]{32}")  # verl's padding rows' uid (padding_utils.py)


def hydra_overrides(args):
    """verl_grpo.py's overrides with this estimator and passk.py's settings `args` (passk.parse_args)."""
    if args.mix == "adaptive":
        passk.die("--mix adaptive needs the policy's token entropy, which verl does not give an "
                  "advantage estimator")
    settings = verl_grpo.hydra_overrides(args)
    settings["algorithm.adv_estimator"] = NAME
    settings.update({"+algorithm.passk_k": args.k, "+algorithm.passk_mode": args.passk_mode,
                     "+algorithm.passk_bootstrap_average": args.bootstrap_average,
                     "+algorithm.passk_mix": args.mix})
    return settings


def passk_settings(config, group_size):
    """passk.py's flags, as passk_training_advantages reads them, from verl's algorithm config."""
    def setting(key, default=None):
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"algorithm.{key} is not set (add +algorithm.{key}=... to the command)")
        return value
    settings = Namespace(group_size=group_size, k=int(setting("passk_k")),
                         passk_mode=setting("passk_mode", "analytic"),
                         bootstrap_average=bool(setting("passk_bootstrap_average", False)),
                         mix=setting("passk_mix", "none"),
                         scale_rewards="group" if config.get("norm_adv_by_std_in_grpo", True)
                         else "none")
    if settings.k > group_size or settings.mix == "adaptive":
        raise ValueError(f"Pass@k: k = {settings.k}, mix = {settings.mix} with groups of "
                         f"{group_size}: k must be at most the group, mix not adaptive")
    return settings


def register():
    """Register the estimator with verl (importing this module registers it once)."""
    import torch
    from verl.trainer.ppo.core_algos import register_adv_est

    @register_adv_est(NAME)
    def passk_training_advantage(token_level_rewards, response_mask, index, config, **_):
        """verl's estimator interface: rewards, mask [B, T], uids [B] -> (advantages, returns) [B, T]."""
        scores = token_level_rewards.sum(dim=-1)  # [B]: one outcome reward per response
        groups = {}  # uid -> its rows, in the batch's order; uids in the order first seen
        for row, uid in enumerate(index):
            if not PADDING_UID.fullmatch(str(uid)):  # verl's padding rows join no group
                groups.setdefault(uid, []).append(row)
        sizes = {len(rows) for rows in groups.values()}
        if len(sizes) != 1:
            raise ValueError(f"Pass@k needs groups of one size (rollout.n); got sizes {sorted(sizes)}")
        order = torch.tensor([row for rows in groups.values() for row in rows])  # [P * G]: grouped
        settings = passk_settings(config, sizes.pop())
        grouped = passk.passk_training_advantages(scores[order].cpu(), settings)  # [P * G]
        advantages = torch.zeros_like(scores)  # [B]: a padding row keeps A = 0
        advantages[order] = grouped.to(scores)  # each row's own advantage, in verl's order
        advantages = advantages[:, None] * response_mask  # [B, T]: every token of y_i gets A_i
        return advantages, advantages  # (advantages, returns), as verl's GRPO returns them

    return passk_training_advantage


def main(argv=None):
    args = passk.parse_args(argv)
    print(" ".join(f"{key}={value}" for key, value in hydra_overrides(args).items()))


if __name__ == "__main__":
    main()
else:  # imported (by verl through VERL_USE_EXTERNAL_MODULES, or by a test): register the name
    estimator = register()
